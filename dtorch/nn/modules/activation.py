"""Activation modules: torch's classes (their constructors, attributes and ``extra_repr``) whose
``forward`` runs dtorch's op on the distributed input.

Each class subclasses its torch twin after ``dtorch.nn.Module``, as the containers do, so
``ReLU(inplace=True)`` takes and prints what torch's takes and prints; only ``forward`` (and
``PReLU``'s parameter) are dtorch's. Placements are those of the op ``forward`` calls
(docs/ops.md): pointwise ones keep any Shard and refuse a Partial input (none is linear);
``Softmax`` and its kin need ``dim`` whole.

>>> import dtorch
>>> act = dtorch.nn.LeakyReLU(0.5)
>>> act, act(dtorch.tensor([-2.0, 2.0])).to_torch()
(LeakyReLU(negative_slope=0.5), tensor([-1.,  2.]))
"""

from __future__ import annotations

import torch

import dtorch

from .. import functional as F
from ..parameter import Parameter
from .module import Module

__all__ = ["ReLU", "ReLU6", "Hardtanh", "Sigmoid", "Tanh", "LeakyReLU", "ELU", "SELU", "CELU",
           "SiLU", "GELU", "Mish", "Hardswish", "Hardsigmoid", "Softplus", "Softsign",
           "Tanhshrink", "Threshold", "Hardshrink", "Softshrink", "LogSigmoid", "PReLU", "GLU",
           "Softmax", "LogSoftmax", "Softmin", "Softmax2d"]


# -- activations of dtorch.nn.functional ----------------------------------------------------------


class ReLU(Module, torch.nn.ReLU):
    def forward(self, input):
        return F.relu(input, inplace=self.inplace)


class Hardtanh(Module, torch.nn.Hardtanh):
    def forward(self, input):
        return F.hardtanh(input, self.min_val, self.max_val, self.inplace)


class ReLU6(Module, torch.nn.ReLU6):
    def forward(self, input):
        return F.relu6(input, inplace=self.inplace)


class Sigmoid(Module, torch.nn.Sigmoid):
    def forward(self, input):
        return F.sigmoid(input)


class Tanh(Module, torch.nn.Tanh):
    def forward(self, input):
        return F.tanh(input)


class LeakyReLU(Module, torch.nn.LeakyReLU):
    def forward(self, input):
        return F.leaky_relu(input, self.negative_slope, self.inplace)


class ELU(Module, torch.nn.ELU):
    def forward(self, input):
        return F.elu(input, self.alpha, self.inplace)


class SELU(Module, torch.nn.SELU):
    def forward(self, input):
        return F.selu(input, self.inplace)


class SiLU(Module, torch.nn.SiLU):
    def forward(self, input):
        return F.silu(input, inplace=self.inplace)


class GELU(Module, torch.nn.GELU):
    def forward(self, input):
        return F.gelu(input, approximate=self.approximate)


class Mish(Module, torch.nn.Mish):
    def forward(self, input):
        return F.mish(input, inplace=self.inplace)


class Hardswish(Module, torch.nn.Hardswish):
    def forward(self, input):
        return F.hardswish(input, inplace=self.inplace)


class Softplus(Module, torch.nn.Softplus):
    def forward(self, input):
        return F.softplus(input, self.beta, self.threshold)


# -- torch's pointwise functions on each block ----------------------------------------------------


class CELU(Module, torch.nn.CELU):
    def forward(self, input):
        return F.celu(input, self.alpha, self.inplace)


class Hardsigmoid(Module, torch.nn.Hardsigmoid):
    def forward(self, input):
        return F.hardsigmoid(input, self.inplace)


class Threshold(Module, torch.nn.Threshold):
    def forward(self, input):
        return F.threshold(input, self.threshold, self.value, self.inplace)


class Softsign(Module, torch.nn.Softsign):
    def forward(self, input):
        return F.softsign(input)


class Tanhshrink(Module, torch.nn.Tanhshrink):
    def forward(self, input):
        return F.tanhshrink(input)


class Hardshrink(Module, torch.nn.Hardshrink):
    def forward(self, input):
        return F.hardshrink(input, self.lambd)


class Softshrink(Module, torch.nn.Softshrink):
    def forward(self, input):
        return F.softshrink(input, self.lambd)


class LogSigmoid(Module, torch.nn.LogSigmoid):
    def forward(self, input):
        return F.logsigmoid(input)


# -- composed of dtorch's ops ---------------------------------------------------------------------


class PReLU(Module):
    """torch's ``PReLU(num_parameters=1, init=0.25)``, plus ``device=``, ``dtype=`` and
    ``device_mesh=``: ``where(x > 0, x, weight * x)``, the weight (Replicate) along the channel
    dim 1 when there are several."""

    def __init__(self, num_parameters: int = 1, init: float = 0.25, device=None, dtype=None,
                 device_mesh=None) -> None:
        super().__init__()
        self.num_parameters, self.init = num_parameters, init
        mesh = dtorch.get_default_device_mesh(device, device_mesh)
        self.weight = Parameter(dtorch.full((num_parameters,), init, dtype=dtype,
                                            device_mesh=mesh))

    def reset_parameters(self) -> None:
        self.weight.copy_(dtorch.full_like(self.weight, self.init))

    def forward(self, input):
        w = self.weight
        if self.num_parameters > 1:
            if input.dim() < 2 or input.shape[1] != self.num_parameters:
                raise RuntimeError(
                    f"Mismatch of parameter numbers and input channel size. Found parameter "
                    f"numbers = {self.num_parameters} and channel size = "
                    f"{input.shape[1] if input.dim() >= 2 else 1}.")
            w = w.reshape((self.num_parameters,) + (1,) * (input.dim() - 2))
        return dtorch.where(input > 0, input, w * input)

    def extra_repr(self) -> str:
        return f"num_parameters={self.num_parameters}"


class GLU(Module, torch.nn.GLU):
    def forward(self, input):
        n = input.shape[self.dim]
        if n % 2:
            raise RuntimeError(f"Halving dimension must be even, but dimension "
                               f"{self.dim % input.dim()} is size {n}")
        a, b = dtorch.chunk(input, 2, self.dim)
        return a * F.sigmoid(b)


class Softmax(Module, torch.nn.Softmax):
    def forward(self, input):
        return F.softmax(input, self.dim)


class LogSoftmax(Module, torch.nn.LogSoftmax):
    def forward(self, input):
        return F.log_softmax(input, self.dim)


class Softmin(Module, torch.nn.Softmin):
    def forward(self, input):
        return F.softmax(-input, self.dim)  # torch's softmin is this


class Softmax2d(Module, torch.nn.Softmax2d):
    def forward(self, input):
        if input.dim() not in (3, 4):
            raise ValueError(f"Softmax2d: expected input to be 3D or 4D, got {input.dim()}D "
                             f"instead")
        return F.softmax(input, -3)
