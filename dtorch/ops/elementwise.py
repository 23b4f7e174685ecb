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
from .registry import INPLACE, VIEW, OpDef, issue, register
from ..placement import Partial, Shard
from .rules import (
    ALL_PARTIALS,
    LINEAR_PARTIALS,
    Placed,
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
def clone(input, *, memory_format=None):
    """``torch.clone``: a copy of each block. A block's strides are not the program's to see, so
    ``memory_format`` may be torch's preserve or contiguous format (HF's generate passes one)."""
    if memory_format not in (None, torch.preserve_format, torch.contiguous_format):
        raise NotImplementedError(f"dtorch.clone: memory_format={memory_format} is not "
                                  f"supported (a block is contiguous)")
    return issue("clone", (input,), ())


register(OpDef("clone", "clone(input: Tensor)", torch.clone,
               pointwise(linear=(0,), partials=ALL_PARTIALS), methods=("clone",), front=clone))
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
# (operator, torch's other name: a function and a method, as DTorch's greater ... less_equal)
COMPARISONS = {"eq": ("__eq__", ()), "ne": ("__ne__", ("not_equal",)),
               "lt": ("__lt__", ("less",)), "le": ("__le__", ("less_equal",)),
               "gt": ("__gt__", ("greater",)), "ge": ("__ge__", ("greater_equal",))}

for name, tail, kernel, rule, methods, inplace in BINARY:
    register(OpDef(name, f"{name}(input: Tensor, other: Tensor{tail})", kernel, rule,
                   meta=probed(kernel), methods=methods,
                   function=not name.startswith("r") or name == "remainder"))
    if inplace:
        register(OpDef(inplace[0], f"{inplace[0]}(input: Tensor, other: Tensor{tail})",
                       getattr(T, inplace[0]), rule, meta=probed(getattr(T, inplace[0])),
                       methods=inplace, function=False, flags=INPLACE))
for name, (dunder, aliases) in COMPARISONS.items():
    register(OpDef(name, f"{name}(input: Tensor, other: Tensor)", getattr(torch, name), NONLINEAR,
                   meta=probed(getattr(torch, name)), methods=(name, dunder), aliases=aliases))

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

# -- rotary embedding (DTorch's ``_apply_rotary_emb``, diffusers' ``apply_rotary_emb``) ----------
# x * cos + rotate(x) * sin, computed in float32 and cast back to x's dtype. A rotation mixes
# the pairs (2i, 2i + 1) of the last dim (``use_real_unbind_dim=-1``) or its two halves (-2), so
# the last dim must be whole; every other dim shards as in a broadcasting op (cos and sin, of
# shape (sequence, dim) for x (batch, heads, sequence, dim), shard along with x's sequence, a
# Replicate one chunked locally: DTorch's automatic R -> S of the freqs). Linear in x for fixed
# freqs: a Partial x with Replicate freqs stays Partial, in float32 only (other dtypes round
# each contribution in the casts).


def _apply_rotary(x, cos, sin, use_real=True, use_real_unbind_dim=-1):
    if not use_real:
        raise NotImplementedError("_apply_rotary_emb: use_real=False (complex freqs) is not "
                                  "supported; pass freqs_cis=[cos, sin] with use_real=True")
    cos, sin = cos[None, None], sin[None, None]
    half = x.shape[-1] // 2  # (not -1: a device's block may be empty)
    if use_real_unbind_dim == -1:  # flux, cogvideox, hunyuan-dit
        real, imag = x.reshape(*x.shape[:-1], half, 2).unbind(-1)
        rotated = torch.stack([-imag, real], dim=-1).flatten(-2)
    elif use_real_unbind_dim == -2:  # stable audio
        real, imag = x.reshape(*x.shape[:-1], 2, half).unbind(-2)
        rotated = torch.cat([-imag, real], dim=-1)
    else:
        raise ValueError(f"`use_real_unbind_dim={use_real_unbind_dim}` but should be -1 or -2.")
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def rotary_rule(call):
    last = Shard(len(call.outs[0][0]) - 1)
    linear = (0,) if all(s.dtype == "float32" for s in call.tensors) else ()
    rows = [row for row in pointwise_rows(call, linear=linear) if row[0][0] != last]
    return expand(call, rows, auto_chunk=True)


def _apply_rotary_emb(x, freqs_cis, use_real=True, use_real_unbind_dim=-1):
    """DTorch's rotary embedding, diffusers' ``apply_rotary_emb``: ``freqs_cis`` is
    ``[cos, sin]`` (exactly two, else ValueError), each (sequence, dim) for ``x`` of shape
    (batch, heads, sequence, dim); ``use_real_unbind_dim`` -1 rotates pairs, -2 halves.

    >>> import dtorch, torch
    >>> mesh = dtorch.DeviceMesh("cpu", [0, 1])
    >>> x = dtorch.ones((1, 2, 4, 6), device_mesh=mesh, placements=[dtorch.Shard(2)])
    >>> cos, sin = dtorch.ones((4, 6), device_mesh=mesh), dtorch.zeros((4, 6), device_mesh=mesh)
    >>> y = dtorch.nn.functional._apply_rotary_emb(x, [cos, sin])   # cos, sin chunked to S(0)
    >>> y.placements, torch.equal(y.to_torch(), torch.ones(1, 2, 4, 6))
    ([Shard(dim=2)], True)
    """
    freqs = list(freqs_cis) if isinstance(freqs_cis, (list, tuple)) else [freqs_cis]
    if len(freqs) != 2:
        raise ValueError("Size of freqsCis must be two")
    return issue("_apply_rotary_emb", (x, *freqs), (use_real, use_real_unbind_dim))


register(OpDef("_apply_rotary_emb", "_apply_rotary_emb(x: Tensor, cos: Tensor, sin: Tensor, "
               "use_real=True, use_real_unbind_dim=-1)", _apply_rotary, rotary_rule,
               front=_apply_rotary_emb, function=False, functional=True))

# -- casts ----------------------------------------------------------------------------------------
# A Partial sum passes a cast only where every contribution converts exactly (``exact_cast``:
# float16 -> float32, float32 -> float64, int16 -> float32, ...): a narrowing cast would round each
# contribution before the sum (float32 -> bfloat16 then misses torch's value by percents where
# they cancel); a cast to an integer or bool type truncates; a bool sum saturates.
CASTS = {"float": torch.float32, "double": torch.float64, "half": torch.float16,
         "bfloat16": torch.bfloat16, "long": torch.int64, "int": torch.int32, "short": torch.int16,
         "char": torch.int8, "byte": torch.uint8, "bool": torch.bool}


def cast_rule(call):
    src, dst = getattr(torch, call.tensors[0].dtype), call.outs[0][1]
    linear = (0,) if exact_cast(src, dst) and (dst.is_floating_point or dst.is_complex) else ()
    return expand(call, pointwise_rows(call, linear=linear))


# a cast to the input's own dtype returns the input itself, as in torch: flagged as a view
for name in CASTS:
    register(OpDef(name, f"{name}(input: Tensor)", getattr(T, name), cast_rule, methods=(name,),
                   function=False, flags=VIEW))
# (``to`` is the cast with a front that also moves: ops/conversion.py)


# -- cpu, cuda: the device type is the mesh's ------------------------------------------------------
# A tensor lives on a mesh of one device type; moving it to another type is a redistribute onto
# a mesh of that type, which is not there yet. So, as torch returns a tensor already on the
# device itself, these return the input on a mesh of their type and raise otherwise.


def _device_type_error(input, method: str, target: str) -> NotImplementedError:
    return NotImplementedError(
        f"dtorch.Tensor.{method}(): this tensor lives on a {input.device_mesh.device_type} mesh, "
        f"and moving a tensor between device types is not supported yet (it will be "
        f"x.redistribute(device_mesh=<a {target} DeviceMesh>, placements=x.placements)); build "
        f"it on a {target} mesh (dtorch.DeviceMesh({target!r}, ids)), or read its value with "
        f"x.to_torch(), a CPU torch.Tensor")


def cpu(input, memory_format=torch.preserve_format):
    """``x.cpu()``: ``x`` itself on a CPU mesh (torch returns a CPU tensor itself); on a CUDA
    mesh, NotImplementedError (read the value with ``x.to_torch()``).

    >>> import dtorch
    >>> x = dtorch.ones(3, device_mesh=dtorch.DeviceMesh("cpu", [0, 1]))
    >>> x.cpu() is x
    True
    """
    if input.device_mesh.device_type != "cpu":
        raise _device_type_error(input, "cpu", "cpu")
    return input


def cuda(input, device=None, non_blocking=False, memory_format=torch.preserve_format):
    """``x.cuda()``: ``x`` itself on a CUDA mesh (``device`` may name the mesh's one device);
    on a CPU mesh, NotImplementedError (build the tensor on a CUDA mesh)."""
    mesh = input.device_mesh
    if mesh.device_type != "cuda":
        raise _device_type_error(input, "cuda", "cuda")
    if device is not None:
        index = device if isinstance(device, int) else torch.device(device).index
        if index is not None and tuple(mesh.devices) != (index,):
            raise NotImplementedError(
                f"dtorch.Tensor.cuda({device!r}): the tensor lives on the mesh {mesh}; move it "
                f"with x.redistribute(device_mesh=dtorch.DeviceMesh('cuda', [{index}]), "
                f"placements=...)")
    return input


for _fn in (cpu, cuda):
    register(OpDef(_fn.__name__, f"{_fn.__name__}(input: Tensor)", None, None, front=_fn,
                   methods=(_fn.__name__,), function=False))


# -- isin: each element looked up in a set every device holds whole ------------------------------


def isin_rule(call) -> Placed:
    """``elements`` in any sharded layout (each element is looked up on its own), the result
    laid out alike; ``test_elements`` (a tensor) Replicate: the whole set on every device."""
    specs = call.tensors
    ndim = len(call.outs[0][0])
    test = (R,) if len(specs) == 2 else ()
    return expand(call, [((Shard(d),), (Shard(d), *test)) for d in range(ndim)])


register(OpDef("isin", "isin(elements: Tensor, test_elements: Tensor, *, assume_unique=False, "
               "invert=False)", torch.isin, isin_rule, methods=("isin",)))
