"""Pooling layers: torch's ``MaxPool1d``, ``AvgPool1d``, ``MaxPool2d``, ``AvgPool2d`` and
``AdaptiveAvgPool2d`` (torch's constructors, attributes, ``extra_repr``, and torch's default
``stride``: the kernel size), and DTorch's ``Pooling2d``, ``GlobalAvgPool2d``,
``GlobalMaxPool2d`` and ``AdaptivePool``.

The 2-D modules take DTorch's ``is_nchw=False`` (channels-last input and output) and, beside
torch's paddings, DTorch's ``"same"``/``"valid"`` and four paddings
``(h_begin, w_begin, h_end, w_end)`` (``dtorch.nn.functional._pooling2d``). DTorch's default
stride of 1 is not kept: a stride left out is the kernel size, as in torch. Inputs shard on the
batch and the channels (docs/ops.md, pooling); global pooling reduces over H and W, which may
be sharded too (an all-reduce).

>>> import dtorch
>>> pool = dtorch.nn.MaxPool2d(2)
>>> pool
MaxPool2d(kernel_size=2, stride=2, padding=0, dilation=1, ceil_mode=False)
>>> pool(dtorch.ones(1, 3, 4, 4)).shape
torch.Size([1, 3, 2, 2])
"""

from __future__ import annotations

import math

import torch

import dtorch

from ...type import OperatorFormat, PaddingType, PoolingKind
from .. import functional as F
from .module import Module

__all__ = ["Pooling2d", "MaxPool1d", "AvgPool1d", "MaxPool2d", "AvgPool2d",
           "AdaptiveAvgPool2d", "GlobalAvgPool2d", "GlobalMaxPool2d", "AdaptivePool"]


def _format(is_nchw: bool) -> OperatorFormat:
    return OperatorFormat.nchw if is_nchw else OperatorFormat.nhwc


def _padding_type(padding):
    """DTorch's ``(padding_type, padding)`` for ``_pooling2d`` from a padding that is a string
    (``"same"``, ``"valid"``) or amounts."""
    if isinstance(padding, str):
        if padding not in ("same", "valid"):
            raise ValueError(f"Invalid padding string {padding!r}, should be one of "
                             f"{{'same', 'valid'}}")
        return PaddingType(padding), 0
    return PaddingType.not_set, padding


def _dtorch_only(padding) -> bool:
    """A padding torch's pooling does not take: ``"same"``, ``"valid"`` or four amounts."""
    return isinstance(padding, str) or not isinstance(padding, int) and len(padding) == 4


def _channels_first(module, input, pool):
    """``pool`` of an NCHW image: ``input`` moved there and back when it is channels last."""
    if module.is_nchw:
        return pool(input)
    out = pool(dtorch.movedim(input, -1, -3))
    if isinstance(out, tuple):
        return tuple(dtorch.movedim(o, -3, -1) for o in out)
    return dtorch.movedim(out, -3, -1)


class Pooling2d(Module):
    """DTorch's pooling module: ``pooling_kind`` (``PoolingKind.max``/``avg``) over
    ``kernel_size`` windows; ``stride=None`` is the kernel size (DTorch's default of 1 is not
    kept); ``padding`` amounts, four amounts or ``"same"``/``"valid"``."""

    def __init__(self, pooling_kind, kernel_size, *, stride=None, padding=(0, 0),
                 dilation=(1, 1), ceil_mode: bool = False, count_include_pad: bool = True,
                 is_nchw: bool = True) -> None:
        super().__init__()
        self.pooling_kind = PoolingKind(pooling_kind)
        self.kernel_size = kernel_size
        self.stride = kernel_size if stride is None else stride
        self.padding, self.dilation = padding, dilation
        self.padding_type, self.actual_pad = _padding_type(padding)
        self.ceil_mode, self.count_include_pad, self.is_nchw = ceil_mode, count_include_pad, is_nchw

    def forward(self, input):
        return F._pooling2d(input, self.pooling_kind, self.dilation, self.kernel_size,
                            self.stride, self.padding_type, self.actual_pad, self.ceil_mode,
                            self.count_include_pad, _format(self.is_nchw))

    def extra_repr(self) -> str:
        s = (f"{self.pooling_kind.name}, kernel_size={self.kernel_size}, stride={self.stride}, "
             f"padding={self.padding}, dilation={self.dilation}, ceil_mode={self.ceil_mode}")
        if self.pooling_kind is PoolingKind.avg:
            s += f", count_include_pad={self.count_include_pad}"
        return s if self.is_nchw else s + ", is_nchw=False"


class MaxPool2d(Module, torch.nn.MaxPool2d):
    """torch's ``MaxPool2d`` plus DTorch's ``is_nchw`` and paddings (``return_indices`` with
    torch's paddings only)."""

    def __init__(self, kernel_size, stride=None, padding=0, dilation=1,
                 return_indices: bool = False, ceil_mode: bool = False,
                 is_nchw: bool = True) -> None:
        super().__init__(kernel_size, stride, padding, dilation, return_indices, ceil_mode)
        self.is_nchw = is_nchw
        _padding_type(padding)  # a bad string raises here

    def _pool(self, x):
        if _dtorch_only(self.padding):
            if self.return_indices:
                raise NotImplementedError(
                    f"MaxPool2d: return_indices=True with padding={self.padding!r}; give "
                    f"torch's padding (an int or (h, w))")
            kind, pad = _padding_type(self.padding)
            return F._pooling2d(x, PoolingKind.max, self.dilation, self.kernel_size,
                                self.stride, kind, pad, self.ceil_mode, True)
        return F.max_pool2d(x, self.kernel_size, self.stride, self.padding, self.dilation,
                            ceil_mode=self.ceil_mode, return_indices=self.return_indices)

    def forward(self, input):
        return _channels_first(self, input, self._pool)

    def extra_repr(self) -> str:
        s = super().extra_repr()
        return s if self.is_nchw else s + ", is_nchw=False"


class AvgPool2d(Module, torch.nn.AvgPool2d):
    """torch's ``AvgPool2d`` plus DTorch's ``is_nchw`` and paddings (``dilation`` is DTorch's
    argument; an average pool has none, as in torch: only 1)."""

    def __init__(self, kernel_size, stride=None, padding=0, ceil_mode: bool = False,
                 count_include_pad: bool = True, divisor_override=None, dilation=1,
                 is_nchw: bool = True) -> None:
        super().__init__(kernel_size, stride, padding, ceil_mode, count_include_pad,
                         divisor_override)
        if any(d != 1 for d in ((dilation,) if isinstance(dilation, int) else dilation)):
            raise NotImplementedError(f"AvgPool2d: an average pool has no dilation (as in "
                                      f"torch), got dilation={dilation!r}")
        self.is_nchw = is_nchw
        _padding_type(padding)

    def _pool(self, x):
        if _dtorch_only(self.padding):
            if self.divisor_override:
                raise NotImplementedError(
                    f"AvgPool2d: divisor_override with padding={self.padding!r}; give torch's "
                    f"padding (an int or (h, w))")
            kind, pad = _padding_type(self.padding)
            return F._pooling2d(x, PoolingKind.avg, 1, self.kernel_size, self.stride, kind,
                                pad, self.ceil_mode, self.count_include_pad)
        return F.avg_pool2d(x, self.kernel_size, self.stride, self.padding, self.ceil_mode,
                            self.count_include_pad, self.divisor_override)

    def forward(self, input):
        return _channels_first(self, input, self._pool)

    def extra_repr(self) -> str:
        s = super().extra_repr()
        return s if self.is_nchw else s + ", is_nchw=False"


class AdaptiveAvgPool2d(Module, torch.nn.AdaptiveAvgPool2d):
    """torch's ``AdaptiveAvgPool2d(output_size)`` plus DTorch's ``is_nchw``."""

    def __init__(self, output_size, is_nchw: bool = True) -> None:
        super().__init__(output_size)
        self.is_nchw = is_nchw

    def forward(self, input):
        return _channels_first(self, input,
                               lambda x: F.adaptive_avg_pool2d(x, self.output_size))

    def extra_repr(self) -> str:
        s = super().extra_repr()
        return s if self.is_nchw else s + ", is_nchw=False"


def _one(v) -> int:
    return v if isinstance(v, int) else v[0]


class MaxPool1d(Module, torch.nn.MaxPool1d):
    """torch's ``MaxPool1d``: a 2-D max pool over a unit height (the values and indices of
    torch's)."""

    def forward(self, input):
        out = F.max_pool2d(dtorch.unsqueeze(input, -2), (1, _one(self.kernel_size)),
                           (1, _one(self.stride)), (0, _one(self.padding)),
                           (1, _one(self.dilation)), ceil_mode=self.ceil_mode,
                           return_indices=self.return_indices)
        if isinstance(out, tuple):
            return tuple(dtorch.squeeze(o, -2) for o in out)
        return dtorch.squeeze(out, -2)


class AvgPool1d(Module, torch.nn.AvgPool1d):
    """torch's ``AvgPool1d``: a 2-D average pool over a unit height, as torch computes it."""

    def forward(self, input):
        out = F.avg_pool2d(dtorch.unsqueeze(input, -2), (1, _one(self.kernel_size)),
                           (1, _one(self.stride)), (0, _one(self.padding)), self.ceil_mode,
                           self.count_include_pad)
        return dtorch.squeeze(out, -2)


class _GlobalPool2d(Module):
    _kind = PoolingKind.avg

    def __init__(self, is_nchw: bool = True) -> None:
        super().__init__()
        self.is_nchw = is_nchw

    def forward(self, input):
        return F._global_pooling2d(input, self._kind, _format(self.is_nchw))

    def extra_repr(self) -> str:
        return "" if self.is_nchw else "is_nchw=False"


class GlobalAvgPool2d(_GlobalPool2d):
    """DTorch's: each channel's mean over H and W, kept as (N, C, 1, 1) ((N, 1, 1, C) with
    ``is_nchw=False``)."""

    _kind = PoolingKind.avg


class GlobalMaxPool2d(_GlobalPool2d):
    """DTorch's: each channel's max over H and W, kept as (N, C, 1, 1)."""

    _kind = PoolingKind.max


class AdaptivePool:
    """DTorch's helper: the ordinary pool (stride, kernel) that an adaptive pool from
    ``input_size`` to ``output_size`` becomes when ``input_size`` is a multiple of
    ``output_size`` (otherwise torch's adaptive windows differ in size, and so do the
    values)."""

    @staticmethod
    def to_normal_pool(input_size: int, output_size: int) -> tuple:
        stride = math.floor(input_size / output_size)
        kernel = input_size - (output_size - 1) * stride
        return stride, kernel
