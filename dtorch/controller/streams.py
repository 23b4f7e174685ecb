"""The stream rule: which accesses to a storage on different streams must wait for each other.

A storage is the memory behind a tensor and its views. Every access to it happens on one stream
at one position (kernels and fetches count the items queued on each stream). A wait is for the
event the host records at the other stream's tail, and a write waits for every access on the
other streams, so the last write is ordered after all that came before it: a reader need only
wait for the last write, and a writer for the accesses since.

    read after write    a kernel waits for the last write of each storage it reads
    write after read    an in-place kernel waits for the reads since the last write
    write after write   ... and for that write (a result is a fresh storage: no wait)

An in-place kernel writes operand 0, and the operands its ``WRITES`` flags name. A VIEW kernel
reads operand 0's storage (it may copy: ``contiguous``, ``reshape``) and its results alias it;
their users also wait for the view's making, since its handle is made there.

``StreamOrder`` is what the rule remembers across batches. The stream pass
(``passes.assign_streams``) asks it kernel by kernel (``kernel``, ``release``, ``fetch``);
replay (``controller/replay.py``) asks it once per window, through the ``Footprint`` the
window's first lowering left (``replay``), and it leaves the state the pass would have left.
"""

from __future__ import annotations

import bisect
from typing import NamedTuple

from ..protocol import INPLACE, VIEW, WRITES, written

COMM_STREAM = 0  # one per device, shared by all graphs: collectives keep one order everywhere


def compute_stream(graph_id: int) -> int:
    return graph_id + 1


def written_operands(node) -> tuple:
    """The tensors an in-place kernel writes: operand 0, and those its ``WRITES`` flags name."""
    flags, operands = node.call.flags, node.operands
    if flags < WRITES:  # (the common case, without the search for the others)
        return (operands[0],)
    return (operands[0], *(operands[k] for k in written(flags)))


class Storage:
    """What the rule knows of one storage: the stream of its last write (``writer``) and that
    write's position (``written``), the last access's position on the writer's stream
    (``last``), each other stream's last access since the write (``others``: stream ->
    position, or None) and how many live views share it besides the tensor that made it
    (``views``)."""

    __slots__ = ("last", "others", "views", "writer", "written")

    def __init__(self, stream: int, written: int, last: int):
        self.writer, self.written, self.last = stream, written, last
        self.others = None
        self.views = 0

    def touch(self, stream: int, pos: int) -> None:
        """An access at position ``pos`` of ``stream``."""
        if self.writer == stream:
            self.last = pos
        elif self.others is None:
            self.others = {stream: pos}
        else:
            self.others[stream] = pos

    def state(self) -> tuple:
        return self.writer, self.written, self.last, self.others, self.views


class View(NamedTuple):
    """Where a view's handle was made: the key of its base's storage, and the stream, position
    and device set (``CallInfo.scope``) of the kernel that made it."""

    storage: int
    stream: int
    position: int
    scope: int


class Access(NamedTuple):
    """What a window does to the storage of one of its outside inputs (offsets: 1 for the
    window's first kernel). ``scopes``: the device sets of the kernels that read the input
    itself (a view made in the window is read on its base's devices); ``written``: the offset
    of the storage's last write in the window (0: none); ``last``: of its last access."""

    scopes: frozenset
    written: int
    last: int


class Footprint(NamedTuple):
    """What a window of kernels on one stream, with no wait, does to the stream state, by the
    numbers of its outside inputs and results (``replay.shape_of``): the ``positions`` it
    takes; its ``inputs`` (number -> Access; not one only its dead code read); the inputs it
    ``released``; and the ``results`` it leaves alive, as ``(number, written, last)``."""

    stream: int
    positions: int
    inputs: dict
    released: frozenset
    results: tuple

    @classmethod
    def of(cls, stream: int, kernels: list, outside: list, made: list,
           released: set) -> Footprint | None:
        """The footprint of ``kernels`` (a window's lowering, in order) binding ``outside``
        and ``made``; None when a view made in the window outlives it (its base's storage
        would have to be kept too)."""
        base = {}  # a view made in the window -> the tensor whose storage it views
        scopes, last, wrote = {}, {}, {}  # by the tensor that names the storage
        for pos, node in enumerate(kernels, 1):
            flags = node.call.flags
            for t in node.inputs:
                scopes.setdefault(t, set()).add(node.call.scope)
                last[base.get(t, t)] = pos
            if flags & INPLACE:
                for t in written_operands(node):
                    root = base.get(t, t)
                    wrote[root] = last[root] = pos
            elif flags & VIEW:
                root = base.get(node.operands[0], node.operands[0])
                base.update((o, root) for o in node.outs)
            else:
                for o in node.outs:
                    wrote[o] = last[o] = pos
        survivors = [k for k, t in enumerate(made) if t not in released]
        if any(made[k] in base for k in survivors):
            return None
        number = {t: k for k, t in enumerate(outside)}
        inputs = {number[t]: Access(frozenset(s), wrote.get(t, 0), last[t])
                  for t, s in scopes.items() if t in number}
        return cls(stream, len(kernels), inputs,
                   frozenset(number[t] for t in released if t in number),
                   tuple((k, wrote[made[k]], last[made[k]]) for k in survivors))


ZERO = [0]  # the positions held on a stream never used: none (a missing one reads as 0)


class Projection(NamedTuple):
    """Part of the stream state (``StreamOrder.project``): its ``shape`` (comparable), the
    ``slots`` its positions fill, each stream's ``values`` (its positions held, sorted, 0
    among them), the storage keys it reached that are not names (``externals``), and each
    stream's position (``top``)."""

    shape: tuple
    slots: list
    values: dict
    externals: tuple
    top: dict


class StreamOrder:
    """The rule's memory. ``position[s]`` counts the items queued on stream s. ``storages``
    holds the Storage of every live tensor's storage, keyed by the id of the tensor that made
    it. ``roots[v]`` is the View of a view v (a VIEW kernel's result, or a view of a view).
    ``covered[s, scope][t]`` is the position on stream t that stream s has waited for on the
    devices of ``scope`` (``CallInfo.scope``): a host records a WAIT's events on the waiting
    kernel's devices only."""

    def __init__(self):
        self.position: dict = {}
        self.storages: dict = {}
        self.roots: dict = {}
        self.covered: dict = {}

    def state(self) -> tuple:
        """All that the rule remembers, comparable with ``==``."""
        return (self.position, {k: m.state() for k, m in self.storages.items()}, self.roots,
                self.covered)

    def _storage(self, tensor: int) -> tuple:
        """``(storage key, View or None, Storage or None)`` of ``tensor``."""
        view = self.roots.get(tensor)
        key = tensor if view is None else view.storage
        return key, view, self.storages.get(key)

    # -- the stream pass, kernel by kernel ------------------------------------------------------
    def kernel(self, node, s: int) -> list | None:
        """Queues kernel ``node`` (an Operator) on stream ``s``; returns the streams it must
        wait for first (a WAIT record's), or None."""
        flags = node.call.flags
        pos = self.position[s] = self.position.get(s, 0) + 1
        after = None  # stream -> the position on it this kernel must come after
        roots, storages = self.roots, self.storages
        # the reads spelled out, not a method per operand: this runs for every operand
        for i in node.inputs:
            view = roots.get(i)
            m = storages.get(i if view is None else view.storage)
            if m is not None:
                if m.writer != s:  # read after write
                    after = _join(after, m.writer, m.written)
                m.touch(s, pos)
            if view is not None and view.stream != s:  # the view's handle is made there
                after = _join(after, view.stream, view.position)
        if flags & INPLACE:
            for t in written_operands(node):
                after = self._write(t, s, pos, after)
        elif flags & VIEW:
            self._alias(node.operands[0], node.outs, s, pos, node.call.scope)
        else:
            for o in node.outs:
                storages[o] = Storage(s, pos, pos)
        return self._waits(s, node.call.scope, after) if after else None

    def _write(self, tensor: int, s: int, pos: int, after):
        """A write of ``tensor``'s storage at position ``pos`` of stream ``s``, after every
        access to it on the other streams."""
        key, _, m = self._storage(tensor)
        if m is None:  # a tensor this runtime did not make: nothing to order against
            self.storages[key] = Storage(s, pos, pos)
            return after
        if m.writer != s:  # write after write, and after the reads on the writer's stream
            after = _join(after, m.writer, m.last)
        if m.others is not None:
            for t, p in m.others.items():  # write after read
                if t != s:
                    after = _join(after, t, p)
        m.writer, m.written, m.last, m.others = s, pos, pos, None
        return after

    def _alias(self, base: int, views, s: int, pos: int, scope: int) -> None:
        """``views`` (split and unbind make several) share ``base``'s storage."""
        key, _, m = self._storage(base)
        if m is None:
            for o in views:
                self.storages[o] = Storage(s, pos, pos)
            return
        for o in views:
            self.roots[o] = View(key, s, pos, scope)
        m.views += len(views)

    def release(self, tensor: int) -> None:
        """``tensor``'s id is gone; its storage too, unless a view of it lives."""
        view = self.roots.pop(tensor, None) if self.roots else None
        key = tensor if view is None else view.storage
        m = self.storages.pop(key, None)
        if m is not None and m.views:  # one of its ids is gone, not the storage
            m.views -= 1
            self.storages[key] = m

    def fetch(self, tensor: int) -> int:
        """The stream a fetch of ``tensor`` queues on: that of its storage's last write, or of
        its view's making if that came later (the view read the storage, so it came after the
        write; a later write waited for it): either way it needs no wait. It counts as a read
        there, so a write queued later on another stream waits for it (write after read)."""
        _, view, m = self._storage(tensor)
        if m is None:  # nothing made it (a fetch of a released id fails on any stream)
            return compute_stream(0)
        s = m.writer
        if view is not None and view.stream != s and not self._has_waited(s, view):
            s = view.stream  # made after the last write
        pos = self.position[s] = self.position.get(s, 0) + 1
        m.touch(s, pos)
        return s

    def _has_waited(self, s: int, view: View) -> bool:
        """Stream ``s`` has waited for the point where ``view`` was made, on its devices."""
        return self.covered.get((s, view.scope), {}).get(view.stream, 0) >= view.position

    def _waits(self, s: int, scope: int, after: dict) -> list | None:
        """The streams of ``after`` (stream -> position, none of them ``s``) that a kernel of
        ``scope`` on ``s`` must wait for. A stream whose own waits cover the others' positions
        goes first, so those need no wait of their own (a compute stream that waited for a
        collective which waited for another graph)."""
        streams = list(after)
        if len(streams) > 1:
            def covers(t):
                seen = self.covered.get((t, scope), {})
                return sum(seen.get(u, 0) >= p for u, p in after.items())

            streams.sort(key=covers, reverse=True)
        waits = None
        for t in streams:
            if self._wait_for(s, scope, t, after[t]):
                if waits is None:
                    waits = []
                waits.append(t)
        return waits

    def _wait_for(self, s: int, scope: int, t: int, pos: int) -> bool:
        """Whether stream ``s`` must wait for stream ``t`` up to ``pos`` on ``scope``'s
        devices, and if so, the wait. The host records the event at t's tail, so the wait
        covers all of t queued so far, and all that t had waited for: that is kept too, so a
        wait through a third stream is not repeated."""
        covered = self.covered.get((s, scope))
        if covered is None:
            covered = self.covered[s, scope] = {}
        if covered.get(t, 0) >= pos:
            return False
        covered[t] = self.position.get(t, 0)
        for u, q in self.covered.get((t, scope), {}).items():
            if u != s and covered.get(u, 0) < q:
                covered[u] = q
        return True

    # -- replay, window by window ---------------------------------------------------------------
    def replay(self, footprint: Footprint, outside: list, made: list) -> bool:
        """Moves the state on past a window of ``footprint`` binding ``outside`` and ``made``,
        as the stream pass would; False (nothing done) when the pass would make it wait, or
        might: an outside input is written there and was touched on another stream, or is read
        there and was last written (or, for a view, made) on another stream not yet waited
        for on the devices of the window's kernels that read it."""
        if not self._needs_no_wait(footprint, outside):
            return False
        stream = footprint.stream
        start = self.position.get(stream, 0)
        self.position[stream] = start + footprint.positions
        reached = {}  # storage key -> [Storage or None, last write's offset, last offset]
        for k, access in footprint.inputs.items():
            key, _, m = self._storage(outside[k])
            seen = reached.get(key)
            if seen is None:
                reached[key] = [m, access.written, access.last]
            else:  # two inputs of one storage (a tensor and its view)
                seen[1], seen[2] = max(seen[1], access.written), max(seen[2], access.last)
        for key, (m, wrote, last) in reached.items():
            if wrote:
                if m is None:
                    self.storages[key] = Storage(stream, start + wrote, start + last)
                else:  # (m.writer is the stream, with no other's access since)
                    m.written, m.last = start + wrote, start + last
            elif m is not None:  # a read, here or on the writer's stream
                m.touch(stream, start + last)
        for k in footprint.released:
            self.release(outside[k])
        for k, wrote, last in footprint.results:
            self.storages[made[k]] = Storage(stream, start + wrote, start + last)
        return True

    def _needs_no_wait(self, footprint: Footprint, outside: list) -> bool:
        stream, covered = footprint.stream, self.covered
        for k, access in footprint.inputs.items():
            _, view, m = self._storage(outside[k])
            if view is not None and view.stream != stream and not all(
                    covered.get((stream, scope), {}).get(view.stream, 0) >= view.position
                    for scope in access.scopes):
                return False  # a view whose handle was made on a stream not waited for
            if m is None:
                continue
            if access.written:
                if m.writer != stream or m.others is not None:
                    return False
            elif m.writer != stream and not all(
                    covered.get((stream, scope), {}).get(m.writer, 0) >= m.written
                    for scope in access.scopes):
                return False
        return True

    # -- a whole batch's effect, learnt once (``controller/step_lowering.py``) ------------------
    def project(self, names: list, externals: tuple = ()) -> Projection:
        """The part of the state the pass reads and writes for a batch whose tensors are
        ``names`` (distinct ids): each name's view, the storages the names and their views
        reach, those of ``externals`` (storage keys), the streams' positions and ``covered``,
        each position a slot ``(stream, position)``. The pass only compares positions on one
        stream, and makes new ones past a stream's end, so it decides alike on two states
        whose ``shape`` is equal: their structure, with each slot's rank on its stream."""
        index = {i: k for k, i in enumerate(names)}
        externals = list(externals)
        named = {key: -1 - j for j, key in enumerate(externals)}  # storage key -> its name
        slots = []

        def slot(t: int, p: int) -> int:
            slots.append((t, p))
            return len(slots) - 1

        def storage_name(key) -> int:  # a name's index, or -1 - j: the j-th external
            n = named.get(key)
            if n is None:
                n = index.get(key)
                if n is None:
                    n = -1 - len(externals)
                    externals.append(key)
                named[key] = n
            return n

        views = []
        for i in names:
            view = self.roots.get(i)
            if view is None:
                storage_name(i)
                views.append(None)
            else:
                views.append((storage_name(view.storage), view.stream,
                              slot(view.stream, view.position), view.scope))
        storages = []
        for key, n in list(named.items()):
            m = self.storages.get(key)
            storages.append((n, None if m is None else (
                m.writer, slot(m.writer, m.written), slot(m.writer, m.last),
                None if m.others is None else tuple((t, slot(t, p))
                                                    for t, p in m.others.items()),
                m.views)))
        position = tuple((t, slot(t, p)) for t, p in sorted(self.position.items()))
        covered = tuple((key, tuple((t, slot(t, p)) for t, p in sorted(seen.items())))
                        for key, seen in sorted(self.covered.items()))
        values: dict = {}
        for t, p in slots:
            values.setdefault(t, {0}).add(p)
        values = {t: sorted(v) for t, v in values.items()}
        ranks = tuple((t, bisect.bisect_left(values[t], p)) for t, p in slots)
        return Projection((tuple(views), tuple(storages), position, covered, ranks),
                          slots, values, tuple(externals), dict(self.position))

    @staticmethod
    def moves(before: Projection, after: Projection) -> tuple | None:
        """What a batch did to the state, from projections ``before`` and after it (``after``
        over the names of ``before`` and those the batch made, its externals seeded with
        ``before``'s), as ``restore`` takes it: each slot after as a new position (an offset
        past its stream's end before) or as the rank of one the state held before. None when
        a slot is neither, or the batch reached a storage ``before`` did not."""
        if after.externals != before.externals:
            return None
        slots = []
        for t, p in after.slots:
            top = before.top.get(t, 0)
            if p > top:
                slots.append((t, True, p - top))
                continue
            held = before.values.get(t, ZERO)
            r = bisect.bisect_left(held, p)
            if r == len(held) or held[r] != p:
                return None
            slots.append((t, False, r))
        return after.shape[:4], tuple(slots)

    def restore(self, moves: tuple, before: Projection, names: list) -> None:
        """The state a batch with these ``moves`` leaves, from the state ``before`` projects
        (its shape the one the moves were learnt from), its names now ``names``."""
        (views, storages, position, covered), slots = moves
        top, values, externals = before.top, before.values, before.externals
        at = [top.get(t, 0) + v if new else values.get(t, ZERO)[v] for t, new, v in slots]
        for n, state in storages:
            key = names[n] if n >= 0 else externals[-1 - n]
            if state is None:
                self.storages.pop(key, None)
                continue
            writer, wrote, last, others, shared = state
            m = self.storages[key] = Storage(writer, at[wrote], at[last])
            if others is not None:
                m.others = {t: at[k] for t, k in others}
            m.views = shared
        for i, view in zip(names, views):
            if view is None:
                self.roots.pop(i, None)
            else:
                n, stream, k, scope = view
                self.roots[i] = View(names[n] if n >= 0 else externals[-1 - n], stream, at[k],
                                     scope)
        self.position.update((t, at[k]) for t, k in position)
        self.covered = {key: {t: at[k] for t, k in seen} for key, seen in covered}


def _join(after, t: int, pos: int) -> dict:
    """``after`` (None: empty) now also comes after position ``pos`` of stream ``t``."""
    if after is None:
        return {t: pos}
    if after.get(t, 0) < pos:
        after[t] = pos
    return after
