"""A replayed step that communicates, lowered once: the hosts' records of its Step made from
the record alone.

A step with collectives or redistributes cannot be one replayed window (a host program runs on
one stream, with no wait: ``runtime/program.py``), so its Step records are expanded and lowered
by the passes (``Replayer.run``). What the passes make of them depends only on the records'
shape and on the part of the stream state the step's tensors reach (``StreamOrder.project``):
equal shapes there, equal decisions, waits included. So ``StepLowering`` watches the lowering
of a step's expansions (``observe``): the records the hosts got, with each value a Step brought
-- an id, a scalar it changes -- and each temporary the controller made (a redistribute's steps)
found in them as a hole, and what the step did to the stream state (``StreamOrder.moves``).
Two steps in a row alike in all three make it learnt, and the records with holes are defined
to the hosts (``P.DefineHostStep``); from then on a Step whose stream state has the learnt
shape (``replay``) is one HostStep record with its own values and fresh temporaries, and the
state moved on as the passes would have: nothing expanded, no pass run, and the hosts fill the
holes.

Where the Step's values sit in the lowered records: ids by place (a kernel's results and tensor
operands, a release, a Recorded's tensor, a REPLAY's ids) and value (a Step's ids are distinct
and none is an id the template fixes); scalars -- among them tape keys, which are ids the Step
brings -- by type: the observed expansion carries them as ``Given`` ints and floats, which the
passes pass along as they are.
"""

from __future__ import annotations

from typing import NamedTuple

from .. import protocol as P

LEARN_TRIES = 8  # observed expansions in a row, none learnt or replayed, before a step that
# never repeats is left to the passes
RECORD, RELEASE, CHAIN = P.RECORD_ENTRY, P.RELEASE_ENTRY, P.CHAIN_ENTRY  # an entry's kind


class Given(int):
    """An int a Step brought, in a scalar's place (``source``: its index in the Step)."""

    source = -1


class GivenFloat(float):
    source = -1


def given(value, source: int):
    out = Given(value) if type(value) is int else GivenFloat(value)
    out.source = source
    return out


class Learnt(NamedTuple):
    """A step's lowering as observed: the names the state held before (indices in ids + fixed
    ids), that state's shape, the names after (temporaries after those), the moves, the
    entries, the temporaries made, and the REPLAY records among the entries."""

    before_names: list
    shape: tuple
    after_names: list
    moves: tuple
    entries: tuple
    n_temps: int
    windows: int


class StepLowering:
    """What the controller learnt of one ``StepTemplate``'s lowering (``learnt``, a
    ``Learnt``)."""

    def __init__(self, template, calls: dict):
        self.template = template
        self.fixed = fixed_ids(template, calls)
        self.fixed_set = frozenset(self.fixed)
        self.seen = self.learnt = None
        self.definition = template.id  # its DefineHostStep's id
        self.tries = 0

    # -- a Step from the record alone -----------------------------------------------------------
    def replay(self, graph, ids: list, dynamic: list, out: list) -> bool:
        """The hosts' records of a Step into ``out`` and the stream state moved on; False
        (nothing done) when the state has not the learnt shape or the ids are not fit."""
        learnt = self.learnt
        if len(set(ids)) != len(ids) or not self.fixed_set.isdisjoint(ids):
            return False
        # (the names the state did not hold before a learnt step are the ids it makes, new
        # in every Step, or ids it does not touch: neither needs looking at)
        names = [*ids, *self.fixed]
        order = graph.streams
        before = order.project([names[k] for k in learnt.before_names])
        if before.shape != learnt.shape:
            return False
        temps = [graph.temp_id() for _ in range(learnt.n_temps)]
        names += temps
        order.restore(learnt.moves, before, [names[k] for k in learnt.after_names])
        out.append([P.HOST_STEP, self.definition, *ids, *dynamic, *temps])
        self.tries = 0
        return True

    # -- learning ----------------------------------------------------------------------------
    def observe(self, replayer, ids: list, dynamic: list, out: list) -> None:
        """Lowers a Step's expansion through ``replayer`` into ``out`` as any batch, and learns
        from it while tries are left (``LEARN_TRIES``: a learnt or replayed Step gives them
        back, so that a state that changes for good now and then is learnt again)."""
        template, graph = self.template, replayer.graph
        names = [*ids, *self.fixed]
        records = None
        if self.tries < LEARN_TRIES and len(set(names)) == len(names) and all(
                type(v) is int or type(v) is float for v in dynamic):
            records = marked(template, graph.calls, ids, dynamic)
        if records is None:
            replayer.run(template.expand(ids, dynamic), out)
            return
        self.tries += 1
        order = graph.streams
        before_names = [k for k, i in enumerate(names) if i in order.storages or i in order.roots]
        before = order.project([names[k] for k in before_names])
        first, start = graph.next_temp, len(out)
        replayer.run(records, out)
        temps = list(range(first, graph.next_temp, -1))  # (temporaries count down)
        names += temps
        held = {k for k, i in enumerate(names) if i in order.storages or i in order.roots}
        after_names = sorted(held.union(before_names))  # (those it released: gone after)
        after = order.project([names[k] for k in after_names], before.externals)
        moves = order.moves(before, after)
        entries = lowered_entries(out[start:], ids, len(dynamic), temps, graph.calls,
                                  replayer.arity)
        out[start:] = plain(out[start:])  # the Step's scalars as what they are
        if moves is None or entries is None:
            self.seen = None
            return
        n_replays = sum(1 for kind, fields, _ in entries if kind == RECORD and
                        fields[0] == P.REPLAY)
        seen = Learnt(before_names, before.shape, after_names, moves, entries, len(temps),
                      n_replays)
        if seen == self.seen:  # defined to the hosts (and to hosts that start later) under
            # the template's id: a lowering learnt again, or a template the client learnt
            # again, replaces the one before
            self.learnt, self.tries = seen, 0
            definition = [P.DEFINE_HOST_STEP, self.definition, entries]
            graph.definitions[:] = [d for d in graph.definitions if d[0] != P.DEFINE_HOST_STEP
                                    or d[1] != self.definition]
            graph.definitions.append(definition)
            out.append(definition)
        self.seen = seen


def fixed_ids(template, calls: dict) -> list:
    """The ids a template's records name that no Step brings (parameters, optimizer state), in
    order."""
    out: dict = {}
    for e in template.entries:
        if type(e) is int:
            continue
        fields, holes, _ = e
        filled = {k for k, _ in holes}
        if fields[0] == P.RECORDED:
            at = (1,)
        else:
            reads, _, end_out = calls[fields[P.OP_CALL]].places
            at = (*range(P.OP_OUTS, end_out), *reads)
        out.update((fields[k], None) for k in at if k not in filled)
    return list(out)


def marked(template, calls: dict, ids: list, dynamic: list) -> list:
    """The template's records with this Step's values (``StepTemplate.expand``), each value in
    a scalar's place (a dynamic one, or an id used as a tape key) a ``Given``."""
    def mark(fields, k, value, source):
        scalars = (2,) if fields[0] == P.RECORDED else calls[fields[P.OP_CALL]].places[1]
        return given(value, source) if k in scalars else value

    return template.expand(ids, dynamic, mark)


def lowered_entries(records: list, ids: list, n_dynamic: int, temps: list, calls: dict,
                    arity: dict) -> tuple | None:
    """``records`` (what the hosts got for an observed Step) as entries with holes: ``(kind,
    fields, holes)``, a hole ``(place, source)`` where source indexes ``[*ids, *dynamic,
    *temporaries]``; a release's fields its id, its holes its source or -1. None when a
    record is one a Step cannot repeat (a definition: the lowering was a first one)."""
    source = {i: j for j, i in enumerate(ids)}
    source.update((t, len(ids) + n_dynamic + k) for k, t in enumerate(temps))

    def entry(rec, ids_at, scalars_at):
        fields, holes = list(rec), []
        for k in ids_at:
            j = source.get(rec[k])
            if j is not None:
                holes.append((k, j))
                fields[k] = None
        for k in scalars_at:
            v = rec[k]
            if type(v) is Given or type(v) is GivenFloat:
                holes.append((k, v.source))
                fields[k] = None
        return tuple(fields), tuple(holes)

    def kernel(rec):
        reads, scalars, end_out = calls[rec[P.OP_CALL]].places
        return entry(rec, (*range(P.OP_OUTS, end_out), *reads), scalars)

    out = []
    for rec in records:
        if type(rec) is int:
            out.append((RELEASE, None if rec in source else rec, source.get(rec, -1)))
            continue
        tag = rec[0]
        if tag == P.KERNEL:
            out.append((RECORD, *kernel(rec)))
        elif tag == P.CHAIN:
            out.append((CHAIN, tuple(kernel(m) for m in rec[1:]), ()))
        elif tag == P.WAIT:
            out.append((RECORD, tuple(rec), ()))
        elif tag == P.RECORDED:
            out.append((RECORD, *entry(rec, (1,), (2,))))
        elif tag == P.REPLAY and rec[1] in arity:
            n = arity[rec[1]]
            out.append((RECORD, *entry(rec, range(2, 2 + n), range(2 + n, len(rec)))))
        else:
            return None
    return tuple(out)


def plain(records: list) -> list:
    """``records`` with each ``Given`` the int or float it stands for."""
    def value(v):
        t = type(v)
        return int(v) if t is Given else float(v) if t is GivenFloat else plain(v) if \
            t is list else v

    return [value(v) for v in records]
