"""Activations and normalisation (dtorch.nn.functional) against torch.nn.functional.

Pointwise activations over layouts x dtypes; softmax/log_softmax and the norms over every
placement of their input on 1-D and 2-D meshes (uneven shards): a call either gives torch's
values or raises a ValueError naming the redistribute() (a sharded softmax dim, normalized dim,
or a Partial). Dropout: torch's formula per element, reproducible, replicas agree.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as TF

import dtorch
import dtorch.nn.functional as F
from dtorch import Partial, Replicate, Shard
from helpers import all_placements, assert_close, assert_refused, check_like_torch, distribute

R, S0, S1, P = Replicate(), Shard(0), Shard(1), Partial()


def sample(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    if not dtype.is_floating_point:
        return torch.randint(-5, 6, shape, generator=g, dtype=dtype)
    return (torch.randn(shape, generator=g) * 3).to(dtype)


def fn_of(name, **kw):
    """The same call on torch.nn.functional or dtorch.nn.functional operands."""
    return lambda *xs: getattr(F if isinstance(xs[0], dtorch.Tensor) else TF, name)(*xs, **kw)


# -- pointwise ------------------------------------------------------------------------------------

POINTWISE = [
    ("relu", {}), ("relu6", {}), ("leaky_relu", {"negative_slope": 0.2}), ("elu", {"alpha": 0.5}),
    ("selu", {}), ("gelu", {}), ("gelu", {"approximate": "tanh"}), ("silu", {}), ("mish", {}),
    ("softplus", {"beta": 2.0, "threshold": 1.0}), ("hardtanh", {"min_val": -0.5}),
    ("hardswish", {}), ("sigmoid", {}), ("tanh", {}),
]
LAYOUTS = [("one", [R]), ("mesh1", [S1]), ("mesh2", [S0, S1]), ("mesh3", [S1, R, S0])]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: v[0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64], ids=str)
def test_pointwise(layout, dtype, request):
    mesh, placements = request.getfixturevalue(layout[0]), layout[1]
    t = sample((5, 7), dtype)
    x = distribute(t, mesh, placements)
    for name, kw in POINTWISE:
        check_like_torch(fn_of(name, **kw), [x], [t], layout[0] == "one")
        if hasattr(TF, name + "_"):
            check_like_torch(lambda v: getattr(F if isinstance(v, dtorch.Tensor) else TF,
                                               name + "_")(v.clone(), **kw),
                             [x], [t], layout[0] == "one")
    y = F.silu(x) if dtype.is_floating_point else F.relu(x)
    assert y.placements == placements


def test_pointwise_methods_and_inplace(mesh1):
    t = sample((5, 7))
    x = distribute(t, mesh1, [S0])
    assert_close(x.relu(), t.relu())
    assert_close(dtorch.selu(x), torch.selu(t))
    y = x.clone()
    assert y.relu_() is y and y.placements == [S0]
    assert_close(y, t.relu())
    z = x.clone()
    assert F.relu(z, inplace=True) is z and z.placements == [S0]  # torch's inplace=True
    assert_close(z, t.relu())
    w = x.clone()
    assert F.silu(w, inplace=True) is w
    assert_close(w, TF.silu(t))
    assert_close(x, t)  # the clones were written, not x


def test_pointwise_partials(mesh1):
    """relu, relu6, selu are non-decreasing: Partial(max)/(min) pass; the others refuse."""
    t = sample((5, 7))
    for op in ("max", "min"):
        x = distribute(t, mesh1, [Partial(op)])
        for name in ("relu", "relu6", "selu", "sigmoid", "tanh"):
            out = getattr(F, name)(x)
            assert out.placements == [Partial(op)]
            assert_close(out, getattr(TF, name)(t))
    for name, _ in POINTWISE:
        assert_refused(getattr(F, name), distribute(t, mesh1, [P]))


# -- softmax and norms over every placement -------------------------------------------------------

# name -> (kwargs, shapes of (input, *operands), the input dims that must be whole (docs/ops.md:
# a softmax's dim, the normalized dims, a group's channels and space); weights span the
# normalized dims. A Partial input is refused throughout.
MIXING = {
    "softmax d1": ("softmax", {"dim": 1}, [(5, 7, 3)], {1}),
    "softmax d-1 float64": ("softmax", {"dim": -1, "dtype": torch.float64}, [(5, 7, 3)], {2}),
    "log_softmax d0": ("log_softmax", {"dim": 0}, [(5, 7, 3)], {0}),
    "layer_norm": ("layer_norm", {"normalized_shape": (3,)}, [(5, 7, 3), (3,), (3,)], {2}),
    "layer_norm 2 dims": ("layer_norm", {"normalized_shape": [7, 3], "eps": 1e-3},
                          [(5, 7, 3)], {1, 2}),
    "rms_norm": ("rms_norm", {"normalized_shape": (3,)}, [(5, 7, 3), (3,)], {2}),
    "rms_norm eps": ("rms_norm", {"normalized_shape": (7, 3), "eps": 1e-2}, [(5, 7, 3)], {1, 2}),
    "group_norm": ("group_norm", {"num_groups": 2}, [(5, 4, 3), (4,), (4,)], {1, 2}),
    # one value per group in a block of one sample: torch's check is on the whole tensor
    "group_norm 2-D": ("group_norm", {"num_groups": 2}, [(4, 2)], {1}),
    # channels shard with the per-channel operands (S(0) there), other dims with them whole
    "batch_norm": ("batch_norm", {}, [(5, 4, 3), (4,), (4,), (4,), (4,)], set()),
}


def mixing_call(name, kw):
    def call(*xs):
        lib = F if isinstance(xs[0], dtorch.Tensor) else TF
        if name in ("layer_norm", "rms_norm"):
            return getattr(lib, name)(xs[0], kw["normalized_shape"], *xs[1:],
                                      **{k: v for k, v in kw.items() if k != "normalized_shape"})
        if name == "group_norm":
            return lib.group_norm(xs[0], kw["num_groups"], *xs[1:])
        return getattr(lib, name)(*xs, **kw)

    return call


def operand_values(shapes):
    ts = [sample(s, seed=k) for k, s in enumerate(shapes)]
    if len(ts) == 5:  # batch_norm: running_var must be positive
        ts[2] = ts[2].abs() + 0.5
    return ts


@pytest.mark.parametrize("case", MIXING)
@pytest.mark.parametrize("mesh_name", ["one", "mesh1", "mesh2"])
def test_mixing_ops_over_placements(case, mesh_name, request):
    """Every input placement (weights Replicate, or sharded like the input's channel dim for
    batch_norm): refused where MIXING says a dim must be whole or the input is Partial, else
    torch's values with the input's placements."""
    name, kw, shapes, whole = MIXING[case]
    mesh = request.getfixturevalue(mesh_name)
    ts = operand_values(shapes)
    fn = mixing_call(name, kw)
    expected = fn(*ts)
    for placements in all_placements(mesh.ndim, len(shapes[0])):
        x = distribute(ts[0], mesh, placements)
        placements = x.placements  # (a Shard on a mesh dim of one device reads back Replicate)
        param = [S0 if p == S1 and name == "batch_norm" else R for p in placements]
        xs = [x] + [distribute(t, mesh, param) for t in ts[1:]]
        if any(p.is_partial() or p.is_shard() and p.dim in whole for p in placements):
            assert_refused(fn, *xs, op=name)
            continue
        out = fn(*xs)
        assert out.placements == placements
        assert_close(out, expected, exact=mesh_name == "one")


def test_mixing_errors_name_the_fix(mesh1):
    x = distribute(sample((5, 7)), mesh1, [S1])
    with pytest.raises(ValueError, match=r"redistribute\(placements=\[Replicate\(\)\]\)"):
        F.softmax(x, dim=1)
    with pytest.raises(ValueError, match="redistribute"):
        F.layer_norm(x, (7,))
    w = distribute(sample((7,)), mesh1, [S0])
    with pytest.raises(ValueError, match=r"weight = weight.redistribute"):
        F.layer_norm(distribute(sample((5, 7)), mesh1, [S0]), (7,), w)


def test_mixing_dtypes_and_torch_errors(mesh2):
    for dtype in (torch.float64, torch.int64, torch.float16):
        t = sample((5, 6), dtype)
        x = distribute(t, mesh2, [S0, R])
        check_like_torch(fn_of("softmax", dim=1), [x], [t], False)
        check_like_torch(fn_of("log_softmax", dim=1, dtype=torch.float64), [x], [t], False)
        check_like_torch(lambda v: (F if isinstance(v, dtorch.Tensor) else TF).layer_norm(v, (6,)),
                         [x], [t], False)
        check_like_torch(lambda v: (F if isinstance(v, dtorch.Tensor) else TF).group_norm(v, 4),
                         [x], [t], False)  # 6 channels in 4 groups: torch's error
    t = sample((5, 6))
    x = distribute(t, mesh2, [S0, R])
    assert_close(F.softmax(x), TF.softmax(t, dim=1))  # dim=None: torch's implicit choice


def test_batch_norm_channel_shards(mesh1):
    """Channels sharded with their running stats and affine params (array_split of C alike)."""
    ts = operand_values([(4, 5, 3), (5,), (5,), (5,), (5,)])
    xs = [distribute(ts[0], mesh1, [S1])] + [distribute(t, mesh1, [S0]) for t in ts[1:]]
    out = F.batch_norm(*xs, eps=1e-3)
    assert out.placements == [S1]
    assert_close(out, TF.batch_norm(*ts, eps=1e-3))
    assert_close(F.batch_norm(xs[0], xs[1], xs[2]), TF.batch_norm(*ts[:3]))


@pytest.mark.parametrize("layout", LAYOUTS + [("mesh2", [S1, S0]), ("mesh1", [Shard(2)])],
                         ids=lambda v: f"{v[0]}-{''.join(map(str, v[1]))}")
@pytest.mark.parametrize("momentum", [0.1, "tensor"])
def test_batch_norm_training_takes_the_global_batch_statistics(layout, momentum, request):
    """Training mode over every layout of an (N, C, L) input, uneven shards included: the
    output, the running statistics moved in place, and the gradients are torch's for the
    whole batch (float64: dtorch's composite and torch's kernel round differently)."""
    mesh, placements = request.getfixturevalue(layout[0]), layout[1]
    ts = [t.double() for t in operand_values([(5, 4, 3), (4,), (4,), (4,), (4,)])]
    x = distribute(ts[0], mesh, placements)
    mean, var, w, b = (distribute(t.clone(), mesh, [R] * mesh.ndim) for t in ts[1:])
    x.requires_grad_(), w.requires_grad_(), b.requires_grad_()
    factor = 0.1 if momentum == 0.1 else distribute(torch.tensor(0.25, dtype=torch.float64),
                                                    mesh, [R] * mesh.ndim)
    out = F.batch_norm(x, mean, var, w, b, True, factor, 1e-3)
    tx, tw, tb = (t.clone().requires_grad_() for t in (ts[0], ts[3], ts[4]))
    tmean, tvar = ts[1].clone(), ts[2].clone()
    want = TF.batch_norm(tx, tmean, tvar, tw, tb, True, 0.1 if momentum == 0.1 else 0.25, 1e-3)
    torch.testing.assert_close(out.to_torch(), want)
    torch.testing.assert_close(mean.to_torch(), tmean)
    torch.testing.assert_close(var.to_torch(), tvar)
    assert not torch.equal(tmean, ts[1])  # the update moved them
    (out * out).sum().backward()
    (want * want).sum().backward()
    for got, ref in ((x, tx), (w, tw), (b, tb)):
        torch.testing.assert_close(got.grad.to_torch(), ref.grad)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        F.batch_norm(distribute(ts[0][:1, :, :1], mesh, [R] * mesh.ndim), None, None,
                     training=True)


# -- dropout --------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS + [("mesh1", [P]), ("mesh2", [R, R])],
                         ids=lambda v: f"{v[0]}-{''.join(map(str, v[1]))}")
def test_dropout(layout, request):
    mesh, placements = request.getfixturevalue(layout[0]), layout[1]
    t = sample((9, 8)) + 0.5 * torch.sign(sample((9, 8), seed=2))  # no zeros in t
    t[t == 0] = 1.0
    x = distribute(t, mesh, placements)
    dtorch.manual_seed(7)
    y = F.dropout(x, p=0.25)
    assert y.placements == placements and y.dtype == t.dtype
    v = y.to_torch()
    kept = v != 0
    torch.testing.assert_close(v[kept], t[kept] / 0.75)
    assert 0.4 < kept.float().mean() < 0.95
    dtorch.manual_seed(7)
    assert torch.equal(F.dropout(x, p=0.25).to_torch(), v)  # reproducible
    assert not torch.equal(F.dropout(x, p=0.25).to_torch(), v)  # a fresh draw next time
    # replicas drew the same values: reading another replica's blocks gives the same tensor
    shards = [S0 if p == R else p for p in placements]
    assert torch.equal(y.redistribute(placements=shards).to_torch(), v)


def test_dropout_edges(mesh1):
    t = sample((5, 7))
    x = distribute(t, mesh1, [S0])
    assert_close(F.dropout(x, 0.5, training=False), t)
    assert_close(F.dropout(x, 0.0), TF.dropout(t, 0.0))
    assert_close(F.dropout(x, 1.0), TF.dropout(t, 1.0))
    with pytest.raises(ValueError):  # torch's check of p
        F.dropout(x, 1.5)
    y = x.clone()
    assert F.dropout(y, 0.0, inplace=True) is y
    assert_close(y, t)
    z = x.clone()
    assert F.dropout(z, 1.0, inplace=True) is z
    assert_close(z, torch.zeros_like(t))
    check_like_torch(lambda v: (F if isinstance(v, dtorch.Tensor) else TF).dropout(v, 0.5),
                     [distribute(t.long(), mesh1, [S0])], [t.long()], False)  # torch's int error


def test_blocks_draw_independently(mesh1):
    """Three uneven shards of a constant tensor do not repeat one another's mask."""
    x = distribute(torch.ones(30, 40), mesh1, [S0])
    v = F.dropout(x, 0.5).to_torch()
    assert not torch.equal(v[:10], v[10:20]) and not torch.equal(v[10:20], v[20:30])

