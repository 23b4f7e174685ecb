"""The extension point: ``dtorch.local_map`` and ``dtorch.register_op`` against plain torch.

Kernels live in ``extension_kernels.py``, which the hosts import by name (tests/ is not on their
path: the client sends the import root). Functions that cannot be sent by name are refused at
the call.
"""

from __future__ import annotations

import pytest
import torch

import dtorch
import extension_kernels as K
from dtorch import Partial, Replicate, Shard
from helpers import assert_close, distribute

R, S0, S1, P = Replicate(), Shard(0), Shard(1), Partial()


def sample(*shape, seed=0, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def blocks(t, mesh_size, dim=0):
    return torch.tensor_split(t, mesh_size, dim)


# -- local_map ------------------------------------------------------------------------------------

@pytest.mark.parametrize("placements", [[S0], [S1], [R]], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64], ids=str)
def test_local_map_keeps_placements(placements, dtype, mesh1):
    t = sample(7, 5, dtype=dtype)
    f = dtorch.local_map(K.scale_rows, placements)
    y = f(distribute(t, mesh1, placements), 3, offset=1)
    assert y.placements == placements
    assert_close(y, K.scale_rows(t, 3, offset=1))


def test_local_map_one_device_is_exact(one):
    t = sample(5, 4)
    y = dtorch.local_map(torch.nn.functional.gelu, [R])(distribute(t, one, [R]))
    assert_close(y, torch.nn.functional.gelu(t), exact=True)


def test_local_map_uneven_result_shapes(mesh1, mesh2):
    """The global shape is joined from every device's block: 7 rows over 3 devices, each
    keeping 2 (blocks of 6 = array_split), or a cumsum per block."""
    t = sample(7, 4)
    y = dtorch.local_map(K.first_rows, [S0])(distribute(t, mesh1, [S0]), 2)
    assert_close(y, torch.cat([b[:2] for b in blocks(t, 3)]))
    z = dtorch.local_map(torch.cumsum, [S1, S0])(distribute(t, mesh2, [S1, S0]), 0)
    expected = torch.cat([torch.cat([b.cumsum(0) for b in blocks(c, 2, 0)], 0)
                          for c in blocks(t, 2, 1)], 1)
    assert_close(z, expected)


def test_local_map_partial_and_two_results(mesh2):
    t = sample(6, 5)
    total, same = dtorch.local_map(K.split_stats, ([P, P], [S0, S1]))(distribute(t, mesh2,
                                                                              [S0, S1]))
    assert total.placements == [P, P]
    assert_close(total, t.sum())
    assert_close(same, t)


def test_local_map_copies_aliasing_results(mesh1):
    t = sample(5, 3)
    x = distribute(t, mesh1, [S0])
    y = dtorch.local_map(K.returns_input, [S0])(x)
    x.add_(1)
    assert_close(y, t)
    assert_close(x, t + 1)


def test_local_map_torch_by_name(mesh1):
    t = sample(6, 4)
    y = dtorch.local_map("torch.nn.functional.softmax", [S0])(distribute(t, mesh1, [S0]), 1)
    assert_close(y, torch.softmax(t, 1))


def test_local_map_errors(mesh1):
    x = distribute(sample(7, 3), mesh1, [S0])
    with pytest.raises(TypeError, match="lambda"):
        dtorch.local_map(lambda v: v, [S0])
    with pytest.raises(TypeError, match="__main__|module"):
        dtorch.local_map(_NotImportable(), [S0])
    with pytest.raises(ValueError, match="array_split"):
        dtorch.local_map(K.bad_uneven, [S0])(x)
    with pytest.raises(ValueError, match=r"redistribute\(placements=\[Replicate\(\)\]\)"):
        dtorch.local_map(K.scale_rows, [R], in_placements=([R], None))(x, 2)
    with pytest.raises(TypeError, match="dtorch.from_torch"):
        dtorch.local_map(K.scale_rows, [S0])(x, torch.ones(1))
    with pytest.raises(TypeError, match="dtorch.Tensor argument"):
        dtorch.local_map(K.scale_rows, [S0])(2.0, 2)
    with pytest.raises(RuntimeError, match="meta"):  # fn reads values: it cannot run on meta
        dtorch.local_map(torch.Tensor.tolist, [S0])(x)


class _NotImportable:
    __module__ = "__main__"
    __qualname__ = "script_fn"

    def __call__(self, x):
        return x


def test_local_map_rejects_main_functions():
    fn = type("f", (), {})
    fn.__module__, fn.__qualname__ = "__main__", "f"
    with pytest.raises(TypeError, match="move it to a module"):
        dtorch.local_map(fn, [R])


# -- register_op ----------------------------------------------------------------------------------

@pytest.mark.parametrize("placements", [[S0], [S1], [R]], ids=str)
def test_registered_op(placements, mesh1):
    t = sample(5, 7)
    x = distribute(t, mesh1, placements)
    dim = 0 if placements == [S1] else -1  # the softmax dim must be whole
    for y in (dtorch.ext_softmax(x, dim), x.ext_softmax(dim), K.softmax(x, dim=dim)):
        assert_close(y, torch.softmax(t, dim))
        assert y.placements == placements


def test_registered_op_placement_error_names_it(mesh2):
    t = sample(5, 7)
    x = distribute(t, mesh2, [S1, S0])
    with pytest.raises(ValueError, match=r"dtorch.ext_softmax.*input=S\(1\)") as e:
        x.ext_softmax(1)
    fix = str(e.value).split("e.g. ")[-1]
    assert "input.redistribute" in fix
    assert_close(x.redistribute(placements=[R, S0]).ext_softmax(1), torch.softmax(t, 1))


def test_registered_linear_op_on_meshes(mesh1, mesh2, one):
    t = sample(6, 3)
    for mesh, placements, exact in ((mesh1, [P], False), (mesh2, [S0, P], False),
                                    (one, [R], True)):
        assert_close(K.double(distribute(t, mesh, placements)), t + t, exact)
    with pytest.raises(ValueError, match="dtorch.ext_double"):
        K.double(distribute(t, mesh1, [S1]))


def test_register_op_refusals():
    with pytest.raises(ValueError, match="already registered"):
        dtorch.register_op("ext_softmax(input: Tensor, dim)", K.row_softmax)
    with pytest.raises(ValueError, match="already registered"):
        dtorch.register_op("add(input: Tensor, other: Tensor)", torch.add)
    with pytest.raises(TypeError, match="meta"):
        dtorch.register_op("ext_ctx(input: Tensor)", K.twice, uses_context=True)
    with pytest.raises(TypeError, match="lambda"):
        dtorch.register_op("ext_lambda(input: Tensor)", lambda x: x)


def test_kernel_error_is_reported_at_the_next_wait(mesh1):
    t = sample(4, 3)
    x = distribute(t, mesh1, [R])
    y = dtorch.local_map(K.fails_on_values, [R])(x)
    with pytest.raises(RuntimeError, match="boom on the host"):
        dtorch.sync()
    with pytest.raises(RuntimeError, match="boom on the host"):
        y.to_torch()
    assert_close(dtorch.local_map(K.scale_rows, [R])(x, 2), t * 2)


# -- results that break the metadata run's promise ------------------------------------------------
# Each kernel returns on the hosts what its metadata run (on meta tensors, on the client) did not
# promise. Every device checks its results before storing them, so the mismatch is the call's
# kernel error, naming what was expected and what came back; unchecked, a collective reading the
# result would exchange buffers of different sizes and gloo would abort the host (SIGABRT).
# 7 rows over mesh1's 3 devices: blocks of 3, 2, 2 rows.

BAD_RESULTS = {
    "dtype-on-one-device": (
        lambda x: K.wrong_dtype(x), "custom_op",
        r"ext_wrong_dtype result 0 on device 1 is a float64 tensor "
        r"of local shape \(2, 3\) on cpu; expected a float32 tensor of local shape \(2, 3\) "
        r"on cpu.*meta rule of dtorch.ext_wrong_dtype"),
    "uneven-local-shape": (
        lambda x: dtorch.local_map(K.host_rows, [S0])(x, 2), "local_map",
        r"host_rows result 0 on device 0 is a float32 tensor of "
        r"local shape \(2, 3\) on cpu; expected a float32 tensor of local shape \(3, 3\) on "
        r"cpu, this device's block of global shape \(7, 3\) under placements S\(0\)"),
    "not-a-tensor": (
        lambda x: dtorch.local_map(K.host_number, [S0])(x), "local_map",
        r"host_number result 0 on device \d is a float, not a torch.Tensor; expected a "
        r"float32 tensor"),
    "number-of-results": (
        lambda x: dtorch.local_map(K.host_pair, [S0])(x), "local_map",
        r"host_pair returned 2 results on device \d; the client's run of host_pair on meta "
        r"tensors gave 1"),
    "device": (
        lambda x: dtorch.local_map(K.host_meta, [S0])(x), "local_map",
        r"host_meta result 0 on device \d is a float32 tensor of local shape \(\d, 3\) on "
        r"meta; expected .* on cpu"),
}


@pytest.mark.parametrize("read", ["directly", "through-all-gather"])
@pytest.mark.parametrize("case", list(BAD_RESULTS))
def test_a_result_that_breaks_its_spec_is_a_kernel_error(case, read, mesh1):
    """The error is raised at the next sync, naming the call site, and again by reading the
    result, also after a collective (every device takes part; none aborts); the runtime then
    runs a collective over the same devices as before."""
    make, carrier, message = BAD_RESULTS[case]
    t = sample(7, 3)
    x = distribute(t, mesh1, [S0])
    y = make(x)
    if read != "directly":
        y = y.redistribute(placements=[R])
    error = rf"dtorch.{carrier} failed \(called at .*test_extension.py:\d+\): RuntimeError: "
    error += message
    with pytest.raises(RuntimeError, match=error):
        dtorch.sync()
    with pytest.raises(RuntimeError, match=error):
        y.to_torch()
    assert_close(x.redistribute(placements=[R]) * 2, t * 2)
