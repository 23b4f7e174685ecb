"""Reductions and scans against plain torch over meshes x placements x dtypes x uneven sizes.

Every case runs one lambda on torch tensors and on dtorch tensors laid out over a mesh and either
gets torch's values (bit for bit on one device), torch's own exception type, or a ValueError at the
call that names the ``redistribute()`` to add: the latter exactly when a reduced dim is sharded
over several devices and the op does not reduce across devices on its own (SELF_REDUCING), or a
Partial input does not commute with the op.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, strategies as st

import dtorch
from dtorch import Partial, Replicate, Shard
from dtorch.placement import placements_str
from helpers import (
    TORCH_RAISED,
    assert_close,
    assert_executed,
    assert_refused,
    distribute,
    fixture_settings,
    mostly,
    torch_expected,
)

R, S0, S1, S2, P = Replicate(), Shard(0), Shard(1), Shard(2), Partial()
HYPOTHESIS = fixture_settings(12)
MIN_EXECUTED = 3  # of 12 examples per op (some draw a dtype torch refuses)


def reduce_by(method, *args, **kwargs):
    """fn(x, dim, keepdim) calling ``x.<method>(*args, dim=dim, keepdim=keepdim, **kwargs)``,
    on torch and dtorch tensors alike; dim None reduces over all dims (no dim= passed)."""

    def fn(x, dim, keepdim):
        dim_kw = {} if dim is None else {"dim": dim, "keepdim": keepdim}
        return getattr(x, method)(*args, **dim_kw, **kwargs)

    return fn


# name -> fn(x, dim, keepdim) on torch and dtorch tensors alike (a method call)
OPS = {
    "sum": reduce_by("sum"),
    "mean": reduce_by("mean"),
    "prod": reduce_by("prod"),
    "amax": reduce_by("amax"),
    "amin": reduce_by("amin"),
    "max": reduce_by("max"),
    "min": reduce_by("min"),
    "argmax": reduce_by("argmax"),
    "argmin": reduce_by("argmin"),
    "any": reduce_by("any"),
    "all": reduce_by("all"),
    "std": reduce_by("std"),
    "var": reduce_by("var", correction=0),
    "norm": reduce_by("norm"),
    "norm-inf": reduce_by("norm", math.inf),
    "norm--inf": reduce_by("norm", -math.inf),
    "norm-0": reduce_by("norm", 0),
    "logsumexp": lambda x, d, k: x.logsumexp(dim=(0, 1) if d is None else d, keepdim=k),
    "cumsum": lambda x, d, k: x.cumsum(0 if d is None else d),
    "cumprod": lambda x, d, k: x.cumprod(-1 if d is None else d),
}
# over a dim sharded on several devices these reduce on their own (a Partial, then all-reduced);
# max/min only without dim
SELF_REDUCING = {"sum", "mean", "amax", "amin", "any", "all", "norm-inf", "norm--inf", "norm-0"}


def scanned_dims(name, dim, ndim) -> set:
    """The dims whose shards an op combines."""
    if name.startswith("cum"):
        dim = (0 if name == "cumsum" else -1) if dim is None else dim
    elif name == "logsumexp" and dim is None:
        dim = (0, 1)
    if dim is None:
        return set(range(ndim))
    return {d % ndim for d in ((dim,) if isinstance(dim, int) else dim)}


def refuses(name, dim, placements, mesh, ndim, dtype=torch.float32) -> bool:
    """docs/ops.md's reduction table: a scanned dim sharded over several devices is refused
    unless the op reduces on its own; a Partial unless it passes (``partial_passes``)."""
    dims = scanned_dims(name, dim, ndim)
    self_reducing = name in SELF_REDUCING or name in ("max", "min") and dim is None
    passes = partial_passes(name, dim, dtype)
    return any(p.is_shard() and p.dim in dims and n > 1 and not self_reducing
               or p.is_partial() and p not in passes for p, n in zip(placements, mesh.shape))


def partial_passes(name, dim, dtype) -> tuple:
    """The Partials an op lets through: sums and cumsum are linear (not of bools: their sum
    saturates), amax and max commute with a max (amin and min with a min)."""
    if name in ("sum", "mean", "cumsum"):
        return () if dtype == torch.bool else (P, Partial("avg"))[:1 + dtype.is_floating_point]
    if name in ("amax", "amin") or name in ("max", "min") and dim is None:
        return (Partial(name[-3:]),)
    return ()


def sample(shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if not dtype.is_floating_point:
        return torch.randint(0 if dtype == torch.uint8 else -5, 6, shape, generator=g, dtype=dtype)
    return torch.randn(shape, generator=g, dtype=dtype) * 0.5 + 1.0  # products stay tame


def compare(out, expected, exact) -> None:
    if isinstance(expected, tuple):
        assert type(out) is type(expected)  # torch.return_types.max: .values, .indices
        assert len(out) == len(expected)
        for o, e in zip(out, expected):
            compare(o, e, exact)
        return
    # a distributed sum adds in another order: the dtype's tolerances
    assert_close(out, expected, exact=exact, equal_nan=not exact)


def check(name, fn, t, mesh, placements, refused: bool) -> None:
    """``fn`` gives torch's values, torch's exception type, or (``refused``) a ValueError naming
    the redistribute, after which the fixed call gives torch's values."""
    x = distribute(t, mesh, placements)
    exact = len(mesh.devices) == 1
    expected = torch_expected(fn, [t], [x])
    if expected is TORCH_RAISED:
        return
    if refused:
        with pytest.raises(ValueError, match=rf"dtorch\.{name.split('-')[0]}.*redistribute"):
            fn(x)
        x = x.redistribute(placements=[R] * len(placements))
    compare(fn(x), expected, exact)


# (mesh fixture, placements, shape): uneven shards throughout; (2, 3) over 3 devices and (1, 3)
# over 2x2x2 leave empty blocks
LAYOUTS = [
    ("one", (R,), (5, 7)), ("one", (S1,), (5, 7)), ("mesh1", (S0,), (5, 7)),
    ("mesh1", (S1,), (5, 7)), ("mesh1", (S0,), (2, 3)), ("mesh2", (S0, S1), (5, 7)),
    ("mesh2", (S1, S1), (5, 7)), ("mesh2", (R, S0), (5, 7)), ("mesh3", (S0, S1, R), (5, 7)),
    ("mesh3", (S0, S0, S1), (1, 3)),
]
DIMS = [(None, False), (0, False), (1, True), (-1, False), ((0, 1), True)]


@pytest.fixture(params=LAYOUTS, ids=lambda v: f"{v[0]}-{placements_str(v[1])}-{v[2]}")
def layout(request):
    name, placements, shape = request.param
    return request.getfixturevalue(name), list(placements), shape


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dim,keepdim", DIMS, ids=repr)
def test_reductions_float(name, dim, keepdim, layout):
    mesh, placements, shape = layout
    t = sample(shape)
    fn = lambda v: OPS[name](v, dim, keepdim)  # noqa: E731
    check(name, fn, t, mesh, placements, refuses(name, dim, placements, mesh, len(shape)))


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.int64, torch.bool, torch.uint8], ids=str)
@pytest.mark.parametrize("dim", [None, 1])
def test_reductions_dtypes(name, dtype, dim, mesh2, one):
    """torch's result dtypes (int sum -> int64, any of uint8 -> uint8) or torch's error."""
    t = sample((5, 7), dtype)
    fn = lambda v: OPS[name](v, dim, False)  # noqa: E731
    for mesh, placements in ((mesh2, [S1, S0]), (one, [R])):
        check(name, fn, t, mesh, placements, refuses(name, dim, placements, mesh, 2))


@pytest.mark.parametrize("name", ["sum", "mean", "prod", "cumsum", "cumprod"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.int32], ids=str)
def test_dtype_argument(name, dtype, mesh2, one):
    t = sample((5, 7), torch.int64)
    dim_kw = {"dim": 1} if name.startswith("cum") or name == "prod" else {"dim": 0}
    fn = lambda v: getattr(v, name)(**dim_kw, dtype=dtype)  # noqa: E731
    check(name, fn, t, mesh2, [S0, R], False)
    check(name, fn, t, one, [S1], False)


def test_max_min_return_torch_named_tuples(mesh1):
    t = sample((5, 7))
    x = distribute(t, mesh1, [S0])
    out = dtorch.max(x, dim=1)
    assert isinstance(out, torch.return_types.max)
    assert out.values.placements == [S0] and out.indices.placements == [S0]
    values, indices = x.min(1, keepdim=True)
    assert_close(values, t.min(1, keepdim=True).values)
    assert_close(indices, t.min(1, keepdim=True).indices)
    assert x.max().placements == [R]  # no dim: a max of maxes, reduced on its own
    assert_close(x.max(), t.max())


def test_first_occurrence_on_ties(mesh1, mesh2):
    """Indices over a whole dim are torch's own: the first of equal values."""
    t = torch.tensor([[1, 3, 3, 0], [2, 2, 1, 2], [0, 0, 0, 0]])
    for mesh, placements in ((mesh1, [S0]), (mesh2, [S0, R])):
        x = distribute(t, mesh, placements)
        for name in ("argmax", "argmin"):
            assert_close(getattr(x, name)(dim=1), getattr(t, name)(dim=1))
        assert_close(x.max(dim=1).indices, t.max(dim=1).indices)


def test_refusal_names_the_fix(mesh2):
    x = distribute(sample((5, 7)), mesh2, [S0, S1])
    with pytest.raises(ValueError) as info:
        x.argmax(dim=1)
    text = str(info.value)
    assert "dtorch.argmax" in text and "mesh dim 1" in text and "mesh dim 0" not in text
    assert "input.redistribute(placements=[Shard(dim=0), Replicate()])" in text
    for fn in (lambda v: v.std(dim=0), lambda v: v.cumsum(1), lambda v: v.prod(0),
               lambda v: v.logsumexp(1), lambda v: v.norm(), lambda v: v.max(0)):
        with pytest.raises(ValueError, match="redistribute"):
            fn(x)


# -- Partial inputs -------------------------------------------------------------------------------

# (op, Partial) that pass through: sum and cumsum are linear, amax commutes with max
PARTIAL_PASSES = {
    "sum": (lambda v: v.sum(dim=1), P), "sum-all": (lambda v: v.sum(), Partial("avg")),
    "mean": (lambda v: v.mean(dim=0), P), "cumsum": (lambda v: v.cumsum(0), P),
    "cumsum-avg": (lambda v: v.cumsum(1), Partial("avg")),
    "amax": (lambda v: v.amax(dim=1), Partial("max")), "max": (lambda v: v.max(), Partial("max")),
    "min": (lambda v: v.min(), Partial("min")), "amin": (lambda v: v.amin(0), Partial("min")),
}
PARTIAL_REFUSED = {
    "prod": (lambda v: v.prod(1), P), "std": (lambda v: v.std(1), P),
    "var": (lambda v: v.var(), P), "norm": (lambda v: v.norm(), P),
    "norm-inf": (lambda v: v.norm(math.inf), Partial("max")),
    "logsumexp": (lambda v: v.logsumexp(0), P), "cumprod": (lambda v: v.cumprod(0), P),
    "argmax": (lambda v: v.argmax(1), Partial("max")),
    "max-dim": (lambda v: v.max(dim=1), Partial("max")), "amax-sum": (lambda v: v.amax(), P),
    "any": (lambda v: v.any(1), P), "all": (lambda v: v.all(), Partial("min")),
    "sum-max": (lambda v: v.sum(), Partial("max")),
    # casts that are not linear: float -> int truncates each contribution
    "sum-to-int": (lambda v: v.sum(dim=0, dtype=torch.int64), P),
    "cumsum-to-int": (lambda v: v.cumsum(0, dtype=torch.int32), P),
}


@pytest.mark.parametrize("name", PARTIAL_PASSES)
def test_partial_passes(name, mesh1):
    fn, p = PARTIAL_PASSES[name]
    t = sample((5, 7))
    out = fn(distribute(t, mesh1, [p]))
    assert out.placements == [p]
    assert_close(out, fn(t))


@pytest.mark.parametrize("name", PARTIAL_REFUSED)
def test_partial_refused(name, mesh1):
    fn, p = PARTIAL_REFUSED[name]
    x = distribute(sample((5, 7)), mesh1, [p])
    with pytest.raises(ValueError, match="redistribute"):
        fn(x)


def test_bool_sum_of_partial_is_refused(mesh1):
    """A bool Partial sum saturates: counting its Trues per device would overcount."""
    with pytest.raises(ValueError, match="redistribute"):
        distribute(sample((5, 7), torch.bool), mesh1, [P]).sum()


def test_reductions_on_2d_mesh_keep_the_other_placements(mesh2):
    t = sample((5, 7))
    x = distribute(t, mesh2, [P, S1])
    out = x.sum(dim=1)  # the shard reduces across mesh dim 1; the Partial stays
    assert out.placements == [P, R]
    assert_close(out, t.sum(dim=1))
    y = distribute(t, mesh2, [S1, S0])
    assert y.any(dim=0).placements == [S0, R]  # kept dim 1 is renumbered
    assert y.amax(dim=0, keepdim=True).placements == [S1, R]
    with pytest.raises(ValueError, match=r"mesh dim 0: no rule takes \(input=S\(1\)\)"):
        y.std(dim=1)
    with pytest.raises(ValueError, match=r"mesh dim 1: no rule takes \(input=S\(0\)\)"):
        y.cumsum(0)


def test_std_var_spellings(mesh1, one):
    """unbiased (positional or keyword) and correction, as torch takes them; over S(0) of
    three devices only the ones that keep dim 0 whole run."""
    t = sample((5, 7), torch.float64)
    spellings = [  # (fn, whether it reduces dim 0)
        (lambda v: v.std(1, True), False), (lambda v: v.std(1, False, True), False),
        (lambda v: v.var(True), True), (lambda v: v.var(dim=0, unbiased=False), True),
        (lambda v: (dtorch if isinstance(v, dtorch.Tensor) else torch).std(v, dim=1,
                                                                           correction=2), False),
        (lambda v: v.std(dim=(0, 1), keepdim=True, correction=0), True),
    ]
    for fn, reduces_dim0 in spellings:
        check("(std|var)", fn, t, mesh1, [S0], reduces_dim0)
        check("std", fn, t, one, [S1], False)


# -- hypothesis: any layout of any reduction is right or refused ----------------------------------


@pytest.mark.parametrize("name", sorted(OPS))
def test_reductions_never_silently_wrong(name, mesh2, mesh3):
    """Any layout of any reduction: refused exactly as the table says, else torch's values (or
    torch's own error, at the call). Layouts lean to the ones the op takes, so that each op
    executes a minimum of examples."""
    executed = []

    @HYPOTHESIS
    @given(data=st.data())
    def example(data):
        mesh = data.draw(st.sampled_from([mesh2, mesh3]))
        shape = tuple(data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
        ndim = len(shape)
        dim = data.draw(st.sampled_from([None, *range(-ndim, ndim)]))
        keepdim = data.draw(st.booleans())
        dtype = data.draw(st.sampled_from([torch.float32, torch.float32, torch.int64, torch.bool]))
        taken = [R, *partial_passes(name, dim, dtype)] + [
            Shard(d) for d in range(ndim) if d not in scanned_dims(name, dim, ndim)
            or name in SELF_REDUCING]
        # an integer Partial(avg) has no integer value to read (the client divides by the
        # device count into floats): floats only
        partials = [P, Partial("max"), Partial("min")] + [Partial("avg")] * dtype.is_floating_point
        anything = st.sampled_from([R] + partials + [Shard(d) for d in range(ndim)])
        placements = [mostly(data, st.sampled_from(taken), anything) for _ in range(mesh.ndim)]
        t = sample(shape, dtype)
        fn = lambda v: OPS[name](v, dim, keepdim)  # noqa: E731
        x = distribute(t, mesh, placements)
        expected = torch_expected(fn, [t], [x])
        if expected is TORCH_RAISED:
            return
        if refuses(name, dim, placements, mesh, ndim, dtype):
            assert_refused(fn, x, op=name.split("-")[0])
            return
        compare(fn(x), expected, exact=False)
        executed.append(placements)

    example()
    assert_executed({name: len(executed)}, [name], MIN_EXECUTED)


def test_nan_survives_the_all_reduce(mesh1):
    """gloo's MAX/MIN drop NaN; the collectives carry a NaN mask so results match torch."""
    t = sample((6, 3))
    t[4, 1] = math.nan
    def same(a, b):
        torch.testing.assert_close(a.to_torch(), b, equal_nan=True)

    same(distribute(t, mesh1, [S0]).amax(), t.amax())
    same(distribute(t, mesh1, [S0]).amin(dim=0), t.amin(dim=0))
    p = distribute(t, mesh1, [S0]).redistribute(placements=[dtorch.Partial("max")])
    same(p.redistribute(placements=[S0]), t)  # reduce-scatter
    same(p.redistribute(placements=[Replicate()]), t)  # all-reduce
