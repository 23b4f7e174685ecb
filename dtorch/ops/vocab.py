"""Vocabulary-parallel embedding (``dtorch.nn.functional.vocab_parallel_embedding``): the
lookup of ``embedding`` for a table whose rows (the vocabulary) are sharded.

Each device holds a block of the table's rows (``S(0)``, ``array_split`` blocks: uneven ones
too). It looks up the indices that fall in its block (shifted by the block's first row) and
gives zero rows for the others, so exactly one device contributes each index's row: the result
is a Partial sum, which a reduction to ``R`` (an all-reduce) or ``S(d)`` (a reduce-scatter)
makes whole. The sum is exact (a row plus zeros), so it matches torch bit for bit.

>>> import dtorch, torch
>>> mesh = dtorch.DeviceMesh("cpu", [0, 1])
>>> w = dtorch.from_torch(torch.arange(10.).view(5, 2), device_mesh=mesh,
...                       placements=[dtorch.Shard(0)])
>>> y = dtorch.nn.functional.vocab_parallel_embedding(dtorch.tensor([4, 0], device_mesh=mesh), w)
>>> y.placements, y.to_torch()
([Partial(reduce_op='sum')], tensor([[8., 9.],
        [0., 1.]]))
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..placement import Partial, Replicate, Shard
from .registry import OpDef, register
from .rules import Placed, expand

R = Replicate()


def vocab_embedding_rule(call) -> Placed:
    """``embedding``'s rows without a Partial table (its masked zeros would not be the identity
    of max or min), and the vocabulary row: indices ``R`` with the table's rows sharded
    (``S(0)``) give a Partial sum, as each index's row comes from the one device holding it."""
    index, _ = call.tensors
    rows = [((Shard(d),), (Shard(d), R)) for d in range(len(index.shape))]
    rows.append(((Shard(len(index.shape)),), (R, Shard(1))))  # columns: each its own slice
    rows.append(((Partial(),), (R, Shard(0))))  # rows: one device holds each index's row
    return expand(call, rows)


def _vocab_embedding(ctx, input, weight, padding_idx=None):
    """This device's contribution: the rows of its block, zero rows where an index lies
    outside it. ``padding_idx`` only masks gradients (the metadata rule checks its range)."""
    spec = ctx.in_specs[1]
    (rows, _), (first, _) = spec.local_region(ctx.coord)
    vocab = spec.shape[0]
    if input.device.type == "cpu" and input.numel() and (
            int(input.min()) < 0 or int(input.max()) >= vocab):
        # torch's own error (a CUDA check would stall the stream: there, such an index gives
        # a zero row)
        raise IndexError(f"index out of range in self: the indices must be in [0, {vocab})")
    if padding_idx is not None:  # torch's: a negative one counts from the end
        padding_idx %= vocab
    if rows == vocab:
        return F.embedding(input, weight, padding_idx)
    out_shape = (*input.shape, weight.shape[1])
    if rows == 0:  # more devices than rows: an empty block holds no index
        return weight.new_zeros(out_shape)
    local = input - first
    inside = (local >= 0) & (local < rows)
    padding = padding_idx - first if padding_idx is not None and 0 <= padding_idx - first < rows \
        else None  # the padding row, where this block holds it
    found = F.embedding(torch.where(inside, local, 0), weight, padding)
    return found.masked_fill(~inside.unsqueeze(-1), 0)


register(OpDef("vocab_parallel_embedding",
               "vocab_parallel_embedding(input: Tensor, weight: Tensor, padding_idx=None)",
               _vocab_embedding, vocab_embedding_rule, meta=F.embedding, uses_context=True,
               functional=True, function=False, positional=True))
