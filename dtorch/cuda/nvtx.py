"""NVTX ranges and marks, ordered with the operators the program issues (DTorch's
``dtorch.cuda.nvtx``).

A range is two operators (``_nvtx_range_push``, ``_nvtx_range_pop`` of ``cuda/nvtx_kernels.py``) that
run on every device of the graph's default mesh (``Graph.device_mesh_guard``; else the
one-device CPU mesh), on the graph's compute stream, between the kernels issued before and after
them. On a CUDA device they call ``torch.cuda.nvtx``, so Nsight shows each range around the
kernels issued inside it; on every device they also append an event to the host process's record
(``cuda/nvtx_kernels.EVENTS``), so CPU meshes keep them for a timeline too. Collectives run on each
device's communication stream: a range brackets them only where they wait for work of its graph.

The client keeps its own record: every closed range and every mark, with the client's
``time.perf_counter_ns()`` when it was issued (the user's thread runs ahead of the devices, so
this is issue time, not run time) and the graph's id. ``recorded()`` returns them.

>>> import dtorch
>>> from dtorch.cuda import nvtx
>>> with nvtx.range("step {}", None, 3):
...     y = dtorch.ones(4) * 2
>>> dtorch.sync()
>>> [r.name for r in nvtx.recorded() if r.name == "step 3"]
['step 3']
"""

from __future__ import annotations

import collections
import contextlib
import functools
import time
from typing import NamedTuple

from .. import current
from ..graph import Graph
from . import nvtx_kernels as system


class Range(NamedTuple):
    """A closed range or a mark (``end_ns == start_ns``), as the client issued it."""

    name: str
    start_ns: int  # time.perf_counter_ns() at range_push (or mark)
    end_ns: int  # ... at range_pop
    graph: int  # the graph's id
    kind: str = "range"  # or "mark"


_open: dict = {}  # graph id -> [(name, start_ns, mesh)], innermost last
_closed: collections.deque = collections.deque(maxlen=system.RECORD_LIMIT)


def range_push(msg: str, graph: Graph | None = None) -> int:
    """Opens a range named ``msg`` on ``graph`` (None: the current graph) and returns its depth
    (0 for the outermost), as ``torch.cuda.nvtx.range_push`` does."""
    system.check_graph("dtorch.cuda.nvtx.range_push", graph)
    system.check_message("dtorch.cuda.nvtx.range_push", msg)
    start = time.perf_counter_ns()
    graph, mesh = system.issue_nvtx("_nvtx_range_push", graph, msg)
    stack = _open.setdefault(graph.id, [])
    stack.append((msg, start, mesh))
    return len(stack) - 1


def range_pop(graph: Graph | None = None) -> int:
    """Closes the innermost range open on ``graph`` (on the devices its push ran on) and
    returns its depth. With none open: ``RuntimeError``, before anything is sent."""
    system.check_graph("dtorch.cuda.nvtx.range_pop", graph)
    gid = (current.current_graph() if graph is None else graph).id
    stack = _open.get(gid)
    if not stack:
        raise RuntimeError(f"dtorch.cuda.nvtx.range_pop: no range is open on graph {gid}; "
                           f"every range_pop closes an earlier range_push of the same graph")
    name, start, mesh = stack[-1]
    system.issue_nvtx("_nvtx_range_pop", graph, name, mesh)
    stack.pop()
    _closed.append(Range(name, start, time.perf_counter_ns(), gid))
    return len(stack)


def mark(msg: str, graph: Graph | None = None) -> None:
    """An instant event named ``msg`` on every device of ``graph``'s default mesh."""
    system.check_graph("dtorch.cuda.nvtx.mark", graph)
    system.check_message("dtorch.cuda.nvtx.mark", msg)
    now = time.perf_counter_ns()
    graph, _ = system.issue_nvtx("_nvtx_mark", graph, msg)
    _closed.append(Range(msg, now, now, graph.id, "mark"))


@contextlib.contextmanager
def range(msg: str, graph: Graph | None = None, *args, **kwargs):  # noqa: A001 - torch's name
    """A range around the block, named ``msg.format(*args, **kwargs)``. As in
    ``torch.cuda.nvtx.range``, ``range("layer {}", 3)`` formats 3: an argument after ``msg`` that
    is not a Graph is the first format argument."""
    if graph is not None and not isinstance(graph, Graph):
        graph, args = None, (graph, *args)
    range_push(msg.format(*args, **kwargs), graph)
    try:
        yield
    finally:
        range_pop(graph)


def module_register_nvtx(module, tag: str = "module") -> list:
    """Wraps the forward of ``module`` and of each of its submodules in a range, named as
    DTorch names them: the last part of the submodule's name, with its parent where it is an
    index (``layers.0``), and ``tag`` for ``module`` itself. Returns the hooks' handles
    (``handle.remove()`` takes a range away). The range closes when forward raises too."""
    handles = []
    for name, m in module.named_modules(remove_duplicate=True):
        label = _label(name or tag)
        handles.append(m.register_forward_pre_hook(functools.partial(_enter, label)))
        handles.append(m.register_forward_hook(_leave, always_call=True))
    return handles


def _label(qualified: str) -> str:
    parts = qualified.split(".")
    return ".".join(parts[-2:]) if parts[-1].isdigit() and len(parts) >= 2 else parts[-1]


def _enter(label, module, args) -> None:
    range_push(label)


def _leave(module, args, output) -> None:
    range_pop()


def recorded() -> list:
    """The client's record: each closed range and mark (the latest ``RECORD_LIMIT``), in order
    of their start."""
    return sorted(_closed, key=lambda r: r.start_ns)


def clear_recorded() -> None:
    """Forgets the closed ranges and marks (open ranges stay open)."""
    _closed.clear()
