"""Activations and normalisation: torch.nn.functional's names (``functional=True``).

Pointwise activations shard like unary elementwise ops. Ops that mix elements along some dims
(softmax over ``dim``, layer_norm and rms_norm over the normalized dims, group_norm over channels
and space) need those dims whole on each device: they accept a Shard only on the dims they treat
independently, and a Shard elsewhere raises a ValueError naming the ``redistribute()`` to
Replicate. None of them redistributes on its own. ``inplace=True`` makes the call in-place (the
client flags that call shape INPLACE), as do the ``_`` entries (``relu_``).

>>> import dtorch, torch
>>> mesh = dtorch.DeviceMesh("cpu", [0, 1])
>>> x = dtorch.from_torch(torch.randn(4, 6), mesh, [dtorch.Shard(0)])
>>> y = dtorch.nn.functional.softmax(x, dim=1)   # rows are whole on each device
>>> torch.allclose(y.to_torch().sum(1), torch.ones(4))
True
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from ..placement import Partial, Shard
from ..type import OperatorFormat
from .creation import fresh_seed
from .meta import probed
from .registry import INPLACE, VIEW, OpDef, issue, register
from .rules import LINEAR_PARTIALS, R, expand, pointwise

MAX_MIN = (Partial("max"), Partial("min"))


# -- pointwise activations ------------------------------------------------------------------------
# relu, relu6 and selu are non-decreasing on the whole line: f(max_i x_i) = max_i f(x_i) (min
# alike), so Partial(max) and Partial(min) pass. The others are not monotone (gelu, silu, mish,
# hardswish) or are monotone only for some static values (leaky_relu's slope, elu's alpha,
# softplus's beta), which the rule does not look at: a Partial input must be reduced first.
# (name, signature tail after ``input: Tensor``, Partials, in-place form in torch.nn.functional)
POINTWISE = [
    ("relu", ", inplace=False", MAX_MIN, "relu_"),
    ("relu6", ", inplace=False", MAX_MIN, None),
    ("selu", ", inplace=False", MAX_MIN, "selu_"),
    ("leaky_relu", ", negative_slope=0.01, inplace=False", (), "leaky_relu_"),
    ("elu", ", alpha=1.0, inplace=False", (), "elu_"),
    ("gelu", ", approximate='none'", (), None),
    ("silu", ", inplace=False", (), None),
    ("mish", ", inplace=False", (), None),
    ("softplus", ", beta=1.0, threshold=20.0", (), None),
    ("hardtanh", ", min_val=-1.0, max_val=1.0, inplace=False", (), "hardtanh_"),
    ("hardswish", ", inplace=False", (), None),
    ("hardsigmoid", ", inplace=False", (), None),
    ("celu", ", alpha=1.0, inplace=False", (), "celu_"),
    ("threshold", ", threshold, value, inplace=False", (), "threshold_"),
    ("hardshrink", ", lambd=0.5", (), None),
    ("softshrink", ", lambd=0.5", (), None),
    ("softsign", "", (), None),
    ("tanhshrink", "", (), None),
    ("logsigmoid", "", (), None),
]


class GeluApproximateError(ValueError, RuntimeError):
    """``gelu``'s ``approximate`` is neither ``'none'`` nor ``'tanh'``: a ValueError, as
    DTorch raises, and the RuntimeError torch raises."""


def _gelu_meta(input, approximate="none"):
    if approximate not in ("none", "tanh"):
        raise GeluApproximateError(f"gelu: approximate argument must be either none or tanh, "
                                   f"got {approximate!r}")
    return probed(F.gelu)(input, approximate=approximate)


META = {"gelu": _gelu_meta}  # where an argument's value needs a check of its own

for name, tail, partials, inplace in POINTWISE:
    rule = pointwise(linear=(0,), partials=partials)
    fn = getattr(F, name)
    register(OpDef(name, f"{name}(input: Tensor{tail})", fn, rule,
                   meta=META.get(name) or probed(fn),
                   methods=(name,) if hasattr(torch.Tensor, name) else (),
                   function=hasattr(torch, name), functional=True))
    if inplace:
        fn = getattr(F, inplace)
        in_tail = tail.replace(", inplace=False", "")
        register(OpDef(inplace, f"{inplace}(input: Tensor{in_tail})", fn, rule, meta=probed(fn),
                       methods=(inplace,) if hasattr(torch.Tensor, inplace) else (),
                       function=hasattr(torch, inplace), functional=True, flags=INPLACE))


# -- ops that mix elements along some dims --------------------------------------------------------
# Each device computes its block alone when every dim the op mixes along is whole there, so the
# rows shard only the dims the op treats independently (``batch_dims``); weights and biases span
# the mixed dims and stay Replicate. Partials are refused: none of these ops is linear.


def softmax_dim(dim, ndim: int) -> int:
    """torch's choice when ``dim`` is None (deprecated there, with a warning)."""
    if dim is None:
        return 0 if ndim in (0, 1, 3) else 1
    n = max(ndim, 1)  # a 0-dim tensor takes dims -1 and 0, as torch's do
    if not -n <= dim < n:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-n}, {n - 1}], "
                         f"but got {dim})")
    return dim % n


def softmax_batch(ndim, static) -> list:
    return [d for d in range(ndim) if d != softmax_dim(static.get("dim"), ndim)]


def norm_batch(ndim, static) -> list:
    shape = static["normalized_shape"]
    return list(range(ndim - (1 if isinstance(shape, int) else len(shape))))


def channel_batch(ndim, static) -> list:
    """group_norm and batch_norm: the batch dim alone (group_norm mixes channels and space,
    batch_norm's channel dim shards with its per-channel operands, see ``channel_rule``)."""
    return [0] if ndim else []


def mixing_rule(batch_dims, channel: bool = False):
    """Rows ``S(d) -> S(d)`` for the independent dims, other operands Replicate. With ``channel``
    (batch_norm in inference): dim 1 may be sharded too, together with every per-channel operand
    (all of length C, so numpy.array_split cuts them exactly as the input's dim 1), and the
    spatial dims are independent."""

    def rule(call):
        spec, others = call.tensors[0], len(call.tensors) - 1
        ndim = len(spec.shape)
        dims = batch_dims(ndim, call.static) + (list(range(2, ndim)) if channel else [])
        rows = [((Shard(d),), (Shard(d),) + (R,) * others) for d in dims]
        if channel and ndim >= 2:
            rows.append(((Shard(1),), (Shard(1),) + (Shard(0),) * others))
        return expand(call, rows)

    return rule


def probed_mixing(kernel, batch_dims):
    """Metadata: shapes from the kernel on meta tensors; dtype and torch's checks (several meta
    kernels skip them, e.g. layer_norm of an int tensor) from the kernel on a CPU input whose
    independent dims are shrunk to two elements at most (the mixed dims stay whole: weights
    must match; two keep group_norm's "more than one value per group" check as torch's)."""

    def meta(input, *operands, **static):
        keep = set(batch_dims(input.dim(), static))
        shape = [min(n, 2) if d in keep else n for d, n in enumerate(input.shape)]
        probe = kernel(torch.ones(shape, dtype=input.dtype), *map(_cpu, operands), **static)
        out = kernel(input, *operands, **static)
        return out if out.dtype == probe.dtype else out.to(probe.dtype)

    return meta


def _cpu(t):
    return torch.ones(t.shape, dtype=t.dtype) if isinstance(t, torch.Tensor) else t


def _softmax(fn):
    """The host kernel resolves ``dim=None`` itself, so hosts do not warn on every call."""

    def kernel(input, dim=None, _stacklevel=3, dtype=None):
        return fn(input, softmax_dim(dim, input.dim()), dtype=dtype)

    return kernel


# kernels take their tensor operands first, then the static args by name (registry.py)
def _layer_norm(input, weight, bias, normalized_shape, eps=1e-05):
    return F.layer_norm(input, normalized_shape, weight, bias, eps)


def _rms_norm(input, weight, normalized_shape, eps=None):
    return F.rms_norm(input, normalized_shape, weight, eps)


def _group_norm(input, weight, bias, num_groups, eps=1e-05):
    """The aten op: F.group_norm's Python check (more than one value per group) holds for the
    whole tensor, which the metadata rule checks, not for an uneven shard of one sample."""
    return torch.group_norm(input, num_groups, weight, bias, eps)


def _group_norm_checked(input, weight, bias, num_groups, eps=1e-05):
    return F.group_norm(input, num_groups, weight, bias, eps)


def _batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False,
                momentum=0.1, eps=1e-05):
    """Inference: the running statistics (training mode is ``batch_statistics``, of dtorch's
    operators, before anything is issued)."""
    return F.batch_norm(input, running_mean, running_var, weight, bias, False, momentum, eps)


# (name, signature, host kernel, metadata kernel when it checks more, independent dims, channel)
MIXING = [
    ("softmax", "softmax(input: Tensor, dim=None, _stacklevel=3, dtype=None)",
     _softmax(F.softmax), None, softmax_batch, False),
    ("log_softmax", "log_softmax(input: Tensor, dim=None, _stacklevel=3, dtype=None)",
     _softmax(F.log_softmax), None, softmax_batch, False),
    ("layer_norm", "layer_norm(input: Tensor, normalized_shape, weight: Tensor = None, "
     "bias: Tensor = None, eps=1e-05)", _layer_norm, None, norm_batch, False),
    ("rms_norm", "rms_norm(input: Tensor, normalized_shape, weight: Tensor = None, eps=None)",
     _rms_norm, None, norm_batch, False),
    ("group_norm", "group_norm(input: Tensor, num_groups, weight: Tensor = None, "
     "bias: Tensor = None, eps=1e-05)", _group_norm, _group_norm_checked, channel_batch,
     False),
    ("batch_norm", "batch_norm(input: Tensor, running_mean: Tensor, running_var: Tensor, "
     "weight: Tensor = None, bias: Tensor = None, training=False, momentum=0.1, eps=1e-05)",
     _batch_norm, None, channel_batch, True),
]

# -- DTorch's argument forms beside torch's (used by ops/nn.py too): a parameter under either
# name (``weight=``/``scale=``), channels-last images (``format=OperatorFormat.nhwc`` or
# ``is_nchw=False``: the channel dim last)


def either(op: str, name: str, value, alias: str, alias_value, default=None):
    """One parameter that torch names ``name`` and DTorch ``alias``; not both."""
    if value is not None and alias_value is not None:
        raise TypeError(f"{op}() got '{name}' and '{alias}', two names of one parameter")
    value = alias_value if value is None else value
    return default if value is None else value


def channels_last(op: str, format=None, is_nchw=None) -> bool:
    """Whether images come channels last: ``format=OperatorFormat.nhwc`` (or ``"nhwc"``), or
    ``is_nchw=False`` (the name DTorch's modules use for the same)."""
    nhwc = None if format is None else OperatorFormat(format) is OperatorFormat.nhwc
    if is_nchw is not None:
        if nhwc is not None and nhwc == bool(is_nchw):
            raise ValueError(f"{op}(): format={OperatorFormat(format)} and is_nchw={is_nchw} "
                             f"disagree")
        nhwc = not is_nchw
    return bool(nhwc)


# -- fronts: torch's forms and DTorch's (``scale=`` for ``weight=``, ``format=`` for batch_norm);
# dtorch.<name> is the nn.functional form, as DTorch's (torch.batch_norm orders its parameters
# otherwise: docs/ops.md)


def _softmax_front(name: str):
    def front(input, dim=None, _stacklevel=3, dtype=None):
        if isinstance(_stacklevel, torch.dtype):  # torch.softmax(x, dim, dtype), x.softmax(...)
            _stacklevel, dtype = 3, _stacklevel
        return issue(name, (input,), (dim, _stacklevel, dtype))

    front.__name__ = front.__qualname__ = name
    front.__doc__ = (f"``torch.nn.functional.{name}`` (and ``torch.{name}(input, dim, dtype)``, "
                     f"``Tensor.{name}``): along ``dim``, which must be whole on each device.")
    return front


def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-05, *, scale=None):
    """``torch.nn.functional.layer_norm``; DTorch's ``scale=`` is ``weight=``, and its
    ``normalized_shape`` may be one int."""
    weight = either("layer_norm", "weight", weight, "scale", scale)
    return issue("layer_norm", (input, weight, bias), (_shape(normalized_shape), eps))


def rms_norm(input, normalized_shape, weight=None, eps=None, *, scale=None):
    """``torch.nn.functional.rms_norm`` (``eps=None``: torch's, the dtype's epsilon); DTorch
    passes ``eps`` (its default is 1e-5), may call the weight ``scale=`` and give
    ``normalized_shape`` as one int."""
    weight = either("rms_norm", "weight", weight, "scale", scale)
    return issue("rms_norm", (input, weight), (_shape(normalized_shape), eps))


def _shape(normalized_shape):
    """DTorch's int ``normalized_shape`` as torch's one-dim tuple."""
    is_int = isinstance(normalized_shape, int) and not isinstance(normalized_shape, bool)
    return (normalized_shape,) if is_int else normalized_shape


def group_norm(input, num_groups, weight=None, bias=None, eps=1e-05, *, scale=None):
    """``torch.nn.functional.group_norm``; DTorch's ``scale=`` is ``weight=``."""
    weight = either("group_norm", "weight", weight, "scale", scale)
    return issue("group_norm", (input, weight, bias), (num_groups, eps))


def batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False,
               momentum=0.1, eps=1e-05, format=None, *, scale=None, is_nchw=None):
    """``torch.nn.functional.batch_norm`` and DTorch's form: ``scale=`` is ``weight=``;
    ``format=OperatorFormat.nhwc`` (or ``is_nchw=False``): the channel dim last.

    >>> import dtorch
    >>> from dtorch.type import OperatorFormat
    >>> mesh = dtorch.DeviceMesh("cpu", [0, 1])
    >>> x = dtorch.ones((2, 4, 4, 3), device_mesh=mesh, placements=[dtorch.Shard(0)])
    >>> mean, var = dtorch.zeros(3, device_mesh=mesh), dtorch.ones(3, device_mesh=mesh)
    >>> dtorch.batch_norm(x, mean, var, format=OperatorFormat.nhwc, eps=0.0).placements
    [Shard(dim=0)]
    """
    if isinstance(format, bool):  # torch.batch_norm(input, weight, bias, mean, var, ...,
        raise TypeError(  # cudnn_enabled)
            "dtorch.batch_norm takes torch.nn.functional.batch_norm's parameters (input, "
            "running_mean, running_var, weight, bias, training, momentum, eps), as DTorch's; "
            "torch.batch_norm's order (weight and bias first, cudnn_enabled last) is not taken")
    weight = either("batch_norm", "weight", weight, "scale", scale)
    nhwc = channels_last("batch_norm", format, is_nchw)
    x = issue("movedim", (input,), (-1, 1)) if nhwc else input
    if training:
        out = batch_statistics(x, running_mean, running_var, weight, bias, momentum, eps)
    else:
        out = issue("batch_norm", (x, running_mean, running_var, weight, bias),
                    (False, momentum, eps))
    return issue("movedim", (out,), (1, -1)) if nhwc else out


def batch_statistics(x, running_mean, running_var, weight, bias, momentum, eps):
    """torch's training-mode batch norm of ``x`` (channels at dim 1): normalised by the batch's
    mean and biased variance over every other dim. A batch sharded over devices is reduced
    across them, so the statistics are the global batch's, as on one device (what torch's
    ``SyncBatchNorm`` gives data parallelism). Running statistics, where given, move towards
    the batch's (its unbiased variance) by ``momentum`` (a number, or a 0-dim tensor: the
    cumulative average of ``momentum=None``), in place and outside autograd, torch's update."""
    dims = (0, *range(2, x.dim()))
    n = x.shape[0] * math.prod(x.shape[2:])
    if n <= 1:
        raise ValueError(f"Expected more than 1 value per channel when training, got input "
                         f"size {torch.Size(x.shape)}")
    mean = x.mean(dims, keepdim=True)
    centred = x - mean
    var = (centred * centred).mean(dims, keepdim=True)
    with torch.no_grad():
        if running_mean is not None:
            running_mean.copy_(running_mean * (1 - momentum) + mean.reshape(-1) * momentum)
        if running_var is not None:
            unbiased = var.reshape(-1) * (n / (n - 1))
            running_var.copy_(running_var * (1 - momentum) + unbiased * momentum)
    out = centred * (var + eps).rsqrt()
    per_channel = (-1,) + (1,) * (x.dim() - 2)
    if weight is not None:
        out = out * weight.reshape(per_channel)
    if bias is not None:
        out = out + bias.reshape(per_channel)
    return out


FRONTS = {"softmax": _softmax_front("softmax"), "log_softmax": _softmax_front("log_softmax"),
          "layer_norm": layer_norm, "rms_norm": rms_norm, "group_norm": group_norm,
          "batch_norm": batch_norm}

for name, signature, kernel, checked, batch_dims, channel in MIXING:
    register(OpDef(name, signature, kernel, mixing_rule(batch_dims, channel),
                   meta=probed_mixing(checked or kernel, batch_dims), functional=True,
                   methods=(name,) if name.endswith("softmax") else (), front=FRONTS[name]))


# -- dropout --------------------------------------------------------------------------------------
# Each device draws the keep-mask of its own block from a generator seeded by the call's seed and
# the block's offsets: shards draw independent values, and replicas (same offsets) draw the same
# ones, so a Replicate result stays replicated. Values therefore differ from torch's for the same
# seed, and depend on the layout. The mask is the same on every device of a Partial mesh dim, and
# mask * sum x_i / (1-p) = sum (mask * x_i / (1-p)): Partial sum and avg pass.


def block_seed(seed: int, offsets) -> int:
    return hash((seed, *offsets)) & (2**63 - 1)  # hashes of int tuples are not salted


def _dropout(ctx, input, seed, p=0.5, training=True, inplace=False):
    """torch's formula (``input * bernoulli(1-p) / (1-p)``, ``input * 0`` for p=1); with
    training=False the input itself, as torch (the entry is flagged as a possible view)."""
    if not training:
        return input
    if p == 1:
        noise = torch.zeros((), dtype=input.dtype, device=input.device)
    else:
        offsets = ctx.out_offsets
        if None in offsets:  # a sub-split block has no one offset: its coordinate tells it apart
            # (and None must not be hashed: its hash is its address, another in every process)
            offsets = (*(-1 if o is None else o for o in offsets), *ctx.out_coord)
        g = torch.Generator(device=input.device).manual_seed(block_seed(seed, offsets))
        noise = torch.empty_like(input).bernoulli_(1 - p, generator=g).div_(1 - p)
    return input.mul_(noise) if inplace else input * noise


def dropout(input, p=0.5, training=True, inplace=False):
    """``torch.nn.functional.dropout`` (also ``dtorch.dropout``): zeroes each element with
    probability ``p`` and scales the rest by ``1 / (1 - p)`` when ``training``; the identity
    otherwise. Draws come from dtorch's seed (``dtorch.manual_seed``), each device for its own
    block, so the values differ from torch's for the same seed.

    >>> import dtorch, torch
    >>> x = dtorch.ones((4, 3), device_mesh=dtorch.DeviceMesh("cpu", [0, 1]),
    ...                 placements=[dtorch.Shard(0)])
    >>> sorted(set(dtorch.nn.functional.dropout(x, 0.5).to_torch().flatten().tolist()) - {0.0})
    [2.0]
    """
    if not 0 <= p <= 1:  # before the draw: a call that fails leaves the seed as it was
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    seed = fresh_seed() if training else 0
    return issue("dropout", (input, seed), (p, training, inplace))


# the seed operand travels by value: the front draws it (dtorch.manual_seed seeds the draws)
register(OpDef("dropout", "dropout(input: Tensor, seed: Tensor, p=0.5, training=True, "
               "inplace=False)", _dropout,
               pointwise(linear=(0,), partials=LINEAR_PARTIALS),
               meta=lambda input, seed, p, training, inplace: F.dropout(input, p, training),
               uses_context=True, functional=True, flags=VIEW, front=dropout))


# -- DTorch's fused ops (diffusers' blocks), each written once over a namespace of ``steps``:
# dtorch's fronts (``STEPS``: each step keeps its own placement rule, so the fused op takes every
# layout its steps take) or torch.nn.functional (the default: ``dtorch.compiled_op``, the torch
# reference of what the hosts compute, step by step)


def silu_linear_chunk(emb, linear_weight, linear_bias, chunk_size, *, steps=F) -> list:
    """``silu(emb) @ linear_weight.T + linear_bias`` cut into ``chunk_size`` pieces along dim
    1 (diffusers' AdaLayerNorm modulation), as a list."""
    pieces = steps.linear(steps.silu(emb), linear_weight, linear_bias).chunk(chunk_size, 1)
    return list(pieces) if isinstance(pieces, (tuple, list)) else [pieces]


def layer_norm_mul_add(x, scale, shift, normalized_shape, norm_eps=1e-05, norm_scale=None,
                       norm_bias=None, *, steps=F):
    """``layer_norm(x) * (1 + scale[:, None]) + shift[:, None]`` (diffusers'
    AdaLayerNormZero: ``scale`` and ``shift`` of shape (batch, dim) modulate each sample of
    ``x`` (batch, tokens, dim)); ``norm_scale``/``norm_bias`` are the layer norm's weight and
    bias."""
    normed = steps.layer_norm(x, _shape(normalized_shape), norm_scale, norm_bias, norm_eps)
    return normed * (scale.unsqueeze(1) + 1) + shift.unsqueeze(1)


# the steps as dtorch's operators
STEPS = SimpleNamespace(silu=lambda x: issue("silu", (x,), (False,)),
                        linear=lambda x, weight, bias=None: issue("linear", (x, weight, bias), ()),
                        layer_norm=layer_norm)


def _silu_linear_chunk(emb, linear_weight, linear_bias, chunk_size):
    """DTorch's ``silu(emb) @ linear_weight.T + linear_bias``, cut into ``chunk_size`` pieces
    along dim 1 (diffusers' AdaLayerNorm modulation), as a list.

    >>> import dtorch
    >>> mesh = dtorch.DeviceMesh("cpu", [0, 1])
    >>> emb, w = dtorch.ones((2, 4), device_mesh=mesh), dtorch.ones((6, 4), device_mesh=mesh)
    >>> [p.shape for p in dtorch.nn.functional._silu_linear_chunk(emb, w, None, 3)]
    [torch.Size([2, 2]), torch.Size([2, 2]), torch.Size([2, 2])]
    """
    return silu_linear_chunk(emb, linear_weight, linear_bias, chunk_size, steps=STEPS)


def _layer_norm_mul_add(x, scale, shift, normalized_shape, norm_eps=1e-05, norm_scale=None,
                        norm_bias=None):
    """DTorch's ``layer_norm(x) * (1 + scale[:, None]) + shift[:, None]`` (see
    ``layer_norm_mul_add``).

    >>> import dtorch
    >>> mesh = dtorch.DeviceMesh("cpu", [0, 1])
    >>> x = dtorch.ones((2, 3, 4), device_mesh=mesh, placements=[dtorch.Shard(1)])
    >>> s = dtorch.ones((2, 4), device_mesh=mesh)
    >>> dtorch.nn.functional._layer_norm_mul_add(x, s, s, (4,)).to_torch().unique().tolist()
    [1.0]
    """
    return layer_norm_mul_add(x, scale, shift, normalized_shape, norm_eps, norm_scale,
                              norm_bias, steps=STEPS)


FUSED = [
    ("_silu_linear_chunk", "emb: Tensor, linear_weight: Tensor, linear_bias: Tensor, chunk_size",
     _silu_linear_chunk),
    ("_layer_norm_mul_add", "x: Tensor, scale: Tensor, shift: Tensor, normalized_shape, "
     "norm_eps=1e-05, norm_scale: Tensor = None, norm_bias: Tensor = None", _layer_norm_mul_add),
]
for name, params, front in FUSED:
    register(OpDef(name, f"{name}({params})", None, None, front=front, function=False,
                   functional=True))
