"""dtorch.profiler: a timeline of the kernels every device ran, as a Chrome/Perfetto trace.

>>> import dtorch
>>> mesh = dtorch.DeviceMesh("cpu", [0, 1])
>>> x = dtorch.ones((64, 64), device_mesh=mesh, placements=[dtorch.Shard(0)])
>>> with dtorch.profiler.trace() as prof:  # trace("out.json") also writes the file
...     total = (x * 2).sum().item()
>>> sorted({e["pid"] for e in prof.kernels()})  # one process per device
[0, 1]
>>> any("mul" in e["name"] for e in prof.kernels())  # a chain's name joins its kernels'
True

While tracing, every host records each kernel it runs: its name, device, stream, start and
end (``time.time_ns()``, one clock for all processes of a machine). The span starts after the
kernel's waits for other streams, so it is busy time. ``stop`` gathers the records into one
trace in the JSON "traceEvents" format: one process per device (pid = the device index), one
thread per stream (tid = the stream id: 0 is the communication stream, graph g's compute stream
is g + 1). Open the file at https://ui.perfetto.dev or chrome://tracing.

The switch travels in program order (``protocol.Trace``). It takes effect on each stream after
the work issued before it, and a stop covers exactly the work issued before it. With tracing off,
a stream pays one attribute check per kernel.
"""

from __future__ import annotations

import contextlib
import json

from ..client import session as _session

__all__ = ["start", "stop", "trace", "Profile", "chrome_events"]


def start() -> None:
    """Starts recording the kernels of the work issued from now on."""
    _session.current().trace(True)


def stop(path: str | None = None) -> list:
    """Stops recording once the work issued so far has run, writes the trace to ``path`` (when
    given) and returns its events (Chrome trace event dicts)."""
    events = chrome_events(_session.current().trace(False))
    if path is not None:
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    return events


class Profile:
    """What ``trace`` yields: ``events`` is filled once the block ends."""

    def __init__(self, path):
        self.path, self.events = path, []

    def kernels(self) -> list:
        """The complete ("X") events, one per kernel run on a device."""
        return [e for e in self.events if e["ph"] == "X"]


@contextlib.contextmanager
def trace(path: str | None = None):
    """Records the kernels of the work issued inside the block. ``path``: where to write it."""
    prof = Profile(path)
    start()
    try:
        yield prof
    finally:
        prof.events = stop(path)


def _stream_name(sid: int) -> str:
    return "comm" if sid == 0 else f"compute (graph {sid - 1})"


def chrome_events(replies) -> list:
    """Chrome trace events from the hosts' TraceEvents: metadata naming each device (with its
    host process) and stream, then one complete event per kernel, with microsecond timestamps
    from the first kernel's start."""
    spans = [(r, e) for r in replies for e in r.events]
    base = min((e[3] for _, e in spans), default=0)
    out, named = [], set()
    for r, (name, device, stream, t0, t1) in spans:
        if device not in named:
            named.add(device)
            out.append({"ph": "M", "name": "process_name", "pid": device, "tid": 0,
                        "args": {"name": f"device {device} (host {r.host}, pid {r.pid}, "
                                         f"{r.threads} torch threads)",
                                 "host": r.host, "torch_threads": r.threads}})
            out.append({"ph": "M", "name": "process_sort_index", "pid": device, "tid": 0,
                        "args": {"sort_index": device}})
        if (device, stream) not in named:
            named.add((device, stream))
            out.append({"ph": "M", "name": "thread_name", "pid": device, "tid": stream,
                        "args": {"name": _stream_name(stream)}})
        out.append({"name": name, "cat": "comm" if stream == 0 else "compute", "ph": "X",
                    "pid": device, "tid": stream, "ts": (t0 - base) / 1e3,
                    "dur": (t1 - t0) / 1e3, "args": {"host": r.host}})
    return out
