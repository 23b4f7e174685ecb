"""Memory figures of devices: ``memory_stats`` and ``empty_cache``, the device side of
``Graph.get_memory_stats`` and ``Graph.empty_cache`` (``dtorch/graph.py``).

Both answer one row per device, ``[allocated, reserved, max_allocated, max_reserved]`` in bytes,
laid out ``Shard(0)`` over a 1-D mesh of the devices asked about: the client reads every
device's row with one fetch of an ``[n, 4]`` int64 tensor. A CUDA device reports torch.cuda's
caching allocator. A CPU device reports the bytes its blobs hold and their peak since the last
reset (``runtime/stream.Memory``); it has no cache, so reserved is allocated. Both ops are
IMPURE: they read (and may reset) state that no operand shows, so they must run even when
nothing reads their rows.
"""

from __future__ import annotations

import torch

from ..mesh import DeviceMesh
from ..ops.registry import IMPURE, OpDef, issue, register
from ..ops.rules import Placed
from ..placement import Shard
from ..runtime import cpu_memory

FIELDS = ("allocated", "reserved", "max_allocated", "max_reserved")


def _row(ctx, reset_peak: bool) -> torch.Tensor:
    """This device's figures, as its 1 x 4 block of the result (on the CPU: only read)."""
    device = ctx.device
    if device.torch_device.type == "cuda":
        d = device.torch_device
        row = [torch.cuda.memory_allocated(d), torch.cuda.memory_reserved(d),
               torch.cuda.max_memory_allocated(d), torch.cuda.max_memory_reserved(d)]
        if reset_peak:
            torch.cuda.reset_peak_memory_stats(d)
    else:
        allocated, peak = device.memory.read(reset_peak)
        row = [allocated, allocated, peak, peak]
    return torch.tensor([row], dtype=torch.int64)


def _memory_stats(ctx, *, n, reset_peak=False):
    return _row(ctx, reset_peak)


def _empty_cache(ctx, *, n):
    if ctx.device.torch_device.type == "cuda":
        torch.cuda.empty_cache()  # the stream thread's current device is this one
    else:
        cpu_memory.release_cached()  # the whole host's: its devices share one malloc
    return _row(ctx, False)


def _rows_meta(n, **_):
    return torch.empty((n, len(FIELDS)), dtype=torch.int64, device="meta")


def one_row_per_device(call) -> Placed:
    """Row i is device i of a 1-D mesh of n devices: ``Shard(0)``, one row to a device."""
    n, mesh = call.static["n"], call.mesh
    if len(mesh.shape) != 1 or len(mesh.devices) != n:
        raise ValueError(f"dtorch.{call.op.name}: needs a 1-D mesh of {n} devices, got {mesh}")
    return Placed(((Shard(0),),))


register(OpDef("memory_stats", "memory_stats(n, *, reset_peak=False, device_mesh=None)",
               _memory_stats, one_row_per_device, meta=_rows_meta, function=False,
               flags=IMPURE, uses_context=True,
               doc="Each device's memory figures (``Graph.get_memory_stats``)."))
register(OpDef("empty_cache", "empty_cache(n, *, device_mesh=None)", _empty_cache,
               one_row_per_device, meta=_rows_meta, function=False, flags=IMPURE,
               uses_context=True,
               doc="Frees each device's cached blocks (``Graph.empty_cache``)."))


def memory_stats(device_type: str, devices: list, reset_peak: bool) -> list:
    """The rows ``[allocated, reserved, max_allocated, max_reserved]`` of ``devices``, in
    their order, read once the work issued before has run on each."""
    rows = issue("memory_stats", (), (len(devices), bool(reset_peak),
                                      DeviceMesh(device_type, devices))).to_torch()
    assert rows.shape[1] == len(FIELDS)
    return rows.tolist()


def empty_cache(device_type: str, devices: list) -> None:
    """Issues ``empty_cache`` on ``devices``."""
    issue("empty_cache", (), (len(devices), DeviceMesh(device_type, devices)))
