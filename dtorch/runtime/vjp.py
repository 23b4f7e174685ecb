"""The backward of recorded kernels on the hosts: torch's own autograd on the local blocks, so
that no derivative formula is written twice.

A call autograd records (``protocol.RECORD``) runs its kernel with the operands the client
differentiates as autograd leaves, keeps the graph in a ``Saved`` slot of the host (keyed by the
tape node's id; the id and those operands' bits travel as the call's last two operands), and stores detached results as blobs, so that later
kernels build no graph on them. Its VJP call (``protocol.VJP_PREFIX`` + the forward call's id)
takes that key and one gradient block per forward result, and returns
``torch.autograd.grad`` of the kept graph for the operands ``needs`` marks. What the graph keeps
is what torch's autograd saves; it is freed when the VJP has run (unless ``retain``), or when the
client drops the tape node (the key's release).

Why local blocks suffice: the client lays the gradient out in the dual of each layout
(``autograd/tape.py``): a device's block of the result's gradient, passed back through its own
kernel, is its block of the operand's gradient, or its contribution to it (a Partial sum)
where the operand was Replicate.
"""

from __future__ import annotations

import torch


class Saved:
    """One device's graph of one recorded call: its autograd leaves and results; or, where the
    kernel did not run, the error that stopped it."""

    __slots__ = ("leaves", "outs", "error")


def _leaf(x):
    return x.detach().requires_grad_(True)


def _detached(out):
    if isinstance(out, torch.Tensor):
        return out.detach()
    if isinstance(out, (tuple, list)):
        return type(out)(_detached(o) for o in out)
    return out


def recording(fn, uses_context: bool):
    """Kernel ``fn`` run with autograd on: ``(ctx, *operands, slot, needs)``, the graph into
    ``slot``; bit k of ``needs`` makes operand k a leaf (only those the client differentiates:
    some operands may not require grad, such as batch norm's running statistics)."""

    def run(ctx, *args, **kwargs):
        *inputs, slot, needs = args
        leaves = [_leaf(x) if needs >> k & 1 else x for k, x in enumerate(inputs)]
        with torch.enable_grad():
            out = fn(ctx, *leaves, **kwargs) if uses_context else fn(*leaves, **kwargs)
        slot.leaves, slot.outs = leaves, out
        return _detached(out)

    return run


class ForwardFailed(Exception):
    """The VJP of a call whose kernel did not run fails with the forward's error (which the
    client has heard of already), so a gradient read names the cause, not the VJP."""

    def __init__(self, error):
        super().__init__(error)
        self.error = error


def vjp(ctx, slot, *grads, needs, retain):
    """The gradient blocks of the operands ``needs`` marks, from the graph in ``slot``."""
    if getattr(slot, "error", None) is not None:
        raise ForwardFailed(slot.error)
    if slot is None or not hasattr(slot, "outs"):
        raise RuntimeError("the forward's autograd graph is gone (backward through the graph a "
                           "second time? use retain_graph=True the first time)")
    outs = slot.outs if isinstance(slot.outs, (tuple, list)) else (slot.outs,)
    pairs = [(o, g) for o, g in zip(outs, grads)
             if isinstance(o, torch.Tensor) and o.requires_grad]
    wrt = [x for x, need in zip(slot.leaves, needs) if need]
    found = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs],
                                retain_graph=retain, allow_unused=True) if pairs else \
        [None] * len(wrt)
    if not retain:
        del slot.leaves, slot.outs
    result = tuple(torch.zeros_like(x) if g is None else g for g, x in zip(found, wrt))
    return result[0] if len(result) == 1 else result
