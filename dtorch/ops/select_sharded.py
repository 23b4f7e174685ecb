"""An int index on a sharded dim (``x[0]`` of a batch-sharded tensor, ``for row in x``).

The element lives in one device's block. Each device selects it from its own block if it holds
it and gives zeros otherwise, so the result is a Partial sum over the mesh dims that shard the
indexed dim, which the rule then reduces to Replicate there (an all-reduce of the result, not a
gather of the input; adding zeros is exact). Only ints take this path, in an index without
index tensors and of a non-bool tensor (a bool sum is no selection); a slice or an index tensor
on a sharded dim is still refused (``ops/indexing.py``).

>>> import dtorch
>>> mesh = dtorch.DeviceMesh("cpu", [0, 1])
>>> x = dtorch.arange(6, device_mesh=mesh).reshape(3, 2).redistribute(mesh, [dtorch.Shard(0)])
>>> row = x[2]
>>> row.placements, row.to_torch()
([Replicate()], tensor([4, 5]))
"""

from __future__ import annotations

from ..placement import Partial, Replicate, Shard
from .rules import Placed

ELLIPSIS, SUM = "...", Partial("sum")


def int_items(items, ndim: int) -> dict:
    """{input dim: position in ``items``} of the ints of an index without tensors."""
    used = sum(1 for it in items if it is not None and it != ELLIPSIS)
    found, d = {}, 0
    for k, it in enumerate(items):
        if it is None:
            continue
        if it == ELLIPSIS:
            d += ndim - used
            continue
        if isinstance(it, int):
            found[d] = k
        d += 1
    return found


def picked_dims(spec, items, n_index_tensors: int) -> dict:
    """{input dim: position in ``items``} of the ints on dims ``spec`` shards, where the
    selection applies."""
    if n_index_tensors or spec.dtype == "bool":
        return {}
    sharded = {p.dim for p in spec.placements if isinstance(p, Shard)}
    return {d: k for d, k in int_items(items, len(spec.shape)).items() if d in sharded}


def picking_rows(picked) -> list:
    """Rule rows: a Shard of a picked dim gives a Partial sum (reduced by ``reduce_picked``)."""
    return [((SUM,), (Shard(d),)) for d in picked]


def reduce_picked(placed: Placed, spec, picked) -> Placed:
    """``placed`` with its Partial sums from picked dims reduced to Replicate (``post``)."""
    if not picked:
        return placed
    outs = placed.outs[0]
    post = tuple(Replicate() if isinstance(q, Shard) and q.dim in picked else p
                 for p, q in zip(outs, spec.placements))
    return Placed(placed.outs, placed.pre, (post,))


def local_items(ctx, items, picked):
    """``items`` with each picked int made local to this device's block, or None when another
    device's block holds the element (this device's share is then zeros)."""
    spec = ctx.in_specs[0]
    shape, offsets = spec.local_region(ctx.coord)
    local = list(items)
    for d, k in picked.items():
        at = items[k] % spec.shape[d] - offsets[d]
        if not 0 <= at < shape[d]:
            return None
        local[k] = at
    return tuple(local)
