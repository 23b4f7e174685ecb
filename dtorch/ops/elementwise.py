"""Elementwise operators: unary math, broadcasting binary ops, comparisons, clamp, where,
masks, lerp/addcmul/addcdiv, in-place forms, casts.

Placement rules come from ``rules.pointwise``: a sharded output dim shards the inputs' matching
dims. Which Partials pass through depends on the algebra, stated per group below. Ops with several
operands chunk a Replicate operand to match a Shard one on their own (local, no communication);
nothing else redistributes automatically. ``masked_scatter`` takes Replicate operands only.

>>> import dtorch, torch
>>> x = dtorch.from_torch(torch.tensor([[-2., 0.5], [3., -1.]]), dtorch.DeviceMesh("cpu", [0, 1]),
...                       [dtorch.Shard(0)])
>>> x.clamp(-1, 1).where(x > 0, 0.0).to_torch()
tensor([[0.0000, 0.5000],
        [1.0000, 0.0000]])
"""

from __future__ import annotations

import torch

from .meta import probed
from .registry import INPLACE, VIEW, OpDef, register
from ..placement import Partial
from .rules import (
    ALL_PARTIALS,
    LINEAR_PARTIALS,
    R,
    exact_cast,
    expand,
    pointwise,
    pointwise_rows,
    replicate_only,
)

T = torch.Tensor

# -- unary ----------------------------------------------------------------------------------------
# Each group's Partials, by its algebra:
#   neg is linear: -(sum x_i) = sum(-x_i), so a Partial sum or avg stays Partial;
#   non-decreasing functions defined on the whole line: f(max_i x_i) = max_i f(x_i) (min alike),
#     so Partial(max) and Partial(min) pass. Functions defined on part of the line (log, sqrt,
#     asin) are left out: one device's out-of-domain contribution would be NaN, which max keeps;
#   the rest are not linear nor monotone: a Partial input must be reduced first.
MAX_MIN = (Partial("max"), Partial("min"))
UNARY_PARTIALS = {"neg": LINEAR_PARTIALS}
MONOTONE_UNARY = ("exp", "expm1", "floor", "ceil", "trunc", "atan", "sinh", "tanh", "erf",
                  "sigmoid", "sign")
NONLINEAR_UNARY = ("abs", "log", "log1p", "log2", "log10", "sqrt", "rsqrt", "square", "reciprocal",
                   "sin", "cos", "tan", "asin", "acos", "cosh", "isinf", "isnan", "isfinite",
                   "logical_not", "bitwise_not")
UNARY_PARTIALS.update({name: MAX_MIN for name in MONOTONE_UNARY})
UNARY_PARTIALS.update({name: () for name in NONLINEAR_UNARY})
UNARY_METHODS = {"neg": ("__neg__",), "abs": ("__abs__",), "bitwise_not": ("__invert__",)}
FUNCTIONAL = ("sigmoid", "tanh")  # torch.nn.functional has them too, with torch's signature


def _unary(name: str, partials, tail: str = "", kernel=None, inplace_kernel=None) -> None:
    """``name`` and, where torch has it, its in-place form ``name_`` (a method, as torch's)."""
    rule = pointwise(linear=(0,), partials=partials)
    kernel = kernel or getattr(torch, name)
    register(OpDef(name, f"{name}(input: Tensor{tail})", kernel, rule, meta=probed(kernel),
                   methods=(name,) + UNARY_METHODS.get(name, ()),
                   functional=name in FUNCTIONAL))
    if hasattr(T, name + "_"):
        inplace_kernel = inplace_kernel or getattr(T, name + "_")
        register(OpDef(name + "_", f"{name}_(input: Tensor{tail})", inplace_kernel, rule,
                       meta=probed(inplace_kernel), methods=(name + "_",), function=False,
                       flags=INPLACE))


for _name, _partials in UNARY_PARTIALS.items():
    _unary(_name, _partials)


def _round(input, decimals=0):
    """torch.round(x, decimals=0) refuses integer tensors where torch.round(x) does not."""
    return torch.round(input, decimals=decimals) if decimals else torch.round(input)


def _round_(input, decimals=0):
    return input.round_(decimals=decimals) if decimals else input.round_()


# round scales by a positive 10**decimals, rounds and scales back: non-decreasing too
_unary("round", MAX_MIN, ", *, decimals=0", _round, _round_)
# copies leave every element as it is, so every Partial passes (max and min included).
# contiguous returns its input when it already is contiguous: flagged as a view (may alias).
register(OpDef("clone", "clone(input: Tensor)", torch.clone,
               pointwise(linear=(0,), partials=ALL_PARTIALS), methods=("clone",)))
register(OpDef("contiguous", "contiguous(input: Tensor)", T.contiguous,
               pointwise(linear=(0,), partials=ALL_PARTIALS), methods=("contiguous",),
               function=False, flags=VIEW))

# -- binary ---------------------------------------------------------------------------------------
# Every binary op chunks a Replicate operand to match a Shard one (auto_chunk). Partials:
#   additive ops: sum a_i + sum b_i = sum (a_i + b_i), so P + P = P (not with a scalar: P + 1
#     would add 1 on every device);
#   mul is linear in each operand: (sum a_i) * b = sum (a_i * b), so P * R = P and R * P = P;
#   div is linear in its numerator, unless the quotient is rounded (floor(a/c) + floor(b/c) is
#     not floor((a+b)/c));
#   maximum is associative and idempotent: max(max_i a_i, max_i b_i) = max_i max(a_i, b_i) and
#     max(max_i a_i, b) = max_i max(a_i, b), so Partial(max) passes on either or both operands
#     (minimum alike, with Partial(min));
#   the rest are not linear.
ADDITIVE = pointwise(linear="all", auto_chunk=True)
MULTIPLICATIVE = pointwise(linear=(0, 1), auto_chunk=True)
NONLINEAR = pointwise(auto_chunk=True)


def _div_rule(call):
    linear = (0,) if call.static.get("rounding_mode") is None else ()
    return expand(call, pointwise_rows(call, linear=linear), auto_chunk=True)


def extremum_rule(reduce_op: str):
    partials = (Partial(reduce_op),)

    def rule(call):
        rows = (pointwise_rows(call, linear="all", partials=partials)
                + pointwise_rows(call, linear=(0, 1), partials=partials))
        return expand(call, rows, auto_chunk=True)

    return rule


# (name, signature tail, kernel, placement rule, methods, in-place methods: the first names the
# entry). Reflected forms (``2 - x``) are entries of their own unless the op commutes.
BINARY = [
    ("add", ", *, alpha=1", torch.add, ADDITIVE, ("add", "__add__", "__radd__"),
     ("add_", "__iadd__")),
    ("sub", ", *, alpha=1", torch.sub, ADDITIVE, ("sub", "__sub__"), ("sub_", "__isub__")),
    ("rsub", ", *, alpha=1", torch.rsub, ADDITIVE, ("__rsub__",), ()),
    ("mul", "", torch.mul, MULTIPLICATIVE, ("mul", "__mul__", "__rmul__"), ("mul_", "__imul__")),
    ("div", ", *, rounding_mode=None", torch.div, _div_rule, ("div", "__truediv__"),
     ("div_", "__itruediv__")),
    ("rdiv", "", T.__rtruediv__, NONLINEAR, ("__rtruediv__",), ()),
    ("pow", "", torch.pow, NONLINEAR, ("pow", "__pow__"), ("pow_", "__ipow__")),
    ("rpow", "", T.__rpow__, NONLINEAR, ("__rpow__",), ()),
    ("floor_divide", "", torch.floor_divide, NONLINEAR, ("floor_divide", "__floordiv__"),
     ("floor_divide_", "__ifloordiv__")),
    ("rfloordiv", "", T.__rfloordiv__, NONLINEAR, ("__rfloordiv__",), ()),
    ("remainder", "", torch.remainder, NONLINEAR, ("remainder", "__mod__"),
     ("remainder_", "__imod__")),
    ("rmod", "", T.__rmod__, NONLINEAR, ("__rmod__",), ()),
    ("fmod", "", torch.fmod, NONLINEAR, ("fmod",), ("fmod_",)),
    ("atan2", "", torch.atan2, NONLINEAR, ("atan2",), ("atan2_",)),
    ("maximum", "", torch.maximum, extremum_rule("max"), ("maximum",), ()),
    ("minimum", "", torch.minimum, extremum_rule("min"), ("minimum",), ()),
    ("logical_and", "", torch.logical_and, NONLINEAR, ("logical_and",), ("logical_and_",)),
    ("logical_or", "", torch.logical_or, NONLINEAR, ("logical_or",), ("logical_or_",)),
    ("logical_xor", "", torch.logical_xor, NONLINEAR, ("logical_xor",), ("logical_xor_",)),
    # bitwise ops commute, so ``2 & x`` is ``x & 2``
    ("bitwise_and", "", torch.bitwise_and, NONLINEAR, ("bitwise_and", "__and__", "__rand__"),
     ("bitwise_and_", "__iand__")),
    ("bitwise_or", "", torch.bitwise_or, NONLINEAR, ("bitwise_or", "__or__", "__ror__"),
     ("bitwise_or_", "__ior__")),
    ("bitwise_xor", "", torch.bitwise_xor, NONLINEAR, ("bitwise_xor", "__xor__", "__rxor__"),
     ("bitwise_xor_", "__ixor__")),
]
COMPARISONS = {"eq": "__eq__", "ne": "__ne__", "lt": "__lt__", "le": "__le__", "gt": "__gt__",
               "ge": "__ge__"}

for name, tail, kernel, rule, methods, inplace in BINARY:
    register(OpDef(name, f"{name}(input: Tensor, other: Tensor{tail})", kernel, rule,
                   meta=probed(kernel), methods=methods,
                   function=not name.startswith("r") or name == "remainder"))
    if inplace:
        register(OpDef(inplace[0], f"{inplace[0]}(input: Tensor, other: Tensor{tail})",
                       getattr(T, inplace[0]), rule, meta=probed(getattr(T, inplace[0])),
                       methods=inplace, function=False, flags=INPLACE))
for name, dunder in COMPARISONS.items():
    register(OpDef(name, f"{name}(input: Tensor, other: Tensor)", getattr(torch, name), NONLINEAR,
                   meta=probed(getattr(torch, name)), methods=(name, dunder)))

# -- selection and fused ops -----------------------------------------------------------------------
# Shards follow the broadcast output as for binary ops (a Replicate operand is chunked locally).
# Partials pass where the op is linear jointly in a group of operands while the others are
# Replicate: f(sum a_i, sum b_i, c) = sum f(a_i, b_i, c). A Python number inside the group breaks
# it (it would count once per device), so such a call must reduce first.


def joint_rows(call, groups, partials=LINEAR_PARTIALS) -> list:
    tensor_pos = [k for k, s in enumerate(call.inputs) if not isinstance(s, type)]
    rows = []
    for group in groups:
        if any(isinstance(call.inputs[k], type) for k in group):
            continue
        for p in partials:
            rows.append(((p,), tuple(p if k in group else R for k in tensor_pos)))
    return rows


def joint_linear(*groups, partials=LINEAR_PARTIALS):
    def rule(call):
        rows = pointwise_rows(call) + joint_rows(call, groups, partials)
        return expand(call, rows, auto_chunk=True)

    return rule


# (name, signature, rule, Tensor methods; the in-place form is "<name>_" where torch has one)
FUSED = [
    # clamp is non-decreasing in its input for fixed bounds: min(max(max_i x_i, lo), hi) =
    # max_i min(max(x_i, lo), hi), so Partial(max) and Partial(min) of the input pass
    ("clamp", "clamp(input: Tensor, min: Tensor = None, max: Tensor = None)",
     joint_linear((0,), partials=MAX_MIN), ("clamp",)),
    ("clip", "clip(input: Tensor, min: Tensor = None, max: Tensor = None)",
     joint_linear((0,), partials=MAX_MIN), ("clip",)),
    # where(c, sum a_i, sum b_i) = sum where(c, a_i, b_i)
    ("where", "where(condition: Tensor, input: Tensor, other: Tensor)", joint_linear((1, 2)),
     ()),
    # the filled value is chosen per element, so input and a tensor value are jointly linear
    ("masked_fill", "masked_fill(input: Tensor, mask: Tensor, value: Tensor)",
     joint_linear((0, 2)), ("masked_fill",)),
    # input + w * (end - input) is linear in (input, end) for a fixed weight
    ("lerp", "lerp(input: Tensor, end: Tensor, weight: Tensor)", joint_linear((0, 1)),
     ("lerp",)),
    # input + v * t1 * t2 is linear in (input, t1) and in (input, t2); input + v * t1 / t2 only
    # in (input, t1)
    ("addcmul", "addcmul(input: Tensor, tensor1: Tensor, tensor2: Tensor, *, value=1)",
     joint_linear((0, 1), (0, 2)), ("addcmul",)),
    ("addcdiv", "addcdiv(input: Tensor, tensor1: Tensor, tensor2: Tensor, *, value=1)",
     joint_linear((0, 1)), ("addcdiv",)),
    # the k-th True of the mask (counted over the whole tensor) takes source[k]: a device cannot
    # know how many Trues precede its block, nor which part of source they consumed, without the
    # whole mask and source, so every operand must be Replicate
    ("masked_scatter", "masked_scatter(input: Tensor, mask: Tensor, source: Tensor)",
     replicate_only, ("masked_scatter",)),
]

for name, signature, rule, methods in FUSED:
    kernel = getattr(torch, name, None) or getattr(T, name)
    register(OpDef(name, signature, kernel, rule, meta=probed(kernel), methods=methods,
                   function=hasattr(torch, name)))
    if hasattr(T, name + "_"):
        kernel = getattr(T, name + "_")
        register(OpDef(name + "_", signature.replace(name, name + "_", 1), kernel, rule,
                       meta=probed(kernel), methods=(name + "_",), function=False,
                       flags=INPLACE))
# x.where(condition, other) takes its operands in another order than torch.where
register(OpDef("where_method", "where_method(input: Tensor, condition: Tensor, other: Tensor)",
               T.where, joint_linear((0, 2)), meta=probed(T.where), methods=("where",),
               function=False))

# -- casts ----------------------------------------------------------------------------------------
# A Partial sum passes a cast only where every contribution converts exactly (``exact_cast``:
# float16 -> float32, float32 -> float64, int16 -> float32, ...): a narrowing cast would round each
# contribution before the sum (float32 -> bfloat16 then misses torch's value by percents where
# they cancel); a cast to an integer or bool type truncates; a bool sum saturates.
CASTS = {"float": torch.float32, "double": torch.float64, "half": torch.float16,
         "bfloat16": torch.bfloat16, "long": torch.int64, "int": torch.int32, "bool": torch.bool}


def _cast_rule(call):
    src, dst = getattr(torch, call.tensors[0].dtype), call.outs[0][1]
    linear = (0,) if exact_cast(src, dst) and (dst.is_floating_point or dst.is_complex) else ()
    return expand(call, pointwise_rows(call, linear=linear))


# a cast to the input's own dtype returns the input itself, as in torch: flagged as a view
for name in CASTS:
    register(OpDef(name, f"{name}(input: Tensor)", getattr(T, name), _cast_rule, methods=(name,),
                   function=False, flags=VIEW))
register(OpDef("to", "to(input: Tensor, dtype, non_blocking=False, copy=False)", T.to, _cast_rule,
               methods=("to",), function=False, flags=VIEW))
