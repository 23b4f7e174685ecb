"""``dtorch.nn.utils``: gradient clipping over parameters on any meshes, as torch's.

torch's total norm is a norm of norms: each tensor's ``vector_norm`` in its own dtype, then the
``vector_norm`` of those norms stacked (grouped by device and dtype, in order of first
appearance). dtorch computes the same: a whole (unsharded) tensor's norm is torch's kernel on
each device's block, so on one device the values are torch's bit for bit; a sharded tensor's is
combined from its blocks' norms (``block_norm``, gathered and combined in float64). For most
orders the two levels equal one norm of everything, but not for order 0: torch's total is then
the count of tensors with a nonzero element, which is what clipping divides by.

>>> import dtorch, torch
>>> mesh = dtorch.DeviceMesh("cpu", [0, 1])
>>> w = dtorch.nn.Parameter(dtorch.zeros(4, device_mesh=mesh, placements=[dtorch.Shard(0)]))
>>> w.grad = dtorch.from_torch(torch.tensor([3.0, 0.0, 4.0, 0.0]), mesh, [dtorch.Shard(0)])
>>> dtorch.nn.utils.clip_grad_norm_([w], 1.0).item(), round(w.grad.to_torch()[0].item(), 6)
(5.0, 0.6)
"""

from __future__ import annotations

import math
import types
import warnings

import torch

from ..placement import Replicate, Shard
from ..tensor import Tensor

__all__ = ["clip_grad_norm_", "clip_grads_with_norm_", "get_total_norm"]

LOW_PRECISION = (torch.float16, torch.bfloat16)


def replicated(t: Tensor, mesh) -> Tensor:
    """``t`` Replicate on ``mesh`` (moved there if it lives elsewhere)."""
    placements = [Replicate()] * mesh.ndim
    if t.device_mesh == mesh and list(t.placements) == placements:
        return t
    return t.redistribute(device_mesh=mesh, placements=placements)


def block_norm(block: torch.Tensor, norm_type: float) -> torch.Tensor:
    """One device's block's ``norm_type`` norm, as a 1-element tensor (``local_map``'s kernel
    in ``tensor_norm``): float32 for a low-precision block (torch accumulates its norm so),
    else the block's dtype. An empty block (an uneven shard) gives the identity of the
    combination: 0, or inf for a negative order (whose combination ignores inf)."""
    dtype = torch.float32 if block.dtype in LOW_PRECISION else None
    if block.numel() == 0:
        fill = math.inf if norm_type < 0 else 0.0
        return torch.full((1,), fill, dtype=dtype or block.dtype, device=block.device)
    return torch.linalg.vector_norm(block, norm_type, dtype=dtype).reshape(1)


def combine(norms: Tensor, norm_type: float) -> Tensor:
    """The norm of a tensor from its blocks' ``norms``: the counts of nonzeros add up, the
    largest (smallest) of the largest (smallest) is the largest (smallest), and the other
    orders add the blocks' p-th powers (in float64, so no power overflows)."""
    if norm_type == 0:
        return norms.sum()
    if norm_type == math.inf:
        return norms.amax()
    if norm_type == -math.inf:
        return norms.amin()
    return (norms.double() ** norm_type).sum() ** (1.0 / norm_type)


def tensor_norm(t: Tensor, norm_type: float) -> Tensor:
    """torch's ``vector_norm(t, norm_type)`` of a gradient: 0-dim, in ``t``'s dtype, Replicate
    on ``t``'s mesh. A Partial tensor is reduced first (the norm of a sum of pieces is not the
    pieces')."""
    if any(p.is_partial() for p in t.placements):
        t = t.redistribute(placements=[Replicate() if p.is_partial() else p
                                       for p in t.placements])
    if not any(p.is_shard() for p in t.placements):
        return t.norm(norm_type)  # torch's kernel on each device's whole block
    import dtorch

    shards = [Shard(0) if p.is_shard() else Replicate() for p in t.placements]
    blocks = dtorch.local_map(block_norm, shards)(t, norm_type)
    return combine(replicated(blocks, t.device_mesh), norm_type).to(t.dtype)


def get_total_norm(tensors, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                   foreach=None) -> Tensor:
    """torch's ``get_total_norm``: the ``norm_type`` norm of the norms of ``tensors`` (see the
    module's docstring), 0-dim, Replicate on the first tensor's mesh, in the dtype torch's
    stack of norms has. Each mesh sends its tensors' norms as one vector, so nothing waits
    unless ``error_if_nonfinite`` (then one read). ``foreach`` is accepted as torch's and
    changes nothing: dtorch computes the same values either way."""
    import dtorch

    tensors = [tensors] if isinstance(tensors, Tensor) else list(tensors)
    if not tensors:
        return dtorch.tensor(0.0)
    norm_type = float(norm_type)
    groups: dict = {}  # (mesh, dtype) -> norms, in order of first appearance (as torch's)
    for t in tensors:
        groups.setdefault((t.device_mesh, t.dtype), []).append(t)
    home = tensors[0].device_mesh
    with torch.no_grad():
        norms = [replicated(dtorch.stack([tensor_norm(t, norm_type) for t in ts]), home)
                 for ts in groups.values()]
        total = (norms[0] if len(norms) == 1 else dtorch.cat(norms)).norm(norm_type)
    if error_if_nonfinite and not bool(total.isfinite().item()):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients from "
                           "`parameters` is non-finite, so it cannot be clipped. To disable "
                           "this error and scale the gradients by the non-finite norm anyway, "
                           "set `error_if_nonfinite=False`")
    return total


def clip_grads_with_norm_(parameters, max_norm: float, total_norm: Tensor,
                          foreach=None) -> None:
    """torch's ``clip_grads_with_norm_``: scales each gradient in place by
    ``min(max_norm / (total_norm + 1e-6), 1)``; the factor stays on the devices (moved to
    each gradient's mesh), so nothing is read."""
    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    with torch.no_grad():
        coef = (float(max_norm) / (total_norm + 1e-6)).clamp(max=1.0)
        scales: dict = {}
        for g in grads:
            if g.device_mesh not in scales:
                scales[g.device_mesh] = replicated(coef, g.device_mesh)
            g.mul_(scales[g.device_mesh])  # a 0-dim factor: torch's arithmetic for each dtype


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach=None) -> Tensor:
    """torch's ``clip_grad_norm_``: scales the gradients in place so that their total norm
    (``get_total_norm``) is at most ``max_norm``, and returns that norm before clipping. The
    parameters may live on different meshes (pipeline stages): one norm spans them all, and
    nothing is read unless ``error_if_nonfinite``."""
    if isinstance(parameters, Tensor):
        parameters = [parameters]
    else:
        generator = isinstance(parameters, types.GeneratorType)
        parameters = list(parameters)
        if generator and not parameters:
            warnings.warn("`parameters` is an empty generator, no gradient clipping will "
                          "occur.", stacklevel=2)
    grads = [p.grad for p in parameters if p.grad is not None]
    total = get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
    clip_grads_with_norm_(parameters, max_norm, total, foreach)
    return total
