"""The call shapes a host runs (``HostCall``), built from their DefineCall by kind.

Each kind of call (``protocol.CallKind``) has its builder in ``BUILDERS``, beside the host's
record handlers: an operator's kernel comes from the registry, a redistribute step's from
``collectives.STEP_KERNELS``, a VJP's is ``vjp.vjp`` on the graph its forward call kept. A
redistribute has no builder: the controller lowers it into steps, so one that reaches a host is
a bug of the runtime, and defining it raises at once rather than running something else.
"""

from __future__ import annotations

from typing import NamedTuple

from .. import protocol as P
from ..ops import registry
from ..protocol import CallKind
from .collectives import STEP_KERNELS, is_hop
from .context import KernelContext
from .vjp import recording, vjp


class Kernel(NamedTuple):
    """What a builder makes of a DefineCall: the function, whether it takes a KernelContext,
    its static kwargs, the mesh dims it communicates along, and its name in errors."""

    fn: object
    uses_context: bool
    kwargs: dict
    comm_dims: tuple
    name: str


def operator_kernel(host, d: P.DefineCall, in_specs) -> Kernel:
    op = registry.lookup(d.target)
    kwargs = dict(zip(P.wire_names(op.static_names), P.unpack_static(d.static)))
    first = next((s for s in in_specs if s is not None), None)
    comm_dims = (tuple(op.comm_dims(in_specs, **kwargs)) if op.comm_dims
                 else tuple(range(len(first.mesh.shape))) if first else ())
    return Kernel(op.kernel, op.uses_context, kwargs, comm_dims, d.target)


def step_kernel(host, d: P.DefineCall, in_specs) -> Kernel:
    mesh_dim = P.unpack(d.static)[0]
    return Kernel(STEP_KERNELS[d.target], True, {"mesh_dim": mesh_dim}, (mesh_dim,),
                  P.call_name(d.kind, d.target))


def vjp_kernel(host, d: P.DefineCall, in_specs) -> Kernel:
    """Its first operand is the key of the graph the forward call kept."""
    forward = host.calls[d.target]
    needs, retain, dropped = P.unpack_static(d.static)
    kwargs = {"needs": tuple(needs), "retain": retain, "dropped": tuple(dropped)}
    return Kernel(vjp, True, kwargs, forward.comm_dims, f"{forward.name} (backward)")


BUILDERS = {
    CallKind.OPERATOR: operator_kernel,
    CallKind.STEP: step_kernel,
    CallKind.VJP: vjp_kernel,
}


class HostCall:
    """A call shape as this host runs it: the kernel, its static kwargs, and the local devices
    taking part (those of the result's mesh, plus the source mesh's for a move)."""

    __slots__ = ("name", "fn", "uses_context", "in_specs", "out_specs", "kwargs", "inplace",
                 "mask", "all_tensors", "devices", "out_devices", "contexts", "comm", "n_out",
                 "comm_dims", "receive_only", "saves", "reads_saved", "hop", "overwrites",
                 "view")

    def __init__(self, host, rec):
        call = P.DefineCall(*rec)
        build = BUILDERS.get(call.kind)
        if build is None:
            raise RuntimeError(
                f"dtorch internal error: host {host.index} was sent call {call.id} of kind "
                f"{CallKind(call.kind).name}, which the controller lowers and never sends")
        flags = P.bits_of(call.flags)  # (an optimizer's list update writes many operands)
        self.in_specs = [host.specs[i] if i else None for i in call.inputs]
        kernel = build(host, call, self.in_specs)
        self.fn, self.uses_context = kernel.fn, kernel.uses_context
        self.name, self.kwargs, self.comm_dims = kernel.name, kernel.kwargs, kernel.comm_dims
        # autograd: a recorded call keeps its graph (the host's Recorded entry gives it the
        # slot and which operands to differentiate and not to keep), a VJP reads one
        self.saves = bool(flags & P.RECORD)
        self.reads_saved = call.kind == CallKind.VJP
        if self.saves:
            self.fn, self.uses_context = recording(self.fn, self.uses_context), True
        self.out_specs = [host.specs[i] for i in call.outputs]
        self.n_out = len(call.outputs)
        self.mask = [bool(i) for i in call.inputs]
        self.all_tensors = all(self.mask)
        self.inplace = bool(flags & P.INPLACE)
        self.overwrites = bool(flags & P.OVERWRITES)  # a failed operand 0 does not stop it
        self.view = bool(flags & P.VIEW)
        self.comm = bool(flags & P.COMM)  # a collective: its peers rely on it taking part
        meshes = [s.mesh for s in self.out_specs] + [s.mesh for s in self.in_specs if s]
        self.out_devices = host.local_devices(self.out_specs[0].mesh) if self.out_specs else []
        self.devices = list({d.index: d for m in meshes for d in host.local_devices(m)}.values())
        # a move's devices outside the source mesh read nothing: see Host.on_chain
        is_move = call.kind == CallKind.STEP and call.target == "move"
        self.receive_only = frozenset(
            set(self.out_specs[0].mesh.devices) - set(self.in_specs[0].mesh.devices)
            if is_move else ())
        self.hop = is_move and is_hop(self.in_specs[0], self.out_specs[0])
        self.contexts: dict = {}

    def context(self, device):
        ctx = self.contexts.get(device.index)
        if ctx is None:
            ctx = self.contexts[device.index] = KernelContext(device, self.in_specs,
                                                              self.out_specs)
        return ctx
