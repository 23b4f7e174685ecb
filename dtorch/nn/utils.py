"""``dtorch.nn.utils``: gradient clipping over parameters on any meshes."""

from __future__ import annotations

import math

import torch

from ..placement import Replicate
from ..tensor import Tensor

__all__ = ["clip_grad_norm_", "get_total_norm"]


def replicated(t: Tensor, mesh) -> Tensor:
    """``t`` Replicate on ``mesh`` (moved there if it lives elsewhere)."""
    placements = [Replicate()] * mesh.ndim
    if t.device_mesh == mesh and list(t.placements) == placements:
        return t
    return t.redistribute(device_mesh=mesh, placements=placements)


def get_total_norm(tensors, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> Tensor:
    """The ``norm_type`` norm of all of ``tensors`` together, as one vector: a 0-dim float32
    tensor, Replicate on the first tensor's mesh. Each mesh reduces its own tensors and sends
    one number, so the work is one small reduction per mesh; nothing waits, unless
    ``error_if_nonfinite`` (then one read)."""
    tensors = [tensors] if isinstance(tensors, Tensor) else list(tensors)
    if not tensors:
        raise ValueError("get_total_norm: no tensors")
    norm_type = float(norm_type)
    by_mesh: dict = {}
    for t in tensors:
        if any(p.is_partial() for p in t.placements):  # a sum of pieces: norms need the sum
            t = t.redistribute(placements=[Replicate() if p.is_partial() else p
                                           for p in t.placements])
        by_mesh.setdefault(t.device_mesh, []).append(t)
    home = tensors[0].device_mesh
    parts = []
    with torch.no_grad():
        for ts in by_mesh.values():
            if norm_type == math.inf:
                part = max_of([t.abs().amax().float() for t in ts])
            else:
                part = sum((t.float().abs() ** norm_type).sum() for t in ts)
            parts.append(replicated(part, home))
        if norm_type == math.inf:
            total = max_of(parts)
        else:
            total = sum(parts[1:], parts[0]) ** (1.0 / norm_type)
    if error_if_nonfinite and not bool(total.isfinite().item()):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients from "
                           "`parameters` is non-finite, so it cannot be clipped. To disable "
                           "this error and scale the gradients by the non-finite norm anyway, "
                           "set `error_if_nonfinite=False`")
    return total


def max_of(values: list) -> Tensor:
    out = values[0]
    for v in values[1:]:
        out = out.maximum(v)
    return out


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach=None) -> Tensor:
    """torch's ``clip_grad_norm_``: scales the gradients in place so that their total norm is
    at most ``max_norm``, and returns that norm before clipping. The parameters may live on
    different meshes (pipeline stages): one reduction spans them all, and the scale factor
    stays on the devices (no read, unless ``error_if_nonfinite``)."""
    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        import dtorch

        return dtorch.tensor(0.0)
    total = get_total_norm(grads, norm_type, error_if_nonfinite)
    with torch.no_grad():
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        scales = {}
        for g in grads:
            mesh = g.device_mesh
            if mesh not in scales:
                scales[mesh] = replicated(coef, mesh)
            g.mul_(scales[mesh].to(g.dtype))
    return total
