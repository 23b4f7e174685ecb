"""dtorch.profiler: a timeline of the kernels every device ran, as a Chrome/Perfetto trace.

>>> import dtorch
>>> mesh = dtorch.DeviceMesh("cpu", [0, 1])
>>> x = dtorch.ones((64, 64), device_mesh=mesh, placements=[dtorch.Shard(0)])
>>> with dtorch.profiler.profile() as prof:  # also trace("out.json"), start() / stop(path)
...     total = (x * 2).sum().item()
>>> sorted({e["pid"] for e in prof.kernels()})  # one process per device
[0, 1]
>>> any("mul" in e["name"] for e in prof.kernels())  # a chain's name joins its kernels'
True
>>> prof.export_chrome_trace("/tmp/dtorch_doctest_trace.json")

While tracing, every host records each kernel it runs: its name, device, stream, start and
end (``time.time_ns()``, one clock for all processes of a machine) and the user's line that
issued it (``args.site``). The span starts after the kernel's waits for other streams, so it is
busy time. ``stop`` gathers the records into one trace in the JSON "traceEvents" format: one
process per device (pid = the device index), one thread per stream (tid = the stream id: 0 is
the communication stream, graph g's compute stream is g + 1; a device's kernel-fusion compiles
have a thread of their own, "fusion compiler", and a replay that runs fused code says so in its
name: ``replay (N kernels, K fused)``). Two more processes come first:
the client (issuing: the user's thread building a batch of records, from its first record to
its send; flushing: the send; and the ``dtorch.cuda.nvtx`` ranges, at issue time), and the
controller (each batch's passes, with how many records went in and out). The client's tracks
also hold what ``record`` adds (``dtorch.elastic``'s losses and recoveries; a trace recorded
across a loss goes on in the new runtime, ``resume``). Open the file at
https://ui.perfetto.dev or chrome://tracing.

The switch travels in program order (``protocol.Trace``). It takes effect on each stream after
the work issued before it, and a stop covers exactly the work issued before it. With tracing off,
a stream pays one attribute check per kernel, the client one per batch.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time

from .. import current
from .. import protocol as P

__all__ = ["start", "stop", "trace", "profile", "Profile", "chrome_events", "graph", "record",
           "resume"]

CLIENT_PID, CONTROLLER_PID = 1 << 20, (1 << 20) + 1  # after every device index


def start() -> None:
    """Starts recording the kernels of the work issued from now on."""
    global _started_ns, _recorded
    _started_ns = time.perf_counter_ns()
    _recorded = []
    current.session().trace(True)


_started_ns = 0  # nvtx's clock (perf_counter_ns) at the last start
_recorded: list | None = None  # while recording (``start`` to ``stop``): ``record``'s spans


def record(name: str, start_ns: int, end_ns: int) -> None:
    """Adds a span of the client's (``time.time_ns()``; a mark when they are equal) to the
    trace being recorded, on its own track of the client: what happened to the run rather
    than a kernel (``dtorch.elastic``'s losses and recoveries). Nothing while not recording."""
    if _recorded is not None:
        _recorded.append((name, P.CLIENT, ELASTIC_TRACK, start_ns, end_ns, 0))


def resume() -> None:
    """Records on the runtime running now, as ``start`` did on one that failed since (the
    kernels of the failed one are lost with it; the nvtx ranges and ``record``'s spans since
    ``start`` stay in the trace)."""
    s = current.session()
    if _recorded is not None and s.tracing is None:
        s.trace(True)


def stop(path: str | None = None) -> list:
    """Stops recording once the work issued so far has run, writes the trace to ``path`` (when
    given) and returns its events (Chrome trace event dicts)."""
    global _recorded
    s = current.session()
    added, _recorded = _recorded or [], None
    events = chrome_events(s.trace(False), s.site_names, _nvtx_spans() + added)
    if path is not None:
        _write(path, events)
    return events


def _write(path: str, events: list) -> None:
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


def _nvtx_spans() -> list:
    """The nvtx ranges and marks closed since ``start``, on the client's clock of the trace."""
    from ..cuda import nvtx

    shift = time.time_ns() - time.perf_counter_ns()
    return [(f"nvtx: {r.name}", P.CLIENT, 2, r.start_ns + shift, r.end_ns + shift, 0)
            for r in nvtx.recorded() if r.start_ns >= _started_ns]


class Profile:
    """What ``profile`` and ``trace`` yield: ``events`` is filled once the block ends."""

    def __init__(self, path=None):
        self.path, self.events = path, []

    def kernels(self) -> list:
        """The complete ("X") events of the devices' kernels."""
        return [e for e in self.events if e["ph"] == "X" and e["pid"] < CLIENT_PID]

    def export_chrome_trace(self, path: str) -> None:
        """Writes the trace (as torch.profiler's method of that name)."""
        _write(path, self.events)


@contextlib.contextmanager
def profile():
    """Records the work issued inside the block (``prof.export_chrome_trace(path)`` after)."""
    prof = Profile()
    start()
    try:
        yield prof
    finally:
        prof.events = stop()


@contextlib.contextmanager
def trace(path: str | None = None):
    """``profile``, the trace written to ``path`` when the block ends."""
    prof = Profile(path)
    start()
    try:
        yield prof
    finally:
        prof.events = stop(path)


@contextlib.contextmanager
def graph(directory: str = "dtorch-graphs"):
    """Writes the LogicalGraph of every batch issued inside the block, after the controller's
    passes, as Graphviz DOT files in ``directory`` (``controller/dot.py``: kernels per stream,
    chains, tensors, waits, releases); and an SVG beside each when the ``graphviz`` package and
    its ``dot`` program are installed. Yields the list of DOT paths, filled when the block ends.
    ``DTORCH_DEBUG=graph`` (or ``DTORCH_GRAPH_DIR``) does the same for a whole program."""
    s = current.session()
    directory = os.path.abspath(directory)
    before = set(_dot_files(directory))
    written: list = []
    s.flush()  # what came before is not drawn
    s.append([P.GRAPH, directory])
    try:
        yield written
    finally:
        s.append([P.GRAPH, None])
        s.sync()
        written += [f for f in _dot_files(directory) if f not in before]
        _render_svg(written)


def _dot_files(directory: str) -> list:
    if not os.path.isdir(directory):
        return []
    return sorted(os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(".dot"))


def _render_svg(paths: list) -> None:
    try:
        import graphviz
    except ImportError:
        return
    if shutil.which("dot") is None:
        return
    for path in paths:
        graphviz.Source.from_file(path).render(outfile=path[:-4] + ".svg", format="svg",
                                               cleanup=False)


ELASTIC_TRACK = 3  # the client's track of ``record``'s spans
STREAMS = {P.CLIENT: {0: "issue", 1: "flush", 2: "nvtx ranges (issued)",
                      ELASTIC_TRACK: "dtorch.elastic (losses, recoveries)"},
           P.CONTROLLER: {P.CONTROLLER: "passes"}}
PIDS = {P.CLIENT: CLIENT_PID, P.CONTROLLER: CONTROLLER_PID}


def _stream_name(device: int, sid: int) -> str:
    if device in STREAMS:
        return STREAMS[device][sid]
    if sid == P.FUSION_TRACK:
        return "fusion compiler"
    return "comm" if sid == 0 else f"compute (graph {sid - 1})"


def _process(device: int, reply) -> dict:
    if device == P.CLIENT:
        return {"name": f"client (pid {reply.pid})"}
    if device == P.CONTROLLER:
        return {"name": f"controller (pid {reply.pid})"}
    return {"name": f"device {device} (host {reply.host}, pid {reply.pid}, {reply.threads} "
                    f"torch threads)", "host": reply.host, "torch_threads": reply.threads}


def chrome_events(replies, site_names=(), client_spans=()) -> list:
    """Chrome trace events from the TraceEvents of the hosts, the controller and the client
    (and more ``client_spans`` of the client's, as in TraceEvents): metadata naming each
    process (devices by index, after the client and the controller) and stream, then one
    complete event per span, in microseconds from the first span's start; a kernel's ``args``
    name its host and the user's line that issued it."""
    client = next((r for r in replies if r.host == P.CLIENT), None)
    spans = [(r, e) for r in replies for e in r.events]
    spans += [(client, e) for e in client_spans]
    base = min((e[3] for _, e in spans), default=0)
    out, named = [], set()
    for r, (name, device, stream, t0, t1, site) in spans:
        pid = PIDS.get(device, device)
        if device not in named:
            named.add(device)
            out.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                        "args": _process(device, r)})
            out.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                        "args": {"sort_index": device}})
        if (device, stream) not in named:
            named.add((device, stream))
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": stream,
                        "args": {"name": _stream_name(device, stream)}})
        if device in PIDS:
            cat, args = ("client" if device == P.CLIENT else "controller"), {}
        else:
            cat = "comm" if stream == 0 else "fusion" if stream == P.FUSION_TRACK else "compute"
            args = {"host": r.host, "site": site_names[site] if site < len(site_names)
                    else site}
        out.append({"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": stream,
                    "ts": (t0 - base) / 1e3, "dur": (t1 - t0) / 1e3, "args": args})
    return out
