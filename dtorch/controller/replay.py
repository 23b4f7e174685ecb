"""Replay: a run of records shaped like one already lowered skips the passes.

Programs issue the same calls again and again: loop bodies, layers, decoding steps. What
``PASSES`` decide for a run of operators and releases depends only on its *shape* -- which calls,
from which lines, reading which results of which records -- and, for the streams, on where its
outside inputs were last touched. So the controller finds where each batch's records repeat with
a period (``periodic``), cuts that stretch into windows of whole periods (``windows``), and lowers
each window shape once. A later window of the same shape (``shape_of``) takes the decisions as
they are: which of its records survive dead-code elimination, which chain, the stream, which
releases follow. Its own records already carry its ids and scalars, so replaying is picking them
out (``Replayer.run``): no Operator is made and no pass runs.

When a window is cached (a ``LoweredWindow``) and replayed:

    cached     its lowering is the window's own records on one compute stream with no wait:
               no collective or redistribute, no definition made, no view it makes outliving
               it, each recorded call right after its Recorded record (the step carries the
               record's bits; its tape key is a value, as a VJP's key operand is)
    replayed   the passes would insert no wait either (``StreamOrder.replay``): an outside input
               it writes was last written on that stream with no other stream's access since;
               one it reads was last written (a view: and made) on that stream, or on one this
               stream has waited for since, on the devices of the kernels that read it

Replay then moves the stream state on exactly as ``assign_streams`` would have, through the
same rule (``controller/streams.py``): the first lowering of a shape leaves its ``Footprint``,
where in the window each outside input's storage and each result left alive was last written
and accessed. (An input only its dead code read is not accessed: the passes dropped that code.)

A batch with no period (a training step: one batch, flushed where the loss is read, repeating
only from batch to batch) offers its longest run of operators, releases and Recorded records as
one window (``segment``), cached the second time its shape is seen and replayed from the third.

A replayed window's dead-code elimination and chains stop at its edges (it was lowered alone, as
was the first window of its shape); windows that do not replay are lowered with their neighbours.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

from .. import config, protocol as P
from ..protocol import COMM, INPLACE, RECORD, RECORDED
from .logical_graph import Operator
from .passes import Chain
from .step_lowering import StepLowering
from .streams import Footprint, compute_stream

MIN_WINDOW = 128  # records: shorter windows of a short period cost more per record than they save
MAX_PERIOD = 2048  # records
MAX_TRIES = 32  # candidate periods tried per batch (each costs a comparison of the stretch)
MAX_PROGRAMS = 4096  # cached window shapes; past it the cache starts again
RELEASE = None  # in a window's key: a release's ref follows
ANNOUNCED = "recorded"  # in a window's key: a Recorded record's two bit sets follow
# a Recorded record's key in ``windows``: an int (keys sort) below every other record's
RECORDED_KEYS, HASH_BITS = -(1 << 62), (1 << 60) - 1
SEGMENT = 2  # a cut's kind: a run with no period (``segment``), cached the second time seen


class LoweredWindow(NamedTuple):
    """A lowered window shape, defined to the hosts as ``id`` (``P.DefineProgram``, which
    holds its kernels), and what a replay of it does to the stream state (``footprint``: its
    kernels run on its graph's compute stream)."""

    id: int
    footprint: Footprint


UNFIT = LoweredWindow(0, None)  # never replays


def periodic(keys: list, min_length: int = 0):
    """``(start, end, period)`` of a stretch around the middle of ``keys`` at least
    ``min_length`` long that repeats every ``period`` items (so a batch may begin and end with
    other work), or None. A candidate period that holds only briefly (two releases in a row
    repeat with period 1) is passed over for the next."""
    n = len(keys)
    middle = n // 2
    if not n:
        return None
    first, p = keys[middle], 0
    for _ in range(MAX_TRIES):
        try:
            p = keys.index(first, middle + p + 1) - middle
        except ValueError:
            return None
        if p > MAX_PERIOD or middle + 2 * p > n:
            return None
        if keys[middle:middle + p] == keys[middle + p:middle + 2 * p]:
            start, end = middle, middle + 2 * p
            while start > 0 and keys[start - 1] == keys[start - 1 + p]:
                start -= 1
            while end < n and keys[end] == keys[end - p]:
                end += 1
            if end - start >= min_length:
                return start, end, p
    return None


def phase(calls: dict, records: list, keys: list, start: int, p: int) -> int:
    """Where, from ``start``, the windows of a stretch with period ``p`` begin: the same
    wherever a batch cut the loop, so that a loop's windows have one shape (one program for the
    hosts to lower, and to fuse, rather than one per phase). At the cut that the fewest tensors
    cross (made in the period before it, not yet released): a window then holds its temporaries'
    whole lives, so that views die inside it and dead code can be dropped. Ties go to the least
    rotation of the keys. Needs three periods of the stretch; the first period's records only
    tell which tensors are alive at its end."""
    first = start + p
    made, released = {}, {}
    for i in range(start, start + 2 * p):
        rec = records[i]
        if type(rec) is int:
            released[rec] = i
        elif rec[0] == P.OP:  # (not a Recorded)
            call = calls[rec[P.OP_CALL]]
            if call.flags & INPLACE:  # its result is its operand, made elsewhere: else the
                continue  # cut would depend on where in the loop the stretch began
            for t in rec[P.OP_OUTS:P.OP_OUTS + len(call.outputs)]:
                made.setdefault(t, i)
    crossing = [0] * (p + 1)  # a difference array over the cuts
    for t, m in made.items():
        # alive at the cuts c with m < c <= its release (and c - p <= m: made in the period
        # before c), as a run of cuts
        lo = max(m + 1, first)
        hi = min(released.get(t, start + 3 * p), m + p, first + p - 1)
        if lo <= hi:
            crossing[lo - first] += 1
            crossing[hi - first + 1] -= 1
    running, costs = 0, []
    for k in range(p):
        running += crossing[k]
        costs.append(running)
    best = min(costs)
    candidates = [k for k in range(p) if costs[k] == best]
    if len(candidates) > 1:
        doubled = keys[first:first + 2 * p]
        candidates.sort(key=lambda k: doubled[k:k + p])
    return candidates[0]  # the same phase from start as from first


def windows(records: list, calls: dict) -> list:
    """``[(start, end, is_window)]`` covering a batch's ``records`` (definitions taken out):
    the windows of whole periods of operators and releases, and the segments around them, which
    are lowered as usual."""
    n = len(records)
    if n < MIN_WINDOW:
        return [(0, n, False)]
    # an operator is its call and site, a release -1, a Recorded its bits, any other record a
    # key of its own
    op, call_at, site_at = P.OP, P.OP_CALL, P.OP_SITE  # (locals: read once per record)
    keys = [-1 if type(r) is int else r[call_at] << 24 | r[site_at] if r[0] == op
            else RECORDED_KEYS - (hash((r[3], r[4])) & HASH_BITS) if r[0] == RECORDED
            else -2 - k
            for k, r in enumerate(records)]
    found = periodic(keys, MIN_WINDOW)
    if found is None:
        return segment(records, keys)
    start, end, p = found
    if end - start >= 3 * p:
        start += phase(calls, records, keys, start, p)
    size = p * -(-MIN_WINDOW // p)
    if end - start < size:  # (a single window may still repeat one of an earlier batch)
        return [(0, n, False)]
    out = [(0, start, False)] if start else []
    while start + size <= end:
        out.append((start, start + size, True))
        start += size
    if start < n:
        out.append((start, n, False))
    return out


def segment(records: list, keys: list) -> list:
    """The cuts of a batch with no period: its longest run of operators, releases and
    Recorded records as one ``SEGMENT`` window, when it is long enough. A training step is one
    batch (flushed where the loss is read) that repeats only from batch to batch."""
    n, best, start = len(records), (0, 0), 0
    for k, key in enumerate(keys + [-2]):
        if RECORDED_KEYS < key < -1:  # another record (not an operator, release or
            # Recorded): a run ends
            if k - start > best[1] - best[0]:
                best = (start, k)
            start = k + 1
    a, b = best
    if b - a < MIN_WINDOW:
        return [(0, n, False)]
    return [cut for cut in ((0, a, False), (a, b, SEGMENT), (b, n, False)) if cut[1] > cut[0]]


def shape_of(calls: dict, records: list):
    """``(key, outside, made, scalars)`` of a window. ``key`` tells its shape: each record's
    call and site, and the *ref* of each tensor operand, result and release (k >= 0: the
    window's k-th result; -1 - j: its j-th outside input), in one flat tuple (a call's id tells
    how many refs follow it, ``RELEASE`` that one does). ``outside`` and ``made`` list those
    ids in order, ``scalars`` the scalar operands' values."""
    refs: dict = {}  # id -> its ref
    outside, made, scalars, key = [], [], [], []
    add = key.append
    call_at, site_at, first_out, op = P.OP_CALL, P.OP_SITE, P.OP_OUTS, P.OP
    # a ref's lookup is spelled out where it is needed, not a function: this runs for every
    # tensor of every record of a window, and is most of what a replay costs the controller
    for rec in records:
        if type(rec) is int:
            ref = refs.get(rec)
            if ref is None:
                ref = refs[rec] = -1 - len(outside)
                outside.append(rec)
            add(RELEASE)
            add(ref)
            continue
        if rec[0] != op:  # a Recorded (``graph_of``: its kernel is the next record): its
            add(ANNOUNCED)  # bits are the shape, its tape key a value
            add(rec[3])
            add(rec[4])
            scalars.append(rec[2])
            continue
        reads, scalars_at, end_out = calls[rec[call_at]].places
        add(rec[call_at])
        add(rec[site_at])
        for k in reads:
            t = rec[k]
            ref = refs.get(t)
            if ref is None:
                ref = refs[t] = -1 - len(outside)
                outside.append(t)
            add(ref)
        for k in scalars_at:
            scalars.append(rec[k])
        for k in range(first_out, end_out):
            t = rec[k]
            ref = refs.get(t)  # known: an in-place call's result is its operand
            if ref is None:
                ref = refs[t] = len(made)
                made.append(t)
            add(ref)
    return tuple(key), outside, made, scalars


def _refs(calls: dict, records: list, outside: list, made: list) -> dict:
    """For each operator record of a window (by index): its results' refs and its operands' (a
    tensor's ref, or a scalar's index among the window's scalars), numbered as ``shape_of``
    numbered them (``outside`` and ``made`` are its lists)."""
    refs = {t: -1 - j for j, t in enumerate(outside)}
    refs.update((t, k) for k, t in enumerate(made))
    n_scalars, out, recorded = 0, {}, None
    for i, rec in enumerate(records):
        if type(rec) is int:
            continue
        if rec[0] == RECORDED:  # its key: the next scalar; it announces the next record
            recorded = [n_scalars, rec[3], rec[4]]
            n_scalars += 1
            continue
        call = calls[rec[P.OP_CALL]]
        n_out = len(call.outputs)
        operands = []
        for t, spec in zip(P.op_operands(rec, n_out), call.inputs):
            if spec:
                operands.append(refs[t])
            else:
                operands.append(n_scalars)
                n_scalars += 1
        out[i] = ([refs[t] for t in P.op_outs(rec, n_out)], operands, recorded)
        recorded = None
    return out


class Replayer:
    """The controller's cache of lowered window shapes. ``passes(nodes)`` is the usual path
    (``PASSES``), ``encode(nodes)`` makes host records of its output."""

    def __init__(self, graph, passes, encode):
        self.graph, self.passes, self.encode = graph, passes, encode
        self.programs: dict = {}  # (graph, window key) -> LoweredWindow
        self.program_ids = itertools.count(1)
        self.fit: dict = {}  # call id -> whether a window with it may replay
        self.replayed = 0  # windows replayed in the last batch (for its trace span)
        self.held: list = []  # the last batch's records after its last window (``run``)
        self.segments_seen: set = set()  # segment shapes seen once (``segment``)
        self.lowered_windows = 0  # windows lowered so far (``learn``), and replayed
        self.replayed_windows = 0
        self.replayed_steps = 0  # Steps made from their record (``step_lowering``)
        self.arity: dict = {}  # program id -> how many ids a REPLAY of it names

    def run(self, records: list, out: list, hold: bool = False) -> None:
        """Appends the host records of a batch's ``records`` (definitions taken out; operators
        still their wire records) to ``out``, after those ``held`` from the batch before.
        ``hold``: when the batch ends inside a loop, the operators and releases after its last
        window are ``held`` for the next batch, where they begin a window again; lowered at the
        batch's edge they would cost the passes and run unfused (8% of a small loop's time)."""
        self.replayed = 0
        if self.held:
            records, self.held = self.held + records, []
        if not config.replay:
            out += self.encode(self.passes(self.nodes(records)))
            return
        cuts = windows(records, self.graph.calls)
        if hold and len(cuts) > 1 and cuts[-2][2] and not cuts[-1][2]:
            tail = records[cuts[-1][0]:]
            if all(type(r) is int or r[0] == P.OP for r in tail) and self.graph_of(
                    records[cuts[-2][0]:cuts[-2][1]]) is not None:
                self.held = tail
                cuts.pop()
        pending = []  # records lowered together: a window's edges would cut chains and DCE
        for start, end, is_window in cuts:
            window = records[start:end]
            graph = self.graph_of(window) if is_window else None
            if graph is None:
                pending += window
            else:
                self.take_window(window, graph, is_window, pending, out)
        self.lower(pending, out)

    def take_window(self, window: list, graph: int, kind, pending: list, out: list):
        """A window of ``graph``'s operators: replayed, cached, or added to ``pending``
        (lowered with its neighbours). Returns its program, when it has one, and its binding
        ``(outside, made, scalars)``."""
        self.lower(pending, out)  # what came before first: it moves the stream state on
        key, outside, made, scalars = shape_of(self.graph.calls, window)
        key = (graph, key)
        program = self.programs.get(key)
        if program is not None and program is not UNFIT and self.advance(
                program, outside, made):
            self.emit_replay(program, outside, made, scalars, out)
            return program, (outside, made, scalars)
        if program is not None or kind == SEGMENT and self.first_sight(key):
            pending += window  # lowered with its neighbours
            return None, None
        lowered = self.passes(self.nodes(window))
        program = self.learn(key, window, outside, made, len(scalars), lowered, out)
        out += self.encode(lowered)
        return program, (outside, made, scalars)

    def emit_replay(self, program, outside: list, made: list, scalars: list, out: list) -> None:
        out.append([P.REPLAY, program.id, *outside, *made, *scalars])
        self.replayed += 1
        self.replayed_windows += 1

    def run_step(self, template, rec, out: list) -> None:
        """A replayed step's Step record (``step_templates``): its program replayed from the
        record alone once learnt; else its records expanded and lowered as one window (a
        segment: cached the second time, replayed from the third), or, when the step cannot
        be one window (it communicates), as any batch."""
        self.replayed = 0
        if self.held:  # (a batch before it ended inside a loop)
            held, self.held = self.held, []
            self.lower(held, out)
        ids, dynamic = template.split(rec)
        if config.replay and template.fast is not None:
            bound = template.bind(ids, dynamic)
            if bound is not None and self.advance(*bound[:3]):
                self.emit_replay(*bound, out)
                return
        if not (config.replay and template.whole):
            self.run_lowered_step(template, ids, dynamic, out)
            return
        records = template.expand(ids, dynamic)
        graph = self.graph_of(records)
        if graph is None:
            template.whole = False
            self.run_lowered_step(template, ids, dynamic, out)
            return
        pending: list = []
        program, binding = self.take_window(records, graph, SEGMENT, pending, out)
        self.lower(pending, out)
        if program is not None:
            template.learn(self.graph.calls, program, ids, dynamic, *binding)
        elif binding is not None:  # lowered, and no program: a view outlives the step
            template.whole = False

    def run_lowered_step(self, template, ids: list, dynamic: list, out: list) -> None:
        """A Step that is not one window: the hosts' records of its lowering made from the
        record once learnt (``step_lowering``), else its records expanded and lowered."""
        if not config.replay:
            self.run(template.expand(ids, dynamic), out)
            return
        lowering = template.lowering
        if lowering is None:
            lowering = template.lowering = StepLowering(template, self.graph.calls)
        if lowering.learnt is not None and lowering.replay(self.graph, ids, dynamic, out):
            self.replayed += lowering.learnt.windows
            self.replayed_windows += lowering.learnt.windows
            self.replayed_steps += 1
            return
        lowering.observe(self, ids, dynamic, out)

    def first_sight(self, key) -> bool:
        """Whether a segment of shape ``key`` is seen for the first time: a batch that does not
        repeat is not worth a program."""
        if key in self.segments_seen:
            return False
        if len(self.segments_seen) >= MAX_PROGRAMS:
            self.segments_seen.clear()
        self.segments_seen.add(key)
        return True

    def lower(self, pending: list, out: list) -> None:
        """The records waiting in ``pending`` through the passes, into ``out``."""
        if pending:
            out += self.encode(self.passes(self.nodes(pending)))
            pending.clear()

    def graph_of(self, window: list) -> int | None:
        """The graph whose operators make up ``window``, or None when it cannot replay: its
        operators come from several graphs (threads issuing at once), one of its calls is a
        collective or a redistribute (known from the calls, so such a window costs no shape),
        or a Recorded record is not followed by the kernel it announces."""
        fit, op, graph = self.fit, P.OP, None
        for k, r in enumerate(window):
            if type(r) is not int and r[0] == RECORDED:
                after = window[k + 1] if k + 1 < len(window) else None
                if type(after) is int or after is None or after[0] != op or \
                        after[P.OP_OUTS] != r[1]:
                    return None
            elif type(r) is not int and r[0] == op:
                if graph is None:
                    graph = r[P.OP_STREAM]
                elif r[P.OP_STREAM] != graph:
                    return None
                ok = fit.get(r[P.OP_CALL])
                if ok is RECORD:  # its Recorded must be in the window, just before it
                    before = window[k - 1] if k else None
                    if type(before) is int or before is None or before[0] != RECORDED:
                        return None
                    continue
                if ok is None:
                    call = self.graph.calls[r[P.OP_CALL]]
                    ok = fit[call.id] = not call.flags & COMM and call.kind in (
                        P.CallKind.OPERATOR, P.CallKind.VJP)
                    if ok and call.flags & RECORD:
                        fit[call.id] = RECORD
                        before = window[k - 1] if k else None
                        if type(before) is int or before is None or before[0] != RECORDED:
                            return None
                if not ok:
                    return None
        return graph

    def nodes(self, records: list) -> list:
        """The passes' nodes: an Operator for each operator's record."""
        calls, op = self.graph.calls, P.OP
        return [Operator(calls[r[P.OP_CALL]], r) if type(r) is not int and r[0] == op else r
                for r in records]

    # -- caching (a miss) -----------------------------------------------------------------------
    def learn(self, key, window: list, outside: list, made: list, n_scalars: int,
              lowered: list, out: list) -> LoweredWindow | None:
        """Caches the lowering of ``window`` (the passes' output nodes) if it qualifies, and
        defines it to the hosts (through ``out``, and for hosts that start later, the graph's
        definitions); returns the program, if it made one."""
        stream = compute_stream(key[0])
        index = {id(r): i for i, r in enumerate(window) if type(r) is not int}
        refs = _refs(self.graph.calls, window, outside, made)
        steps, kernels = [], []
        for node in lowered:
            if type(node) is int:
                continue  # a release: the hosts free what the window made at its last use
            if type(node) is not Chain and type(node) is not Operator and \
                    node[0] == RECORDED:
                continue  # its kernel's step carries it (``_refs``)
            members = node.members if type(node) is Chain else [node] if type(node) is \
                Operator else None
            if members is None:  # a definition, or another record: not a pure window
                return None
            for m in members:  # (its calls may replay: ``graph_of``)
                if m.waits or id(m.rec) not in index or m.stream != stream:
                    return None
                outs, operands, recorded = refs[index[id(m.rec)]]
                steps.append([m.call.id, m.site, stream, outs, operands, *(
                    [recorded] if recorded else [])])
            kernels += members
        released = {r for r in window if type(r) is int}
        if len(self.programs) >= MAX_PROGRAMS:
            self.programs.clear()
            self.arity.clear()
        footprint = Footprint.of(stream, kernels, outside, made, released)
        if footprint is None:  # a view left alive: lowered as usual
            self.programs[key] = UNFIT
            return None
        program = LoweredWindow(next(self.program_ids), footprint)
        self.programs[key] = program
        self.arity[program.id] = len(outside) + len(made)
        self.lowered_windows += 1
        definition = list(P.DefineProgram(
            P.DEFINE_PROGRAM, program.id, len(outside), len(made), n_scalars, steps,
            [k for k, _, _ in footprint.results], sorted(footprint.released)))
        self.graph.definitions.append(definition)
        out.append(definition)
        return program

    # -- replaying (a hit) ----------------------------------------------------------------------
    def advance(self, program: LoweredWindow, outside: list, made: list) -> bool:
        """Moves the stream state on past a replay of ``program`` binding ``outside`` and
        ``made``; False (nothing done) when the passes would make it wait
        (``StreamOrder.replay``)."""
        return self.graph.streams.replay(program.footprint, outside, made)
