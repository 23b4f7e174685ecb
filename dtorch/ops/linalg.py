"""Matrix products: matmul mm bmm dot mv outer einsum, and the affine ones addmm baddbmm linear.

Placement rows come from the einsum form of each product (``rules.einsum_rows``): sharding a kept
dim shards the output, sharding the contracted dim on every operand that has it gives a Partial
sum, and one Partial operand times Replicate stays Partial (a product is linear in each operand).

The affine ops add a term to a product: ``beta * input + alpha * (a @ b)`` (``linear``: the bias).
The term follows the product's placement (``affine_rows``); where the product is a Partial sum and
the term is Replicate, only coordinate 0 of that mesh dim adds it, so the sum over devices counts it
once (``replicated_once``).
"""

from __future__ import annotations

import string

import torch

from ..placement import Partial, Replicate, Shard
from .meta import probed
from .registry import OpDef, register
from .rules import einsum_rows, expand

R = Replicate()


def matmul_labels(a_ndim: int, b_ndim: int) -> tuple:
    """Einsum labels of torch.matmul's operands and result, batch dims broadcast from the right."""
    batch = string.ascii_lowercase[: max(a_ndim, b_ndim, 2) - 2]
    a = ("n" if a_ndim >= 2 else "") + "k"
    b = "k" + ("m" if b_ndim >= 2 else "")
    a = batch[len(batch) - max(a_ndim - 2, 0):] + a
    b = batch[len(batch) - max(b_ndim - 2, 0):] + b
    out = batch + ("n" if a_ndim >= 2 else "") + ("m" if b_ndim >= 2 else "")
    return (a, b), out


def matmul_rule(call):
    a, b = call.tensors
    ins, out = matmul_labels(len(a.shape), len(b.shape))
    return expand(call, einsum_rows(ins, out, [a.shape, b.shape]))


for _name, _methods in (("matmul", ("matmul", "__matmul__")), ("mm", ("mm",)), ("bmm", ("bmm",)),
                        ("dot", ("dot",)), ("mv", ("mv",))):
    register(OpDef(_name, f"{_name}(input: Tensor, other: Tensor)", getattr(torch, _name),
                   matmul_rule, meta=probed(getattr(torch, _name)), methods=_methods))


def outer_rule(call):
    a, b = call.tensors
    return expand(call, einsum_rows(("i", "j"), "ij", [a.shape, b.shape]))


register(OpDef("outer", "outer(input: Tensor, vec2: Tensor)", torch.outer, outer_rule,
               meta=probed(torch.outer), methods=("outer",)))


# -- einsum ---------------------------------------------------------------------------------------


def einsum_labels(equation: str, ndims) -> tuple:
    """The labels of each operand and of the result, with ``...`` spelled out as digits (no
    letter of the equation can clash; aligned from the right, as the operands broadcast) and the
    implicit result made explicit: torch's rule, the broadcast dims then the letters used once,
    in alphabetical order."""
    lhs, arrow, rhs = equation.replace(" ", "").partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ndims):
        return None  # torch's metadata rule has raised already
    n_ellipsis = max((n - len(t.replace("...", "")) for t, n in zip(terms, ndims)
                      if "..." in t), default=0)
    broadcast = string.digits[:n_ellipsis]
    ins = tuple(t.replace("...", broadcast[n_ellipsis - (n - len(t) + 3):])
                for t, n in zip(terms, ndims))
    if arrow:
        return ins, rhs.replace("...", broadcast)
    once = sorted(c for c in set("".join(ins)) if c.isalpha() and "".join(ins).count(c) == 1)
    return ins, broadcast + "".join(once)


def einsum_rule(call):
    specs = call.tensors
    ins, out = einsum_labels(call.static["equation"], [len(s.shape) for s in specs])
    return expand(call, einsum_rows(ins, out, [s.shape for s in specs]))


def _einsum(*operands, equation):
    return torch.einsum(equation, *operands)


register(OpDef("einsum", "einsum(equation, *operands: TensorList)", _einsum, einsum_rule,
               meta=probed(_einsum)))


# -- affine: beta * input + alpha * product -------------------------------------------------------


def affine_rows(product_rows, term_shape, out_shape, term_first: bool) -> list:
    """Rows of ``term + product`` from the product's rows. Sharded product: the term is sharded
    alike where it has the dim at full size (where it broadcasts it stays Replicate). Partial
    product: a Partial term of the same op adds per device (``P + P = P``); a Replicate term is
    added once (by coordinate 0, ``replicated_once``) to a Partial sum, and by every device to a
    Partial avg (the average of ``t + p_i`` is ``t + avg p``)."""
    off = len(out_shape) - len(term_shape)
    rows = []
    for (out,), ins in product_rows:
        if isinstance(out, Shard):
            d = out.dim - off
            terms = [Shard(d) if d >= 0 and term_shape[d] == out_shape[out.dim] else R]
        else:
            terms = [out, R]
        for t in terms:
            rows.append(((out,), (t, *ins) if term_first else (*ins, t)))
    return rows


def replicated_once(ctx, t, k: int):
    """Operand ``k`` as this device's contribution: zeros on the mesh dims where the result is a
    Partial sum, the operand Replicate, and this device not at coordinate 0."""
    spec = ctx.in_specs[k]
    for p, q, c in zip(ctx.out_specs[0].placements, spec.placements, ctx.out_coord):
        if p == Partial("sum") and q == R and c != 0:
            return torch.zeros_like(t)
    return t


def addmm_rule(call):
    term, a, b = call.tensors
    ins, out = matmul_labels(len(a.shape), len(b.shape))
    rows = einsum_rows(ins, out, [a.shape, b.shape])
    return expand(call, affine_rows(rows, term.shape, call.outs[0][0], term_first=True))


def _affine(fn):
    def kernel(ctx, input, a, b, *, beta=1, alpha=1):
        return fn(replicated_once(ctx, input, 0), a, b, beta=beta, alpha=alpha)

    return kernel


for _name, _m in (("addmm", "mat"), ("baddbmm", "batch")):
    _fn = getattr(torch, _name)
    register(OpDef(_name, f"{_name}(input: Tensor, {_m}1: Tensor, {_m}2: Tensor, *, beta=1, "
                          f"alpha=1)", _affine(_fn), addmm_rule, meta=probed(_fn),
                   methods=(_name,), uses_context=True))


def linear_rule(call):
    """``input @ weight.T + bias``: the einsum ``...k,mk->...m`` plus the bias (when given)."""
    x, w, *bias = call.tensors
    batch = string.ascii_lowercase[: len(x.shape) - 1]
    ins, out = (batch + "y", "zy"[2 - len(w.shape):]), batch + "z"[: len(w.shape) - 1]
    rows = einsum_rows(ins, out, [x.shape, w.shape])
    if bias:
        rows = affine_rows(rows, bias[0].shape, call.outs[0][0], term_first=False)
    return expand(call, rows)


def _linear(ctx, input, weight, bias=None):
    if bias is not None:
        bias = replicated_once(ctx, bias, 2)
    return torch.nn.functional.linear(input, weight, bias)


# torch has it as torch.nn.functional.linear only
register(OpDef("linear", "linear(input: Tensor, weight: Tensor, bias: Tensor = None)", _linear,
               linear_rule, meta=probed(torch.nn.functional.linear), function=False,
               functional=True, uses_context=True))
