"""``dtorch.nn.utils.clip_grad_norm_`` and ``get_total_norm`` against torch's on the same
gradients: every order torch takes (0, 1, 2, inf, -inf, fractional, negative), on one device, on
data- and tensor-parallel layouts (uneven and empty shards among them), on a 2-D mesh and across
two meshes; a total norm below, at and above ``max_norm``; the non-finite check.

Tolerances: a whole (unsharded) gradient's norm is torch's kernel on the same block, so where no
gradient is sharded the results are torch's bit for bit. A sharded gradient's norm combines its
blocks' norms (each rounded once to float32), in float64: within 2 float32 ulps of torch's
(which accumulates in double on the CPU); the clipping factor divides once more, and the
gradient's product rounds once more: 4 ulps (``RTOL``)."""

import math
import warnings

import pytest
import torch

import dtorch
from dtorch import Partial, Replicate, Shard

R, S0, S1 = Replicate(), Shard(0), Shard(1)
RTOL = 4 * torch.finfo(torch.float32).eps
ORDERS = [0, 1, 2, math.inf, -math.inf, 0.5, 3, -2]
SHAPES = [(5, 3), (4,), (7, 2), (1, 3)]  # (1, 3) on S(0) over 2 devices: one block is empty


def one():
    return dtorch.DeviceMesh("cpu", [0])


def pair():
    return dtorch.DeviceMesh("cpu", [0, 1])


def grid():
    return dtorch.DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=["dp", "tp"])


# layout -> one (mesh, placements) per shape of SHAPES
LAYOUTS = {
    "one-device": lambda: [(one(), [R])] * 4,
    "dp": lambda: [(pair(), [R]), (pair(), [R]), (pair(), [Partial()]), (pair(), [R])],
    "tp": lambda: [(pair(), [S0]), (pair(), [S0]), (pair(), [S1]), (pair(), [S0])],
    "dp-tp": lambda: [(grid(), [R, S1]), (grid(), [Partial(), S0]), (grid(), [S0, S0]),
                      (grid(), [S1, R])],
    "two-meshes": lambda: [(pair(), [S0]), (dtorch.DeviceMesh("cpu", [2, 3]), [R]),
                           (dtorch.DeviceMesh("cpu", [2, 3]), [S0]), (pair(), [R])],
}


def gradients(seed: int = 0) -> list:
    """Values away from 0 (so every order's norm is a genuine one: the smallest |x| is not
    0), one per shape."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for shape in SHAPES:
        x = torch.randn(shape, generator=g)
        out.append(x + torch.where(x < 0, -0.1, 0.1))
    return out


def both(values, layout):
    """torch leaves and dtorch Parameters holding ``values`` as their ``.grad``."""
    ts, ds = [], []
    for v, (mesh, placements) in zip(values, layout):
        t = torch.zeros(v.shape, dtype=v.dtype, requires_grad=True)
        t.grad = v.clone()
        d = dtorch.nn.Parameter(dtorch.zeros(v.shape, dtype=v.dtype, device_mesh=mesh,
                                             placements=[R] * mesh.ndim))
        d.grad = dtorch.from_torch(v, device_mesh=mesh, placements=placements)
        ts.append(t)
        ds.append(d)
    return ts, ds


def assert_like(got: dtorch.Tensor, expected: torch.Tensor, exact: bool) -> None:
    value = got.to_torch()
    assert value.dtype == expected.dtype
    if exact:
        assert torch.equal(value, expected) or (value.isnan() & expected.isnan()).all(), \
            (value, expected)
    else:
        torch.testing.assert_close(value, expected, rtol=RTOL, atol=0, equal_nan=True)


def is_sharded(layout) -> bool:
    return any(p.is_shard() for _, placements in layout for p in placements)


@pytest.mark.parametrize("norm_type", ORDERS, ids=str)
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_clip_grad_norm_follows_torch(name, norm_type):
    """Per order and layout, three ``max_norm``: twice the total (no clipping: the gradients
    stay torch's bit for bit), the total itself (torch scales by total / (total + 1e-6)), and
    a third of it. The returned norm is torch's in every case."""
    layout = LAYOUTS[name]()
    exact = not is_sharded(layout)
    values = gradients()
    total = torch.nn.utils.get_total_norm(values, norm_type)
    for max_norm in (2 * total.item(), total.item(), total.item() / 3):
        ts, ds = both(values, layout)
        expected = torch.nn.utils.clip_grad_norm_(ts, max_norm, norm_type)
        got = dtorch.nn.utils.clip_grad_norm_(ds, max_norm, norm_type)
        assert got.placements == [R] * layout[0][0].ndim
        assert got.device_mesh == layout[0][0]
        assert_like(got, expected, exact)
        for t, d in zip(ts, ds):
            if max_norm > total.item():  # no clipping: the very gradients
                assert torch.equal(d.grad.to_torch(), t.grad)
            else:
                assert_like(d.grad, t.grad, exact)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_order_zero_counts_the_tensors_that_have_a_nonzero(name):
    """torch's order-0 total is the 0-norm of the tensors' nonzero counts: how many gradients
    have any nonzero element (here 3 of 4: one is all zeros, one has a single nonzero); the
    gradients are clipped by that count."""
    values = gradients()
    values[1] = torch.zeros(SHAPES[1])
    values[2] = torch.zeros(SHAPES[2])
    values[2][3, 1] = 5.0
    layout = LAYOUTS[name]()
    ts, ds = both(values, layout)
    expected = torch.nn.utils.clip_grad_norm_(ts, 0.5, norm_type=0)
    got = dtorch.nn.utils.clip_grad_norm_(ds, 0.5, norm_type=0)
    assert expected.item() == 3.0
    assert_like(got, expected, exact=True)
    for t, d in zip(ts, ds):
        assert_like(d.grad, t.grad, exact=not is_sharded(layout))
    assert dtorch.nn.utils.get_total_norm([d.grad for d in ds], 0).item() == 3.0


@pytest.mark.parametrize("foreach", [None, True, False])
def test_foreach_and_the_signature_are_torchs(foreach):
    """``foreach`` as torch takes it (same values), a single tensor as ``parameters``, the
    norm type as a string, and ``get_total_norm``/``clip_grads_with_norm_`` as torch's two
    halves."""
    layout = LAYOUTS["tp"]()
    ts, ds = both(gradients(1), layout)
    expected = torch.nn.utils.clip_grad_norm_(ts[0], 0.1, "inf", foreach=foreach)
    got = dtorch.nn.utils.clip_grad_norm_(ds[0], 0.1, "inf", foreach=foreach)
    assert_like(got, expected, exact=True)
    assert_like(ds[0].grad, ts[0].grad, exact=False)
    total_t = torch.nn.utils.get_total_norm([t.grad for t in ts], 2.0, foreach=foreach)
    total_d = dtorch.nn.utils.get_total_norm([d.grad for d in ds], 2.0, foreach=foreach)
    assert_like(total_d, total_t, exact=False)
    torch.nn.utils.clip_grads_with_norm_(ts, 1.0, total_t, foreach=foreach)
    dtorch.nn.utils.clip_grads_with_norm_(ds, 1.0, total_d, foreach=foreach)
    for t, d in zip(ts, ds):
        assert_like(d.grad, t.grad, exact=False)


@pytest.mark.parametrize("bad", [math.inf, math.nan], ids=str)
def test_a_nonfinite_norm_raises_only_when_asked(bad):
    """``error_if_nonfinite=True``: torch's RuntimeError, gradients untouched; without it the
    non-finite norm is returned and the gradients are scaled by it, as torch's are."""
    values = gradients()
    values[0][1, 2] = bad
    layout = LAYOUTS["dp-tp"]()
    ts, ds = both(values, layout)
    with pytest.raises(RuntimeError, match="is non-finite, so it cannot be clipped") as theirs:
        torch.nn.utils.clip_grad_norm_(ts, 1.0, error_if_nonfinite=True)
    with pytest.raises(type(theirs.value), match="is non-finite, so it cannot be clipped"):
        dtorch.nn.utils.clip_grad_norm_(ds, 1.0, error_if_nonfinite=True)
    for t, d in zip(ts, ds):
        torch.testing.assert_close(d.grad.to_torch(), t.grad, rtol=0, atol=0, equal_nan=True)
    expected = torch.nn.utils.clip_grad_norm_(ts, 1.0)
    got = dtorch.nn.utils.clip_grad_norm_(ds, 1.0)
    assert_like(got, expected, exact=True)  # inf or nan: no rounding to differ by
    for t, d in zip(ts, ds):
        torch.testing.assert_close(d.grad.to_torch(), t.grad, rtol=RTOL, atol=0,
                                   equal_nan=True)


def test_no_gradients_and_an_empty_generator():
    """No gradient: a norm of 0 and nothing scaled; an empty generator warns, as torch's."""
    mesh = pair()
    w = dtorch.nn.Parameter(dtorch.ones(3, device_mesh=mesh))
    assert dtorch.nn.utils.clip_grad_norm_([w], 1.0).item() == 0.0
    assert w.grad is None
    with pytest.warns(UserWarning, match="empty generator") as theirs:
        torch.nn.utils.clip_grad_norm_((p for p in []), 1.0)
    with pytest.warns(type(theirs[0].message), match="empty generator"):
        dtorch.nn.utils.clip_grad_norm_((p for p in []), 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dtorch.nn.utils.clip_grad_norm_([], 1.0)  # a list, not a generator: no warning


@pytest.mark.parametrize("name", ["one-device", "tp"])
def test_gradients_of_several_dtypes(name):
    """Each gradient's norm in its own dtype, the total in the dtype torch's stack of them
    promotes to (float64 here), grouped by dtype as torch groups them; each gradient scaled by
    the factor cast to its dtype."""
    layout = LAYOUTS[name]()
    values = [v.to(dt) for v, dt in zip(gradients(2), [torch.float32, torch.bfloat16,
                                                        torch.float64, torch.bfloat16])]
    ts, ds = both(values, layout)
    for norm_type in (2, 0.5, math.inf):
        expected = torch.nn.utils.clip_grad_norm_(ts, 0.5, norm_type)
        got = dtorch.nn.utils.clip_grad_norm_(ds, 0.5, norm_type)
        assert expected.dtype == torch.float64
        # sharded, a bfloat16 gradient's norm rounds once to bfloat16 as torch's does, but
        # from blocks' norms: it may land one bfloat16 ulp away, and so may the factor
        total_rtol = 0 if name == "one-device" else torch.finfo(torch.bfloat16).eps
        torch.testing.assert_close(got.to_torch(), expected, rtol=total_rtol, atol=0)
        for t, d in zip(ts, ds):
            assert d.grad.dtype == t.grad.dtype
            rtol = total_rtol and total_rtol + 4 * torch.finfo(t.grad.dtype).eps
            torch.testing.assert_close(d.grad.to_torch(), t.grad, rtol=rtol, atol=0)
