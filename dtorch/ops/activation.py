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

import torch
import torch.nn.functional as F

from ..placement import Partial, Shard
from .meta import probed
from .registry import INPLACE, VIEW, OpDef, register
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
]

for name, tail, partials, inplace in POINTWISE:
    rule = pointwise(linear=(0,), partials=partials)
    fn = getattr(F, name)
    register(OpDef(name, f"{name}(input: Tensor{tail})", fn, rule,
                   meta=probed(fn), methods=(name,) if hasattr(torch.Tensor, name) else (),
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
    """Inference only; the check runs in the metadata rule too, so it raises at the call."""
    if training:
        raise NotImplementedError(
            "dtorch.nn.functional.batch_norm: training=True is not supported yet (batch "
            "statistics over sharded dims and running-stat updates); use training=False")
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

for name, signature, kernel, checked, batch_dims, channel in MIXING:
    rule = mixing_rule(batch_dims, channel)
    # functional only: torch.softmax, torch.batch_norm and Tensor.softmax order their
    # parameters otherwise
    register(OpDef(name, signature, kernel, rule,
                   meta=probed_mixing(checked or kernel, batch_dims), function=False,
                   functional=True))


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
        g = torch.Generator(device=input.device).manual_seed(block_seed(seed, ctx.out_offsets))
        noise = torch.empty_like(input).bernoulli_(1 - p, generator=g).div_(1 - p)
    return input.mul_(noise) if inplace else input * noise


register(OpDef("dropout", "dropout(input: Tensor, seed: Tensor, p=0.5, training=True, "
               "inplace=False)", _dropout,
               pointwise(linear=(0,), partials=LINEAR_PARTIALS),
               meta=lambda input, seed, p, training, inplace: F.dropout(input, p, training),
               uses_context=True, function=False, flags=VIEW,
               doc="Use dtorch.nn.functional.dropout, which draws the seed operand."))
