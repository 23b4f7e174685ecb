"""The calling thread's context: which graph it issues to, that graph's defaults, and the session.

Every front (``ops/``), ``tensor.py`` and the client read this module, and it reads nothing of
theirs: it holds state only (no sockets, no client, no registry), so the layers below the client
ask it what the user's thread is doing instead of importing the client.

- **Graphs.** Each thread has a default graph and the graphs it has entered with ``with graph:``
  (innermost last): ``per_thread`` (a ``threading.local``). The innermost, else the default, is
  the *current* graph: factories make their tensors on it. Other operators run on their
  operands' graph, which each tensor records; one whose operands are on several graphs on the
  innermost ``with graph:`` when it is one of them (``client/dispatch.graph_of``). A thread's default graph is made on its first
  use, of the class ``dtorch/graph.py`` names when it defines it (``plug_graph_type``); its id
  is taken when the thread first touches this module's state, so the importing thread's
  default graph is 0.
- **Defaults.** The mesh and dtype of tensors made without one: the current graph's
  (``default_mesh``, ``default_dtype``; a graph's guards set them).
- **Deferred values.** Inside ``dtorch.nn.init_empty()`` (counted per thread, ``deferring``)
  or torch's ``with torch.device("meta"):``, factories of arbitrary or random values make
  tensors without values and the random fills draw nothing (``ops/random_fill.py``).
- **The session**, as an opaque handle: ``session()`` is the running runtime's session (started on
  first use), as the client hands it in (``plug_session``); callers use only what they are given
  (``sync``, ``sync_async``, ``trace``...), never the client's modules.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

from .mesh import DeviceMesh

_graph_ids = itertools.count(0)
_CPU0: list = []  # the one-device CPU mesh, every graph's first default (made on first use)


def new_graph_id() -> int:
    """A fresh graph id (unique in this process)."""
    return next(_graph_ids)


class _NoGraphType:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("dtorch: a graph was asked for before dtorch.graph defined Graph "
                           "(import dtorch first)")


_graph_type: type = _NoGraphType  # ``dtorch.graph.Graph``, once it is defined


def plug_graph_type(graph_type: type) -> None:
    """``graph_type``: the Graph class (``dtorch.graph.Graph``); ``graph_type(_id=n)`` makes
    the graph of id ``n`` (a thread's default)."""
    global _graph_type
    _graph_type = graph_type


class ThreadGraphs(threading.local):
    """One thread's graphs: its default graph (made on first use) and the graphs it has entered
    (innermost last). Each thread gets its own on first use."""

    def __init__(self) -> None:
        self.default_id = new_graph_id()
        self.stack: list = []
        self._default = None
        self.deferring = 0  # ``dtorch.nn.init_empty()`` contexts entered and not left

    @property
    def default(self):
        if self._default is None:
            self._default = _graph_type(_id=self.default_id)
        return self._default

    def enter(self, graph) -> None:
        self.stack.append(graph)

    def exit(self) -> None:
        self.stack.pop()


per_thread = ThreadGraphs()  # the importing thread's default graph is the first: id 0


def current_graph():
    """The calling thread's current graph: the innermost ``with graph:``, else the thread's
    default graph."""
    state = per_thread
    return state.stack[-1] if state.stack else state.default


def entered_graph():
    """The calling thread's innermost ``with graph:``, or None outside every such block."""
    stack = per_thread.stack
    return stack[-1] if stack else None


def graph_or_current(graph, name: str):
    """A factory's ``graph=``: that Graph, else the current graph; anything else is refused at
    the user's line."""
    if graph is None:
        return current_graph()
    if not isinstance(graph, _graph_type):
        raise TypeError(f"dtorch.{name}: graph must be a dtorch.Graph, got "
                        f"{type(graph).__name__}")
    return graph


def deferring() -> bool:
    """Whether the calling thread makes parameters without values: inside
    ``dtorch.nn.init_empty()``, or inside torch's ``with torch.device("meta"):``."""
    if per_thread.deferring:
        return True
    import torch  # (torch's default device: read only here, where it is rarely asked)

    return torch.get_default_device().type == "meta"


def cpu0() -> DeviceMesh:
    """``DeviceMesh("cpu", [0])``, every graph's first default mesh."""
    if not _CPU0:
        _CPU0.append(DeviceMesh("cpu", [0]))
    return _CPU0[0]


def default_mesh() -> DeviceMesh:
    """The mesh of tensors made without one: the current graph's default."""
    return current_graph().default_device_mesh


def default_dtype():
    """The dtype of floating tensors made without one: the current graph's default."""
    return current_graph().default_dtype


# -- the session ----------------------------------------------------------------------------------


def _no_session():
    raise RuntimeError("dtorch: the runtime was asked for before the client plugged in its "
                       "session (import dtorch first)")


def _no_running_session():
    return None  # no client plugged in: no session runs


_session: Callable = _no_session
_running: Callable = _no_running_session


def plug_session(current: Callable, running: Callable) -> None:
    """The client's ``current()`` (the running session, started on first use) and
    ``running()`` (the running session, or None: starts nothing)."""
    global _session, _running
    _session, _running = current, running


def session():
    """The running session (started on first use): an opaque handle."""
    return _session()


def running_session():
    """The running session, or None when none runs; starts nothing."""
    return _running()
