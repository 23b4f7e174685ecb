"""Normalisation layers: ``LayerNorm``, ``RMSNorm``, ``GroupNorm`` and ``BatchNorm2d``, with
torch's constructor arguments plus ``device=``, ``dtype=`` and ``device_mesh=`` (default: the
graph's mesh, which ``Graph.device_mesh_guard`` sets).

Parameters and buffers are Replicate on every mesh dim and start as torch's (weights ones,
biases zeros, ``running_mean`` zeros, ``running_var`` ones, ``num_batches_tracked`` 0), under
torch's names, so ``load_state_dict(torch_module.state_dict())`` loads strictly. Inputs shard
as the ops allow (docs/ops.md): the leading (not normalised) dims for ``LayerNorm`` and
``RMSNorm``, the batch for ``GroupNorm``, any dim for ``BatchNorm2d`` in eval mode (channels
too).

``BatchNorm2d`` in training mode normalises with the batch's statistics and updates the
running ones in place, as torch's: the mean and the biased variance over (N, H, W) are
reductions, so a batch sharded over devices reduces across them (an all-reduce).

>>> import dtorch
>>> norm = dtorch.nn.LayerNorm(4)
>>> norm
LayerNorm((4,), eps=1e-05, elementwise_affine=True, bias=True)
>>> norm(dtorch.arange(8.0).reshape(2, 4)).to_torch().sum().item()
0.0
"""

from __future__ import annotations

import numbers

import torch

import dtorch

from .. import functional as F
from ..parameter import Buffer, Parameter
from .module import Module

__all__ = ["LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm2d"]


def _shape(normalized_shape) -> tuple:
    if isinstance(normalized_shape, numbers.Integral):
        return (int(normalized_shape),)
    return tuple(normalized_shape)


def _filled(shape, value: float, dtype, mesh) -> Parameter:
    return Parameter(dtorch.full(shape, value, dtype=dtype, device_mesh=mesh))


def _affine(module: Module, shape, affine: bool, bias: bool, dtype, mesh) -> None:
    """A per-channel ``weight`` (ones) and ``bias`` (zeros, unless ``bias`` is False), or
    both None."""
    module.register_parameter("weight", _filled(shape, 1.0, dtype, mesh) if affine else None)
    module.register_parameter("bias", _filled(shape, 0.0, dtype, mesh) if affine and bias
                              else None)


def _refill(*params) -> None:
    """Parameters back to their initial values: weights ones, biases zeros (``(param, value)``
    pairs; None parameters skipped)."""
    for p, value in params:
        if p is not None:
            p.copy_(dtorch.full_like(p, value))


class LayerNorm(Module):
    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, device=None, dtype=None, device_mesh=None) -> None:
        super().__init__()
        self.normalized_shape = _shape(normalized_shape)
        self.eps, self.elementwise_affine = eps, elementwise_affine
        mesh = dtorch.get_default_device_mesh(device, device_mesh)
        affine = elementwise_affine
        self.register_parameter(
            "weight", _filled(self.normalized_shape, 1.0, dtype, mesh) if affine else None)
        self.register_parameter(
            "bias", _filled(self.normalized_shape, 0.0, dtype, mesh) if affine and bias else None)

    def reset_parameters(self) -> None:
        _refill((self.weight, 1.0), (self.bias, 0.0))

    def forward(self, input):
        return F.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}, bias={self.bias is not None}")


class RMSNorm(Module):
    """torch's ``RMSNorm``: ``eps=None`` is the input dtype's epsilon, as torch's (DTorch's
    would fail in its binding)."""

    def __init__(self, normalized_shape, eps: float | None = None,
                 elementwise_affine: bool = True, device=None, dtype=None,
                 device_mesh=None) -> None:
        super().__init__()
        self.normalized_shape = _shape(normalized_shape)
        self.eps, self.elementwise_affine = eps, elementwise_affine
        mesh = dtorch.get_default_device_mesh(device, device_mesh)
        self.register_parameter("weight", _filled(self.normalized_shape, 1.0, dtype, mesh)
                                if elementwise_affine else None)

    def reset_parameters(self) -> None:
        _refill((self.weight, 1.0))

    def forward(self, input):
        return F.rms_norm(input, self.normalized_shape, self.weight, self.eps)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}")


class GroupNorm(Module):
    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5,
                 affine: bool = True, device=None, dtype=None, device_mesh=None, *,
                 bias: bool = True) -> None:
        super().__init__()
        if num_channels % num_groups != 0:
            raise ValueError(f"num_channels ({num_channels}) must be divisible by num_groups "
                             f"({num_groups})")
        self.num_groups, self.num_channels = num_groups, num_channels
        self.eps, self.affine = eps, affine
        mesh = dtorch.get_default_device_mesh(device, device_mesh)
        _affine(self, (num_channels,), affine, bias, dtype, mesh)

    def reset_parameters(self) -> None:
        _refill((self.weight, 1.0), (self.bias, 0.0))

    def forward(self, input):
        return F.group_norm(input, self.num_groups, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return (f"{self.num_groups}, {self.num_channels}, eps={self.eps}, "
                f"affine={self.affine}, bias={self.bias is not None}")


class BatchNorm2d(Module):
    """torch's ``BatchNorm2d`` (DTorch's argument order: ``is_nchw`` before ``device``;
    ``is_nchw=False`` takes channels-last input). Training mode uses the batch's statistics
    and updates ``running_mean``, ``running_var`` and ``num_batches_tracked`` in place
    (``momentum=None``: a cumulative average), as torch's; eval mode uses the running ones
    (or the batch's without ``track_running_stats``)."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, is_nchw: bool = True,
                 device=None, dtype=None, device_mesh=None, *, bias: bool = True) -> None:
        super().__init__()
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.affine, self.track_running_stats, self.is_nchw = affine, track_running_stats, is_nchw
        mesh = dtorch.get_default_device_mesh(device, device_mesh)
        _affine(self, (num_features,), affine, bias, dtype, mesh)
        if track_running_stats:
            stat = (num_features,)
            self.running_mean = Buffer(dtorch.zeros(stat, dtype=dtype, device_mesh=mesh))
            self.running_var = Buffer(dtorch.ones(stat, dtype=dtype, device_mesh=mesh))
            self.num_batches_tracked = Buffer(dtorch.zeros((), dtype=torch.long,
                                                           device_mesh=mesh))
        else:
            for name in ("running_mean", "running_var", "num_batches_tracked"):
                self.register_buffer(name, None)

    def reset_running_stats(self) -> None:
        if self.track_running_stats:
            _refill((self.running_mean, 0.0), (self.running_var, 1.0),
                    (self.num_batches_tracked, 0))

    def reset_parameters(self) -> None:
        self.reset_running_stats()
        _refill((self.weight, 1.0), (self.bias, 0.0))

    def forward(self, input):
        if input.dim() != 4:
            raise ValueError(f"expected 4D input (got {input.dim()}D input)")
        if self.training or self.running_mean is None:  # the batch's statistics
            factor = 0.0 if self.momentum is None else self.momentum
            if self.training and self.track_running_stats:
                self.num_batches_tracked.add_(1)
                if self.momentum is None:  # the cumulative average: 1 / batches seen
                    factor = 1.0 / self.num_batches_tracked.to(self.running_mean.dtype)
            stats = (self.running_mean, self.running_var) if self.training else (None, None)
            return F.batch_norm(input, *stats, self.weight, self.bias, True, factor, self.eps,
                                is_nchw=self.is_nchw)
        stats = [self._per_channel(t, input) for t in (self.running_mean, self.running_var,
                                                        self.weight, self.bias)]
        return F.batch_norm(input, *stats, False, 0.0, self.eps, is_nchw=self.is_nchw)

    def _per_channel(self, t, input):
        """A per-channel operand (Replicate) chunked to the input's channel shards, which
        batch_norm's rule asks for (a local chunk: no communication)."""
        if t is None:
            return None
        channel = 1 if self.is_nchw else 3
        if not any(p.is_shard(channel) for p in input.placements):
            return t
        return t.redistribute(placements=[dtorch.Shard(0) if p.is_shard(channel) else
                                          dtorch.Replicate() for p in input.placements])

    def extra_repr(self) -> str:
        s = (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, "
             f"affine={self.affine}, bias={self.bias is not None}, "
             f"track_running_stats={self.track_running_stats}")
        return s if self.is_nchw else s + ", is_nchw=False"
