"""Replayed windows on a host: the lowered program, and the stream task that runs it.

The controller defines a window shape once (``P.DefineProgram``) and then sends one short Replay
record per window of that shape (``controller/replay.py``). A host lowers the program once per
device (``Program.lower``): each step's kernel, context and operand sources resolved, and the step
after which each result is last needed. A replay then costs the host's main thread one blob
lookup per outside input and one blob per result left alive, and its stream one task
(``ProgramRun``) that runs the kernels in a loop, results passed in a list: no record decoded,
no blob made or task queued per kernel, and each temporary freed right after its last use.

Failures behave as in ``KernelRun``: a kernel that raises reports its error (naming its site and
first result) and every result depending on it carries that error on, quietly.
"""

from __future__ import annotations

import time

from .. import protocol as P

MADE, OUTSIDE, SCALAR = 0, 1, 2  # where a step's operand comes from


class Step:
    """One kernel of a program on one device."""

    __slots__ = ("call", "ctx", "sources", "site", "outs", "frees", "original")

    def __init__(self, call, ctx, sources, site, outs):
        self.call, self.ctx, self.sources, self.site, self.outs = call, ctx, sources, site, outs
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


class Program:
    """A ``P.DefineProgram`` as this host runs it."""

    def __init__(self, host, rec):
        d = P.DefineProgram(*rec)
        self.n_outside, self.n_made, self.n_scalars = d.n_outside, d.n_made, d.n_scalars
        self.definition = d
        self.steps = [(host.calls[call], site, stream, outs, operands)
                      for call, site, stream, outs, operands in d.steps]
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
        for call, _, _, outs, _ in self.steps:
            for ref, spec in zip(outs, call.out_specs):
                if ref >= 0:
                    self.survivor_specs[ref] = (spec, call.out_devices)

    def lower(self, dev):
        """``(steps, outside inputs read)`` of this program on ``dev`` (the host keeps them:
        ``fusion.Hot``)."""
        steps, reads = [], set()
        for call, site, _, outs, operands in self.steps:
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
            steps.append(Step(call, call.context(dev) if call.uses_context else None,
                              tuple(sources), site, tuple(outs)))
        mark_frees(steps)
        return steps, sorted(reads)

    def expand(self, rec) -> list:
        """A Replay record of this program as the records it stands for: its kernels, then the
        releases of the outside inputs it releases and of the results it does not leave alive."""
        d = self.definition
        outside, made, scalars = self.bind(rec)

        def tensor(ref):
            return made[ref] if ref >= 0 else outside[-1 - ref]

        records = []
        for (call, _, _, _, _), (call_id, site, stream, outs, operands) in zip(self.steps,
                                                                                 d.steps):
            values = [tensor(r) if is_tensor else scalars[r]
                      for r, is_tensor in zip(operands, call.mask)]
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


class Failed:
    """A result that did not come to be: the error it carries on."""

    __slots__ = ("error",)

    def __init__(self, error):
        self.error = error


class ProgramRun:
    """One replay of a program on one device, queued on its stream as one task. ``outside``:
    the outside inputs' Blobs by number (None where this device reads none); ``blobs``: the
    survivors' Blobs by result number; ``ids``: the outside inputs' and the results' ids (a
    failure names its kernel's first result); ``probe``: a fusion.Probe on the run that makes
    the program hot, else None; ``hot``: the program's fusion.Hot, whose ``spent`` the run's
    time is added to, while the program may still become hot (else None)."""

    __slots__ = ("steps", "outside", "blobs", "ids", "scalars", "host", "probe", "hot")
    waits = None  # a replayed window waits for nothing (the controller made sure)

    def __init__(self, steps, outside, blobs, ids, scalars, host, probe=None, hot=None):
        self.steps, self.outside, self.blobs = steps, outside, blobs
        self.ids, self.scalars, self.host, self.probe = ids, scalars, host, probe
        self.hot = hot

    @property
    def trace_name(self) -> str:
        fused = sum(step.original is not None for step in self.steps)
        return f"replay ({len(self.steps)} kernels" + (f", {fused} fused)" if fused else ")")

    @property
    def site(self) -> int:
        return self.steps[-1].site if self.steps else 0

    def __call__(self) -> None:
        values = [None] * len(self.ids[1])
        if self.hot is None:
            self._run(self.steps, values, self.probe)
        else:
            t0 = time.perf_counter()
            self._run(self.steps, values, self.probe)
            self.hot.spent += time.perf_counter() - t0
        if self.probe is not None:
            self.probe.done()

    def _run(self, steps, values, probe) -> None:
        outside, scalars, blobs = self.outside, self.scalars, self.blobs
        for index, step in enumerate(steps):
            if probe is not None:
                probe.capture(index, values, outside)
            args, error = [], None
            for kind, k in step.sources:
                if kind == MADE:
                    v = values[k]
                    if type(v) is Failed:
                        error = v.error
                        break
                elif kind == OUTSIDE:
                    b = outside[k]
                    if b.error is not None:
                        error = b.error
                        break
                    v = b.tensor
                else:
                    v = scalars[k]
                args.append(v)
            if error is not None and step.original is not None:
                # a fused step's input failed: its kernels one by one, so that only the
                # results depending on the failure carry it
                self._run(step.original, values, None)
                for ref in step.frees:
                    values[ref] = None
                continue
            if error is None:
                call = step.call
                try:
                    if step.ctx is not None:
                        result = call.fn(step.ctx, *args, **call.kwargs)
                    else:
                        result = call.fn(*args, **call.kwargs)
                except Exception as e:  # noqa: BLE001 - a kernel error becomes the client's
                    error = (step.site, call.name, f"{type(e).__name__}: {e}")
                    outside_ids, made = self.ids
                    first = step.outs[0] if step.outs else None
                    key = 0 if first is None else made[first] if first >= 0 else \
                        outside_ids[-1 - first]
                    self.host.send(P.KernelError(P.KERNEL_ERROR, *error, key))
            if error is not None:
                result = Failed(error)
                results = [result] * len(step.outs)
            elif len(step.outs) == 1:
                results = (result,)
            else:
                results = result
            for ref, value in zip(step.outs, results):
                if ref >= 0:
                    values[ref] = value
                    blob = blobs.get(ref)
                else:
                    blob = outside[-1 - ref]  # written in place
                if blob is not None:
                    if type(value) is Failed:
                        blob.error = value.error
                    else:
                        blob.hold(value)
            for ref in step.frees:
                values[ref] = None
