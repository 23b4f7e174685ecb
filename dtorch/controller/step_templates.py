"""Replayed steps on the controller: a client's ``DefineStep`` (``dtorch.step_replay``) kept,
and each ``Step`` record bound to it.

A Step brings a replay's ids and changing scalars. ``expand`` makes the records the client
would have sent (what the passes and ``Replayer`` take as any batch). Once the whole step has a
lowered program (``Replayer.run_step``: the step is one window, with no collective or
redistribute), ``learn`` works out where that program's outside inputs, results and scalars
come from in a Step -- an id of the Step, a fixed id (a parameter), a dynamic scalar, a fixed
one -- and checks it against the batch it learnt from; from then on ``bind`` gives a Step's
program arguments directly: the controller neither expands nor reads the step's records.

``bind`` declines (None: the step is expanded and lowered) when the Step's ids are not all
distinct or one of them is a fixed id: the program's shape numbers equal ids once, so such a
Step would not have its shape.
"""

from __future__ import annotations

from .. import protocol as P


class StepTemplate:
    """One ``DefineStep``; ``whole``: whether its step may be one window (False once it was
    not); ``fast``: the program and its argument sources, once learnt."""

    def __init__(self, rec):
        d = P.DefineStep(*rec)
        self.id, self.n_ids, self.entries = d.id, d.n_ids, d.entries
        self.whole = True
        self.fast = None
        self.lowering = None  # when it is not one window: ``step_lowering.StepLowering``

    def split(self, rec) -> tuple:
        """A Step record's ids and dynamic scalars."""
        return rec[2:2 + self.n_ids], rec[2 + self.n_ids:]

    def expand(self, ids, dynamic, mark=None) -> list:
        """The step's records with this replay's ids and scalars (lists: the passes write
        operator records in place). ``mark(fields, k, value, source)``, if given, gives what
        goes at place ``k`` instead of ``value``, the Step's ``source``-th value
        (``step_lowering.marked``)."""
        out, d, n = [], 0, len(ids)
        for e in self.entries:
            if type(e) is int:
                out.append(ids[e])
                continue
            fields, holes, dyn_at = e
            rec = list(fields)
            for k, j in holes:
                rec[k] = ids[j] if mark is None else mark(fields, k, ids[j], j)
            for k in dyn_at:
                rec[k] = dynamic[d] if mark is None else mark(fields, k, dynamic[d], n + d)
                d += 1
            out.append(rec)
        return out

    def learn(self, calls: dict, program, ids, dynamic, outside, made, scalars) -> None:
        """Where ``program``'s arguments come from in a Step, found from one replay's ids,
        scalars and the program's binding of them (``replay.shape_of``'s ``outside``, ``made``
        and ``scalars``); kept only when it gives that binding back."""
        index = {i: j for j, i in enumerate(ids)}
        if len(index) != len(ids) or any(i not in index for i in made):
            return
        fixed_ids = frozenset(i for i in outside if i not in index)
        sources = ([], [], [])  # outside, made, scalars: (position, Step index) of each hole
        values = (list(outside), list(made), [])
        for position, i in enumerate(outside):
            if i in index:
                sources[0].append((position, index[i]))
        sources[1].extend((position, index[i]) for position, i in enumerate(made))
        d = 0
        for e in self.entries:  # the scalars in ``shape_of``'s order
            if type(e) is int:
                continue
            fields, holes, dyn_at = e
            holes, dynamic_at = dict(holes), {}
            for k in dyn_at:
                dynamic_at[k] = d
                d += 1
            if fields[0] == P.RECORDED:  # its tape key: an id the Step brings
                at = [2]
            else:
                at = calls[fields[P.OP_CALL]].places[1]
            for k in at:
                position = len(values[2])
                values[2].append(fields[k])
                if k in holes:
                    sources[2].append((position, holes[k]))
                elif k in dynamic_at:
                    sources[2].append((position, len(ids) + dynamic_at[k]))
        self.fast = (program, fixed_ids, values, sources)
        if self.bind(ids, dynamic) != (program, outside, made, scalars):
            self.fast = None

    def bind(self, ids, dynamic):
        """``(program, outside, made, scalars)`` of a Step, or None (see the module
        docstring)."""
        program, fixed_ids, values, sources = self.fast
        if len(set(ids)) != len(ids) or not fixed_ids.isdisjoint(ids):
            return None
        given = [*ids, *dynamic]
        bound = []
        for base, holes in zip(values, sources):
            got = list(base)
            for position, j in holes:
                got[position] = given[j]
            bound.append(got)
        return (program, *bound)
