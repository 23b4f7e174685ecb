"""Neural-network operators (``dtorch.nn.functional``): embedding, one_hot, convolutions,
pooling, interpolate, mse_loss.

The important local case is the batch: samples never meet, so a batch-sharded input (``S(0)``)
with Replicate weights gives a batch-sharded output on every device's own samples. Pooling and
interpolation also keep channels apart (``S(1)``). Everything else must be Replicate.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..placement import Partial, Replicate, Shard
from .registry import OpDef, register
from .rules import ALL_PARTIALS, LINEAR_PARTIALS, Placed, expand, placement_error

R = Replicate()


def batch_rule(dims=(0,), partials=()):
    """``dims`` of the first operand shard the output alike (weights Replicate); ``partials``
    pass where the op is linear (avg pool, interpolate) or monotone (max pool, P(max))."""

    def rule(call) -> Placed:
        n_in, n_out = len(call.tensors), len(call.outs)
        rows = [((Shard(d),) * n_out, (Shard(d),) + (R,) * (n_in - 1)) for d in dims
                if d < len(call.tensors[0].shape)]
        rows += [((p,) * n_out, (p,) + (R,) * (n_in - 1)) for p in partials]
        return expand(call, rows)

    return rule


def empty_safe(fn):
    """``fn`` on the block, or the result's empty block when this device's block is empty (an
    uneven split of a few channels over more devices): torch refuses empty channel dims."""

    def kernel(ctx, input, *args, **static):
        if input.numel():
            return fn(input, *args, **static)
        blocks = [torch.empty(spec.local_region(ctx.out_coord)[0], device=input.device,
                              dtype=input.dtype if k == 0 else torch.int64)
                  for k, spec in enumerate(ctx.out_specs)]
        return blocks[0] if len(blocks) == 1 else tuple(blocks)

    return kernel


# -- embedding, one_hot ---------------------------------------------------------------------------


def embedding_rule(call) -> Placed:
    """Each index looks its row up: indices sharded on any dim shard the output alike; an
    embedding table sharded on its columns (``S(1)``) gives the output's last dim sharded; a
    Partial table passes (lookup copies rows)."""
    index, _ = call.tensors
    rows = [((Shard(d),), (Shard(d), R)) for d in range(len(index.shape))]
    rows.append(((Shard(len(index.shape)),), (R, Shard(1))))
    rows += [((p,), (R, p)) for p in ALL_PARTIALS]
    return expand(call, rows)


def _one_hot_meta(input, num_classes=-1):
    if num_classes < 0:
        raise ValueError("dtorch.one_hot: num_classes=-1 depends on the values (their max); "
                         "pass num_classes")
    return F.one_hot(input, num_classes)


register(OpDef("embedding", "embedding(input: Tensor, weight: Tensor, padding_idx=None)",
               F.embedding, embedding_rule, functional=True, function=False))
register(OpDef("one_hot", "one_hot(input: Tensor, num_classes=-1)", F.one_hot,
               batch_rule(dims=range(8)), meta=_one_hot_meta, functional=True,
               function=False))


# -- convolution, pooling, interpolation ----------------------------------------------------------

CONV = "input: Tensor, weight: Tensor, bias: Tensor = None, stride=1, padding=0, dilation=1, " \
       "groups=1"
for _name in ("conv1d", "conv2d"):
    register(OpDef(_name, f"{_name}({CONV})", getattr(F, _name), batch_rule(), functional=True))

# a channel is pooled and resized on its own, like a sample; averages and resizes are linear
# (Partial sum/avg pass); a max of maxima is the max (Partial(max) passes a max pool)
POOL_DIMS = (0, 1)
def _max_pool2d(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False,
                return_indices=False):
    return F.max_pool2d(input, kernel_size, stride, padding, dilation, ceil_mode=ceil_mode,
                        return_indices=return_indices)


def max_pool_rule(call) -> Placed:
    # the indices of a P(max) value's maxima are not those of any one contribution
    partials = () if call.static.get("return_indices") else (Partial("max"),)
    return batch_rule(POOL_DIMS, partials)(call)


POOLS = [
    ("max_pool2d", "kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, "
     "return_indices=False", _max_pool2d, max_pool_rule),
    ("avg_pool2d", "kernel_size, stride=None, padding=0, ceil_mode=False, "
     "count_include_pad=True, divisor_override=None", F.avg_pool2d,
     batch_rule(POOL_DIMS, LINEAR_PARTIALS)),
    ("adaptive_avg_pool2d", "output_size", F.adaptive_avg_pool2d,
     batch_rule(POOL_DIMS, LINEAR_PARTIALS)),
    ("interpolate", "size=None, scale_factor=None, mode='nearest', align_corners=None, "
     "recompute_scale_factor=None, antialias=False", F.interpolate,
     batch_rule(POOL_DIMS, LINEAR_PARTIALS)),
]
for _name, _args, _fn, _rule in POOLS:
    register(OpDef(_name, f"{_name}(input: Tensor, {_args})", empty_safe(_fn), _rule, meta=_fn,
                   uses_context=True, functional=True, function=False))


# -- losses ---------------------------------------------------------------------------------------


def loss_rule(call) -> Placed:
    """Elementwise, then reduced: dims sharded alike in input and target (same size); with
    ``reduction='none'`` the result keeps them, else each device reduces its block to a Partial
    sum, which is reduced across devices on its own (an all-reduce), as ``sum`` does."""
    input, target = call.tensors
    rows = [((Shard(d),), (Shard(d), Shard(d))) for d in range(len(input.shape))
            if d < len(target.shape) and input.shape == target.shape]
    if call.static.get("reduction", "mean") == "none":
        return expand(call, rows)
    table = {ins: None for _, ins in rows}
    table[(R, R)] = None
    outs, bad = [], []
    for i in range(len(call.mesh.shape)):
        ins = (input.placements[i], target.placements[i])
        if ins not in table:
            bad.append((i, ins))
        outs.append(Partial() if isinstance(ins[0], Shard) else R)
    if bad:
        raise placement_error(call, table, bad)
    post = (R,) * len(outs) if Partial() in outs else None
    return Placed((tuple(outs),), (), (post,) if post else ())


def _mse_loss(ctx, input, target, reduction="mean"):
    """A sharded 'mean' is each block's sum over the global count, so that the Partial sum is
    the mean even for uneven blocks; otherwise torch's own, bit for bit."""
    if reduction != "mean" or not any(isinstance(p, Partial)
                                      for p in ctx.out_specs[0].placements):
        return F.mse_loss(input, target, reduction=reduction)
    return F.mse_loss(input, target, reduction="sum") / math.prod(ctx.in_specs[0].shape)


register(OpDef("mse_loss", "mse_loss(input: Tensor, target: Tensor, reduction='mean')",
               _mse_loss, loss_rule, uses_context=True, functional=True, function=False,
               meta=lambda input, target, reduction="mean": F.mse_loss(input, target,
                                                                       reduction=reduction)))
