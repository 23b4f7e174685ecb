"""NVTX operators: ranges and marks, in program order on every device of a mesh.

DTorch's ``_nvtx_range_push(graph, message)``, ``_nvtx_range_pop(graph)`` and
``_nvtx_mark(graph, message)`` (in ``dtorch.nn.functional``; ``dtorch.cuda.nvtx`` holds the forms
users call, which also keep the client's record of each range). Each is an operator like any
other, so each device runs it on its graph's compute stream between the kernels issued before
and after it. The kernel
- on a CUDA device calls ``torch.cuda.nvtx`` (from the stream's thread, the one that launches
  that stream's kernels, so Nsight shows the range around their launches);
- on every device, CPU ones included, appends ``(message, kind, time.perf_counter_ns(), device)``
  to ``EVENTS``, its host process's record (kind ``"push"``, ``"pop"`` or ``"mark"``; the last
  ``RECORD_LIMIT``), for a timeline. Nothing reads it back to the client yet.

An operator has a result in this runtime: these return a 0-dim int64 token, Replicate, which no
one reads, and are IMPURE so the controller never drops them as dead code. The message travels as
a bytes operand (a value, not a static arg), so one call template serves every message, however
many distinct ones a program makes ("step 1", "step 2", ...).
"""

from __future__ import annotations

import collections
import time

import torch

from .. import current
from ..graph import Graph
from ..ops.registry import IMPURE, OpDef, issue, register
from ..ops.rules import Placed
from ..placement import Replicate

RECORD_LIMIT = 100_000  # events a host keeps (and ranges the client keeps), the latest ones
EVENTS: collections.deque = collections.deque(maxlen=RECORD_LIMIT)
KINDS = {"_nvtx_range_push": "push", "_nvtx_range_pop": "pop", "_nvtx_mark": "mark"}
_CUDA_CALLS = {"push": lambda m: torch.cuda.nvtx.range_push(m),
               "pop": lambda m: torch.cuda.nvtx.range_pop(),
               "mark": lambda m: torch.cuda.nvtx.mark(m)}
_TOKENS: dict = {}  # torch device -> the token its kernels return (never written)


def nvtx_kernel(kind: str):
    def kernel(ctx, message: bytes):
        device = ctx.device.torch_device
        text = message.decode()
        if device.type == "cuda":
            _CUDA_CALLS[kind](text)
        EVENTS.append((text, kind, time.perf_counter_ns(), ctx.device.index))
        token = _TOKENS.get(device)
        if token is None:
            token = _TOKENS[device] = torch.zeros((), dtype=torch.int64, device=device)
        return token

    return kernel


def _token_meta(message):
    return torch.empty((), dtype=torch.int64, device="meta")


def replicated(call) -> Placed:
    """The token is the same nothing on every device."""
    return Placed(((Replicate(),) * len(call.mesh.shape),))


# -- fronts (client only) -------------------------------------------------------------------------


def check_graph(who: str, graph) -> None:
    if graph is not None and not isinstance(graph, Graph):
        raise TypeError(f"{who}: graph must be a dtorch.Graph or None, not "
                        f"{type(graph).__name__}")


def check_message(who: str, message) -> None:
    if not isinstance(message, str):
        raise TypeError(f"{who}: the message must be a str, not {type(message).__name__}")


def issue_nvtx(name: str, graph, message: str, mesh=None) -> tuple:
    """Issues the NVTX entry ``name`` with ``message`` on ``graph`` (None: the current graph),
    on every device of ``mesh`` (default: the graph's default mesh). Returns (graph, mesh)."""
    issuing = current.current_graph()
    graph = issuing if graph is None else graph
    if mesh is None:
        mesh = graph.default_device_mesh
    operands, static = (message.encode(),), (mesh,)
    if graph == issuing:
        issue(name, operands, static)
    else:
        with graph:
            issue(name, operands, static)
    return graph, mesh


def _front(name: str, with_message: bool):
    who = f"dtorch.nn.functional.{name}"
    if with_message:
        def front(graph, message):
            check_graph(who, graph)
            check_message(who, message)
            issue_nvtx(name, graph, message)
    else:
        def front(graph):
            check_graph(who, graph)
            issue_nvtx(name, graph, "")

    front.__name__ = front.__qualname__ = name
    front.__doc__ = (f"DTorch's ``{name}``: on every device of ``graph``'s default mesh, in "
                     f"program order (see ``dtorch.cuda.nvtx``, which also records the range on "
                     f"the client).")
    return front


for _name, _kind in KINDS.items():
    register(OpDef(_name, f"{_name}(message: Tensor, *, device_mesh=None)", nvtx_kernel(_kind),
                   replicated, meta=_token_meta, function=False, functional=True, flags=IMPURE,
                   uses_context=True, front=_front(_name, _kind != "pop")))
