"""Kernel fusion on a host: the hot replayed programs' elementwise runs, compiled in the background.

A replayed program (``runtime/program.py``) that runs ``config.fusion_after`` times in a row on a
device with the same scalars, and whose runs have taken ``config.fusion_after_s`` seconds there
(a compile costs seconds of the host's CPU: only a program that has already cost as much is
likely to repay it), is hot. Its next run also keeps a copy of what each *segment* reads:
a segment is a stretch of two or more consecutive kernels that fusion may merge (``fusable``). A
compiler thread of the host then traces each segment into an FX graph (``make_fx``), compiles it
with inductor (C++ on the CPU, Triton on a GPU; cached on disk in ``config.fusion_cache_dir``, the
TORCHINDUCTOR_CACHE_DIR a host starts with), and runs the fused code and the kernels one by one on the copied inputs. A segment whose fused results
differ from its kernels' in any bit (NaN payloads aside), or in dtype, shape or strides, stays
unfused. Once its segments are compiled the program's lowering for those scalars is swapped for
one where each segment is one ``Fused`` step; until then, and for other scalars, the program runs
unfused, so results are bit-identical with fusion on or off.

What may fuse (``EXACT``): operators whose every result is one correctly rounded IEEE operation
of its operands (add, sub, mul, div, reciprocal), a choice among them (maximum, where, clamp,
relu), a comparison, a cast between the exact dtypes, or a rounding to an integer, so that fusing
cannot change a bit. Not fused, because inductor's code differs from ATen's, by reassociation or
in the last bits: reductions (sum, mean: another order of additions), transcendental functions
(exp, tanh, log, sin, erf, sigmoid: other polynomials), sqrt and rsqrt (other handling of
signed zeros and subnormals), add and sub with ``alpha`` and lerp/addcmul (contracted into one
rounding), remainder, floor division and round with decimals (``EXACT_ONLY_WITH``). Half and
bfloat16 tensors do not fuse: inductor keeps a fused chain's intermediates in float32, where the
kernels round each to 16 bits. The check on the copied inputs is the last guard, for what this
reasoning misses.

A fused step whose input failed runs its kernels one by one instead, so that only the results
that depend on the failure carry it, as without fusion.
"""

from __future__ import annotations

import copy
import queue
import sys
import threading
import time

import torch

from .. import config, logs, protocol as P
from . import cuda_graphs
from .program import MADE, OUTSIDE, SCALAR, Lowering, ProgramStep, mark_frees

log = logs.host

EXACT = frozenset({  # registry names
    "add", "sub", "rsub", "mul", "div", "neg", "abs", "square", "reciprocal", "maximum",
    "minimum", "clamp", "clip", "relu", "where", "masked_fill", "sign", "floor", "ceil", "trunc",
    "round", "eq", "ne", "lt", "le", "gt", "ge", "logical_not", "logical_and", "logical_or",
    "logical_xor", "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not", "isnan", "isinf",
    "isfinite", "to", "float", "double", "int", "long", "bool", "type_as",
})
COMPILING_SWITCH_S = 0.0002  # sys.setswitchinterval while a compile runs (see _compile_all)
# the dtypes whose fused code rounds as the kernels do (half and bfloat16 do not: see above)
EXACT_DTYPES = frozenset({torch.float32, torch.float64, torch.bool, torch.uint8, torch.int8,
                          torch.int16, torch.int32, torch.int64})


# static arguments that make an EXACT operator inexact unless they have these values: add(x, y,
# alpha=a) is contracted into x + a * y in one rounding, div's rounding modes and round's
# decimals are computed otherwise than ATen's
EXACT_ONLY_WITH = {"alpha": 1, "rounding_mode": None, "decimals": 0}


def fusable(step: ProgramStep) -> bool:
    """A kernel that may join a segment: an EXACT operator, not in place, without a context."""
    call = step.call
    return (call.name in EXACT and step.ctx is None and not call.inplace and not call.saves
            and all(ref >= 0 for ref in step.outs)
            and all(call.kwargs.get(name, value) == value
                    for name, value in EXACT_ONLY_WITH.items()))


def segments(steps: list, survivors) -> list:
    """The segments of a lowering: ``(first, end, inputs, outputs)`` per stretch
    ``steps[first:end]`` of two or more fusable kernels. ``inputs``: the sources (MADE or
    OUTSIDE, each once) its kernels read from outside it; ``outputs``: the results it makes that
    later steps read or that outlive the program (``survivors``)."""
    found, k = [], 0
    while k < len(steps):
        if not fusable(steps[k]):
            k += 1
            continue
        end = k
        while end < len(steps) and fusable(steps[end]):
            end += 1
        if end - k >= 2:
            found.append((k, end, *_boundary(steps, k, end, survivors)))
        k = end
    return found


def _boundary(steps, first, end, survivors):
    made, inputs = set(), []
    for step in steps[first:end]:
        for source in step.sources:
            if source[0] != SCALAR and source not in inputs and not (
                    source[0] == MADE and source[1] in made):
                inputs.append(source)
        made.update(step.outs)
    read_later = {k for step in steps[end:] for kind, k in step.sources if kind == MADE}
    outputs = [ref for step in steps[first:end] for ref in step.outs
               if ref in read_later or ref in survivors]
    return inputs, outputs


class FusedCall:
    """A segment's compiled code, in the place of a HostCall (``ProgramStep.call``)."""

    __slots__ = ("fn", "name", "kwargs", "inplace", "saves")
    overwrites = False  # in-place kernels never fuse

    def __init__(self, fn, name):
        self.fn, self.name, self.kwargs = fn, name, {}
        self.inplace = self.saves = False


class Fused(ProgramStep):
    """A segment as one step: its inputs as sources, its outputs as results, and ``original``,
    its kernels one by one (run instead when an input failed)."""

    __slots__ = ()

    def __init__(self, fn, segment_steps, inputs, outputs, name=None):
        name = name or "fused " + "+".join(s.call.name for s in segment_steps)
        super().__init__(FusedCall(fn, name), None, tuple(inputs), segment_steps[-1].site,
                         tuple(outputs))
        self.original = tuple(segment_steps)


def steps_function(steps, inputs, outputs, scalars):
    """Steps as a function of their inputs (sources, in ``inputs`` order) returning their
    ``outputs``, with the scalars of this run as constants: a segment as ``make_fx`` traces it
    and as the reference it is checked against, or a whole program as a CUDA graph captures it."""
    where = {source: n for n, source in enumerate(inputs)}

    def run(*args):
        values = {}
        for step in steps:
            operands = [scalars[k] if kind == SCALAR else
                        values[k] if kind == MADE and k in values else args[where[(kind, k)]]
                        for kind, k in step.sources]
            call = step.call
            if step.ctx is not None:
                result = call.fn(step.ctx, *operands, **call.kwargs)
            else:
                result = call.fn(*operands, **call.kwargs)
            values.update(zip(step.outs, (result,) if len(step.outs) == 1 else result))
        return tuple(values[ref] for ref in outputs)

    return run


def same_bits(a, b) -> bool:
    """Equal dtype, shape, strides and bits (any NaN equals any NaN)."""
    if a.dtype != b.dtype or a.shape != b.shape or a.stride() != b.stride():
        return False
    if not a.dtype.is_floating_point:
        return torch.equal(a, b)
    nan = torch.isnan(a)
    if not torch.equal(nan, torch.isnan(b)):
        return False
    a, b = a[~nan], b[~nan]
    return torch.equal(a, b) and torch.equal(torch.signbit(a), torch.signbit(b))


class Hot:
    """Fusion's state for one program on one device: the unfused lowering, the run of replays
    with the same scalars so far, and the fused lowering once compiled (for ``scalars``)."""

    __slots__ = ("plain", "scalars", "streak", "spent", "fused", "asked")

    def __init__(self, plain: Lowering):
        self.plain = plain
        self.scalars, self.streak = None, 0  # scalars: packed (Fuser.lowering)
        self.spent = 0.0  # seconds its unfused runs took on the stream (ProgramRun adds them)
        self.fused = None  # the lowering with Fused steps, for self.scalars
        self.asked = False  # compiled (or being compiled) once: never again


class Probe:
    """Rides on one run of a hot program: copies what each segment reads as the run reaches it
    (and, for a CUDA graph, every outside input the program reads), then hands them to the
    compiler."""

    __slots__ = ("fuser", "hot", "dev", "scalars", "segments", "starts", "captured",
                 "graph_inputs")

    def __init__(self, fuser, hot, dev, scalars, found, graph):
        self.fuser, self.hot, self.dev, self.scalars = fuser, hot, dev, scalars
        self.segments, self.starts = found, {seg[0]: n for n, seg in enumerate(found)}
        self.captured = [None] * len(found)
        self.graph_inputs = [] if graph else None  # [] until copied, None: no graph wanted

    def capture(self, index, values, outside) -> None:
        """Before step ``index`` runs: if it starts a segment, copy that segment's inputs
        (None if one failed: that segment is not compiled)."""
        if index == 0 and self.graph_inputs == []:
            self.graph_inputs = _copies([(OUTSIDE, j) for j in self.hot.plain.reads], values,
                                        outside)
        n = self.starts.get(index)
        if n is not None:
            self.captured[n] = _copies(self.segments[n][2], values, outside)

    def done(self) -> None:
        if self.dev.torch_device.type == "cuda":  # the copies were made on this stream
            torch.cuda.current_stream().synchronize()
        self.fuser.jobs.put(self)


def _copies(sources, values, outside):
    """Copies of these sources' values now; None if one failed."""
    copies = []
    for kind, k in sources:
        if kind == MADE:
            v = values[k]
        else:
            blob = outside[k]
            v = None if blob.error is not None else blob.tensor
        if not isinstance(v, torch.Tensor):
            return None
        copies.append(v.clone())
    return copies


class Fuser:
    """A host's fusion: which replays are hot (on the host's main thread), and the compiler
    thread."""

    def __init__(self, host):
        self.host = host
        self.hot: dict = {}  # (program id, device index) -> Hot
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.busy = 0  # probes queued or compiling (changed under _lock)
        self.idle_waiters: list = []
        self._lock = threading.Lock()
        self._thread = None

    @staticmethod
    def scalars_key(scalars) -> bytes:
        """What tells one replay's scalars from another's, made once per replay: their bytes,
        since equal values of another type (1 and 1.0, 0.0 and -0.0) may give other results."""
        return P.pack(scalars) if config.fusion else b""

    def lowering(self, program, dev, scalars, same: bytes):
        """``(lowering, probe, hot)`` for one replay of ``program`` on ``dev`` with these
        ``scalars`` (``same``: their ``scalars_key``): the fused lowering if one is ready for
        them; a Probe when this run makes the program hot; the Hot whose time the run counts
        while it may still become hot (else None)."""
        lowering, probe, hot = self._lowering(program, dev, scalars, same)
        return lowering, probe, None if hot.asked or not config.fusion else hot

    def _lowering(self, program, dev, scalars, same):
        key = (program.definition.id, dev.index)
        hot = self.hot.get(key)
        if hot is None:
            hot = self.hot[key] = Hot(program.lower(dev))
        if hot.asked and hot.fused is None or not config.fusion:
            return hot.plain, None, hot
        if same == hot.scalars:
            if hot.fused is not None:
                return hot.fused, None, hot
            hot.streak += 1
        elif hot.asked:
            return hot.plain, None, hot
        else:
            hot.scalars, hot.streak = same, 1
        if hot.streak < config.fusion_after or hot.spent < config.fusion_after_s:
            return hot.plain, None, hot
        hot.asked = True
        found = segments(hot.plain.steps, hot.plain.survivors)
        graph = (dev.torch_device.type == "cuda" and config.cuda_graphs
                 and cuda_graphs.capturable(hot.plain.steps))
        if not found and not graph:
            return hot.plain, None, hot
        with self._lock:
            self.busy += 1
        self._start()
        return hot.plain, Probe(self, hot, dev, tuple(scalars), found, graph), hot

    def when_idle(self, callback) -> None:
        """Calls ``callback()`` once no compile is queued or running (at once if none is)."""
        with self._lock:
            if self.busy:
                self.idle_waiters.append(callback)
                return
        callback()

    # -- the compiler thread --------------------------------------------------------------------
    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._compile_all, name="fusion compiler",
                                            daemon=True)
            self._thread.start()

    def _compile_all(self) -> None:
        import torch._inductor.config as inductor_config

        inductor_config.compile_threads = 1  # in this thread: no pool of worker processes
        while True:
            probe = self.jobs.get()
            # Compiling is seconds of Python holding the GIL, which the stream threads need
            # back after every kernel: by default they would wait up to 5 ms for it each time,
            # so while compiling the interpreter hands the GIL over every 0.2 ms instead.
            switch = sys.getswitchinterval()
            sys.setswitchinterval(COMPILING_SWITCH_S)
            try:
                self._compile(probe)
            except Exception:  # logged: a failed compile leaves the program unfused
                log.debug("a program stays unfused", exc_info=True)
            sys.setswitchinterval(switch)
            with self._lock:
                self.busy -= 1
                waiters = self.idle_waiters if not self.busy else []
                if waiters:
                    self.idle_waiters = []
            for callback in waiters:
                callback()

    def _compile(self, probe: Probe) -> None:
        from torch._inductor import compile as inductor_compile
        from torch.fx.experimental.proxy_tensor import make_fx

        t0 = time.time_ns()
        # copies: the unfused lowering's steps may be running on the stream meanwhile
        hot, steps = probe.hot, [copy.copy(step) for step in probe.hot.plain.steps]
        fused = 0
        for (first, end, inputs, outputs), args in reversed(list(zip(probe.segments,
                                                                     probe.captured))):
            if args is None or any(a.dtype not in EXACT_DTYPES for a in args):
                continue
            kernels = steps[first:end]
            fn = steps_function(kernels, inputs, outputs, probe.scalars)
            try:
                expected = fn(*args)
                if not outputs or any(r.dtype not in EXACT_DTYPES for r in expected):
                    continue
                compiled = inductor_compile(make_fx(fn)(*args), list(args))
                got = compiled(*args)
            except Exception:  # logged: this segment stays unfused, the others may not
                log.debug("a stretch of %d kernels stays unfused", len(kernels),
                          exc_info=True)
                continue
            if len(got) != len(expected) or not all(map(same_bits, got, expected)):
                continue
            steps[first:end] = [Fused(_unpacked(compiled, len(outputs)), kernels, inputs,
                                      outputs)]
            fused += end - first
        if fused:
            mark_frees(steps)
        name = f"fused {fused} kernels into {sum(type(s) is Fused for s in steps)}"
        graph = self._graph(probe, steps) if probe.graph_inputs else None
        if graph is not None:
            steps, name = [graph], name + ", captured as a CUDA graph"
        if fused or graph is not None:
            # the main thread's next replay with these scalars runs it
            hot.fused = Lowering(steps, hot.plain.reads, hot.plain.survivors,
                                 hot.plain.slots)
        tracer = self.host.tracer
        if tracer is not None:
            tracer.events.append((name, probe.dev.index, P.FUSION_TRACK, t0, time.time_ns(), 0))

    def _graph(self, probe: Probe, steps):
        """The whole lowering ``steps`` as one step that launches a CUDA graph, or None."""
        made_here = {ref for step in steps for ref in step.outs}
        outputs = [ref for ref in sorted(probe.hot.plain.survivors) if ref in made_here]
        inputs = [(OUTSIDE, j) for j in probe.hot.plain.reads]
        run = steps_function(steps, inputs, outputs, probe.scalars)
        captured = cuda_graphs.capture(run, probe.graph_inputs, probe.dev.torch_device)
        if captured is None:
            return None
        replay, got, expected = captured
        if not all(map(same_bits, got, expected)):
            return None
        graph = Fused(_unpacked(replay, len(outputs)), steps, inputs, outputs,
                      name=f"CUDA graph of {len(steps)} steps")
        return graph


def _unpacked(compiled, n: int):
    """The compiled segment called as a kernel: its one result bare, several as a tuple."""
    if n == 1:
        return lambda *args: compiled(*args)[0]
    return lambda *args: tuple(compiled(*args))
