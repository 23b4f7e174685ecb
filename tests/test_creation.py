"""Factories against torch: every one on every mesh, with dtype=, device_mesh= and placements=
(Partial included: the value is the reduction of the blocks), and random factories equal to
torch's draws for the same seeded torch.Generator."""

from __future__ import annotations

import pytest
import torch

import dtorch
from dtorch import Partial, Replicate, Shard
from helpers import assert_close, layout_fixture

R, S0, S1, P = Replicate(), Shard(0), Shard(1), Partial()

LAYOUTS = [
    ("one", (R,)), ("mesh1", (S0,)), ("mesh1", (S1,)), ("mesh1", (P,)),
    ("mesh2", (S0, S1)), ("mesh2", (P, S0)), ("mesh2", (S1, Partial("max"))),
    ("mesh3", (S0, S0, S1)), ("mesh3", (R, P, S1)),
]


layout = layout_fixture(LAYOUTS)


def where(layout) -> dict:
    mesh, placements, _ = layout
    return {"device_mesh": mesh, "placements": placements}


def seeded(seed: int = 7) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def laid_out(x, layout, shape, dtype) -> None:
    mesh, placements, _ = layout
    assert x.device_mesh == mesh and x.placements == placements
    assert tuple(x.shape) == shape and x.dtype == dtype


# -- constant factories ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [None, torch.float64, torch.int64, torch.bool], ids=str)
def test_zeros_ones_full_empty(dtype, layout):
    kw = where(layout)
    for name in ("zeros", "ones"):
        expected = getattr(torch, name)(5, 7, dtype=dtype)
        for x in (getattr(dtorch, name)(5, 7, dtype=dtype, **kw),
                  getattr(dtorch, name)((5, 7), dtype=dtype, **kw),
                  getattr(dtorch, name)([5, 7], dtype=dtype, **kw),
                  getattr(dtorch, name)(torch.Size([5, 7]), dtype=dtype, **kw)):
            laid_out(x, layout, (5, 7), expected.dtype)
            assert_close(x, expected, exact=True)
    assert_close(dtorch.full((5, 7), 3, dtype=dtype, **kw), torch.full((5, 7), 3, dtype=dtype),
                 exact=True)
    e = dtorch.empty(5, 7, dtype=dtype, **kw)
    laid_out(e, layout, (5, 7), torch.empty(0, dtype=dtype).dtype)
    assert e.to_torch().shape == (5, 7)


def test_full_infers_dtype_from_fill_value(mesh2):
    kw = {"device_mesh": mesh2, "placements": [S0, S1]}
    for fill in (2, 2.5, True):
        assert_close(dtorch.full((3, 4), fill, **kw), torch.full((3, 4), fill), exact=True)


def test_default_mesh_and_placements():
    x = dtorch.zeros(2, 3)
    assert x.device_mesh.devices == (0,) and x.placements == [R]
    assert_close(x, torch.zeros(2, 3), exact=True)
    assert_close(dtorch.ones(()), torch.ones(()), exact=True)  # 0-d


def test_like_factories(layout):
    mesh, placements, _ = layout
    t = torch.randn(5, 7, generator=seeded())
    x = dtorch.from_torch(t, mesh, placements)
    for name in ("zeros_like", "ones_like", "empty_like"):
        y = getattr(dtorch, name)(x)
        laid_out(y, layout, (5, 7), torch.float32)
        if name != "empty_like":
            assert_close(y, getattr(torch, name)(t), exact=True)
    y = dtorch.full_like(x, 4, dtype=torch.int64)
    laid_out(y, layout, (5, 7), torch.int64)
    assert_close(y, torch.full_like(t, 4, dtype=torch.int64), exact=True)
    z = dtorch.zeros_like(x, placements=[R] * mesh.ndim)
    assert z.placements == [R] * mesh.ndim
    assert_close(dtorch.ones_like(x, dtype=torch.bool), torch.ones_like(t, dtype=torch.bool))


def test_like_on_another_mesh(mesh1, mesh2):
    x = dtorch.ones(4, 3, device_mesh=mesh1, placements=[S0])
    y = dtorch.zeros_like(x, device_mesh=mesh2)
    assert y.device_mesh == mesh2 and y.placements == [R, R]
    y = dtorch.ones_like(x, device_mesh=mesh2, placements=[S1, S0])
    assert y.placements == [S1, S0]
    assert_close(y, torch.ones(4, 3), exact=True)


# -- ranges ---------------------------------------------------------------------------------------

ARANGES = [((5,), {}), ((1, 10, 3), {}), ((0, 1, 0.1), {}), ((7,), {"dtype": torch.float64}),
           ((-3, 3), {"dtype": torch.int32}), ((10, 0, -2), {})]


@pytest.mark.parametrize("args,kwargs", ARANGES, ids=str)
def test_arange(args, kwargs, mesh1, mesh3):
    expected = torch.arange(*args, **kwargs)
    for mesh, placements in ((mesh1, [S0]), (mesh1, [P]), (mesh3, [S0, S0, R])):
        x = dtorch.arange(*args, **kwargs, device_mesh=mesh, placements=placements)
        assert x.placements == placements
        assert_close(x, expected, exact=True)


# -- random ---------------------------------------------------------------------------------------

RANDOM = {
    "rand": (lambda lib, g, **kw: lib.rand(5, 7, generator=g, **kw)),
    "randn": (lambda lib, g, **kw: lib.randn((5, 7), generator=g, **kw)),
    "randn64": (lambda lib, g, **kw: lib.randn(5, 7, generator=g, dtype=torch.float64, **kw)),
    "randint": (lambda lib, g, **kw: lib.randint(10, (5, 7), generator=g, **kw)),
    "randint-kw": (lambda lib, g, **kw: lib.randint(10, size=(5, 7), generator=g, **kw)),
    "randint-low": (lambda lib, g, **kw: lib.randint(-4, 4, (5, 7), generator=g, **kw)),
    "randint-i32": (lambda lib, g, **kw: lib.randint(0, 9, (5, 7), generator=g,
                                                     dtype=torch.int32, **kw)),
}


@pytest.mark.parametrize("name", RANDOM)
def test_random_equals_torch_for_a_generator(name, layout):
    draw = RANDOM[name]
    g, tg = seeded(), seeded()
    x = draw(dtorch, g, **where(layout))
    expected = draw(torch, tg)
    laid_out(x, layout, (5, 7), expected.dtype)
    assert_close(x, expected, exact=True)
    # the generator advanced exactly as torch's did: the next draws match too
    assert torch.equal(g.get_state(), tg.get_state())
    assert_close(draw(dtorch, g, **where(layout)), draw(torch, tg), exact=True)


def test_random_without_generator_is_seeded_and_layout_independent(mesh1, mesh2):
    dtorch.manual_seed(3)
    a = dtorch.rand(6, 5, device_mesh=mesh1, placements=[S0])
    b = dtorch.randn(6, 5, device_mesh=mesh1, placements=[S1])
    dtorch.manual_seed(3)
    a2 = dtorch.rand(6, 5, device_mesh=mesh2, placements=[S1, S0])
    b2 = dtorch.randn(6, 5, device_mesh=mesh2, placements=[P, R])
    assert torch.equal(a.to_torch(), a2.to_torch())
    torch.testing.assert_close(b.to_torch(), b2.to_torch())
    assert not torch.equal(a.to_torch(), dtorch.rand(6, 5, device_mesh=mesh1).to_torch())


# -- from torch data ------------------------------------------------------------------------------

DATA = {
    "float32": torch.randn(5, 7, generator=seeded()),
    "float64": torch.randn(3, 5, 2, generator=seeded(), dtype=torch.float64),
    "int64": torch.randint(-9, 9, (5, 7), generator=seeded()),
    "bool": torch.randint(0, 2, (5, 7), generator=seeded()).bool(),
    "bfloat16": torch.randn(5, 7, generator=seeded()).bfloat16(),
    "half": torch.randn(5, 7, generator=seeded()).half(),
    "non-contiguous": torch.randn(7, 5, generator=seeded()).t(),
    "empty": torch.zeros(0, 7),
}


@pytest.mark.parametrize("name", DATA)
def test_from_torch_reads_back(name, layout):
    mesh, placements, _ = layout
    t = DATA[name]
    x = dtorch.from_torch(t, device_mesh=mesh, placements=placements)
    laid_out(x, layout, tuple(t.shape), t.dtype)
    assert_close(x, t, exact=True)


@pytest.mark.parametrize("op", ["sum", "max", "min", "avg"])
def test_from_torch_partial_reads_back(op, mesh1, mesh2):
    t = DATA["float32"]
    for mesh, placements in ((mesh1, [Partial(op)]), (mesh2, [Partial(op), S1]),
                             (mesh2, [S0, Partial(op)])):
        # avg reads back as (t + t + ...) / n: equal up to rounding
        assert_close(dtorch.from_torch(t, mesh, placements), t, exact=op != "avg")


def test_from_torch_scalars_and_tensor(mesh1):
    assert_close(dtorch.from_torch(torch.tensor(2.5), mesh1, [P]), torch.tensor(2.5), exact=True)
    for data, kw in (([[1, 2], [3, 4]], {}), ([1.5, 2.5], {"dtype": torch.float64}),
                     ([True, False, True], {}), (3, {})):
        expected = torch.tensor(data, **kw)
        placements = [S0] if expected.dim() else [R]
        x = dtorch.tensor(data, **kw, device_mesh=mesh1, placements=placements)
        assert x.placements == placements
        assert_close(x, expected, exact=True)


def test_bad_placements_raise(mesh1, mesh2):
    with pytest.raises(ValueError, match="one per mesh dim"):
        dtorch.zeros(3, 4, device_mesh=mesh2, placements=[S0])
    with pytest.raises(IndexError):
        dtorch.zeros(3, 4, device_mesh=mesh1, placements=[Shard(2)])
    with pytest.raises(TypeError):
        dtorch.from_torch([1, 2], mesh1)
    with pytest.raises(TypeError, match="DeviceMesh"):
        dtorch.ones(3, device_mesh=[0, 1])
    assert_close(dtorch.zeros(3, 4, device_mesh=mesh1, placements=[Shard(-1)]), torch.zeros(3, 4))


# -- eye, linspace, logspace, randperm, *_like, size= ---------------------------------------------

SPACED = {
    "eye": (lambda lib, **kw: lib.eye(5, **kw)),
    "eye-rect": (lambda lib, **kw: lib.eye(5, 7, **kw)),
    "eye-int": (lambda lib, **kw: lib.eye(6, 5, dtype=torch.int64, **kw)),
    "eye-bool": (lambda lib, **kw: lib.eye(5, 7, dtype=torch.bool, **kw)),
    "linspace": (lambda lib, **kw: lib.linspace(-1, 2, 11, **kw)),
    "linspace-f64": (lambda lib, **kw: lib.linspace(0, 1, 7, dtype=torch.float64, **kw)),
    "linspace-int": (lambda lib, **kw: lib.linspace(0, 20, 8, dtype=torch.int64, **kw)),
    "linspace-1": (lambda lib, **kw: lib.linspace(3, 4, 1, **kw)),
    "logspace": (lambda lib, **kw: lib.logspace(0, 3, 8, **kw)),
    "logspace-base": (lambda lib, **kw: lib.logspace(-2, 2, 9, base=2, **kw)),
}
ONE_D = [("one", (R,)), ("mesh1", (S0,)), ("mesh1", (P,)), ("mesh2", (S0, S0)),
         ("mesh2", (Partial("max"), S0)), ("mesh3", (S0, R, P))]


@pytest.mark.parametrize("name", SPACED)
def test_eye_and_spaced(name, layout, mesh1, mesh2, mesh3, one):
    meshes = {"one": one, "mesh1": mesh1, "mesh2": mesh2, "mesh3": mesh3}
    expected = SPACED[name](torch)
    layouts = [layout] if expected.dim() == 2 else [
        (meshes[m], list(p), m == "one") for m, p in ONE_D]
    for lay in layouts:
        x = SPACED[name](dtorch, **where(lay))
        laid_out(x, lay, tuple(expected.shape), expected.dtype)
        assert_close(x, expected, exact=Partial("avg") not in lay[1])


def test_randperm_equals_torch(mesh1):
    g, tg = seeded(), seeded()
    for n, dtype in ((11, torch.int64), (7, torch.int32), (6, torch.float32)):
        x = dtorch.randperm(n, generator=g, dtype=dtype, device_mesh=mesh1, placements=[S0])
        assert_close(x, torch.randperm(n, generator=tg, dtype=dtype), exact=True)
    assert torch.equal(g.get_state(), tg.get_state())
    dtorch.manual_seed(5)
    a = dtorch.randperm(9, device_mesh=mesh1, placements=[S0]).to_torch()
    assert torch.equal(a.sort().values, torch.arange(9))


@pytest.mark.parametrize("name", ["rand_like", "randn_like", "randint_like"])
def test_random_like(name, layout):
    mesh, placements, _ = layout
    t = torch.zeros(5, 7, dtype=torch.float64)
    x = dtorch.from_torch(t, mesh, placements)
    args = (3, 9) if name == "randint_like" else ()
    g, tg = seeded(), seeded()
    y = getattr(dtorch, name)(x, *args, generator=g)
    laid_out(y, layout, (5, 7), torch.float64)
    assert_close(y, getattr(torch, name)(t, *args, generator=tg), exact=True)
    z = getattr(dtorch, name)(x, *args, dtype=torch.float32, placements=[R] * mesh.ndim)
    assert z.dtype == torch.float32 and z.placements == [R] * mesh.ndim
    if name == "randint_like":  # randint_like(input, high)
        assert dtorch.randint_like(x, 4).to_torch().max() < 4


def test_size_keyword(mesh2):
    for name in ("zeros", "ones", "empty"):
        x = getattr(dtorch, name)(size=(3, 4), device_mesh=mesh2, placements=[S0, S1])
        assert tuple(x.shape) == (3, 4) and x.placements == [S0, S1]
        assert getattr(dtorch, name)(size=[2]).shape == getattr(torch, name)(size=[2]).shape
        with pytest.raises(TypeError):
            getattr(dtorch, name)(2, size=(3, 4))
    assert_close(dtorch.ones(size=(2, 3), dtype=torch.int32), torch.ones(2, 3, dtype=torch.int32),
                 exact=True)


def test_factory_errors_are_torch_errors():
    for fn in (lambda lib: lib.eye(-1), lambda lib: lib.linspace(0, 1, -2),
               lambda lib: lib.randperm(-3), lambda lib: lib.zeros(2, -1)):
        with pytest.raises(Exception) as expected:
            fn(torch)
        with pytest.raises(expected.type):
            fn(dtorch)


def test_equal_static_values_of_other_types_are_other_calls():
    """6 == 6.0 in Python, yet arange(6) is int64 and arange(6.) float32: the rule cache must
    not mistake one call for the other."""
    assert dtorch.arange(6).dtype == torch.int64
    assert dtorch.arange(6.0).dtype == torch.float32
    assert dtorch.full((2,), 1).dtype == torch.int64
    assert dtorch.full((2,), 1.0).dtype == torch.float32
    assert dtorch.full((2,), True).dtype == torch.bool
    x = dtorch.arange(4)
    assert x.clamp(min=0).dtype == torch.int64 and x.clamp(min=0.5).dtype == torch.float32
    # inside a size or dims too: (3.0, 2) == (3, 2), but torch refuses the float
    y = dtorch.ones((2, 3))
    for good, bad in ((lambda v: v.reshape(3, 2), lambda v: v.reshape(3.0, 2)),
                      (lambda v: v.reshape((3, 2)), lambda v: v.reshape([3, 2.0])),
                      (lambda v: v.flip(1), lambda v: v.flip(1.0)),
                      (lambda v: v.sum((1,)), lambda v: v.sum((True,)))):
        assert good(y).shape == good(torch.ones((2, 3))).shape
        with pytest.raises(TypeError):
            bad(torch.ones((2, 3)))
        with pytest.raises(TypeError):
            bad(y)
