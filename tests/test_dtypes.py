"""Dtypes beyond float32 through the runtime: every collective step for low-precision floats,
complex numbers, small integers and bools, on a 1-D mesh, a permuted 2x2 mesh and a 2x3 mesh;
low-precision sums, means and products reduced in float32 and rounded once; casts of Partials;
complex arithmetic where torch has it.

Low-precision results are compared bit for bit with what rounding once gives: each device's
local result (torch's own kernel on its block), added in float32 across the devices, rounded to
the dtype. A collective that adds in the low dtype (rounding at every hop) misses it.
"""

from __future__ import annotations

import pytest
import torch

import dtorch
from dtorch import DeviceMesh, Partial, Replicate, Shard
from helpers import assert_close, assert_refused, distribute, sample

R, S0, S1, P = Replicate(), Shard(0), Shard(1), Partial()
PA, PMAX, PMIN = Partial("avg"), Partial("max"), Partial("min")
PERMUTED = DeviceMesh("cpu", [[3, 1], [0, 2]])  # devices out of order along both mesh dims
MESH_2X3 = DeviceMesh("cpu", [[0, 1, 2], [3, 4, 5]])
MESH_1D = DeviceMesh("cpu", [0, 1, 2])
ELSEWHERE = DeviceMesh("cpu", [5, 2, 4])  # a mesh of the same shape as MESH_1D, moved onto
LOW = [torch.bfloat16, torch.float16]
DTYPES = LOW + [torch.float64, torch.complex64, torch.complex128, torch.int32, torch.uint8,
                torch.bool]


def value(shape, dtype, seed=0) -> torch.Tensor:
    if dtype.is_complex:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype == torch.uint8:
        return sample(shape, torch.int64, seed).abs().to(dtype)
    return sample(shape, dtype, seed)


def transitions(dtype, ndim: int) -> list:
    """(source, target) pairs that take every redistribute step once at least: all_gather,
    all_reduce, reduce_scatter, all_to_all, chunk, partition, pad_partial (Partial max and min
    where the dtype is ordered, avg where it divides)."""
    ordered = not dtype.is_complex
    partials = [P] + [PMAX, PMIN] * ordered + [PA] * (dtype.is_floating_point or dtype.is_complex)
    pairs = [(S0, R), (S0, S1), (R, S1), (R, P), (S1, P)] + [(p, R) for p in partials] + [
        (p, S0) for p in partials] + [(S0, PMAX)] * ordered
    if ndim == 1:
        return [([a], [b]) for a, b in pairs]
    return [([a, S1], [b, S1]) for a, b in pairs] + [([S1, a], [R, b]) for a, b in pairs]


@pytest.mark.parametrize("mesh", [MESH_1D, PERMUTED, MESH_2X3], ids=["1d", "permuted", "2x3"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_collective_every_dtype(dtype, mesh):
    """Each transition from genuine contributions (uneven 5 x 7 over the mesh) gives the value;
    then a move to another mesh."""
    t = value((5, 7), dtype)
    cases = transitions(dtype, mesh.ndim)
    outs = [distribute(t, mesh, src, seed=k).redistribute(placements=dst)
            for k, (src, dst) in enumerate(cases)]  # issued together: they pipeline
    for (src, dst), y in zip(cases, outs):
        assert y.placements == dst, (src, dst)
        assert_close(y, t)
    if mesh is MESH_1D:
        y = distribute(t, mesh, [S0]).redistribute(ELSEWHERE, [S1])
        assert_close(y.redistribute(mesh, [R]), t, exact=True)


def blocks(t, mesh, dim):
    """The blocks of ``t`` sharded along ``dim`` over a 1-D mesh."""
    return t.tensor_split(mesh.size(), dim)


def rounded_once(parts) -> torch.Tensor:
    """What a low-precision reduction over devices gives when it adds in float32 and rounds
    once (each part already the device's own result, in the low dtype)."""
    return torch.stack(parts).float().sum(0).to(parts[0].dtype)


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_low_precision_sums_round_once(dtype):
    """x.sum() over a sharded dim is computed as torch computes it, in float32 and rounded
    once: each device sums its block in float32, the all-reduce adds those in float32, and the
    value is cast to the dtype at the end (bit for bit that, and as close to the exact sum as
    torch's own). Genuine Partial contributions, which add up to the value exactly, give the
    value itself through the all-reduce and the reduce-scatter."""
    t = value((4000,), dtype, seed=3)
    x = distribute(t, MESH_1D, [S0])
    total = x.sum()
    assert (total.dtype, total.placements) == (dtype, [R])
    wide = [b.sum(dtype=torch.float32) for b in blocks(t, MESH_1D, 0)]
    assert_close(total, rounded_once(wide).to(dtype), exact=True)
    m = value((6, 300), dtype, seed=4)
    y = distribute(m, MESH_1D, [S1])
    wide = [b.sum(1, dtype=torch.float32) for b in blocks(m, MESH_1D, 1)]
    assert_close(y.sum(dim=1), rounded_once(wide).to(dtype), exact=True)
    # mean: each block's float32 sum over the global count, then the float32 all-reduce
    assert_close(y.mean(dim=1), rounded_once([w / 300 for w in wide]).to(dtype), exact=True)
    # a 2-D mesh reducing over both mesh dims, keepdim, and dtype= given (no cast then)
    z = distribute(m, MESH_2X3, [S0, S1])
    assert_close(z.sum(dim=(0, 1), keepdim=True), m.sum(dim=(0, 1), keepdim=True))
    assert z.sum(dtype=torch.float32).dtype == torch.float32
    p = distribute(m, PERMUTED, [P, P], seed=5)
    assert_close(p.redistribute(placements=[R, R]), m, exact=True)
    assert_close(p.redistribute(placements=[S0, S1]), m, exact=True)


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_low_precision_sums_as_close_as_torch(dtype):
    """Over many rows, a sharded low-precision sum is no further from the exact sum than
    torch's: rounding each device's sum before the all-reduce made it about 2x further."""
    m = value((64, 3000), dtype, seed=6)
    exact = m.double().sum(1)
    ours = distribute(m, MESH_1D, [S1]).sum(dim=1).to_torch().double()
    theirs = m.sum(1).double()
    ours_err, torch_err = (ours - exact).abs().mean(), (theirs - exact).abs().mean()
    assert ours_err <= 1.1 * torch_err, (ours_err, torch_err)


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_low_precision_matmul(dtype):
    """A contracted dim sharded: each device's product, added in float32 and rounded once;
    the other rows against torch's tolerance for the dtype."""
    a, b = value((5, 9), dtype), value((9, 4), dtype, seed=1)
    out = distribute(a, MESH_1D, [S1]) @ distribute(b, MESH_1D, [S0])
    assert out.placements == [P]
    locals_ = [x @ y for x, y in zip(blocks(a, MESH_1D, 1), blocks(b, MESH_1D, 0))]
    assert_close(out.redistribute(placements=[R]), rounded_once(locals_), exact=True)
    for pa, pb in (([S0, R], [R, S1]), ([S1, R], [S0, S1]), ([P, S0], [R, R])):
        got = distribute(a, PERMUTED, pa) @ distribute(b, PERMUTED, pb)
        assert_close(got, a @ b)


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("name", ["amax", "amin", "max", "min"])
def test_low_precision_extrema_are_exact(name, dtype):
    """A max of maxima rounds nothing: torch's value bit for bit."""
    t = value((5, 7), dtype)
    for mesh, placements in ((MESH_1D, [S0]), (MESH_2X3, [S1, S0]), (PERMUTED, [PMAX, S1])):
        if name in ("amin", "min") and PMAX in placements:
            placements = [PMIN, S1]
        x = distribute(t, mesh, placements)
        assert_close(getattr(x, name)(), getattr(t, name)(), exact=True)


def test_partial_casts_to_lower_precision_are_refused(mesh1):
    """Rounding each contribution before their sum misses the rounded sum (by percents where
    they cancel): a narrowing cast of a Partial sum is refused, a widening one passes."""
    t = value((5, 7), torch.float32)
    x = distribute(t, mesh1, [P])
    for dtype in LOW:
        assert_refused(lambda v: v.to(dtype), x, op="to")
        assert_refused(lambda v: v.sum(dim=0, dtype=dtype), x, op="sum")
        low = distribute(t.to(dtype), mesh1, [P])
        wide = low.to(torch.float32)
        assert wide.placements == [P]
        assert_close(wide, t.to(dtype).float())
    fixed = x.redistribute(placements=[R]).to(torch.bfloat16)  # the fix the error names
    assert_close(fixed, t.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
def test_complex_arithmetic(dtype, mesh1):
    """Where torch has complex kernels: elementwise ops, products (a contracted shard's Partial
    sum), sums over a sharded dim, and genuine complex Partials through linear ops."""
    a, b = value((5, 7), dtype), value((7, 4), dtype, seed=1)
    x, y = distribute(a, mesh1, [S0]), distribute(b, mesh1, [R])
    for out, expected in ((x * 2 + x.exp(), a * 2 + a.exp()), (x @ y, a @ b),
                          (x.sum(dim=0), a.sum(dim=0)), (x.abs(), a.abs())):
        assert_close(out, expected)
    product = distribute(a, mesh1, [S1]) @ distribute(b, mesh1, [S0])
    assert product.placements == [P]
    assert_close(product.sum(), (a @ b).sum())
    p = distribute(a, mesh1, [P])
    for fn in (lambda v: v * 2 - v, lambda v: v.t(),
               lambda v: v.mean(dim=1)):
        assert fn(p).placements == [P]
        assert_close(fn(p), fn(a))


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_reading_a_low_precision_partial_rounds_once(dtype):
    """The client joins the blocks of a Partial value it reads the way the collectives
    reduce them: in float32, rounded once. Contributions big, 1, 1 (big a power of two where
    the dtype's spacing is 2) add up to big + 2; added one by one in the low dtype, each + 1
    rounds back to big."""
    big = 256.0 if dtype is torch.bfloat16 else 2048.0
    parts = torch.tensor([big, 1.0, 1.0], dtype=dtype)
    one_each = dtorch.from_torch(parts, device_mesh=MESH_1D, placements=[S0])
    partial = dtorch.local_map(torch.sum, [Partial()])(one_each)
    assert partial.to_torch().item() == big + 2
