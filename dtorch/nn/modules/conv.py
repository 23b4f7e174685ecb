"""Convolution layers: ``Conv1d`` and ``Conv2d`` with torch's constructor arguments (including
``padding="same"``/``"valid"`` and ``padding_mode``) plus ``device=``, ``dtype=`` and
``device_mesh=``; ``Conv2d`` also takes DTorch's ``is_nchw=False`` (channels-last input and
output), four paddings ``(h_begin, w_begin, h_end, w_end)`` and ``padding="same"`` with a
stride (DTorch's ``ceil(size / stride)`` outputs; torch refuses it).

The weight ``(out, in / groups, *kernel)`` and bias are Replicate, initialised as torch's
``reset_parameters`` (uniform in ``+-1 / sqrt(fan_in)``, drawn on the devices: nothing is
copied from the client; values differ from torch's for the same seed). Inputs shard on the
batch (``S(0)``) and, as DTorch, on an image dim the windows tile (docs/ops.md, ``conv2d``).

>>> import dtorch
>>> conv = dtorch.nn.Conv2d(3, 8, 3, padding="same", bias=False)
>>> conv
Conv2d(3, 8, kernel_size=(3, 3), stride=(1, 1), padding=same, bias=False)
>>> conv(dtorch.ones(2, 3, 5, 5)).shape
torch.Size([2, 8, 5, 5])
"""

from __future__ import annotations

import math

import dtorch

from ...ops.nn import same_pads
from .. import functional as F
from ..parameter import Parameter
from .linear import reset_linear
from .module import Module

__all__ = ["Conv1d", "Conv2d"]

PADDING_MODES = ("zeros", "reflect", "replicate", "circular")
PADDING_STRINGS = ("same", "valid")


def _tuple(value, n: int, name: str) -> tuple:
    t = (value,) * n if isinstance(value, int) else tuple(value)
    if len(t) == 1:
        t = t * n
    if len(t) != n:
        raise ValueError(f"{name} must be an int or {n} ints, got {value!r}")
    return t


class _ConvNd(Module):
    """What Conv1d and Conv2d share: torch's checks, the parameters, the padding in
    ``padding_mode``, ``reset_parameters`` and ``extra_repr``."""

    _dims = 0  # image dims
    _strided_same = False  # DTorch's padding="same" with a stride (Conv2d)

    def __init__(self, in_channels, out_channels, kernel_size, stride, padding, dilation,
                 groups, bias, padding_mode, device, dtype, device_mesh) -> None:
        super().__init__()
        n = self._dims
        if groups <= 0:
            raise ValueError("groups must be a positive integer")
        if in_channels % groups != 0:
            raise ValueError("in_channels must be divisible by groups")
        if out_channels % groups != 0:
            raise ValueError("out_channels must be divisible by groups")
        if padding_mode not in PADDING_MODES:
            raise ValueError(f"padding_mode must be one of {PADDING_MODES}, but got "
                             f"padding_mode='{padding_mode}'")
        self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
        self.kernel_size = _tuple(kernel_size, n, "kernel_size")
        self.stride = _tuple(stride, n, "stride")
        self.dilation = _tuple(dilation, n, "dilation")
        self.padding = self._padding(padding)
        self.padding_mode = padding_mode
        mesh = dtorch.get_default_device_mesh(device, device_mesh)
        shape = (out_channels, in_channels // groups, *self.kernel_size)
        self.weight = Parameter(dtorch.empty(shape, dtype=dtype, device_mesh=mesh))
        self.register_parameter("bias", Parameter(dtorch.empty(
            (out_channels,), dtype=dtype, device_mesh=mesh)) if bias else None)
        self.reset_parameters()

    def _padding(self, padding):
        if isinstance(padding, str):
            if padding not in PADDING_STRINGS:
                raise ValueError(f"Invalid padding string {padding!r}, should be one of "
                                 f"{set(PADDING_STRINGS)}")
            if padding == "same" and any(s != 1 for s in self.stride) and (
                    not self._strided_same):
                raise ValueError("padding='same' is not supported for strided convolutions")
            return padding
        return _tuple(padding, self._dims, "padding")

    def reset_parameters(self) -> None:
        """torch's init: ``kaiming_uniform_(a=sqrt(5))`` for the weight, which is uniform in
        ``+-1 / sqrt(fan_in)``, and the same bound for the bias."""
        reset_linear(self.weight, self.bias)

    def _pads(self, size) -> tuple:
        """``F.pad``'s amounts (last dim first, each as (before, after)) that ``padding``
        stands for, for ``padding_mode`` other than zeros."""
        if self.padding == "valid":
            per_dim = [(0, 0)] * self._dims
        elif self.padding == "same" and any(s != 1 for s in self.stride):
            top, left, bottom, right = same_pads(size, self.kernel_size, self.stride,
                                                 self.dilation)
            per_dim = [(top, bottom), (left, right)]
        elif self.padding == "same":  # torch's: the extra element after
            per_dim = [(d * (k - 1) // 2, d * (k - 1) - d * (k - 1) // 2)
                       for d, k in zip(self.dilation, self.kernel_size)]
        elif len(self.padding) == 2 * self._dims:  # DTorch's (h_begin, w_begin, h_end, w_end)
            per_dim = list(zip(self.padding[:self._dims], self.padding[self._dims:]))
        else:
            per_dim = [(p, p) for p in self.padding]
        return tuple(a for pair in reversed(per_dim) for a in pair)

    def _conv(self, input):
        """The convolution of a channels-first input, padded by ``padding_mode`` first when it
        is not zeros (torch's order)."""
        if self.padding_mode == "zeros":
            return self._op(input, self.padding)
        pads = self._pads(tuple(input.shape[-self._dims:]))
        return self._op(F.pad(input, pads, mode=self.padding_mode), 0)

    def extra_repr(self) -> str:
        s = (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
             f"stride={self.stride}")
        if self.padding != (0,) * len(self.padding):
            s += f", padding={self.padding}"
        if self.dilation != (1,) * self._dims:
            s += f", dilation={self.dilation}"
        if self.groups != 1:
            s += f", groups={self.groups}"
        if self.bias is None:
            s += ", bias=False"
        if self.padding_mode != "zeros":
            s += f", padding_mode={self.padding_mode}"
        return s


class Conv1d(_ConvNd):
    _dims = 1

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0,
                 dilation=1, groups: int = 1, bias: bool = True, padding_mode: str = "zeros",
                 device=None, dtype=None, device_mesh=None) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation,
                         groups, bias, padding_mode, device, dtype, device_mesh)

    def _op(self, x, padding):
        return F.conv1d(x, self.weight, self.bias, self.stride, padding, self.dilation,
                        self.groups)

    def forward(self, input):
        return self._conv(input)


class Conv2d(_ConvNd):
    """torch's ``Conv2d`` and DTorch's: ``is_nchw=False`` takes and gives channels-last
    images (the weight stays ``(out, in / groups, kh, kw)``); ``padding`` may also be
    DTorch's four ``(h_begin, w_begin, h_end, w_end)``, and ``"same"`` may go with a stride."""

    _dims = 2
    _strided_same = True

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0,
                 dilation=1, groups: int = 1, bias: bool = True, padding_mode: str = "zeros",
                 device=None, dtype=None, is_nchw: bool = True, device_mesh=None) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation,
                         groups, bias, padding_mode, device, dtype, device_mesh)
        self.is_nchw = is_nchw

    def _padding(self, padding):
        if not isinstance(padding, (int, str)) and len(padding) == 4:
            return tuple(padding)
        return super()._padding(padding)

    def _op(self, x, padding):
        return F.conv2d(x, self.weight, self.bias, self.stride, padding=padding,
                        dilation=self.dilation, groups=self.groups)

    def forward(self, input):
        if self.is_nchw:
            return self._conv(input)
        return dtorch.movedim(self._conv(dtorch.movedim(input, -1, -3)), -3, -1)

    def extra_repr(self) -> str:
        s = super().extra_repr()
        return s if self.is_nchw else s + ", is_nchw=False"
