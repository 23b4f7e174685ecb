"""Redistribute planning: which collective turns one layout into another, per mesh dim.

A plan is data: a tuple of ``Step(kind, mesh_dim, src, dst)``, each changing the placement of one
mesh dim, memoized on (shape, mesh shape, source, target). The controller lowers each step to a
kernel; the hosts run it (``runtime/collectives.py``). The transitions, one mesh dim at a time:

    S(d) -> R      all_gather       gather the chunks (padded to equal size when uneven)
    P    -> R      all_reduce
    P    -> S(d)   reduce_scatter   reduce and keep own chunk
    S(d) -> S(e)   all_to_all       send chunk j of dim e to device j, join the received on d
    S(d) -> P      pad_partial      local: own chunk in place, zeros around (sum only)
    R    -> S(d)   chunk            local: keep own chunk
    R    -> P      partition        local: device 0 keeps the value, the others the identity
    P(a) -> P(b)   all_reduce then partition

Mesh dims shard in order (see ``placement.local_region``), so a dim is changed only when no later
mesh dim shards the same tensor dim: the planner first walks from the last mesh dim to the first,
leaving Shard/Partial (unsharding a later dim when an earlier one must change under it), then walks
forward entering the target placements from Replicate. A direct one-step transition is used only
when no other mesh dim touches the tensor dims involved; otherwise the plan goes through Replicate.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from .placement import Partial, Replicate, Shard, placements_str

R = Replicate()


class Step(NamedTuple):
    kind: str
    mesh_dim: int
    src: object
    dst: object

    def __str__(self) -> str:
        return f"{self.kind}[{self.mesh_dim}]({self.src}->{self.dst})"


def _touches(placements, mesh_dim: int, dims) -> bool:
    return any(
        isinstance(p, Shard) and p.dim in dims for k, p in enumerate(placements) if k != mesh_dim
    )


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

    for i in reversed(range(len(state))):
        cur, want = state[i], dst[i]
        nested = isinstance(cur, Shard) and any(
            state[k] != dst[k] and cur in (state[k], dst[k]) for k in range(i)
        )
        if (cur == want and not nested) or isinstance(cur, Replicate):
            continue
        if isinstance(cur, Shard):
            if nested:
                move("all_gather", i, R)
            elif isinstance(want, Shard) and not _touches(state, i, (cur.dim, want.dim)) and not _touches(dst, i, (cur.dim, want.dim)):
                move("all_to_all", i, want)
            elif want == Partial("sum") and not _touches(state, i, (cur.dim,)):
                move("pad_partial", i, want)
            else:
                move("all_gather", i, R)
        else:  # Partial
            if isinstance(want, Shard) and cur.reduce_op != "avg" and not _touches(state, i, (want.dim,)) and not _touches(dst, i, (want.dim,)):
                move("reduce_scatter", i, want)
            else:
                move("all_reduce", i, R)
    for i, want in enumerate(dst):
        if state[i] != want:
            move("chunk" if isinstance(want, Shard) else "partition", i, want)
    return tuple(steps)


def plan_str(src, steps) -> str:
    """Short form of a plan: ``S(0)R -> RR -> RS(1)``."""
    state, out = list(src), [placements_str(src)]
    for s in steps:
        state[s.mesh_dim] = s.dst
        out.append(placements_str(state))
    return " -> ".join(out)


COMM_STEPS = frozenset({"all_gather", "all_reduce", "reduce_scatter", "all_to_all"})
