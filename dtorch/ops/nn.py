"""Neural-network operators (``dtorch.nn.functional``): embedding, one_hot, convolutions,
pooling, interpolate, losses (mse_loss, cross_entropy, nll_loss). Attention is ``attention.py``.

The important local case is the batch: samples never meet, so a batch-sharded input (``S(0)``)
with Replicate weights gives a batch-sharded output on every device's own samples. Pooling and
interpolation also keep channels apart (``S(1)``). Everything else must be Replicate.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..placement import Partial, Replicate, Shard
from ..type import OperatorFormat, PaddingType, PoolingKind
from .activation import channels_last, either
from .registry import OpDef, issue, register
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


def _embedding_meta(input, weight, padding_idx=None, max_norm=None, norm_type=2.0,
                    scale_grad_by_freq=False, sparse=False):
    if max_norm is not None or sparse:  # (max_norm renormalizes the table in place)
        raise NotImplementedError("dtorch.nn.functional.embedding: max_norm and sparse=True are "
                                  "not supported")
    return F.embedding(input, weight, padding_idx, None, norm_type, scale_grad_by_freq)


# dtorch.embedding is DTorch's, the nn.functional order (torch.embedding takes the weight first);
# torch's other arguments are taken (torch.nn.Embedding passes them all), refused when set
register(OpDef("embedding", "embedding(input: Tensor, weight: Tensor, padding_idx=None, "
               "max_norm=None, norm_type=2.0, scale_grad_by_freq=False, sparse=False)",
               F.embedding, embedding_rule, meta=_embedding_meta, functional=True))
register(OpDef("one_hot", "one_hot(input: Tensor, num_classes=-1)", F.one_hot,
               batch_rule(dims=range(8)), meta=_one_hot_meta, functional=True,
               function=False))


# -- convolution, pooling, interpolation ----------------------------------------------------------

CONV = "input: Tensor, weight: Tensor, bias: Tensor = None, stride=1, padding=0, dilation=1, " \
       "groups=1"


def conv_rule(call) -> Placed:
    """The batch, when there is one (an unbatched image has its channels first, which the
    weight spans); and, as DTorch, an image dim whose windows tile it (no padding, no dilation,
    kernel == stride there) when each device's block is a whole number of windows, the same
    number on every device: each block convolves alone, into the result's ``array_split``
    block (a kernel of 1 always; else the size divides by kernel x shards)."""
    x, w = call.tensors[:2]
    spatial, st = len(w.shape) - 2, call.static
    weights = (R,) * (len(call.tensors) - 1)
    rows = [((Shard(0),), (Shard(0),) + weights)] if len(x.shape) == spatial + 2 else []
    pads = st["padding"]
    if pads in (0, "valid") or not isinstance(pads, (int, str)) and not any(pads):
        dilation, stride = _each(st["dilation"], spatial), _each(st["stride"], spatial)
        for j, k, s, d in zip(range(len(x.shape) - spatial, len(x.shape)), w.shape[2:], stride,
                              dilation):
            n = math.prod(m for p, m in zip(x.placements, call.mesh.shape) if p == Shard(j))
            if d == 1 and k == s and (k == 1 or x.shape[j] % (k * n) == 0):
                rows.append(((Shard(j),), (Shard(j),) + weights))
    return expand(call, rows)


def _each(v, n: int) -> tuple:
    return (v,) * n if isinstance(v, int) else tuple(v) * (n // len(v))


register(OpDef("conv1d", f"conv1d({CONV})", F.conv1d, conv_rule, functional=True))


# DTorch's argument forms beside torch's: a parameter under either name (``groups=``/``group=``,
# ``either``), padding by type (``PaddingType``) or by amounts (DTorch's four,
# ``(h_begin, w_begin, h_end, w_end)``), and channels-last images (``channels_last``), which the
# fronts move to torch's layout and back.


def to_nchw(x, nhwc: bool):
    """Channels last to torch's channel dim (the third from the end: N, C, H, W or C, H, W)."""
    return issue("movedim", (x,), (-1, -3)) if nhwc else x


def from_nchw(x, nhwc: bool):
    return issue("movedim", (x,), (-3, -1)) if nhwc else x


def four_pads(padding) -> tuple:
    """``(top, left, bottom, right)`` from torch's int or (h, w), or DTorch's four."""
    p = (padding,) if isinstance(padding, int) else tuple(padding)
    if len(p) == 1:
        p = p * 2
    if len(p) == 2:
        p = p * 2
    if len(p) != 4:
        raise ValueError(f"padding must be an int, (h, w) or (h_begin, w_begin, h_end, w_end), "
                         f"got {padding!r}")
    return p


def same_pads(size, kernel, stride, dilation) -> tuple:
    """DTorch's (and TensorFlow's, ONNX's SAME_UPPER) ``same``: ``ceil(size / stride)`` outputs,
    the padding they need split in two, the extra element after."""
    pads = []
    for n, k, s, d in zip(size, _each(kernel, 2), _each(stride, 2), _each(dilation, 2)):
        need = max(0, (-(-n // s) - 1) * s + (k - 1) * d + 1 - n)
        pads.append((need // 2, need - need // 2))
    (top, bottom), (left, right) = pads
    return top, left, bottom, right


def padded(x, pads, value=None):
    """``x`` padded by ``(top, left, bottom, right)`` on its last two dims (``F.pad``'s order)."""
    top, left, bottom, right = pads
    return issue("pad", (x,), ((left, right, top, bottom), "constant", value)) if any(pads) else x


def conv2d(input, weight, bias=None, stride=1, *args, padding=None, dilation=None, groups=None,
           padding_type=None, group=None, format=None, is_nchw=None):
    """``torch.nn.functional.conv2d`` and DTorch's ``conv2d(input, weight, bias=None, stride=1,
    padding_type=PaddingType.not_set, padding=0, dilation=1, group=1,
    format=OperatorFormat.nchw)``: a ``PaddingType`` after ``stride`` takes DTorch's order;
    ``groups=`` or ``group=``; ``padding="same"``/``"valid"`` or ``padding_type=``
    (``same`` with a stride: DTorch's ``ceil(size / stride)`` outputs); four paddings
    ``(h_begin, w_begin, h_end, w_end)``; ``format=OperatorFormat.nhwc`` (or ``is_nchw=False``):
    input and output channels last (the weight stays ``(out, in / groups, kh, kw)``).

    >>> import dtorch
    >>> from dtorch.type import OperatorFormat, PaddingType
    >>> mesh = dtorch.DeviceMesh("cpu", [0, 1])
    >>> x = dtorch.ones((2, 5, 5, 3), device_mesh=mesh, placements=[dtorch.Shard(0)])
    >>> w = dtorch.ones((4, 3, 3, 3), device_mesh=mesh)
    >>> y = dtorch.conv2d(x, w, None, 1, PaddingType.same, format=OperatorFormat.nhwc)
    >>> y.shape, y.placements
    (torch.Size([2, 5, 5, 4]), [Shard(dim=0)])
    """
    kw = {"padding": padding, "dilation": dilation, "groups": groups,
          "padding_type": padding_type, "group": group, "format": format}
    names = CONV_DTORCH if args and isinstance(args[0], PaddingType) else CONV_TORCH
    if len(args) > len(names):
        raise TypeError(f"conv2d() takes at most {4 + len(names)} positional arguments")
    for name, value in zip(names, args):
        if kw[name] is not None:
            raise TypeError(f"conv2d() got multiple values for argument '{name}'")
        kw[name] = value
    groups = either("conv2d", "groups", kw["groups"], "group", kw["group"], 1)
    dilation = 1 if kw["dilation"] is None else kw["dilation"]
    nhwc = channels_last("conv2d", kw["format"], is_nchw)
    x = to_nchw(input, nhwc)
    padding = padding_arg("conv2d", kw["padding_type"], kw["padding"])
    if padding == "same" and _each(stride, 2) != (1, 1):  # torch refuses a strided "same"
        x, padding = padded(x, same_pads(x.shape[-2:], weight.shape[-2:], stride, dilation)), 0
    elif not isinstance(padding, (int, str)) and len(padding) == 4:
        pads = four_pads(padding)
        x, padding = (x, pads[:2]) if pads[:2] == pads[2:] else (padded(x, pads), 0)
    return from_nchw(issue("conv2d", (x, weight, bias), (stride, padding, dilation, groups)), nhwc)


CONV_TORCH = ("padding", "dilation", "groups")
CONV_DTORCH = ("padding_type", "padding", "dilation", "group", "format")


def padding_arg(op: str, padding_type, padding):
    """torch's ``padding`` (amounts, ``"same"``, ``"valid"``) from it or DTorch's
    ``padding_type``; a type other than ``not_set`` takes no amounts."""
    kind = PaddingType.not_set if padding_type is None else PaddingType(padding_type)
    if kind is PaddingType.not_set:
        return 0 if padding is None else padding
    if padding is not None and not isinstance(padding, str) and any(four_pads(padding)):
        raise ValueError(f"{op}(): padding_type={kind} takes no explicit padding, got "
                         f"padding={padding!r}")
    if isinstance(padding, str) and padding != kind.value:
        raise ValueError(f"{op}(): padding_type={kind} and padding={padding!r} disagree")
    return kind.value


register(OpDef("conv2d", f"conv2d({CONV})", F.conv2d, conv_rule, functional=True,
               front=conv2d))

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
                   uses_context=True, functional=True, function=hasattr(torch, _name)))


def _pooling2d(input, pooling_kind, dilation, kernel_size, stride, padding_type, padding,
               ceil_mode, count_include_pad, format=OperatorFormat.nchw):
    """DTorch's pooling: ``max_pool2d`` or ``avg_pool2d`` by ``pooling_kind``
    (``PoolingKind.max``/``avg``), padding by type (``same``: ``ceil(size / stride)`` outputs,
    ``valid``: none; both without ceil mode) or by amounts (int, (h, w), or
    ``(h_begin, w_begin, h_end, w_end)``: uneven ones pad explicitly, with -inf for max, zeros
    for avg, which then counts them), channels last with ``format=OperatorFormat.nhwc``.

    >>> import dtorch
    >>> from dtorch.type import PaddingType, PoolingKind
    >>> x = dtorch.ones((1, 2, 5, 5), device_mesh=dtorch.DeviceMesh("cpu", [0, 1]))
    >>> F = dtorch.nn.functional
    >>> F._pooling2d(x, PoolingKind.max, 1, 2, 2, PaddingType.same, 0, False, True).shape
    torch.Size([1, 2, 3, 3])
    """
    kind, nhwc = PoolingKind(pooling_kind), channels_last("_pooling2d", format)
    x = to_nchw(input, nhwc)
    padding = padding_arg("_pooling2d", padding_type, padding)
    if padding in ("same", "valid"):
        ceil_mode = False
        pads = same_pads(x.shape[-2:], kernel_size, stride, dilation) if padding == "same" \
            else (0, 0, 0, 0)
    else:
        pads = four_pads(padding)
    even = pads[:2] == pads[2:]
    if not even:  # torch pools with even paddings only: pad first
        if kind is PoolingKind.avg and not count_include_pad:
            raise NotImplementedError("_pooling2d: uneven padding of an avg pool with "
                                      "count_include_pad=False is not supported")
        low = -math.inf if x.dtype.is_floating_point else torch.iinfo(x.dtype).min
        x = padded(x, pads, low if kind is PoolingKind.max else None)
    amounts = pads[:2] if even else 0
    if kind is PoolingKind.max:
        out = issue("max_pool2d", (x,), (kernel_size, stride, amounts, dilation, ceil_mode,
                                         False))
    elif _each(dilation, 2) != (1, 1):
        raise NotImplementedError("_pooling2d: an avg pool has no dilation (as in torch)")
    else:
        out = issue("avg_pool2d", (x,), (kernel_size, stride, amounts, ceil_mode,
                                         count_include_pad, None))
    return from_nchw(out, nhwc)


def _global_pooling2d(input, pooling_kind, format=OperatorFormat.nchw):
    """DTorch's global pooling: the mean (``PoolingKind.avg``) or max of each channel's image,
    kept as (N, C, 1, 1), or (N, 1, 1, C) with ``format=OperatorFormat.nhwc``. It is
    ``input.mean((-2, -1), keepdim=True)`` (``amax``), so a sharded H or W reduces on its own
    (values as ``adaptive_avg_pool2d(x, 1)`` up to rounding).

    >>> import dtorch
    >>> from dtorch.type import PoolingKind
    >>> x = dtorch.ones((1, 2, 4, 4), device_mesh=dtorch.DeviceMesh("cpu", [0, 1]),
    ...                 placements=[dtorch.Shard(2)])
    >>> dtorch.nn.functional._global_pooling2d(x, PoolingKind.avg).to_torch().flatten().tolist()
    [1.0, 1.0]
    """
    dims = (-3, -2) if channels_last("_global_pooling2d", format) else (-2, -1)
    if PoolingKind(pooling_kind) is PoolingKind.max:
        return issue("amax", (input,), (dims, True))
    return issue("mean", (input,), (dims, True, None))


# DTorch's pooling forms: fronts made of the pooling, padding and reduction entries
register(OpDef("_pooling2d", "_pooling2d(input: Tensor, pooling_kind, dilation, kernel_size, "
               "stride, padding_type, padding, ceil_mode, count_include_pad, format='nchw')",
               None, None, front=_pooling2d, function=False, functional=True))
register(OpDef("_global_pooling2d", "_global_pooling2d(input: Tensor, pooling_kind, "
               "format='nchw')", None, None, front=_global_pooling2d, function=False,
               functional=True))


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
