"""Conversions: detach, copy_ into a tensor's own layout, and the comparisons that answer one
bool (equal, allclose).

Their public forms are fronts in ``dtorch/fronts.py``, which add what needs the client: moving a
copy's source across meshes, ``to`` a mesh or another tensor, and reading the bool. Casts
(``to(dtype)``) are the ``to`` entry of ``ops/elementwise.py``.
"""

from __future__ import annotations

import torch

from ..placement import Partial, Replicate, Shard
from .registry import INPLACE, VIEW, OpDef, register
from .rules import Placed, expand, pointwise_rows

R = Replicate()
# Each block answers 1 (it agrees) or 0; the tensors agree when every block does: the minimum.
AGREE = Partial("min")


def same_layout(call) -> Placed:
    return Placed((call.tensors[0].placements,))


# detach shares its input's blocks: any layout passes unchanged
register(OpDef("detach", "detach(input: Tensor)", torch.detach, same_layout,
               methods=("detach",), flags=VIEW))


# -- copy_ ----------------------------------------------------------------------------------------


def source_placements(dst, src) -> tuple:
    """The layout ``src`` takes to be copied into ``dst`` block by block: ``dst``'s shards where
    the dims line up (where ``src`` broadcasts, Replicate), and Replicate on ``dst``'s Partial
    mesh dims (each device then keeps its share of the value, as a factory does: a sum of
    partial copies would not survive the cast to ``dst``'s dtype)."""
    off = len(dst.shape) - len(src.shape)
    out = []
    for p in dst.placements:
        e = p.dim - off if isinstance(p, Shard) else -1
        out.append(Shard(e) if e >= 0 and src.shape[e] == dst.shape[p.dim] else R)
    return tuple(out)


def copy_rule(call) -> Placed:
    """The destination keeps its layout; the source is redistributed to match it first (the
    one automatic redistribution of a conversion, documented in docs/ops.md)."""
    dst, src = call.tensors
    target = source_placements(dst, src)
    return Placed((dst.placements,), (None, None if target == src.placements else target))


def _copy(ctx, input, src, non_blocking=False):
    return input.copy_(ctx.partition(src), non_blocking=non_blocking)


register(OpDef("copy_", "copy_(input: Tensor, src: Tensor, non_blocking=False)", _copy,
               copy_rule, meta=torch.Tensor.copy_, function=False, flags=INPLACE,
               uses_context=True))


# -- equal, allclose ------------------------------------------------------------------------------


def agree_rule(call) -> Placed:
    """Blocks are compared where they line up, as in a binary elementwise op (a Replicate
    operand is chunked locally to the other's shards); a sharded mesh dim then holds one answer
    per block, reduced by their minimum. A Partial operand must be reduced first (the parts of
    equal tensors need not be equal)."""
    shape = torch.broadcast_shapes(*(s.shape for s in call.tensors))
    rows = pointwise_rows(call._replace(outs=[(tuple(shape), None)]))
    return expand(call, [((AGREE,), ins) for _, ins in rows], auto_chunk=True)


def _answer(input, ok: torch.Tensor) -> torch.Tensor:
    return ok.to(device=input.device, dtype=torch.int64)


def _equal(input, other):
    return _answer(input, torch.tensor(torch.equal(input, other)))


def _allclose(input, other, rtol=1e-05, atol=1e-08, equal_nan=False):
    return _answer(input, torch.isclose(input, other, rtol, atol, equal_nan).all())


def _answer_meta(input, other, **tolerances):
    if tolerances:  # allclose: torch's own checks of dtypes and shapes
        torch.isclose(input, other, **tolerances)
    return torch.empty((), dtype=torch.int64, device="meta")


# the fronts compare shapes first (torch.equal is False for different shapes, not an error)
register(OpDef("equal", "equal(input: Tensor, other: Tensor)", _equal, agree_rule,
               meta=_answer_meta, function=False))
register(OpDef("allclose",
               "allclose(input: Tensor, other: Tensor, rtol=1e-05, atol=1e-08, equal_nan=False)",
               _allclose, agree_rule, meta=_answer_meta, function=False))
