"""The backward of recorded kernels on the hosts: torch's own autograd on the local blocks, so
that no derivative formula is written twice.

A call autograd records (``protocol.RECORD``) runs its kernel with the operands the client
differentiates as autograd leaves, keeps the graph in a ``Saved`` slot of the host (keyed by the
tape node's id; the id and two bit sets of operands travel in the ``protocol.Recorded`` record
that announces the kernel, and the host passes the slot and the bits after the operands), and
stores detached results as blobs, so that later kernels build no graph on them. Its VJP call
(kind ``protocol.CallKind.VJP``, of the forward call's id) takes that key and one gradient
block per forward result, and returns ``torch.autograd.grad`` of the kept graph for the operands
``needs`` marks. What the graph keeps is what torch's autograd saves; it is freed when the VJP
has run (unless ``retain``), or when the client drops the tape node (the key's release).

Gathered operands (``autograd.gathered``: ZeRO-3's whole parameters) are the exception: the
graph keeps no reference to their blocks (torch's saved-tensor hooks keep the view's geometry
instead), so the blocks go when the layer is done with them; the VJP receives the operand
gathered again and the saved views are rebuilt on it.

Why local blocks suffice: the client lays the gradient out in the dual of each layout
(``autograd/tape.py``): a device's block of the result's gradient, passed back through its own
kernel, is its block of the operand's gradient, or its contribution to it (a Partial sum)
where the operand was Replicate.
"""

from __future__ import annotations

import contextlib

import torch


class Saved:
    """One device's graph of one recorded call: its autograd leaves and results; or, where the
    kernel did not run, the error that stopped it."""

    __slots__ = ("leaves", "outs", "error", "regathered")


def _leaf(x):
    return x.detach().requires_grad_(True)


def _detached(out):
    if isinstance(out, torch.Tensor):
        return out.detach()
    if isinstance(out, (tuple, list)):
        return type(out)(_detached(o) for o in out)
    return out


def recording(fn, uses_context: bool):
    """Kernel ``fn`` run with autograd on: ``(ctx, *operands, slot, needs, dropped)``, the graph
    into ``slot``; bit k of ``needs`` makes operand k a leaf (only those the client
    differentiates: some operands may not require grad, such as batch norm's running
    statistics), bit k of ``dropped`` keeps operand k's block out of the graph."""

    def run(ctx, *args, **kwargs):
        *inputs, slot, needs, dropped = args
        leaves = [_leaf(x) if needs >> k & 1 else x for k, x in enumerate(inputs)]
        with torch.enable_grad(), _dropping(slot, leaves, dropped):
            out = fn(ctx, *leaves, **kwargs) if uses_context else fn(*leaves, **kwargs)
        slot.leaves, slot.outs = leaves, out
        if dropped:
            slot.leaves = [_husk(x) if dropped >> k & 1 else x for k, x in enumerate(leaves)]
        return _detached(out)

    return run


class _Dropped:
    """A saved view of a dropped operand: which one, and the view's geometry."""

    __slots__ = ("operand", "size", "stride", "offset")

    def __init__(self, operand: int, t):
        self.operand, self.size, self.stride = operand, t.size(), t.stride()
        self.offset = t.storage_offset()


def _husk(x):
    """A dropped operand as the slot keeps it: for a leaf (the VJP's ``wrt``), the same tensor
    with its data swapped for one element broadcast to its shape, so its block can go; else
    nothing."""
    if not (isinstance(x, torch.Tensor) and x.requires_grad):
        return None
    x.data = x.new_empty((1,) * x.dim() or ()).expand(x.shape)
    return x


def _dropping(slot, leaves, dropped: int):
    """Saved-tensor hooks that keep, for a tensor viewing a dropped operand's storage, only
    where it lies; the VJP rebuilds it on the operand gathered again (``slot.regathered``)."""
    if not dropped:
        return contextlib.nullcontext()
    storages = {leaves[k].untyped_storage().data_ptr(): k for k in range(len(leaves))
                if dropped >> k & 1}

    def pack(t):
        k = storages.get(t.untyped_storage().data_ptr()) if t.device.type != "meta" else None
        return t if k is None else _Dropped(k, t)

    def unpack(saved):
        if type(saved) is not _Dropped:
            return saved
        return slot.regathered[saved.operand].as_strided(saved.size, saved.stride, saved.offset)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


class ForwardFailed(Exception):
    """The VJP of a call whose kernel did not run fails with the forward's error (which the
    client has heard of already), so a gradient read names the cause, not the VJP."""

    def __init__(self, error):
        super().__init__(error)
        self.error = error


def vjp(ctx, slot, *grads, needs, retain, dropped):
    """The gradient blocks of the operands ``needs`` marks, from the graph in ``slot``; after
    one gradient block per result come the ``dropped`` operands, gathered again."""
    if getattr(slot, "error", None) is not None:
        raise ForwardFailed(slot.error)
    if slot is None or not hasattr(slot, "outs"):
        raise RuntimeError("the forward's autograd graph is gone (backward through the graph a "
                           "second time? use retain_graph=True the first time)")
    if dropped:
        grads, again = grads[:len(grads) - len(dropped)], grads[len(grads) - len(dropped):]
        slot.regathered = dict(zip(dropped, again))
    outs = slot.outs if isinstance(slot.outs, (tuple, list)) else (slot.outs,)
    pairs = [(o, g) for o, g in zip(outs, grads)
             if isinstance(o, torch.Tensor) and o.requires_grad]
    wrt = [x for x, need in zip(slot.leaves, needs) if need]
    found = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs],
                                retain_graph=retain, allow_unused=True) if pairs else \
        [None] * len(wrt)
    if not retain:
        del slot.leaves, slot.outs
    if dropped:
        del slot.regathered
    result = tuple(torch.zeros_like(x) if g is None else g for g, x in zip(found, wrt))
    return result[0] if len(result) == 1 else result
