"""Elementwise operators: unary math, broadcasting binary ops, comparisons, in-place forms, casts.

Placement rules come from ``rules.pointwise``: a sharded output dim shards the inputs' matching
dims. Which Partials pass through depends on the algebra, stated per group below. Binary ops chunk
a Replicate operand to match a Shard one on their own (local, no communication); nothing else
redistributes automatically.
"""

from __future__ import annotations

import torch

from .meta import probed
from .registry import INPLACE, VIEW, OpDef, register
from .rules import ALL_PARTIALS, expand, pointwise, pointwise_rows

T = torch.Tensor

# -- unary ----------------------------------------------------------------------------------------
# neg is linear: -(sum x_i) = sum(-x_i), so a Partial sum or avg stays Partial.
register(OpDef("neg", "neg(input: Tensor)", torch.neg, pointwise(linear=(0,)),
               meta=probed(torch.neg), methods=("neg", "__neg__")))
# the rest are not linear: a Partial input must be reduced first.
NONLINEAR_UNARY = ("abs", "exp", "log", "sqrt", "rsqrt", "sin", "cos", "tanh", "sigmoid", "relu")
for name in NONLINEAR_UNARY:
    register(OpDef(name, f"{name}(input: Tensor)", getattr(torch, name), pointwise(),
                   meta=probed(getattr(torch, name)),
                   methods=(name,) + (("__abs__",) if name == "abs" else ())))
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
#   the rest are not linear.
ADDITIVE = pointwise(linear="all", auto_chunk=True)
MULTIPLICATIVE = pointwise(linear=(0, 1), auto_chunk=True)
NONLINEAR = pointwise(auto_chunk=True)


def _div_rule(call):
    linear = (0,) if call.static.get("rounding_mode") is None else ()
    return expand(call, pointwise_rows(call, linear=linear), auto_chunk=True)


# (name, signature tail, kernel, placement rule, methods, in-place name)
BINARY = [
    ("add", ", *, alpha=1", torch.add, ADDITIVE, ("add", "__add__", "__radd__"), "add_"),
    ("sub", ", *, alpha=1", torch.sub, ADDITIVE, ("sub", "__sub__"), "sub_"),
    ("rsub", ", *, alpha=1", torch.rsub, ADDITIVE, ("__rsub__",), None),
    ("mul", "", torch.mul, MULTIPLICATIVE, ("mul", "__mul__", "__rmul__"), "mul_"),
    ("div", ", *, rounding_mode=None", torch.div, _div_rule, ("div", "__truediv__"), "div_"),
    ("rdiv", "", T.__rtruediv__, NONLINEAR, ("__rtruediv__",), None),
    ("pow", "", torch.pow, NONLINEAR, ("pow", "__pow__"), "pow_"),
    ("rpow", "", T.__rpow__, NONLINEAR, ("__rpow__",), None),
    ("floor_divide", "", torch.floor_divide, NONLINEAR, ("floor_divide", "__floordiv__"), None),
    ("rfloordiv", "", T.__rfloordiv__, NONLINEAR, ("__rfloordiv__",), None),
    ("remainder", "", torch.remainder, NONLINEAR, ("remainder", "__mod__"), None),
    ("maximum", "", torch.maximum, NONLINEAR, ("maximum",), None),
    ("minimum", "", torch.minimum, NONLINEAR, ("minimum",), None),
]
COMPARISONS = {"eq": "__eq__", "ne": "__ne__", "lt": "__lt__", "le": "__le__", "gt": "__gt__",
               "ge": "__ge__"}

for name, tail, kernel, rule, methods, inplace in BINARY:
    register(OpDef(name, f"{name}(input: Tensor, other: Tensor{tail})", kernel, rule,
                   meta=probed(kernel), methods=methods,
                   function=not name.startswith("r") or name == "remainder"))
    if inplace:
        dunder = "__i" + methods[1][2:]
        register(OpDef(inplace, f"{inplace}(input: Tensor, other: Tensor{tail})",
                       getattr(T, inplace), rule, meta=probed(getattr(T, inplace)),
                       methods=(inplace, dunder), function=False, flags=INPLACE))
for name, dunder in COMPARISONS.items():
    register(OpDef(name, f"{name}(input: Tensor, other: Tensor)", getattr(torch, name), NONLINEAR,
                   meta=probed(getattr(torch, name)), methods=(name, dunder)))

# -- casts ----------------------------------------------------------------------------------------
# A cast from a number to a floating dtype commutes with a sum up to rounding, so a Partial may
# pass; a cast to an integer or bool type does not (truncation), nor one from bool (a bool sum
# saturates: True + True is True).
CASTS = {"float": torch.float32, "double": torch.float64, "half": torch.float16,
         "bfloat16": torch.bfloat16, "long": torch.int64, "int": torch.int32, "bool": torch.bool}


def _cast_rule(call):
    linear = (0,) if call.outs[0][1].is_floating_point and call.tensors[0].dtype != "bool" else ()
    return expand(call, pointwise_rows(call, linear=linear))


# a cast to the input's own dtype returns the input itself, as in torch: flagged as a view
for name in CASTS:
    register(OpDef(name, f"{name}(input: Tensor)", getattr(T, name), _cast_rule, methods=(name,),
                   function=False, flags=VIEW))
register(OpDef("to", "to(input: Tensor, dtype, non_blocking=False, copy=False)", T.to, _cast_rule,
               methods=("to",), function=False, flags=VIEW))
