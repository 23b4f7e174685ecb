"""A collective inside a communicating kernel, differentiable.

``exchange(x, there, back)`` is ``there(x)``: ``there`` moves this device's block to its peers
(an all-to-all, a swap with a peer, an all-gather of column blocks) and returns what arrives.
Its backward is ``back(grad)``, the collective that sends each gradient where its value came
from: the all-to-all with the splits exchanged, the swap again, a reduce-scatter for an
all-gather. Written this way, the kernels of ``ops/attention.py`` and ``ops/moe.py`` are
differentiable by torch's own autograd on the hosts: a recorded call keeps their graph
(``runtime/vjp.py``), and its VJP runs ``back`` on the communication stream, where every peer
meets the same collectives in the same order, because every device's graph has the same shape.
"""

from __future__ import annotations

import torch


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, there, back):
        ctx.back = back
        return there(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.back(grad.contiguous()), None, None


def exchange(x, there, back):
    """``there(x)``, whose gradient is ``back(gradient)`` (see the module doc)."""
    if x.requires_grad and torch.is_grad_enabled():
        return _Exchange.apply(x, there, back)
    return there(x)
