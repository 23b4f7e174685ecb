"""Neural-network operators (``dtorch.nn.functional``): embedding, one_hot, convolutions,
pooling, interpolate, losses (mse_loss, cross_entropy, nll_loss), scaled_dot_product_attention.

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


# -- class losses: cross_entropy, nll_loss --------------------------------------------------------
# input (N, C, d1, ...) or (C,); target (N, d1, ...) class indices, or (for cross_entropy) class
# probabilities shaped like the input. A sample's loss needs its whole row of classes, so the class
# dim and the weight (one per class) are Replicate; samples and positions never meet.


def _reduction(size_average=None, reduce=None, reduction="mean", **_) -> str:
    """torch's reduction, legacy ``size_average``/``reduce`` spellings included."""
    if size_average is not None or reduce is not None:
        return F._Reduction.legacy_get_string(size_average, reduce)
    return reduction


def class_loss_rule(call) -> Placed:
    """A sample dim (any dim but the class dim) sharded alike in input and target shards the
    per-sample losses ('none'); 'sum' and 'mean' make each device's block a Partial sum of
    losses (and, for 'mean', of the denominator: a second output), reduced across devices on
    their own, then divided (see ``class_loss``). Weight Replicate; no Partial input (the log
    of a softmax is not linear)."""
    input, target = call.tensors[:2]
    if len(input.shape) < 2:  # one sample, no batch
        return expand(call, [])
    probs = len(target.shape) == len(input.shape)
    weights = (R,) * (len(call.tensors) - 2)
    rows = [((Shard(d - (d > 1)),), (Shard(d), Shard(d if probs else d - (d > 1))) + weights)
            for d in range(len(input.shape)) if d != 1]
    if _reduction(**call.static) == "none":
        return expand(call, rows)
    rows = [((Partial(),) * len(call.outs), ins) for _, ins in rows]
    placed = expand(call, rows)
    if Partial() not in placed.outs[0]:
        return placed
    post = tuple(R for _ in placed.outs[0])
    return placed._replace(post=(post,) * len(call.outs))


def _count(input, target, weight, ignore_index):
    """The denominator of torch's 'mean' for this block: the total weight of the targets that
    are not ignored (their count without weights), or the number of samples for class
    probabilities."""
    if target.dtype.is_floating_point:
        return torch.tensor(input.numel() // max(input.shape[1 if input.dim() > 1 else 0], 1),
                            dtype=input.dtype, device=input.device)
    kept = target != ignore_index
    if weight is None:
        return kept.sum().to(input.dtype)
    return (weight[target.masked_fill(~kept, 0).long()] * kept).sum()


def class_loss(fn):
    """``fn`` (F.cross_entropy or F.nll_loss). Reduced over a sharded batch, a 'mean' is value
    dependent (the count of kept targets, or their total weight), so each device returns its
    block's (sum, denominator) as two Partial sums and the call divides once they are reduced;
    otherwise torch's own, with a denominator of 1 (bit for bit: x / 1 == x)."""

    def kernel(ctx, input, target, weight=None, size_average=None, ignore_index=-100,
               reduce=None, reduction="mean", **smoothing):
        reduction = _reduction(size_average, reduce, reduction)
        partial = any(isinstance(p, Partial) for p in ctx.out_specs[0].placements)
        if reduction != "mean" or not partial:
            loss = fn(input, target, weight, ignore_index=ignore_index, reduction=reduction,
                      **smoothing)
            return (loss, torch.ones_like(loss)) if reduction == "mean" else loss
        total = fn(input, target, weight, ignore_index=ignore_index, reduction="sum",
                   **smoothing)
        return total, _count(input, target, weight, ignore_index)

    return kernel


def class_loss_meta(fn):
    """torch on meta tensors gives the shapes, but skips checks its CPU kernel makes (target
    dtype, weight dtype and size): these run on small real tensors of the same dtypes first.
    'mean' has two outputs (see ``class_loss``)."""

    def meta(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
             reduction="mean", **smoothing):
        kw = {"ignore_index": ignore_index, "reduction": _reduction(size_average, reduce,
                                                                    reduction), **smoothing}
        fn(*_small(input, target, weight), **kw)
        loss = fn(input, target, weight, **kw)
        return (loss, loss) if kw["reduction"] == "mean" else loss

    return meta


def _small(input, target, weight) -> tuple:
    """One sample of each (every dim 1 but the classes), on the CPU, class 0 as the target."""
    shape = [1] * input.dim()
    shape[1 if input.dim() > 1 else 0] = input.shape[1 if input.dim() > 1 else 0]
    small = torch.zeros(shape, dtype=input.dtype)
    probs = target.dim() == input.dim() and target.dtype.is_floating_point
    tiny = torch.zeros(shape if probs else [1] * target.dim(), dtype=target.dtype)
    return small, tiny, None if weight is None else torch.ones(weight.shape, dtype=weight.dtype)


def _divide(result):
    """'mean' comes back as (sum, denominator), both reduced: their quotient is the loss."""
    return result[0] / result[1] if isinstance(result, tuple) else result


LOSS = "input: Tensor, target: Tensor, weight: Tensor = None, size_average=None, " \
       "ignore_index=-100, reduce=None, reduction='mean'"
for _name, _extra in (("cross_entropy", ", label_smoothing=0.0"), ("nll_loss", "")):
    _fn = getattr(F, _name)
    register(OpDef(_name, f"{_name}({LOSS}{_extra})", class_loss(_fn), class_loss_rule,
                   meta=class_loss_meta(_fn), result=_divide, uses_context=True,
                   functional=True, function=False))


# -- attention ------------------------------------------------------------------------------------
# query (..., Hq, L, E), key (..., Hk, S, E), value (..., Hk, S, Ev) -> (..., Hq, L, Ev); the mask
# broadcasts to (..., Hq, L, S). Each (batch, head) pair attends on its own, so the leading dims
# shard alike; a position attends to every key position, so L, S and the embedding dims are whole
# (context parallel would need a ring of key/value blocks).


def attention_rule(call) -> Placed:
    """A leading dim sharded alike in every operand of its full size (one that broadcasts it
    stays Replicate) shards the output there. With GQA (Hk < Hq), query head h reads key head
    h // (Hq / Hk): array_split blocks of the two head dims do not line up, so the query heads
    shard with key and value heads Replicate (each device picks its heads' keys, see
    ``_attention``). The output is linear in value: a Partial value with the rest Replicate
    gives a Partial."""
    out = call.outs[0][0]
    shapes = [s.shape for s in call.tensors]
    gqa = shapes[1][-3:-2] != shapes[0][-3:-2]
    rows = []
    for d in range(len(out) - 2):
        ins = [_along(shape, d, out) for shape in shapes]
        if gqa and d == len(out) - 3:
            ins[1] = ins[2] = R
        if all(ins) and any(p != R for p in ins):  # None: a size neither full nor 1
            rows.append(((Shard(d),), tuple(ins)))
    for p in LINEAR_PARTIALS:
        rows.append(((p,), tuple(p if k == 2 else R for k in range(len(shapes)))))
    return expand(call, rows)


def _along(shape, d, out):
    """An operand's placement when the output's dim ``d`` is sharded: Shard of its matching dim,
    Replicate where it broadcasts (missing or size 1), None where it can do neither."""
    di = d - (len(out) - len(shape))
    if di >= 0 and shape[di] == out[d]:
        return Shard(di)
    return R if di < 0 or shape[di] == 1 else None


def _attention(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *,
               scale=None, enable_gqa=False):
    """torch's own; with GQA and this device holding a block of the query heads (keys whole),
    the key and value heads those query heads read (head h reads h // (Hq / Hk))."""
    q_spec, k_spec = ctx.in_specs[0], ctx.in_specs[1]
    if enable_gqa and query.dim() > 2 and query.shape[-3] != q_spec.shape[-3]:
        _, offsets = q_spec.local_region(ctx.coord)
        group = q_spec.shape[-3] // k_spec.shape[-3]
        first = offsets[len(q_spec.shape) - 3]
        heads = torch.arange(first, first + query.shape[-3], device=key.device) // group
        key, value = key.index_select(-3, heads), value.index_select(-3, heads)
    return F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal,
                                          scale=scale, enable_gqa=enable_gqa)


def _attention_meta(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *,
                    scale=None, enable_gqa=False):
    if dropout_p > 0:
        raise NotImplementedError("dtorch.scaled_dot_product_attention: dropout_p > 0 is not "
                                  "supported yet; apply dtorch.nn.functional.dropout to the "
                                  "attention weights of an explicit softmax(q @ k.T) @ v")
    # torch's meta kernel refuses a mask with is_causal, which its CPU kernel combines (a mask
    # and the causal triangle): the shapes are the same either way
    causal = is_causal and attn_mask is None
    return F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, causal,
                                          scale=scale, enable_gqa=enable_gqa)


register(OpDef("scaled_dot_product_attention",
               "scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor, "
               "attn_mask: Tensor = None, dropout_p=0.0, is_causal=False, *, scale=None, "
               "enable_gqa=False)", _attention, attention_rule, meta=_attention_meta,
               uses_context=True, functional=True, function=False))
