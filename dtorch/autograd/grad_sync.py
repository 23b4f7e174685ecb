"""Gradient synchronization switched off for some leaves: DDP's ``no_sync()`` and FSDP2's
``set_requires_gradient_sync(False)``, which are one mechanism here.

A data-parallel weight's gradient leaves the backward as a Partial (each device's sum over its
own examples) and one reduction makes it the ``.grad`` (an all-reduce, or ZeRO-2's
reduce-scatter: ``tape._land``). Reductions are linear, so k micro-steps need only one: while a
leaf's sync is off, a gradient that still needs a reduction is summed *unreduced* on its
devices and held here, and nothing communicates. The held sum is settled (added to the new
gradient and reduced once, in the backward's buckets) by the next backward that reaches the
leaf with its sync on, by any syncing backward's end, or by reading ``.grad`` (the reduction of
the sum so far, so every read is the gradient torch's single process would have). A gradient
that needs no reduction (a tensor-parallel shard with no data-parallel dim) lands in ``.grad``
as usual. Assigning ``.grad`` (``zero_grad()``) drops what is held, as it replaces torch's local
gradient.

Sync is counted per leaf, so contexts nest; the state is shared by all threads, under one lock.
"""

from __future__ import annotations

import contextlib
import threading

from ..tensor import DEFERRED_GRADS

_lock = threading.RLock()
_off: dict = {}  # leaf id -> how many holders switched its sync off
_held: dict = {}  # leaf id -> (leaf, its unreduced gradient summed so far, its lander)
_switched_off: dict = {}  # holder -> the leaves it switched off (``switch``)


def set_sync(leaves, enabled: bool) -> None:
    """Switches the gradient sync of ``leaves`` on or off (counted: one ``on`` per ``off``)."""
    with _lock:
        for leaf in leaves:
            n = _off.get(leaf._id, 0) + (-1 if enabled else 1)
            if n > 0:
                _off[leaf._id] = n
            else:
                _off.pop(leaf._id, None)


def switch(holder, leaves, enabled: bool) -> None:
    """A named holder's switch (FSDP2's ``set_requires_gradient_sync``): not counted, so
    switching it off twice takes one switch on."""
    with _lock:
        if not enabled and holder not in _switched_off:
            _switched_off[holder] = list(leaves)
            set_sync(_switched_off[holder], False)
        elif enabled and holder in _switched_off:
            set_sync(_switched_off.pop(holder), True)


@contextlib.contextmanager
def no_sync(leaves):
    """Backwards inside skip the reduction of ``leaves``' gradients; the first after it
    reduces what they summed."""
    leaves = list(leaves)
    set_sync(leaves, False)
    try:
        yield
    finally:
        set_sync(leaves, True)


def needs_reduction(g, spec) -> bool:
    """Whether ``g`` becomes ``.grad`` (laid out as ``spec``) only through a reduction."""
    return any(p.is_partial() and not q.is_partial()
               for p, q in zip(g._spec.placements, spec.placements))


def settle(leaf, g, spec, add, land):
    """The gradient to land for ``leaf`` (``g`` plus what is held for it), or None when its sync
    is off and ``g`` needs a reduction: then it is held. ``add`` sums two gradients; ``land``
    reduces one into ``.grad`` at once (for a read of ``.grad``)."""
    with _lock:
        held = _held.pop(leaf._id, None)
        if held is not None:
            g = add(held[1], g)
            DEFERRED_GRADS.pop(leaf._id, None)
        if leaf._id in _off and needs_reduction(g, spec):
            _held[leaf._id] = (leaf, g, land)
            DEFERRED_GRADS[leaf._id] = _settle
            return None
        return g


def take_synced() -> list:
    """``(leaf, held gradient)`` of every leaf whose sync is on again, taken out."""
    with _lock:
        out = [(leaf, g) for i, (leaf, g, _) in list(_held.items()) if i not in _off]
        for leaf, _ in out:
            del _held[leaf._id]
            DEFERRED_GRADS.pop(leaf._id, None)
        return out


def _settle(leaf, read: bool) -> None:
    """``leaf.grad`` read (the held gradient reduced into it now) or assigned (dropped)."""
    with _lock:
        held = _held.pop(leaf._id, None)
        DEFERRED_GRADS.pop(leaf._id, None)
    if held is not None and read:
        _, g, land = held
        land(leaf, g)
