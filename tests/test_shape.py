"""Shape operators against plain torch over meshes x placements x dtypes x uneven sizes.

Every case runs one lambda on torch and on dtorch. A case names the input dims it acts on: a
layout that shards one of them must raise a ValueError at the call whose suggested
``redistribute(...)`` then gives torch's values; any other layout must give torch's values
(bit-identical on one device). Hypothesis drives reshapes, whose rule depends on the sizes.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings, strategies as st

import dtorch
from dtorch import Partial, Replicate, Shard
from helpers import (
    TORCH_RAISED,
    assert_close,
    assert_refused,
    distribute,
    layout_fixture,
    lib,
    reshape_refused,
    sample,
    torch_expected,
)

R, S0, S1, S2, S3, P = Replicate(), Shard(0), Shard(1), Shard(2), Shard(3), Partial()
ALL = "all"  # a case that acts on every dim
RESHAPE = "reshape"  # a reshape: whether a shard survives depends on the sizes (reshape_refused)

# (mesh fixture, placements) for 3-D inputs: uneven shards, nested shards, Partials
LAYOUTS = [
    ("one", (R,)), ("one", (S2,)), ("mesh1", (S0,)), ("mesh1", (S1,)), ("mesh1", (S2,)),
    ("mesh1", (P,)), ("mesh1", (Partial("max"),)), ("mesh2", (S0, S1)), ("mesh2", (S2, S0)),
    ("mesh2", (R, S1)), ("mesh2", (S1, S1)), ("mesh2", (P, S2)), ("mesh3", (S0, S1, S2)),
    ("mesh3", (S2, S2, R)),
]


def fn_lib(x):
    return dtorch.nn.functional if isinstance(x, dtorch.Tensor) else F


# name: (input shape, fn, input dims acted on, refuses a Partial sum)
CASES = {
    "view-1": ((4, 6, 5), lambda x: x.view(4, -1), RESHAPE, False),
    "reshape-split": ((6, 4, 5), lambda x: x.reshape(6, 2, 2, 5), RESHAPE, False),
    "flatten": ((5, 7, 3), lambda x: x.flatten(1), RESHAPE, False),
    "unflatten": ((5, 6, 3), lambda x: x.unflatten(1, (2, 3)), RESHAPE, False),
    "unflatten-1": ((5, 7, 3), lambda x: x.unflatten(2, (-1, 1)), (), False),
    "squeeze": ((5, 1, 3), lambda x: x.squeeze(1), (1,), False),
    "unsqueeze": ((5, 7, 3), lambda x: x.unsqueeze(-1), (), False),
    "transpose": ((5, 7, 3), lambda x: x.transpose(0, 2), (), False),
    "permute": ((5, 7, 3), lambda x: x.permute(2, 0, 1), (), False),
    "movedim": ((5, 7, 3), lambda x: x.movedim(0, 2), (), False),
    "movedim-2": ((5, 7, 3), lambda x: lib(x).movedim(x, (0, 1), (2, 0)), (), False),
    "expand": ((5, 1, 3), lambda x: x.expand(2, 5, 4, 3), (1,), False),
    "expand-1": ((5, 1, 3), lambda x: x.expand(-1, 6, -1), (1,), False),
    "repeat": ((5, 7, 3), lambda x: x.repeat(1, 2, 1), (1,), False),
    "repeat-new-dim": ((5, 7, 3), lambda x: x.repeat(2, 1, 1, 1), (), False),
    "tile": ((5, 7, 3), lambda x: lib(x).tile(x, (2,)), (2,), False),
    "repeat_interleave": ((5, 7, 3), lambda x: x.repeat_interleave(2, dim=1), (1,), False),
    "repeat_interleave-flat": ((5, 7, 3), lambda x: lib(x).repeat_interleave(x, 2), ALL, False),
    "split": ((5, 7, 3), lambda x: x.split(2, 1), (1,), False),
    "split-sections": ((5, 7, 3), lambda x: lib(x).split(x, [1, 4], 0), (0,), False),
    "split-one": ((5, 7, 3), lambda x: x.split(9, 1), (1,), False),
    "chunk": ((5, 7, 3), lambda x: x.chunk(3, 2), (2,), False),
    "chunk-fewer": ((5, 7, 3), lambda x: lib(x).chunk(x, 4, dim=-1), (2,), False),
    "unbind": ((5, 7, 3), lambda x: x.unbind(1), (1,), False),
    "unbind-last": ((5, 7, 3), lambda x: lib(x).unbind(x, -1), (2,), False),
    "narrow": ((5, 7, 3), lambda x: x.narrow(1, 2, 4), (1,), False),
    # joining along a sharded dim gives a sub-split Shard (tests/test_sub_split.py)
    "cat": ((5, 7, 3), lambda x: lib(x).cat([x, x], 1), (), False),
    "concat": ((5, 7, 3), lambda x: lib(x).concat([x, x], -1), (), False),
    "stack": ((5, 7, 3), lambda x: lib(x).stack([x, x], 1), (), False),
    "flip": ((5, 7, 3), lambda x: x.flip([0, 2]), (0, 2), False),
    "flip-int": ((5, 7, 3), lambda x: x.flip(1), (1,), False),
    "roll": ((5, 7, 3), lambda x: x.roll(2, 1), (1,), False),
    "roll-2": ((5, 7, 3), lambda x: lib(x).roll(x, (1, -2), (0, 2)), (0, 2), False),
    "roll-flat": ((5, 7, 3), lambda x: x.roll(3), ALL, False),
    "pad": ((5, 7, 3), lambda x: fn_lib(x).pad(x, (1, 2)), (2,), False),
    "pad-value": ((5, 7, 3), lambda x: fn_lib(x).pad(x, (1, 1, 2, 0), value=1.5), (1, 2), True),
    "pad-crop": ((5, 7, 3), lambda x: fn_lib(x).pad(x, (0, 0, -1, -2)), (1,), False),
    "pad-reflect": ((5, 7, 3), lambda x: fn_lib(x).pad(x, (2, 1), mode="reflect"), (2,), False),
    "pad-replicate": ((5, 7, 3), lambda x: fn_lib(x).pad(x, (1, 1, 1, 1), mode="replicate"),
                      (1, 2), False),
    "pad-circular": ((5, 7, 3), lambda x: fn_lib(x).pad(x, (1, 2), mode="circular"), (2,), False),
    "tril": ((3, 6, 7), lambda x: x.tril(), (), False),
    "tril-2": ((3, 7, 6), lambda x: lib(x).tril(x, -2), (), False),
    "triu": ((3, 6, 7), lambda x: x.triu(1), (), False),
    "triu-neg": ((3, 7, 5), lambda x: lib(x).triu(x, -1), (), False),
}


layout = layout_fixture(LAYOUTS)


SUGGESTION = re.compile(r"([\w\[\]]+) = [\w\[\]]+\.redistribute\(placements=(\[[^\]]*\])\)")


def suggested_fix(error: ValueError) -> list:
    """The placements the error says to redistribute the input to."""
    m = SUGGESTION.search(str(error))
    assert m, error
    return eval(m.group(2), {"Shard": Shard, "Replicate": Replicate, "Partial": Partial})


def refused_by(name, placements, mesh) -> bool:
    """CASES' declaration for a layout: a shard of a dim the op acts on (a reshape: see merge
    and split), or a Partial sum where the op adds a constant."""
    shape, fn, acted, refuses_sum = CASES[name]
    # a Shard on a mesh dim of one device is Replicate: that device holds the whole dim
    placements = [R if p.is_shard() and n == 1 else p for p, n in zip(placements, mesh.shape)]
    if refuses_sum and P in placements:
        return True
    if acted == RESHAPE:
        return reshape_refused(shape, fn(torch.empty(shape, device="meta")).shape, placements,
                               mesh)
    acted = range(len(shape)) if acted == ALL else acted
    return any(p.is_shard() and p.dim in acted for p in placements)


def check_case(name, x, t, placements, exact) -> None:
    """Torch's values, or (where CASES says a layout is refused) a ValueError whose fix gives
    them (the input laid out as the fix says)."""
    fn = CASES[name][1]
    expected = torch_expected(fn, [t], [x])
    if expected is TORCH_RAISED:
        return
    if refused_by(name, placements, x.device_mesh):
        with pytest.raises(ValueError, match=r"redistribute\(") as info:
            fn(x)
        x = distribute(t, x.device_mesh, suggested_fix(info.value))
    assert_close(fn(x), expected, exact)


@pytest.mark.parametrize("name", CASES)
def test_shape_ops(name, layout):
    mesh, placements, exact = layout
    t = sample(CASES[name][0])
    check_case(name, distribute(t, mesh, placements), t, placements, exact)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64, torch.bool], ids=str)
@pytest.mark.parametrize("name", CASES)
def test_shape_ops_dtypes(name, dtype, mesh2, one):
    t = sample(CASES[name][0], dtype)
    for mesh, placements, exact in ((mesh2, [S2, S0], False), (one, [R], True)):
        check_case(name, distribute(t, mesh, placements), t, placements, exact)


def test_kept_placements(mesh1, mesh2):
    """Local ops keep the shards of the dims they do not act on (renumbered as dims move)."""
    t = sample((5, 7, 3))
    x = distribute(t, mesh2, [S0, S2])
    assert x.movedim(0, 2).placements == [S2, S1]
    assert [u.placements for u in x.unbind(1)] == [[S0, S1]] * 7
    assert x.split(3, 1)[0].placements == [S0, S2]
    assert x.repeat(2, 1, 3, 1).placements == [S1, S3]
    assert x.flip(1).placements == x.roll(1, 1).placements == x.triu().placements == [S0, S2]
    assert dtorch.nn.functional.pad(x, (0, 0, 1, 1)).placements == [S0, S2]
    e = distribute(sample((5, 1, 3)), mesh2, [S0, S2])
    assert e.expand(2, 5, 4, 3).placements == [S1, S3]
    assert e.expand_as(distribute(sample((5, 4, 3)), mesh2, [R, R])).placements == [S0, S2]


def test_expand_as_and_errors(mesh1):
    t, u = sample((5, 1, 3)), sample((2, 5, 4, 3), seed=1)
    x, y = distribute(t, mesh1, [S0]), distribute(u, mesh1, [S2])
    assert_close(x.expand_as(y), t.expand_as(u))
    with pytest.raises(ValueError, match=r"redistribute"):
        distribute(t, mesh1, [S1]).expand_as(y)  # one device holds the broadcast element
    with pytest.raises(RuntimeError):
        x.expand(3, 3)


TORCH_ERRORS = {  # torch's own errors, raised at the call
    "narrow out of range": lambda x: x.narrow(1, 5, 4),
    "chunk 0": lambda x: x.chunk(0),
    "chunk dim": lambda x: x.chunk(2, 5),
    "movedim dim": lambda x: x.movedim(0, 5),
    "unflatten sizes": lambda x: x.unflatten(1, (2, 4)),
    "view -1": lambda x: x.view(-1, 4),
    "repeat too few": lambda x: x.repeat(2),
    "reflect too wide": lambda x: fn_lib(x).pad(x, (3, 3), mode="reflect"),
    "pad odd": lambda x: fn_lib(x).pad(x, (1,)),
    "tril 1-d": lambda x: x.flatten().tril(),
    "split dim": lambda x: x.split(2, 3),
    "unbind dim": lambda x: x.unbind(-4),
    "flip dim": lambda x: x.flip(3),
    "roll mismatch": lambda x: x.roll((1, 2), 0),
    "cat shapes": lambda x: lib(x).cat([x, x.flatten(1)]),
}


@pytest.mark.parametrize("name", TORCH_ERRORS)
def test_torch_errors(name, mesh2):
    fn, t = TORCH_ERRORS[name], sample((5, 7, 3))
    with pytest.raises(Exception) as expected:
        fn(t)
    with pytest.raises(expected.type):
        fn(distribute(t, mesh2, [R, R]))


def test_views_see_inplace_writes(mesh1):
    t = sample((5, 7, 3))
    x = distribute(t, mesh1, [S0])
    parts, n, v = x.split(3, 1), x.narrow(2, 1, 2), x.unflatten(1, (7, 1))
    x += 1
    for got, expected in zip(parts, (t + 1).split(3, 1)):
        assert_close(got, expected)
    assert_close(n, (t + 1).narrow(2, 1, 2))
    assert_close(v, (t + 1).unflatten(1, (7, 1)))


def _set_column(v):
    v[:, 0] = 3.0


# name: (an in-place write through a view of x (6, 5), the dims of x the view cuts (refused
# where sharded), whether a Partial sum refuses it: a number added or written is not linear)
VIEW_WRITES = {
    "slice mul_": (lambda x: x[:, 1:3].mul_(2), {1}, False),
    "t add_": (lambda x: x.t().add_(1), set(), True),
    "view sub_": (lambda x: x.view(6, 5).sub_(0.5), set(), True),
    "unsqueeze mul_": (lambda x: x.unsqueeze(0).mul_(3), set(), False),
    "select setitem": (lambda x: _set_column(x.t()), {0}, True),
    "narrow mul_": (lambda x: x.narrow(1, 1, 2).mul_(0), {1}, False),
    "transpose relu_": (lambda x: x.transpose(0, 1).relu_(), set(), True),
    "split neg_": (lambda x: x.split(4, 0)[1].neg_(), {0}, False),
}
VIEW_LAYOUTS = [("mesh1", [S0]), ("mesh1", [P]), ("permuted", [S0, S1]), ("2x3", [S1, S0]),
                ("2x3", [P, S1]), ("mesh2", [R, S0])]
MESHES = {"permuted": dtorch.DeviceMesh("cpu", [[3, 1], [0, 2]]),
          "2x3": dtorch.DeviceMesh("cpu", [[0, 1, 2], [3, 4, 5]])}


@pytest.mark.parametrize("where", VIEW_LAYOUTS, ids=lambda w: f"{w[0]}-{''.join(map(str, w[1]))}")
@pytest.mark.parametrize("name", VIEW_WRITES)
def test_inplace_writes_through_views_of_sharded_tensors(name, where, request):
    """A view shares its base's blocks: writing it in place writes the base, as in torch."""
    write, cut, refuses_sum = VIEW_WRITES[name]
    mesh = MESHES.get(where[0]) or request.getfixturevalue(where[0])
    placements = where[1]
    t = sample((6, 5))
    x = distribute(t, mesh, placements)
    if any(p.is_shard() and p.dim in cut for p in placements) or refuses_sum and P in placements:
        assert_refused(write, x)
        assert_close(x, t)  # nothing was written
        return
    write(x)
    write(t)
    assert x.placements == placements
    assert_close(x, t)


def test_empty_results(mesh1):
    x = distribute(torch.zeros(0, 3), mesh1, [S1])
    assert x.unbind(0) == ()
    chunks = x.chunk(3)
    assert len(chunks) == len(torch.zeros(0, 3).chunk(3))
    for c in chunks:
        assert_close(c, torch.zeros(0, 3))


# -- reshapes: never silently wrong ---------------------------------------------------------------


def factor_shapes(n: int) -> list:
    """Shapes with product ``n`` of up to 3 dims."""
    out = [(n,)]
    for a in range(1, n + 1):
        if n % a == 0:
            out.append((a, n // a))
            for b in range(1, n // a + 1):
                if (n // a) % b == 0:
                    out.append((a, b, n // a // b))
    return out


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_reshape_keeps_a_valid_sharding_or_raises(data, mesh1, mesh2):
    n = data.draw(st.sampled_from([6, 12, 8, 10, 9]))
    shapes = factor_shapes(n)
    shape, target = data.draw(st.sampled_from(shapes)), data.draw(st.sampled_from(shapes))
    mesh = data.draw(st.sampled_from([mesh1, mesh2]))
    choices = [R, P] + [Shard(d) for d in range(len(shape))]
    placements = [data.draw(st.sampled_from(choices)) for _ in mesh.shape]
    op = data.draw(st.sampled_from(["reshape", "view", "flatten"]))
    t = torch.arange(n, dtype=torch.float32).reshape(shape)
    x = distribute(t, mesh, placements)
    fn = (lambda v: v.flatten()) if op == "flatten" else (lambda v: getattr(v, op)(target))
    if reshape_refused(shape, fn(t).shape, placements, mesh):
        with pytest.raises(ValueError, match=r"redistribute\(") as info:
            fn(x)
        x = distribute(t, mesh, suggested_fix(info.value))  # the fix it names works
    assert_close(fn(x), fn(t))


# -- chunk: a registry entry with torch's piece sizes ---------------------------------------------


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(0, 9), chunks=st.integers(1, 6), dim=st.sampled_from([0, 1, -1]),
       sharded=st.sampled_from([None, 0, 1]))
def test_chunk_sizes(mesh1, n, chunks, dim, sharded):
    """torch's piece count and sizes (ceil(n / chunks), fewer pieces when they run out, as many
    empty pieces as asked of an empty dim); the other dim may be sharded (uneven: 5 over 3)."""
    shape = [n, 5] if dim == 0 else [5, n]
    t = torch.arange(n * 5, dtype=torch.float32).reshape(shape)
    cut = dim % 2
    placements = [R if sharded is None else Shard(sharded)]
    x = distribute(t, mesh1, placements)
    if sharded == cut:
        with pytest.raises(ValueError, match="redistribute"):
            x.chunk(chunks, dim)
        return
    expected = t.chunk(chunks, dim)
    got = dtorch.chunk(x, chunks, dim=dim)
    assert isinstance(got, tuple) and len(got) == len(expected)
    for g, e in zip(got, expected):
        assert_close(g, e)
        assert g.placements == placements


def test_chunk_is_one_registered_view():
    from dtorch.ops.registry import REGISTRY, VIEW

    assert REGISTRY["chunk"].flags & VIEW and "chunk" in REGISTRY["chunk"].methods


def test_torch_aliases_and_flip_dims_spellings(mesh1):
    t = sample((4, 5, 3))
    x = distribute(t, mesh1, [Shard(0)])
    assert_close(dtorch.swapaxes(x, 1, 2), torch.swapaxes(t, 1, 2))
    assert_close(x.swapdims(1, 2), t.swapdims(1, 2))
    assert_close(dtorch.moveaxis(x, 2, 1), torch.moveaxis(t, 2, 1))
    assert_close(dtorch.concatenate([x, x], 1), torch.concatenate([t, t], 1))
    assert_close(x.flip(1, 2), t.flip(1, 2))
    assert_close(dtorch.flip(x, (1, 2)), torch.flip(t, (1, 2)))
    assert_close(x.flip(2), t.flip(2))
