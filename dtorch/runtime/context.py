"""What a kernel may know of where it runs: KernelContext, and the process groups of a device.

A context exists per (call shape, device) and is built once: the device's mesh coordinate, the
specs of operands and results and the block of each result this device holds. Kernels that need
no layout (almost all) never see it.
"""

from __future__ import annotations

import datetime

import torch
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo

from .. import config
from ..placement import Partial
from ..spec import coordinate_of, group_devices

class KernelContext:
    __slots__ = ("device", "in_specs", "out_specs", "coord", "out_coord", "out_local_shape",
                 "out_offsets")

    def __init__(self, device, in_specs, out_specs):
        self.device = device
        self.in_specs, self.out_specs = in_specs, out_specs
        first_in = next((s for s in in_specs if s is not None), None)
        self.coord = _coord(first_in, device.index)
        out = out_specs[0] if out_specs else None
        self.out_coord = _coord(out, device.index)
        if self.out_coord is not None:
            self.out_local_shape, self.out_offsets = out.local_region(self.out_coord)
        else:
            self.out_local_shape = self.out_offsets = None

    def partition(self, t: torch.Tensor) -> torch.Tensor:
        """This device's contribution to a value every device holds whole (``holds_value``),
        else zeros."""
        return t if self.holds_value() else torch.zeros_like(t)

    def holds_value(self) -> bool:
        """Whether this device's block of the result holds the value (every device computing
        it whole): not on a Partial sum mesh dim past coordinate 0, whose blocks are zeros
        (max, min and avg of equal values are the value)."""
        return not any(isinstance(p, Partial) and p.reduce_op == "sum" and c
                       for p, c in zip(self.out_specs[0].placements, self.out_coord))

    def group(self, mesh_dim: int):
        """The process group along ``mesh_dim`` through this device, and this device's rank."""
        spec = self.in_specs[0]
        members = group_devices(spec.mesh, mesh_dim, self.coord)
        return self.device.group(members), members.index(self.device.index)


def _coord(spec, device: int):
    if spec is None or device not in spec.mesh.devices:
        return None
    return coordinate_of(spec.mesh, device)


class Groups:
    """A device's process groups, created on first use on its communication stream. Every member
    runs its collectives in the same program order, so creation (a rendezvous through the
    store) meets up without deadlock.

    Each group's collectives raise once ``config.collective_timeout_s`` passes without their
    peers (a kernel that waits for a member that never comes, a peer stuck elsewhere): the
    kernel then fails at its call site like any other, rather than hanging the program. On
    gloo the deadline raises in the waiting kernel; NCCL's watchdog enforces it instead, in the
    way ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` says (by default it ends the process, which the
    client reports as a dead host).
    """

    def __init__(self, device_index: int, torch_device: torch.device, connect_store,
                 prefix: str = "pg/"):
        self.index, self.torch_device, self.prefix = device_index, torch_device, prefix
        self.connect_store, self.store = connect_store, None
        self.groups: dict = {}

    def get(self, members: tuple):
        pg = self.groups.get(members)
        if pg is None:
            pg = self.groups[members] = self._create(members)
        return pg

    def _create(self, members: tuple):
        if self.store is None:
            self.store = self.connect_store()
        store = PrefixStore(self.prefix + "-".join(map(str, members)), self.store)
        rank, size = members.index(self.index), len(members)
        timeout = datetime.timedelta(seconds=config.collective_timeout_s)
        if self.torch_device.type == "cuda":
            from torch._C._distributed_c10d import ProcessGroupNCCL

            opts = ProcessGroupNCCL.Options()
            opts._timeout = timeout
            return ProcessGroupNCCL(store, rank, size, opts)
        opts = ProcessGroupGloo._Options()
        opts._devices = [ProcessGroupGloo.create_device(hostname=config.bind_host)]
        opts._timeout = timeout  # gloo's rendezvous (connecting the pairs) waits this long too
        return ProcessGroupGloo(store, rank, size, opts)
