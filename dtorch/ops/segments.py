"""Cutting a sub-split tensor back into its segments: ``split``, ``chunk`` and slices along a
sub-split dim whose pieces line up with the segments' boundaries.

A sub-split ``Shard(d, sub_split=(n0, n1, ...))`` (what ``cat`` along a sharded dim makes) holds
on every device its piece of each segment, in order, so the positions of one run of whole
segments are one range of every device's block: cutting them out is a local ``narrow``, and the
result is sharded as those segments are (one segment: a plain Shard). This is how a joint
attention splits its text and image tokens apart again after attending over them together. A
cut that does not line up with the segments would need other devices' elements; those go
through the plain operators, whose errors name the redistribute to add.
"""

from __future__ import annotations

import itertools

import torch

from ..placement import Shard
from .registry import OpDef, issue, register
from .rules import Placed


def sub_split_of(x, dim: int):
    """The segment sizes of ``x``'s dim ``dim`` when it is sub-split, else None."""
    return next((p.sub_split for p in x.placements if p.is_shard(dim) and p.sub_split), None)


def cut_segments(x, dim: int, sizes):
    """``x`` cut along ``dim`` into consecutive parts of ``sizes``, when ``dim`` is sub-split and
    every cut lies on a segment boundary; else None (the caller's plain operator applies)."""
    dim = dim % x.ndim if x.ndim else dim
    split = sub_split_of(x, dim)
    if split is None:
        return None
    bounds = set(itertools.accumulate(split, initial=0))
    starts = list(itertools.accumulate(sizes, initial=0))
    if not bounds.issuperset(starts):
        return None
    return tuple(issue("_take_segments", (x,), (dim, a, b - a)) for a, b in itertools.pairwise(starts))


def cut_slice(x, index):
    """``x[index]`` for a slice of whole segments along one sub-split dim (every other dim
    taken whole, ``x[:, :n]``), else None."""
    if not any(isinstance(p, Shard) and p.sub_split for p in x._spec.placements):
        return None
    items = index if isinstance(index, tuple) else (index,)
    if not items or not all(isinstance(i, slice) or i is Ellipsis for i in items) or \
            sum(i is Ellipsis for i in items) > 1:
        return None
    if Ellipsis in items:
        k = items.index(Ellipsis)
        items = items[:k] + (slice(None),) * (x.ndim - len(items) + 1) + items[k + 1:]
    cut = [d for d, i in enumerate(items) if i != slice(None)]
    if len(cut) != 1 or len(items) > x.ndim:
        return None
    (dim,) = cut
    start, stop, step = items[dim].indices(x.shape[dim])
    if step != 1 or stop <= start:
        return None
    parts = cut_segments(x, dim, (start, stop - start, x.shape[dim] - stop))
    return None if parts is None else parts[1]


def _segments_within(split: tuple, start: int, length: int) -> tuple:
    sizes, at = [], 0
    for n in split:
        if start <= at and at + n <= start + length:
            sizes.append(n)
        at += n
    return tuple(sizes)


def take_segments_rule(call):
    """The segments within ``[start, start + length)`` of each sub-split mesh dim; every other
    placement passes (a copy of whole positions)."""
    (spec,) = call.tensors
    dim, start, length = (call.static[k] for k in ("dim", "start", "length"))
    outs = tuple(Shard(dim, _segments_within(p.sub_split, start, length))
                 if p.is_shard(dim) and p.sub_split else p for p in spec.placements)
    return Placed((outs,))


def _take_segments(ctx, input, dim, start, length):
    """This device's pieces of the segments within ``[start, start + length)``: one range of
    its block."""
    pieces = ctx.in_specs[0].local_pieces(ctx.coord)[dim]
    first = sum(n for offset, n in pieces if offset < start)
    count = sum(n for offset, n in pieces if start <= offset < start + length)
    return input.narrow(dim, first, count).clone()


register(OpDef("_take_segments", "_take_segments(input: Tensor, dim, start, length)",
               _take_segments, take_segments_rule,
               meta=lambda input, dim, start, length: input.narrow(dim, start, length),
               uses_context=True, function=False, sub_splits=True))


def torch_split_sizes(shape, dim: int, how, chunks: bool = False) -> list:
    """The sizes of torch's ``split`` (``chunk`` with ``chunks``) of a tensor of ``shape``."""
    meta = torch.empty(shape, device="meta")
    parts = meta.chunk(how, dim) if chunks else meta.split(how, dim)
    return [p.shape[dim] for p in parts]
