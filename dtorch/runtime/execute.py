"""Running kernels on a stream: the one step runner, and the kernel loop's task.

Every kernel a host runs goes through ``Runner.run_step``: a kernel record's (``KernelRun``, one
task per kernel or chain), a replayed program's loop (``program.ProgramRun``); a program's
generated code (``program.straight_line``) calls the kernels itself and hands a failure back to
that loop. A step's operands are blobs, results of earlier steps, Failures and scalars; a failed
operand stops the kernel quietly, its results carrying the Failure on (``runtime/failures.py``),
unless the kernel writes all of it (``Blob.overwritable``); a kernel that raises fails with a new
Failure, told to the client once. A collective runs through the failure agreement instead
(``failures.run_collective``), since its peers would wait for it forever.
"""

from __future__ import annotations

import threading
import time

from .. import logs
from ..ops.registry import NO_VALUE_KERNEL, NoValue
from .failures import Failure, run_collective, tell
from .stream import Blob, record_uses
from .vjp import ForwardFailed

log = logs.host

PREV = object()  # a chain step's operand that is the previous step's result


class Runner:
    """A stream task that runs steps: ``run_step`` runs one, ``tell`` reports a new failure."""

    __slots__ = ()

    def run_step(self, call, ctx, operands, site, step=None):
        """Kernel ``call`` (issued at ``site``; ``step``: the program step it is, for ``tell``)
        on ``operands``: its result, or the Failure its results carry."""
        args = []
        for x in operands:
            if type(x) is Blob:
                if x.error is None:
                    args.append(x.tensor)
                    continue
                target = x.overwritable(ctx) if call.overwrites and not args else None
                if target is None:  # failed: pass the failure on, quietly
                    return x.error
                args.append(target)  # unless the kernel writes all of it
            elif type(x) is Failure:
                return x
            else:
                args.append(x)
        try:
            if ctx is not None:
                result = call.fn(ctx, *args, **call.kwargs)
            else:
                result = call.fn(*args, **call.kwargs)
        except ForwardFailed as e:  # told when the forward failed
            return e.error
        except Exception as e:  # noqa: BLE001 - a kernel error becomes the client's error
            return self.failed(site, call.name, e, step)
        if call.overwrites and type(operands[0]) is Blob and operands[0].error is not None:
            operands[0].overwritten(result)  # the full write cleared its failure
        return result

    def failed(self, site: int, name: str, e: Exception, step=None) -> Failure:
        """The Failure of kernel ``name`` (``step``) that raised ``e``, told to the client, but
        for a result that has no value by design (``NoValue``), which only a read reports."""
        if type(e) is NoValue:
            return Failure(site, name, str(e))
        return self.tell(Failure.raised(site, name, e), step)

    def tell(self, failure: Failure, step=None) -> Failure:
        """Tells the client of ``failure``, a kernel's (``step``'s) new one; returns it."""
        raise NotImplementedError


class KernelRun(Runner):
    """One kernel on one device, queued on a stream; or a chain of kernels each feeding the next
    (``passes.fuse_chains``), of which only the last step's results become blobs.
    A step is (HostCall, KernelContext or None, operands: Blob / PREV / scalar, site)."""

    __slots__ = ("steps", "outputs", "waits", "host", "key")

    def __init__(self, steps, outputs, waits, host, key):
        self.steps, self.outputs, self.waits, self.host = steps, outputs, waits, host
        self.key = key  # the kernel's first result id, naming its failure to the client

    def __call__(self) -> None:
        if self.waits:
            for e in self.waits:
                e.wait()
        steps = self.steps
        if self.host.cuda:
            for step in steps:
                record_uses(step[2])
        if steps[0][0].comm:
            result = run_collective(self, *steps[0])
        else:
            chain, result = len(steps) > 1, None
            for call, ctx, inputs, site in steps:
                if chain:  # the previous step's result is an operand
                    inputs = [result if x is PREV else x for x in inputs]
                result = self.run_step(call, ctx, inputs, site)
                if type(result) is Failure:
                    break
                if self.host.log_kernels:
                    log.debug("host %d: %s %s done at %.6f", self.host.index,
                              threading.current_thread().name, call.name, time.perf_counter())
        if type(result) is Failure:
            self._fail(result)
        else:
            self._store(result)

    @property
    def trace_name(self) -> str:
        """The kernel's name in a trace (a chain's joined with "+"); read only while tracing."""
        return "+".join(step[0].name for step in self.steps)

    @property
    def site(self) -> int:
        """The user's line that issued the (last) kernel."""
        return self.steps[-1][3]

    def tell(self, failure: Failure, step=None) -> Failure:
        tell(self.host, failure, self.key)
        return failure

    def _store(self, result) -> None:
        outputs = self.outputs
        if len(outputs) == 1:
            outputs[0].hold(result)
        else:
            for blob, value in zip(outputs, result):
                blob.hold(value)

    def _fail(self, failure: Failure) -> None:
        no_value = failure.op == NO_VALUE_KERNEL
        for blob in self.outputs:
            blob.error = failure
            if no_value and blob.tensor is None:  # a view of a tensor made without a value
                blob.view = False  # (a Parameter's alias): a full write gives it its own block
        for call, _, inputs, _ in self.steps:  # a recorded call that did not run: its VJP fails
            if call.saves and not hasattr(inputs[-3], "outs"):  # alike (``saved_slots``)
                inputs[-3].error = failure
