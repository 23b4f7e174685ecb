"""An int or an index tensor on a sharded dim (``x[0]`` of a batch-sharded tensor,
``for row in x``, CLIP's ``states[arange(B), eos_positions]`` on data parallelism).

Each element lives in one device's block. Each device selects the elements its own block holds
and gives zeros for the others, so the result is a Partial sum over the mesh dims that shard
the indexed dims, which the rule then reduces to Replicate there (an all-reduce of the result,
not a gather of the input; adding zeros is exact). An int another device holds makes this
device's share all zeros; an index tensor's values are made local (``i - offset``, torch's
negative indices first wrapped), those outside the block clamped into it for the read and
zeroed after (``_held``: where each picked element lands in the result, read through the same
index from a zero-stride view of a flag per position). A bool tensor is refused (a bool sum is
no selection), and so is a slice on a sharded dim (``ops/indexing.py``).

>>> import dtorch
>>> mesh = dtorch.DeviceMesh("cpu", [0, 1])
>>> x = dtorch.arange(6, device_mesh=mesh).reshape(3, 2).redistribute(mesh, [dtorch.Shard(0)])
>>> row = x[2]
>>> row.placements, row.to_torch()
([Replicate()], tensor([4, 5]))
>>> x[dtorch.tensor([2, 0, 2], device_mesh=mesh)].to_torch()
tensor([[4, 5],
        [0, 1],
        [4, 5]])
"""

from __future__ import annotations

import functools
import operator

import torch

from ..placement import Partial, Replicate, Shard
from .rules import Placed

ELLIPSIS, TENSOR, SUM = "...", "T", Partial("sum")


def indexed_items(items, ndim: int) -> dict:
    """{input dim: position in ``items``} of the ints and index tensors of an index."""
    used = sum(1 for it in items if it is not None and it != ELLIPSIS)
    found, d = {}, 0
    for k, it in enumerate(items):
        if it is None:
            continue
        if it == ELLIPSIS:
            d += ndim - used
            continue
        if isinstance(it, int) or it == TENSOR:
            found[d] = k
        d += 1
    return found


def picked_dims(spec, items) -> dict:
    """{input dim: position in ``items``} of the ints and index tensors on dims ``spec``
    shards, where the selection applies."""
    if spec.dtype == "bool":
        return {}
    sharded = {p.dim for p in spec.placements if isinstance(p, Shard)}
    return {d: k for d, k in indexed_items(items, len(spec.shape)).items() if d in sharded}


def picking_rows(picked, n_index_tensors: int) -> list:
    """Rule rows: a Shard of a picked dim gives a Partial sum (reduced by ``reduce_picked``);
    the index tensors are Replicate."""
    return [((SUM,), (Shard(d),) + (Replicate(),) * n_index_tensors) for d in picked]


def reduce_picked(placed: Placed, spec, picked) -> Placed:
    """``placed`` with its Partial sums from picked dims reduced to Replicate (``post``)."""
    if not picked:
        return placed
    outs = placed.outs[0]
    post = tuple(Replicate() if isinstance(q, Shard) and q.dim in picked else p
                 for p, q in zip(outs, spec.placements))
    return Placed(placed.outs, placed.pre, (post,))


def pick(ctx, input, tensors, items, picked, index):
    """This device's share of ``index(input, tensors, items)`` (the kernel's indexing) with
    the ``picked`` dims sharded: the elements its block holds, zeros elsewhere."""
    spec = ctx.in_specs[0]
    shape, offsets = spec.local_region(ctx.coord)
    items, tensors = list(items), list(tensors)
    slot = {k: n for n, k in enumerate(k for k, it in enumerate(items) if it == TENSOR)}
    flagged = []
    for d, k in picked.items():
        if not shape[d]:  # an empty block holds nothing
            return torch.zeros(ctx.out_local_shape, dtype=input.dtype, device=input.device)
        if items[k] == TENSOR:
            n = slot[k]
            at = tensors[n] % spec.shape[d] - offsets[d]
            tensors[n] = at.clamp(0, shape[d] - 1)
            flagged.append((d, n, torch.where((at >= 0) & (at < shape[d]), at, shape[d])))
            continue
        at = items[k] % spec.shape[d] - offsets[d]
        if not 0 <= at < shape[d]:  # another device's block holds the element
            return torch.zeros(ctx.out_local_shape, dtype=input.dtype, device=input.device)
        items[k] = at
    out = index(input, tensors, items)
    if not flagged:
        return out
    held = [_held(input, d, shape[d], tensors, n, at, items, index) for d, n, at in flagged]
    return out.masked_fill(~functools.reduce(operator.and_, held), 0)


def _held(input, d: int, size: int, tensors, n: int, at, items, index):
    """Which elements of the result index tensor ``n`` picks from this block along ``d``:
    the same index read from a view of ``input``'s shape, one longer along ``d``, that is True
    but at the extra position, where ``at`` sends the indices outside the block."""
    flag = torch.ones(size + 1, dtype=torch.bool, device=input.device)
    flag[size] = False
    view, shape = [1] * input.dim(), list(input.shape)
    view[d] = shape[d] = size + 1
    tensors = list(tensors)
    tensors[n] = at
    return index(flag.view(view).expand(shape), tensors, items)
