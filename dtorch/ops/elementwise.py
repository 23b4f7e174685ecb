"""Elementwise operators: unary math, broadcasting binary ops, comparisons, in-place forms, casts.

Placement rules come from ``rules.pointwise``: a sharded output dim shards the inputs' matching
dims. Which Partials pass through depends on the algebra, stated per group below. Binary ops chunk
a Replicate operand to match a Shard one on their own (local, no communication); nothing else
redistributes automatically.
"""

from __future__ import annotations

import torch

from .registry import INPLACE, OpDef, register
from .rules import expand, pointwise, pointwise_rows

T = torch.Tensor

# -- unary ----------------------------------------------------------------------------------------
# neg is linear: -(sum x_i) = sum(-x_i), so a Partial sum stays Partial.
LINEAR_UNARY = {"neg": ("neg", "__neg__"), "clone": ("clone",)}
# the rest are not linear: a Partial input must be reduced first.
NONLINEAR_UNARY = ("abs", "exp", "log", "sqrt", "rsqrt", "sin", "cos", "tanh", "sigmoid", "relu")

for name, methods in LINEAR_UNARY.items():
    register(OpDef(name, f"{name}(input: Tensor)", getattr(torch, name), pointwise(linear=(0,)),
                   methods=methods))
for name in NONLINEAR_UNARY:
    register(OpDef(name, f"{name}(input: Tensor)", getattr(torch, name), pointwise(),
                   methods=(name,) + (("__abs__",) if name == "abs" else ())))
register(OpDef("contiguous", "contiguous(input: Tensor)", T.contiguous, pointwise(linear=(0,)),
               methods=("contiguous",), function=False))

# -- binary ---------------------------------------------------------------------------------------
# (name, signature tail, kernel, linear, methods, in-place name)
#   additive ops ("all"): sum a_i + sum b_i = sum (a_i + b_i), so P + P = P (not with a scalar);
#   mul is linear in each operand: (sum a_i) * b = sum (a_i * b), so P * R = P and R * P = P;
#   div is linear in its numerator only.
BINARY = [
    ("add", ", *, alpha=1", torch.add, "all", ("add", "__add__", "__radd__"), "add_"),
    ("sub", ", *, alpha=1", torch.sub, "all", ("sub", "__sub__"), "sub_"),
    ("rsub", ", *, alpha=1", torch.rsub, "all", ("__rsub__",), None),
    ("mul", "", torch.mul, (0, 1), ("mul", "__mul__", "__rmul__"), "mul_"),
    ("div", ", *, rounding_mode=None", torch.div, (0,), ("div", "__truediv__"), "div_"),
    ("rdiv", "", T.__rtruediv__, (), ("__rtruediv__",), None),
    ("pow", "", torch.pow, (), ("pow", "__pow__"), "pow_"),
    ("rpow", "", T.__rpow__, (), ("__rpow__",), None),
    ("floor_divide", "", torch.floor_divide, (), ("floor_divide", "__floordiv__"), None),
    ("rfloordiv", "", T.__rfloordiv__, (), ("__rfloordiv__",), None),
    ("remainder", "", torch.remainder, (), ("remainder", "__mod__"), None),
    ("maximum", "", torch.maximum, (), ("maximum",), None),
    ("minimum", "", torch.minimum, (), ("minimum",), None),
]
COMPARISONS = {"eq": "__eq__", "ne": "__ne__", "lt": "__lt__", "le": "__le__", "gt": "__gt__",
               "ge": "__ge__"}

for name, tail, kernel, linear, methods, inplace in BINARY:
    register(OpDef(name, f"{name}(input: Tensor, other: Tensor{tail})", kernel,
                   pointwise(linear=linear, auto_chunk=True), methods=methods,
                   function=not name.startswith("r") or name == "remainder"))
    if inplace:
        dunder = "__i" + methods[1][2:]
        register(OpDef(inplace, f"{inplace}(input: Tensor, other: Tensor{tail})",
                       getattr(T, inplace), pointwise(linear=linear, auto_chunk=True),
                       methods=(inplace, dunder), function=False, flags=INPLACE))
for name, dunder in COMPARISONS.items():
    register(OpDef(name, f"{name}(input: Tensor, other: Tensor)", getattr(torch, name),
                   pointwise(auto_chunk=True), methods=(name, dunder)))

# -- casts ----------------------------------------------------------------------------------------
# A cast to a floating dtype commutes with a sum up to rounding, so a Partial may pass; a cast to
# an integer or bool type does not (truncation), so it needs Replicate or Shard.
CASTS = {"float": torch.float32, "double": torch.float64, "half": torch.float16,
         "bfloat16": torch.bfloat16, "long": torch.int64, "int": torch.int32, "bool": torch.bool}


def _cast_rule(call):
    linear = (0,) if call.outs[0][1].is_floating_point else ()
    return expand(call, pointwise_rows(call, linear=linear))


for name in CASTS:
    register(OpDef(name, f"{name}(input: Tensor)", getattr(T, name), _cast_rule, methods=(name,),
                   function=False))
register(OpDef("to", "to(input: Tensor, dtype, non_blocking=False, copy=False)", T.to, _cast_rule,
               methods=("to",), function=False))
