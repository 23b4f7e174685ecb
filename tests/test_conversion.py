"""Conversions against torch: to (dtype, mesh, other tensor), type_as, copy_ from any layout or
mesh (broadcast and cast as torch), detach, numel, and equal/allclose answering Python bools."""

from __future__ import annotations

import pytest
import torch

import dtorch
from dtorch import Partial, Replicate, Shard
from helpers import assert_close, assert_refused, distribute, layout_fixture

R, S0, S1, P = Replicate(), Shard(0), Shard(1), Partial()

LAYOUTS = [
    ("one", (R,)), ("mesh1", (S0,)), ("mesh1", (S1,)), ("mesh1", (P,)), ("mesh2", (S0, S1)),
    ("mesh2", (S1, S1)), ("mesh2", (Partial("max"), S0)), ("mesh3", (S0, R, S1)),
]


layout = layout_fixture(LAYOUTS)


def sample(shape=(5, 7), dtype=torch.float32, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 4).to(dtype)


# docs/ops.md: a Partial sum passes a cast only where every contribution converts exactly
# (float32 -> float64); a cast to an integer or bool, or a narrowing one (float32 -> float16),
# refuses it, and a Partial max refuses every cast
PARTIAL_CASTS = {torch.float64}


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64, torch.bool, torch.float16], ids=str)
def test_to_dtype_and_type_as(dtype, layout):
    mesh, placements, exact = layout
    t = sample()
    x = distribute(t, mesh, placements)
    if any(p.is_partial() and (p != P or dtype not in PARTIAL_CASTS) for p in placements):
        for cast in (lambda v: v.to(dtype), lambda v: v.type_as(distribute(t.to(dtype), mesh,
                                                                           [R] * mesh.ndim))):
            assert_refused(cast, x)
        placements = [R if p.is_partial() else p for p in placements]  # the fix it names
        x = distribute(t, mesh, placements)
    for y in (x.to(dtype), x.to(dtype=dtype), x.to(dtype, False, True), x.to("cpu", dtype),
              x.type_as(distribute(t.to(dtype), mesh, [R] * mesh.ndim))):
        assert y.placements == placements
        assert_close(y, t.to(dtype), exact)


def test_to_returns_self_unless_it_changes(mesh1):
    x = distribute(sample(), mesh1, [S0])
    assert x.to("cpu") is x and x.to(mesh1) is x and x.to(torch.device("cpu")) is x
    y = x.to(torch.float32, copy=True)
    assert y is not x
    assert_close(y, sample())
    with pytest.raises(NotImplementedError, match="device_mesh"):
        x.to("cuda")
    with pytest.raises(TypeError):
        x.to(3)


def test_to_mesh_and_other(mesh1, mesh2, one):
    t = sample()
    x = distribute(t, mesh1, [S1])
    y = x.to(one)  # same placements on another 1-D mesh (a Shard on one device: Replicate)
    assert y.device_mesh == one and y.placements == [R]
    assert_close(y, t, exact=True)
    z = x.to(distribute(sample(dtype=torch.float64), one, [R]))  # other's dtype and mesh
    assert z.device_mesh == one and z.dtype == torch.float64
    assert_close(z, t.double(), exact=True)
    with pytest.raises(ValueError, match=r"redistribute\(device_mesh"):
        x.to(mesh2)  # a 1-D layout on a 2-D mesh: say which placements


SOURCES = {  # source tensors for copy_ into a (5, 7) float32 destination
    "same": (sample(seed=1), None),
    "int": (sample(seed=1, dtype=torch.int64), None),
    "row": (sample((7,), seed=2), None),
    "column": (sample((5, 1), seed=3), None),
    "scalar": (torch.tensor(2.5, dtype=torch.float64), None),
    "bad shape": (sample((6,), seed=4), RuntimeError),
}


@pytest.mark.parametrize("src", SOURCES)
@pytest.mark.parametrize("src_placement", ["replicate", "sharded", "partial"])
def test_copy_(src, src_placement, layout):
    mesh, placements, exact = layout
    s, error = SOURCES[src]
    x = distribute(sample(), mesh, placements)
    sp = {"replicate": [R] * mesh.ndim, "partial": [P] * mesh.ndim,
          "sharded": [Shard(0) if s.dim() else R] + [R] * (mesh.ndim - 1)}[src_placement]
    y = distribute(s, mesh, sp)
    if error:
        with pytest.raises(error):
            x.copy_(y)
        return
    assert x.copy_(y) is x
    assert x.placements == placements
    assert_close(x, sample().copy_(s), exact and src_placement != "partial")


def test_copy_across_meshes_and_errors(mesh1, mesh2):
    x = distribute(sample(), mesh2, [S0, P])
    s = sample(seed=1)
    x.copy_(distribute(s, mesh1, [S1]))
    assert x.placements == [S0, P]
    assert_close(x, s)
    with pytest.raises(TypeError):
        x.copy_(3.0)
    i = distribute(torch.zeros(5, 7, dtype=torch.int64), mesh1, [S0])
    i.copy_(distribute(torch.full((5, 7), 2.7), mesh1, [P]))  # reduced before the cast
    assert_close(i, torch.full((5, 7), 2.7).to(torch.int64))


def test_detach_and_numel(layout):
    mesh, placements, exact = layout
    t = sample()
    x = distribute(t, mesh, placements)
    d = x.detach()
    assert d.placements == placements
    assert_close(d, t.detach(), exact)
    assert dtorch.detach(x).shape == x.shape
    assert dtorch.numel(x) == x.numel() == torch.numel(t)


def test_equal_and_allclose(layout):
    mesh, placements, exact = layout
    t = sample()
    x = distribute(t, mesh, placements)
    rep = [R] * mesh.ndim
    if P in placements or Partial("max") in placements:  # parts of equal tensors differ
        assert_refused(dtorch.equal, x, x, op="equal")
        assert_refused(dtorch.allclose, x, x, op="allclose")
        x = distribute(t, mesh, rep)
    same, near = distribute(t.clone(), mesh, rep), distribute(t + 1e-7, mesh, x.placements)
    off = t.clone()
    off[4, 6] += 1  # on the last (smallest) shard
    far = distribute(off, mesh, x.placements)
    assert dtorch.equal(x, same) is True and x.equal(same)
    assert dtorch.equal(x, far) is False and not x.equal(far)
    assert dtorch.equal(x, distribute(t[:4], mesh, rep)) is False  # shapes differ
    assert dtorch.allclose(x, near) is True and x.allclose(near, atol=1e-6)
    assert dtorch.allclose(x, far) is False
    assert dtorch.allclose(x, far, atol=2) is True
    assert dtorch.allclose(x, distribute(t[0], mesh, rep)) is torch.allclose(t, t[0])
    nan = torch.full((5, 7), float("nan"))
    n = distribute(nan, mesh, rep)
    assert dtorch.equal(n, n) is torch.equal(nan, nan)
    assert dtorch.allclose(n, n, equal_nan=True) is True


def test_equal_allclose_dtypes_and_errors(mesh1):
    a = distribute(torch.arange(6), mesh1, [S0])
    b = distribute(torch.arange(6.0), mesh1, [S0])
    assert dtorch.equal(a, b) is torch.equal(torch.arange(6), torch.arange(6.0))
    with pytest.raises(RuntimeError):  # torch: "Float did not match Double"
        dtorch.allclose(b, b.to(torch.float64))
    with pytest.raises(RuntimeError):
        dtorch.allclose(b, distribute(torch.ones(4), mesh1, [R]))
    with pytest.raises(TypeError):
        dtorch.equal(b, 1.0)
