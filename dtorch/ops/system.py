"""System operators: NVTX ranges and marks, in program order on every device of a mesh; the
failure token a load reads to learn whether its values arrived (``failure_token``).

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

from ..mesh import DeviceMesh
from ..placement import Replicate, Shard
from .registry import IMPURE, OpDef, issue, register
from .rules import Placed

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


def current_graph():
    """The graph the calling thread issues to (the innermost ``with graph:``, else its default
    graph). The client owns graphs: imported here, so the hosts, which import this module for
    the kernels, never load it."""
    from ..client import graph as g

    current = getattr(g, "current_graph", None)
    return current() if current is not None else g.default_graph


_CPU0: list = []


def graph_mesh(graph) -> DeviceMesh:
    """The mesh a graph's NVTX ops run on: its default mesh (``Graph.device_mesh_guard``)."""
    mesh = getattr(graph, "default_device_mesh", None)
    if mesh is None:  # a Graph without defaults: the one-device CPU mesh, every graph's first
        if not _CPU0:
            _CPU0.append(DeviceMesh("cpu", [0]))
        mesh = _CPU0[0]
    return mesh



def check_graph(who: str, graph) -> None:
    from ..client.graph import Graph

    if graph is not None and not isinstance(graph, Graph):
        raise TypeError(f"{who}: graph must be a dtorch.Graph or None, not "
                        f"{type(graph).__name__}")


def check_message(who: str, message) -> None:
    if not isinstance(message, str):
        raise TypeError(f"{who}: the message must be a str, not {type(message).__name__}")


def issue_nvtx(name: str, graph, message: str, mesh=None) -> tuple:
    """Issues the NVTX entry ``name`` with ``message`` on ``graph`` (None: the current graph),
    on every device of ``mesh`` (default: the graph's default mesh). Returns (graph, mesh)."""
    current = current_graph()
    graph = current if graph is None else graph
    if mesh is None:
        mesh = graph_mesh(graph)
    operands, static = (message.encode(),), (mesh,)
    if graph == current:
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


# -- failure tokens -------------------------------------------------------------------------------


def failure_token(tensors):
    """A token that carries the first failure any of ``tensors`` (on one mesh) carries, on any
    device: reading it (``to_torch()``) raises that failure (the op and the user's line that
    failed), else gives zeros. One element per device, so reading it hears from every device:
    what a load reads to know that its values arrived (``nn.modules.module.check_loaded``).

    >>> import dtorch
    >>> mesh = dtorch.DeviceMesh("cpu", [0, 1])
    >>> x = dtorch.ones(4, device_mesh=mesh, placements=[dtorch.Shard(0)])
    >>> failure_token([x, x * 2]).to_torch()
    tensor([0, 0])
    """
    tensors = tuple(tensors)
    with torch.no_grad():  # a token has no gradient: autograd records nothing of it
        return issue("failure_token", tensors, (tensors[0].device_mesh.size(),))


def _no_failure(ctx, *blocks, devices):
    return torch.zeros(1, dtype=torch.int64, device=ctx.device.torch_device)


def one_per_device(call) -> Placed:
    return Placed(((Shard(0),) * len(call.mesh.shape),))


register(OpDef("failure_token", "failure_token(tensors: TensorList, devices)", _no_failure,
               one_per_device, meta=lambda *blocks, devices: torch.empty(
                   devices, dtype=torch.int64, device="meta"), function=False,
               uses_context=True, front=failure_token))
