"""A host's local device: its torch device, streams, blobs and process groups.

A Device is made on first use (``Host.local_devices``) and lives as long as its host. Its blobs
are keyed by tensor id; its streams, made on first use too, run the kernels queued for it
(``runtime/stream.py``); its groups run the collectives, and a second set of gloo groups on the
CPU carries the failure agreement's flags (``runtime/failures.py``).
"""

from __future__ import annotations

import torch

from .context import Groups
from .stream import Memory, Stream


class Device:
    def __init__(self, host, index: int, device_type: str):
        self.host, self.index = host, index
        # a GPU's ordinal is its index on its own machine (device ids count machine by machine)
        self.torch_device = torch.device("cpu") if device_type == "cpu" else torch.device(
            "cuda", index - host.facts.first_device())
        self.streams: dict = {}
        self.blobs: dict = {}
        # the bytes its blobs hold (a CUDA device reports torch.cuda's allocator instead)
        self.memory = Memory() if device_type == "cpu" else None
        self._groups = Groups(index, self.torch_device, host.store)
        # failure agreement runs on the CPU (reading a flag from a GPU would sync its stream)
        self._cpu_groups = self._groups if device_type == "cpu" else Groups(
            index, torch.device("cpu"), host.store, prefix="cpu-pg/")

    def stream(self, sid: int) -> Stream:
        s = self.streams.get(sid)
        if s is None:
            s = self.streams[sid] = Stream(f"dev{self.index}-stream{sid}", self.torch_device,
                                           on_error=self.host.on_stream_error,
                                           label=(self.index, sid))
            s.tracer = self.host.tracer  # a stream made while tracing records from its start
        return s

    def group(self, members: tuple):
        return self._groups.get(members)

    def cpu_group(self, members: tuple):
        """A gloo group of the same members, for small flags the CPU reads."""
        return self._cpu_groups.get(members)
