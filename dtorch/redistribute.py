"""Redistribute planning: which collective turns one layout into another, per mesh dim.

A plan is data: a tuple of ``Step(kind, mesh_dim, src, dst)``, each changing the placement of one
mesh dim, memoized on the (source, target) placements (the kernels size their buffers from the
specs, so the plan does not depend on the shape). The controller lowers each step to a kernel;
the hosts run it (``runtime/collectives.py``). The transitions, one mesh dim at a time:

    S(d) -> R      all_gather       gather the chunks (padded to equal size when uneven)
    P    -> R      all_reduce
    P    -> S(d)   reduce_scatter   reduce and keep own chunk
    S(d) -> S(e)   all_to_all       send chunk j of dim e to device j, join the received on d
    S(d) -> P      pad_partial      local: own chunk in place, the reduction's identity around
                                    (sum, max, min; avg goes through R)
    R    -> S(d)   chunk            local: keep own chunk
    R    -> P      partition        local: device 0 keeps the value, the others the identity
    P(a) -> P(b)   all_reduce, then partition

A sub-split Shard (``Shard(d, sub_split=...)``) leaves and enters only through Replicate: its
all_gather joins the members' pieces by position and its chunk cuts a device's piece of every
segment; every other transition to or from it takes those two steps.

Why an order is needed. Mesh dims shard in order (see ``placement.local_region``): a tensor dim
sharded by mesh dims i < k is split over i first, then each chunk over k. So a mesh dim may change
how it shards tensor dim d only while no later mesh dim shards d. Partials nest the same way: the
value is the reduction over the last mesh dim first, so a mesh dim may reduce only while the
later Partial mesh dims hold ops that commute with its own (sum and avg are both linear; max and
min commute only with themselves).

The plan. First find the mesh dims to undo: those that change, and, in mesh order, every later
dim that conflicts with an undone earlier one (shares a tensor dim with it, or holds a Partial
that does not commute with it). Then walk the undone dims from the last to the first, taking the
direct one-step transition where the dim conflicts with no earlier undone dim, and leaving to
Replicate otherwise. Last, walk forward entering the remaining targets from Replicate. Every
step therefore finds the later mesh dims either untouched by it, Replicate, or at targets that do
not conflict with it, which is the condition above.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from .placement import Partial, Replicate, Shard, placements_str

R = Replicate()
LINEAR_OPS = frozenset({"sum", "avg"})
PAD_OPS = frozenset({"sum", "max", "min"})  # reductions with an identity to pad around a chunk


class Step(NamedTuple):
    kind: str
    mesh_dim: int
    src: object
    dst: object

    def __str__(self) -> str:
        return f"{self.kind}[{self.mesh_dim}]({self.src}->{self.dst})"


# -- what one mesh dim's transition touches -------------------------------------------------------


def _shard_dims(transition) -> set:
    return {p.dim for p in transition if isinstance(p, Shard)}


def _partial_ops(transition) -> set:
    return {p.reduce_op for p in transition if isinstance(p, Partial)}


def _commute(a: str, b: str) -> bool:
    return a == b or (a in LINEAR_OPS and b in LINEAR_OPS)


def _conflicts(later, earlier) -> bool:
    """Whether two mesh dims' transitions ``(src, dst)`` cannot run independently: they shard
    the same tensor dim, or hold Partials whose reductions do not commute."""
    if _shard_dims(later) & _shard_dims(earlier):
        return True
    return any(not _commute(a, b) for a in _partial_ops(later) for b in _partial_ops(earlier))


def _direct(cur, want):
    """The one-step transition between two non-Replicate placements, or None."""
    if cur == want or isinstance(cur, Replicate) or isinstance(want, Replicate):
        return None
    if _sub_split(cur) or _sub_split(want):  # through Replicate: a gather and a local cut
        return None
    if isinstance(want, Shard):
        return "all_to_all" if isinstance(cur, Shard) else "reduce_scatter"
    if isinstance(cur, Shard) and want.reduce_op in PAD_OPS:
        return "pad_partial"
    return None


def _sub_split(p) -> bool:
    return isinstance(p, Shard) and p.sub_split is not None


LEAVE = {Shard: "all_gather", Partial: "all_reduce"}  # X -> Replicate
ENTER = {Shard: "chunk", Partial: "partition"}  # Replicate -> X


def _undone(src: tuple, dst: tuple) -> list:
    """Mesh dims that must leave their source placement, in mesh order (see the module doc)."""
    undo = []
    for k, (cur, want) in enumerate(zip(src, dst)):
        if cur != want or any(_conflicts((cur, want), (src[j], dst[j])) for j in undo):
            undo.append(k)
    return undo


@lru_cache(maxsize=4096)
def plan_redistribute(src: tuple, dst: tuple) -> tuple:
    """Steps turning placements ``src`` into ``dst`` on one mesh (same tensor, same mesh).

    >>> from dtorch import Shard, Replicate
    >>> [s.kind for s in plan_redistribute((Shard(0), Replicate()), (Replicate(), Shard(1)))]
    ['all_gather', 'chunk']
    """
    state, steps = list(src), []

    def move(kind, i, new):
        steps.append(Step(kind, i, state[i], new))
        state[i] = new

    undo = _undone(src, dst)
    for n, i in reversed(list(enumerate(undo))):
        kind = _direct(src[i], dst[i])
        if kind and not any(_conflicts((src[i], dst[i]), (src[j], dst[j])) for j in undo[:n]):
            move(kind, i, dst[i])
        elif not isinstance(src[i], Replicate):
            move(LEAVE[type(src[i])], i, R)
    for i in undo:
        if state[i] != dst[i]:
            move(ENTER[type(dst[i])], i, dst[i])
    return tuple(steps)


def plan_str(src, steps) -> str:
    """Short form of a plan: ``S(0)R -> RR -> RS(1)``."""
    state, out = list(src), [placements_str(src)]
    for s in steps:
        state[s.mesh_dim] = s.dst
        out.append(placements_str(state))
    return " -> ".join(out)


COMM_STEPS = frozenset({"all_gather", "all_reduce", "reduce_scatter", "all_to_all"})
