"""The redistribute planner, without a runtime: which collectives a plan picks, and a simulation
on full tensors proving that every step of any plan keeps the logical value.

The simulation gives each mesh coordinate its block (genuine Partial contributions, not a value
on coordinate 0 and identities elsewhere), applies each step as its collective defines it on the
blocks of one process group, and checks after every step that the blocks are exactly the layout
the step claims (shapes from ``local_region``, values from the full tensor).
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings, strategies as st

from dtorch import Partial, Replicate, Shard
from dtorch.client.assemble import assemble
from dtorch.placement import local_region
from dtorch.redistribute import Step, plan_redistribute, plan_str

R = Replicate()
S0, S1, S2 = Shard(0), Shard(1), Shard(2)
P, PMAX, PMIN, PAVG = Partial(), Partial("max"), Partial("min"), Partial("avg")


pytestmark = pytest.mark.no_runtime  # (conftest syncs after the other tests)


def kinds(src, dst) -> list:
    return [s.kind for s in plan_redistribute(tuple(src), tuple(dst))]


# -- expected collectives -------------------------------------------------------------------------

SINGLE_DIM = [
    (S0, R, ["all_gather"]),
    (S1, R, ["all_gather"]),
    (P, R, ["all_reduce"]),
    (PMAX, R, ["all_reduce"]),
    (PAVG, R, ["all_reduce"]),
    (R, S0, ["chunk"]),
    (R, S1, ["chunk"]),
    (R, P, ["partition"]),
    (R, PMIN, ["partition"]),
    (S0, S1, ["all_to_all"]),
    (S1, S0, ["all_to_all"]),
    (P, S0, ["reduce_scatter"]),
    (P, S1, ["reduce_scatter"]),
    (PAVG, S1, ["reduce_scatter"]),
    (PMAX, S0, ["reduce_scatter"]),
    (S0, P, ["pad_partial"]),
    (S1, PMAX, ["pad_partial"]),
    (S0, PMIN, ["pad_partial"]),
    (S0, PAVG, ["all_gather", "partition"]),  # avg has no identity to pad with
    (P, PMAX, ["all_reduce", "partition"]),
    (PMAX, P, ["all_reduce", "partition"]),
    (R, R, []),
    (S0, S0, []),
    (P, P, []),
]


@pytest.mark.parametrize("src,dst,expected", SINGLE_DIM, ids=lambda v: str(v))
def test_single_dim_collective(src, dst, expected):
    assert kinds([src], [dst]) == expected


NESTED = [
    # each mesh dim on its own: one step per changed dim, the last mesh dim first
    ((S0, S1), (R, R), ["all_gather", "all_gather"]),
    ((S0, R), (R, S1), ["all_gather", "chunk"]),
    ((R, P), (S0, S1), ["reduce_scatter", "chunk"]),
    ((P, P), (R, R), ["all_reduce", "all_reduce"]),
    ((P, P), (S0, S1), ["reduce_scatter", "reduce_scatter"]),
    # [S(0), S(0)]: the earlier mesh dim can change only once the later one let go of dim 0
    ((S0, S0), (R, R), ["all_gather", "all_gather"]),
    ((S0, S0), (R, S0), ["all_gather", "all_gather", "chunk"]),
    ((R, S0), (S0, S0), ["all_gather", "chunk", "chunk"]),
    ((S0, S0), (S0, R), ["all_gather"]),
    ((S0, S0), (S0, S1), ["all_to_all"]),  # the earlier S(0) stays: the group is its chunk
    ((S0, S1), (S1, S0), ["all_gather", "all_to_all", "chunk"]),
    ((S0, S0), (S1, S1), ["all_gather", "all_to_all", "chunk"]),
    ((P, S0), (S0, S0), ["all_gather", "reduce_scatter", "chunk"]),
    # a Partial max under a changing Partial sum must be reduced first (sum of max != max of sum)
    ((P, PMAX), (R, PMAX), ["all_reduce", "all_reduce", "partition"]),
    ((PMAX, P), (R, P), ["all_reduce", "all_reduce", "partition"]),  # and the other way round
    ((PMAX, PMAX), (R, PMAX), ["all_reduce"]),  # max of max is max, in any order
    ((P, PAVG), (R, PAVG), ["all_reduce"]),  # sum and avg commute (both linear)
    ((S0, R, S0), (R, R, S0), ["all_gather", "all_gather", "chunk"]),
    ((R, S0, S1), (S1, S0, R), ["all_gather", "chunk"]),
]


@pytest.mark.parametrize("src,dst,expected", NESTED, ids=lambda v: str(v))
def test_nested_collectives(src, dst, expected):
    steps = plan_redistribute(src, dst)
    assert [s.kind for s in steps] == expected, plan_str(src, steps)
    simulate(src, dst, steps, (5, 7, 3)[: _tensor_ndim(src, dst)], (2, 3, 2)[: len(src)], seed=0)


def _tensor_ndim(src, dst) -> int:
    return 1 + max([p.dim for p in src + dst if isinstance(p, Shard)], default=0)


def test_plan_str():
    steps = plan_redistribute((S0, R), (R, S1))
    assert plan_str((S0, R), steps) == "S(0)R -> RR -> RS(1)"
    assert str(steps[0]) == "all_gather[0](S(0)->R)"


# -- simulation on full tensors -------------------------------------------------------------------

IDENTITY = {"sum": 0.0, "avg": 0.0, "max": float("-inf"), "min": float("inf")}


def _reduce(op, blocks):
    stacked = torch.stack(blocks)
    if op == "sum":
        return stacked.sum(0)
    if op == "avg":
        return stacked.sum(0) / len(blocks)
    return stacked.amax(0) if op == "max" else stacked.amin(0)


def _contributions(value, n, op, g):
    """``n`` blocks whose reduction by ``op`` is exactly ``value``, most unlike the value (small
    integers in float64, so every sum is exact)."""
    if op in ("sum", "avg"):
        noise = torch.randint(-3, 4, (n,) + value.shape, generator=g).double()
        noise[0] = -noise[1:].sum(0)  # zero sum: avg of value + noise is the value
        if op == "sum":
            return [noise[c] + (value if c == 0 else 0) for c in range(n)]
        return [value + noise[c] for c in range(n)]
    sign = -1 if op == "max" else 1
    holder = torch.randint(0, n, value.shape, generator=g)
    gaps = torch.randint(1, 4, (n,) + value.shape, generator=g).double()
    return [value + sign * gaps[c] * (holder != c) for c in range(n)]


def distribute_blocks(full, mesh_shape, placements, g) -> dict:
    """{coord: block}, splitting over the mesh dims in order (the inverse of ``assemble``)."""
    blocks = {(): full}
    for n, p in zip(mesh_shape, placements):
        nxt = {}
        for prefix, b in blocks.items():
            if isinstance(p, Shard):
                parts = torch.tensor_split(b, n, dim=p.dim)
            elif isinstance(p, Partial):
                parts = _contributions(b, n, p.reduce_op, g)
            else:
                parts = [b] * n
            for c, part in enumerate(parts):
                nxt[prefix + (c,)] = part.clone()
        blocks = nxt
    return blocks


def _groups(blocks, i):
    groups = {}
    for coord in sorted(blocks):
        groups.setdefault(coord[:i] + coord[i + 1:], []).append(coord)
    return groups.values()


def _gather(members, d):
    return torch.cat(members, d)


def _all_to_all(members, c, step):
    n = len(members)
    return torch.cat([torch.tensor_split(b, n, step.dst.dim)[c] for b in members], step.src.dim)


def _pad_partial(members, c, step):
    """Own block at its offset in the group's whole, the identity elsewhere."""
    d = step.src.dim
    whole = _gather(members, d)
    out = torch.full_like(whole, IDENTITY[step.dst.reduce_op])
    offset = sum(b.shape[d] for b in members[:c])
    out.narrow(d, offset, members[c].shape[d]).copy_(members[c])
    return out


def _partition(members, c, step):
    if step.dst.reduce_op == "sum" and c:
        return torch.zeros_like(members[c])
    return members[c]


STEP_SEMANTICS = {
    "all_gather": lambda m, c, s: _gather(m, s.src.dim),
    "all_reduce": lambda m, c, s: _reduce(s.src.reduce_op, m),
    "reduce_scatter": lambda m, c, s: torch.tensor_split(
        _reduce(s.src.reduce_op, m), len(m), s.dst.dim)[c],
    "all_to_all": _all_to_all,
    "chunk": lambda m, c, s: torch.tensor_split(m[c], len(m), s.dst.dim)[c],
    "partition": _partition,
    "pad_partial": _pad_partial,
}


def apply_step(blocks, step) -> dict:
    out = {}
    for coords in _groups(blocks, step.mesh_dim):
        members = [blocks[c] for c in coords]
        for c, coord in enumerate(coords):
            out[coord] = STEP_SEMANTICS[step.kind](members, c, step).clone()
    return out


def check_layout(blocks, full, mesh_shape, placements) -> None:
    """The blocks are exactly ``full`` laid out as ``placements``."""
    for coord, b in blocks.items():
        shape, _ = local_region(full.shape, mesh_shape, placements, coord)
        assert tuple(b.shape) == shape, (coord, tuple(b.shape), shape)
    # reduce the Partial mesh dims, the last first (the order their reductions nest in)
    reduced = list(placements)
    for i in reversed(range(len(placements))):
        p = reduced[i]
        if isinstance(p, Partial):
            blocks = apply_step(blocks, Step("all_reduce", i, p, R))
            reduced[i] = R
    for coord, b in blocks.items():
        shape, offsets = local_region(full.shape, mesh_shape, tuple(reduced), coord)
        index = tuple(slice(o, o + n) for o, n in zip(offsets, shape))
        # values are distinct integers: a tolerance far below 1 only forgives avg's rounding
        assert torch.allclose(b, full[index], rtol=0, atol=1e-9), (coord, placements)


def simulate(src, dst, steps, shape, mesh_shape, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    full = torch.randperm(max(1, torch.Size(shape).numel()), generator=g)[
        : torch.Size(shape).numel()].double().reshape(shape)
    blocks = distribute_blocks(full, mesh_shape, src, g)
    check_layout(blocks, full, mesh_shape, src)
    state = list(src)
    for step in steps:
        assert step.src == state[step.mesh_dim] != step.dst, plan_str(src, steps)
        blocks = apply_step(blocks, step)
        state[step.mesh_dim] = step.dst
        check_layout(blocks, full, mesh_shape, tuple(state))
    assert tuple(state) == tuple(dst), plan_str(src, steps)


def placement(tensor_ndim):
    return st.one_of(
        st.just(R),
        st.builds(Shard, st.integers(0, tensor_ndim - 1)),
        st.builds(Partial, st.sampled_from(["sum", "max", "min", "avg"])),
    )


@st.composite
def layouts(draw):
    mesh_shape = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=3)))
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=1, max_size=3)))
    pl = st.lists(placement(len(shape)), min_size=len(mesh_shape), max_size=len(mesh_shape))
    return shape, mesh_shape, tuple(draw(pl)), tuple(draw(pl))


@settings(max_examples=400, deadline=None)
@given(layouts(), st.integers(0, 2**16))
def test_any_plan_keeps_the_value(layout, seed):
    shape, mesh_shape, src, dst = layout
    steps = plan_redistribute(src, dst)
    simulate(src, dst, steps, shape, mesh_shape, seed)
    # at most one step to leave and one to enter per mesh dim
    assert len(steps) <= 2 * len(src)
    assert all(s.src != s.dst for s in steps)


@settings(max_examples=100, deadline=None)
@given(layouts(), st.integers(0, 2**16))
def test_assemble_inverts_distribution(layout, seed):
    """The client's assembly of the blocks it fetches (coordinate 0 on Replicate dims) gives
    the full value back, for any layout, nested and Partial ones included."""
    shape, mesh_shape, placements, _ = layout
    g = torch.Generator().manual_seed(seed)
    full = torch.randint(-9, 10, shape, generator=g).double()
    blocks = distribute_blocks(full, mesh_shape, placements, g)
    fetched = {c: b for c, b in blocks.items()
               if not any(c[i] and isinstance(p, Replicate) for i, p in enumerate(placements))}
    spec = SimpleNamespace(mesh=SimpleNamespace(shape=mesh_shape), placements=placements)
    assert torch.equal(assemble(spec, fetched), full)


def test_every_transition_on_small_meshes():
    """Exhaustively, every (src, dst) pair on 1-D and 2-D meshes for a 2-D tensor."""
    choices = [R, S0, S1, P, PMAX, PAVG]
    for mesh_shape in [(3,), (2, 3)]:
        for src, dst in itertools.product(itertools.product(choices, repeat=len(mesh_shape)),
                                          repeat=2):
            simulate(src, dst, plan_redistribute(src, dst), (5, 4), mesh_shape, seed=1)
