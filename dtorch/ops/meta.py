"""Metadata rules shared by operator families: what a call's outputs look like (shape, dtype)
without running it on real data. The default rule (no ``meta=`` in an entry) runs the kernel on
meta tensors of the global shapes."""

from __future__ import annotations

import torch


def probed(kernel):
    """For ops whose result dtype and validity depend only on the operands' dtypes and ranks
    (elementwise ops, matmul): shapes come from the kernel on meta tensors, the dtype and torch's
    own checks from the kernel on one-element CPU tensors of the same dtypes and ranks, because
    several meta kernels skip them (bool subtraction, ``int *= float``, ``abs`` of bool,
    ``bool ** True`` keeping bool). It runs on a cache miss only, like every metadata rule.

    >>> probed(torch.pow)(torch.empty(3, dtype=torch.bool, device="meta"), True).dtype
    torch.bool
    """

    def meta(*args, **static):
        probe = kernel(*[_one(a) for a in args], **static)
        out = kernel(*args, **static)
        return out if out.dtype == probe.dtype else out.to(probe.dtype)

    return meta


def _one(a):
    if type(a) in (bool, int, float, complex):  # by type, as the rule cache keys it: a value
        return type(a)(1)  # (``x // 0``) must not make a call fail here on a cache miss only
    if not isinstance(a, torch.Tensor):
        return a
    return torch.ones((1,) * a.dim(), dtype=a.dtype)
