"""Replayed windows on a host: the lowered program, and the stream task that runs it.

The controller defines a window shape once (``P.DefineProgram``) and then sends one short Replay
record per window of that shape (``controller/replay.py``). A host lowers the program once per
device (``HostProgram.lower``): each step's kernel, context and operand sources resolved, and
the step after which each result is last needed. A replay then costs the host's main thread one blob
lookup per outside input and one blob per result left alive, and its stream one task
(``ProgramRun``) that runs the kernels, results passed in a list: no record decoded, no blob
made or task queued per kernel, and each temporary freed right after its last use.

From its ``STRAIGHT_AFTER``-th run on, a lowering runs as one generated Python function
(``straight_line``): its steps unrolled, each operand's source and each result's place written
into the code. What a kernel costs the stream beside torch's own call drops from 1.4-1.8 µs (a
loop interpreting the steps) to 0.1-0.2 µs (64 adds of 8 floats, where torch's own call takes
1.5-2.0). The loop (``ProgramRun._run``) stays for the runs before, for a run that copies
inputs for the compiler, and for everything after a failure.

The loop runs each kernel through the host's one step runner (``execute.Runner.run_step``), as
a kernel record's task does, so failures behave alike: a kernel that raises reports its error
(naming its site and first result) and every result depending on it carries that Failure on
(``runtime/failures.py``), quietly; in the values list a Failure stands in for a result that did
not come to be.
"""

from __future__ import annotations

import time

from .. import protocol as P
from .execute import Runner
from .failures import Failure, first_failure, tell
from .stream import record_uses
from .vjp import Saved

# where a step's operand comes from (ProgramRun._run's index); SLOT: the run's autograd slots
# and bits (``Lowering.slots``), made on the host's main thread when the replay is queued
MADE, OUTSIDE, SCALAR, SLOT = 0, 1, 2, 3
# runs of a lowering before it is generated: compiling costs about 45 µs a step on the stream
# thread, what some 35 runs save
STRAIGHT_AFTER = 32


class ProgramStep:
    """One kernel of a program on one device."""

    __slots__ = ("call", "ctx", "sources", "site", "outs", "frees", "original", "slot")

    def __init__(self, call, ctx, sources, site, outs, slot=None):
        self.call, self.ctx, self.sources, self.site, self.outs = call, ctx, sources, site, outs
        self.slot = slot  # a recorded call's: where its Saved slot is in the run's slots
        self.frees = ()  # the results (by number) last needed by this step
        self.original = None  # a fused step's kernels, one by one (runtime/fusion.py)


def mark_frees(steps: list) -> None:
    """Sets each step's ``frees``: the results (by number) that no later step reads."""
    last = {}
    for n, step in enumerate(steps):
        step.frees = ()
        for kind, k in step.sources:
            if kind == MADE:
                last[k] = n
    frees: dict = {}
    for ref, n in last.items():
        frees.setdefault(n, []).append(ref)
    for n, refs in frees.items():
        steps[n].frees = tuple(refs)


class HostProgram:
    """A ``P.DefineProgram`` as this host runs it."""

    def __init__(self, host, rec):
        d = P.DefineProgram(*rec)
        self.n_outside, self.n_made, self.n_scalars = d.n_outside, d.n_made, d.n_scalars
        self.definition = d
        # (a recorded call's step carries its Recorded: [key's scalar, needs, gathered])
        self.steps = [(host.calls[call], site, stream, outs, operands, *recorded)
                      for call, site, stream, outs, operands, *recorded in d.steps]
        self.stream = self.steps[0][2] if self.steps else 0
        self.survivors = d.survivors
        self.released = d.released
        devices = {}
        for call, *_ in self.steps:
            for dev in call.devices:
                devices.setdefault(dev.index, dev)
        self.devices = list(devices.values())
        # each survivor's spec, and the devices holding its blob (its kernel's result mesh)
        self.survivor_specs = {}
        for call, _, _, outs, *_ in self.steps:
            for ref, spec in zip(outs, call.out_specs):
                if ref >= 0:
                    self.survivor_specs[ref] = (spec, call.out_devices)

    def lower(self, dev) -> Lowering:
        """This program on ``dev`` (the host keeps it: ``fusion.Hot``)."""
        steps, reads, slots = [], set(), []
        for call, site, _, outs, operands, *recorded in self.steps:
            if dev not in call.devices:
                continue
            sources = []
            for ref, is_tensor in zip(operands, call.mask):
                if not is_tensor:
                    sources.append((SCALAR, ref))
                elif ref >= 0:
                    sources.append((MADE, ref))
                else:
                    sources.append((OUTSIDE, -1 - ref))
                    reads.add(-1 - ref)
            for ref in outs:  # an in-place kernel's result is its (outside) operand
                if ref < 0:
                    reads.add(-1 - ref)
            slot = None
            if call.saves:  # its graph into a new slot, after its operands (``vjp.recording``)
                (key, needs, gathered), = recorded
                slot = len(slots)
                sources += [(SLOT, slot), (SLOT, slot + 1), (SLOT, slot + 2)]
                slots += [(MAKE, key, None), (BITS, P.bits_of(needs), None),
                          (BITS, P.bits_of(gathered), None)]
            elif call.reads_saved:  # its key operand becomes the slot its forward filled
                sources[0] = (SLOT, len(slots))
                slots.append((FIND, operands[0], call.kwargs["retain"]))
            steps.append(ProgramStep(call, call.context(dev) if call.uses_context else None,
                                     tuple(sources), site, tuple(outs), slot))
        mark_frees(steps)
        return Lowering(steps, sorted(reads), self.survivors, tuple(slots))

    def expand(self, rec) -> list:
        """A Replay record of this program as the records it stands for: its kernels, then the
        releases of the outside inputs it releases and of the results it does not leave alive."""
        d = self.definition
        outside, made, scalars = self.bind(rec)

        def tensor(ref):
            return made[ref] if ref >= 0 else outside[-1 - ref]

        records = []
        for (call, *_), (call_id, site, stream, outs, operands, *recorded) in zip(self.steps,
                                                                                  d.steps):
            values = [tensor(r) if is_tensor else scalars[r]
                      for r, is_tensor in zip(operands, call.mask)]
            if recorded:
                (key, needs, gathered), = recorded
                records.append([P.RECORDED, tensor(outs[0]), scalars[key], needs, gathered])
            records.append([P.KERNEL, call_id, site, stream, *map(tensor, outs), *values])
        alive = set(d.survivors)
        records += [outside[j] for j in d.released]
        records += [t for k, t in enumerate(made) if k not in alive]
        return records

    def bind(self, rec):
        """``(outside ids, result ids, scalar values)`` of a Replay record."""
        a = 2 + self.n_outside
        b = a + self.n_made
        return rec[2:a], rec[a:b], rec[b:]


MAKE, BITS, FIND = 0, 1, 2  # a run's slot entry: a new Saved, bits, or the slot a key names


class Lowering:
    """A program's ``steps`` on one device, the outside inputs they read (``reads``, by number)
    and the results that outlive the program (``survivors``, by number); ``fast``: the steps as
    one generated function (``straight_line``), made on run ``STRAIGHT_AFTER``. ``slots``: what
    each run's autograd entries are (``slots_of``): ``(MAKE, key's scalar, _)`` a recorded
    call's new slot, ``(BITS, bits, _)`` its bits, ``(FIND, key's scalar, retain)`` the slot a
    VJP reads."""

    __slots__ = ("steps", "reads", "survivors", "fast", "runs", "slots")

    def __init__(self, steps: list, reads: list, survivors, slots=()):
        self.steps, self.reads, self.survivors = steps, reads, frozenset(survivors)
        self.fast, self.runs, self.slots = None, 0, slots

    def fast_function(self):
        """``fast``, or None while it is not worth the compile. Called on the stream thread
        that runs the program."""
        if self.fast is None:
            self.runs += 1
            if self.runs >= STRAIGHT_AFTER:
                self.fast = straight_line(self.steps, self.reads, self.survivors)
        return self.fast


def slots_of(lowering: Lowering, graphs: dict, dev_index: int, scalars) -> list:
    """A run's autograd entries (``Lowering.slots``), made in program order on the host's main
    thread as ``Host.saved_slots`` makes a kernel's: a recorded call's slot is kept under its
    tape key in ``graphs`` (the host's), a VJP's found there (and let go unless retained)."""
    out = []
    for kind, value, retain in lowering.slots:
        if kind == BITS:
            out.append(value)
        elif kind == MAKE:
            slot = Saved()
            graphs.setdefault(scalars[value], {})[dev_index] = slot
            out.append(slot)
        else:
            key = scalars[value]
            table = graphs.get(key, {})
            out.append(table.get(dev_index) if retain else table.pop(dev_index, None))
            if not table:
                graphs.pop(key, None)
    return out


def straight_line(steps: list, reads: list, survivors):
    """``steps`` unrolled into ``run(outside, scalars, blobs, values, slots)``, which does what
    ``ProgramRun._run`` does for a run without failures: each kernel called on its operands
    (``values[k]``, ``outside[j].tensor``, ``scalars[k]``), its results stored, survivors' blobs
    holding theirs, each temporary dropped after its last use. It returns None, or where the
    loop must take over: ``(0, None)`` before any kernel when an outside input carries an error,
    ``(n, exception)`` when step ``n``'s kernel raised (its results not stored)."""
    env, lines = {}, ["def run(outside, scalars, blobs, values, slots):"]
    lines += [f"    if outside[{j}].error is not None: return 0, None" for j in reads]
    lines += ["    n = 0", "    try:"]
    for n, step in enumerate(steps):
        call = step.call
        env[f"fn{n}"] = call.fn
        args = [f"ctx{n}"] if step.ctx is not None else []
        if step.ctx is not None:
            env[f"ctx{n}"] = step.ctx
        args += [f"values[{k}]" if kind == MADE else f"outside[{k}].tensor" if kind == OUTSIDE
                 else f"scalars[{k}]" if kind == SCALAR else f"slots[{k}]"
                 for kind, k in step.sources]
        if call.kwargs:
            env[f"kwargs{n}"] = call.kwargs
            args.append(f"**kwargs{n}")
        lines += [f"        n = {n}", f"        result = fn{n}({', '.join(args)})"]
        for i, ref in enumerate(step.outs):
            value = "result" if len(step.outs) == 1 else f"result[{i}]"
            if ref < 0:  # written in place: the outside input's blob holds the result
                lines.append(f"        outside[{-1 - ref}].hold({value})")
                continue
            lines.append(f"        values[{ref}] = {value}")
            if ref in survivors:  # (a device outside the result's mesh has no blob for it)
                lines += [f"        blob = blobs.get({ref})",
                          f"        if blob is not None: blob.hold(values[{ref}])"]
        lines += [f"        values[{ref}] = None" for ref in step.frees]
    lines += ["    except Exception as e:  # the loop reports it", "        return n, e"]
    exec(compile("\n".join(lines), "<dtorch program>", "exec"), env)
    return env["run"]


class ProgramRun(Runner):
    """One replay of a program on one device, queued on its stream as one task. ``lowering``:
    the program on this device; ``outside``: the outside inputs' Blobs by number (None where
    this device reads none); ``blobs``: the survivors' Blobs by result number; ``ids``: the
    outside inputs' and the results' ids (a failure names its kernel's first result);
    ``probe``: a fusion.Probe on the run that makes the program hot, else None; ``hot``: the
    program's fusion.Hot, whose ``spent`` the run's time is added to, while the program may
    still become hot (else None)."""

    __slots__ = ("lowering", "outside", "blobs", "ids", "scalars", "host", "probe", "hot",
                 "slots")
    waits = None  # a replayed window waits for nothing (the controller made sure)

    def __init__(self, lowering, outside, blobs, ids, scalars, host, probe=None, hot=None,
                 slots=()):
        self.lowering, self.outside, self.blobs = lowering, outside, blobs
        self.ids, self.scalars, self.host, self.probe = ids, scalars, host, probe
        self.hot, self.slots = hot, slots  # (slots: ``slots_of``)

    @property
    def trace_name(self) -> str:
        steps = self.lowering.steps
        fused = sum(step.original is not None for step in steps)
        return f"replay ({len(steps)} kernels" + (f", {fused} fused)" if fused else ")")

    @property
    def site(self) -> int:
        steps = self.lowering.steps
        return steps[-1].site if steps else 0

    def __call__(self) -> None:
        if self.host.cuda:
            record_uses(self.outside)
        values = [None] * len(self.ids[1])
        if self.hot is None:
            self._run_all(values)
        else:
            t0 = time.perf_counter()
            self._run_all(values)
            self.hot.spent += time.perf_counter() - t0
        if self.probe is not None:
            self.probe.done()

    def _run_all(self, values) -> None:
        steps = self.lowering.steps
        fast = self.lowering.fast_function() if self.probe is None else None
        if fast is None:
            self._run(steps, values, self.probe)
            return
        stop = fast(self.outside, self.scalars, self.blobs, values, self.slots)
        if stop is None:
            return
        n, raised = stop  # the loop goes on from there
        if raised is not None:
            step = steps[n]
            self._store(step, self.failed(step.site, step.call.name, raised, step), values)
            n += 1
        self._run(steps[n:], values, None)

    def _run(self, steps, values, probe) -> None:
        outside = self.outside
        where = (values, outside, self.scalars, self.slots)  # by a source's kind
        run_step, store = self.run_step, self._store
        for index, step in enumerate(steps):
            if probe is not None:
                probe.capture(index, values, outside)
            operands = [where[kind][k] for kind, k in step.sources]
            if step.original is not None and first_failure(operands) is not None:
                # a fused step's input failed: its kernels one by one, so that only the
                # results depending on the failure carry it
                self._run(step.original, values, None)
                for ref in step.frees:
                    values[ref] = None
                continue
            store(step, run_step(step.call, step.ctx, operands, step.site, step), values)

    def tell(self, failure: Failure, step=None) -> Failure:
        """Names ``step``'s kernel by its first result."""
        outside_ids, made = self.ids
        first = step.outs[0] if step.outs else None
        key = 0 if first is None else made[first] if first >= 0 else outside_ids[-1 - first]
        tell(self.host, failure, key)
        return failure

    def _store(self, step, result, values) -> None:
        """``step``'s results (a Failure: each of them carries it) into ``values`` and the
        blobs that hold them; then the temporaries it read last are dropped."""
        if type(result) is Failure:
            results = [result] * len(step.outs)
            if step.slot is not None:  # a recorded call that did not run: its VJP fails
                self.slots[step.slot].error = result
        elif len(step.outs) == 1:
            results = (result,)
        else:
            results = result
        blobs, outside = self.blobs, self.outside
        for ref, value in zip(step.outs, results):
            if ref >= 0:
                values[ref] = value
                blob = blobs.get(ref)
            else:
                blob = outside[-1 - ref]  # written in place
            if blob is not None:
                if type(value) is Failure:
                    blob.error = value
                else:
                    blob.hold(value)
        for ref in step.frees:
            values[ref] = None
