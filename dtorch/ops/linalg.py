"""Matrix products. Placement rows come from the einsum form of each product
(``rules.einsum_rows``): sharding a kept dim shards the output, sharding the contracted dim on
both sides gives a Partial sum, and one Partial operand times Replicate stays Partial."""

from __future__ import annotations

import string

import torch

from .meta import probed
from .registry import OpDef, register
from .rules import einsum_rows, expand


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


for _name, _methods in (("matmul", ("matmul", "__matmul__")), ("mm", ("mm",)), ("bmm", ("bmm",))):
    register(OpDef(_name, f"{_name}(input: Tensor, other: Tensor)", getattr(torch, _name),
                   matmul_rule, meta=probed(getattr(torch, _name)), methods=_methods))
