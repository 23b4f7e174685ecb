"""Failures on a host: the value a failed result carries, and how a collective's members agree
on one.

A kernel that raises fails its results with a ``Failure``: the user's line (site), the kernel's
name and the exception, told to the client once (``tell``). Every result that depends on it
carries the same Failure on, quietly, and reading one raises it. The Failure is the value a
failed blob holds (``Blob.error``) and the value a replayed program keeps in place of a result
that did not come to be (``program.ProgramRun``), so the kernel loop, replays and generated
code pass on one thing.

A collective cannot skip its kernel as other kernels do: its peers would wait for it forever.
Every member takes part (with zeros for a failed operand, ``stand_in``), and the members agree
on whether any member's input failed (``run_collective``), so a failure on one device poisons
exactly the values that depend on it, on every device. A member that learns of a peer's failure
knows only its site: its results carry ``Failure.at(site)``, which the client reads as
"poisoned by the failure there".
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch._C._distributed_c10d import AllreduceOptions, ReduceOp

from .. import protocol as P
from ..spec import span_devices
from .collectives import hop
from .stream import Blob


class Failure(NamedTuple):
    """Why a result is not there: ``(site, op, message)``, as ``P.KernelError`` and
    ``P.FetchFailed`` carry it (op and message None: a peer's failure at ``site``)."""

    site: int
    op: str | None
    message: str | None

    @classmethod
    def raised(cls, site: int, op: str, e: BaseException) -> Failure:
        """Kernel ``op``, issued at ``site``, raised ``e``."""
        return cls(site, op, f"{type(e).__name__}: {e}")

    @classmethod
    def at(cls, site: int) -> Failure:
        """A peer's failure at ``site``, known by its site alone."""
        return cls(site, None, None)


def tell(host, failure: Failure, key: int) -> None:
    """Tells the client of a new failure, naming the failed kernel by its first result
    (``key``); every device tells, the client tells the user once."""
    host.send(P.KernelError(P.KERNEL_ERROR, *failure, key))


def first_failure(operands):
    """The first Failure among a step's operands (failed blobs and failed results), or None."""
    for x in operands:
        if type(x) is Blob:
            if x.error is not None:
                return x.error
        elif type(x) is Failure:
            return x
    return None


def stand_in(ctx, k: int, x):
    """Operand ``k`` of a collective: the blob's tensor, or zeros of its block's shape when the
    blob failed."""
    if type(x) is not Blob:
        return x
    if x.error is None:
        return x.tensor
    spec = ctx.in_specs[k]
    shape = spec.local_region(ctx.coord)[0]
    return torch.zeros(shape, dtype=getattr(torch, spec.dtype), device=ctx.device.torch_device)


def failure_peers(ctx, call) -> tuple:
    """The devices that run one collective together: a move spans both meshes (every device of
    either runs it); every other step runs along one mesh dim of one mesh, and a COMM kernel
    along its ``comm_dims``."""
    src = next(s for s in call.in_specs if s is not None)  # a VJP's first operand is its key
    dst = call.out_specs[0]
    if src.mesh is not dst.mesh:
        return tuple(sorted(set(src.mesh.devices) | set(dst.mesh.devices)))
    return span_devices(src.mesh, call.comm_dims, ctx.coord)


def run_collective(run, call, ctx, inputs, site):
    """A collective's result on this device, or the Failure its results carry (a new one told
    through ``run.tell``). A member whose input failed takes part with zeros. Alongside, the
    members all-reduce (MAX) the site of their input's failure plus one (0: none), so all of
    them fail their results together. The flag travels on another of gloo's threads while the
    collective runs. (A hop between meshes of one shape needs none of this: ``run_hop``.)"""
    if call.hop:
        return run_hop(run, call, ctx, inputs[0], site)
    error = first_failure(inputs) or (getattr(inputs[0], "error", None) if call.reads_saved
                                      else None)  # a VJP of a forward that did not run
    # a VJP's collectives are its graph's: a device whose forward failed has none, so the
    # peers learn of that (or of a failed gradient) before any of them starts
    missing = call.reads_saved and error is None and not hasattr(inputs[0], "outs")
    failed = error is not None or missing
    flag = torch.tensor([error[0] + 1 if error else site + 1 if missing else 0],
                        dtype=torch.int64)
    peers = failure_peers(ctx, call)
    agreed = failure = result = None
    if len(peers) > 1:
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.MAX
        agreed = ctx.device.cpu_group(peers).allreduce([flag], opts)
        if call.reads_saved:
            failure, agreed = _agree(agreed, site, call), None
            failed = failed or bool(int(flag))
    try:
        if not (call.reads_saved and failed and not missing):
            args = [stand_in(ctx, k, x) for k, x in enumerate(inputs)]
            result = call.fn(ctx, *args, **call.kwargs)
    except Exception as e:  # noqa: BLE001 - a kernel error becomes the client's error
        failure = Failure.raised(site, call.name, e)
    if agreed is not None:
        failure = _agree(agreed, site, call) or failure
    if error is not None:
        return error
    if failure is not None:
        return run.tell(failure)
    if int(flag):
        return Failure.at(int(flag) - 1)
    return result


def run_hop(run, call, ctx, block, site):
    """A pipeline hop (``collectives.hop``): each received block depends on its sender's
    input alone, and the sender's failure travels with it, so the receiver fails its block
    exactly when that input failed, with no agreement among the other devices."""
    error = block.error if type(block) is Blob else None
    try:
        received, sender = hop(ctx, stand_in(ctx, 0, block), error[0] + 1 if error else 0)
    except Exception as e:  # noqa: BLE001 - a kernel error becomes the client's error
        return run.tell(Failure.raised(site, call.name, e))
    if sender:
        return Failure.at(sender - 1)
    return received


def _agree(agreed, site, call):
    """Waits for the failure flags' all-reduce: None, or the failure of a peer that missed it."""
    try:
        agreed.wait()
    except Exception as e:  # noqa: BLE001 - e.g. a peer missed the deadline
        return Failure.raised(site, call.name, e)
    return None
