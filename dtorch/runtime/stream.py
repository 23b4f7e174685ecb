"""Blob, Stream and Event: the execution resources of one device.

A Stream runs its queue of kernels in order on a thread of its own (on CUDA the thread also
enters a ``torch.cuda.Stream``, so kernels from two streams overlap on the GPU). An Event is
recorded by one stream and waited for by another; on CUDA it carries a ``torch.cuda.Event`` too,
so the waiting stream waits on the GPU rather than on the CPU.
"""

from __future__ import annotations

import queue
import threading

import torch


class Blob:
    """A tensor a device holds (or the error that prevented it). Kernels hold the Blob objects
    they use, so dropping a Blob from the device's table frees the memory only once the last
    queued kernel using it has run."""

    __slots__ = ("tensor", "error", "spec")

    def __init__(self, spec, tensor=None):
        self.spec, self.tensor, self.error = spec, tensor, None


class Event:
    __slots__ = ("_flag", "_cuda")

    def __init__(self, cuda: bool):
        self._flag = threading.Event()
        self._cuda = torch.cuda.Event() if cuda else None

    def record(self) -> None:
        """Runs on the producing stream, after everything queued before it."""
        if self._cuda is not None:
            self._cuda.record()
        self._flag.set()

    def wait(self) -> None:
        self._flag.wait()
        if self._cuda is not None:
            torch.cuda.current_stream().wait_event(self._cuda)


class Stream:
    def __init__(self, name: str, device: torch.device, on_start=None):
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.device = device
        self._on_start = on_start
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def put(self, item) -> None:
        """Queues a callable; it runs after everything queued before it."""
        self.queue.put(item)

    def _run(self) -> None:
        if self._on_start is not None:
            self._on_start()
        get = self.queue.get
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            with torch.cuda.stream(torch.cuda.Stream(self.device)):
                while (item := get()) is not None:
                    item()
        else:
            while (item := get()) is not None:
                item()

    def close(self) -> None:
        self.queue.put(None)
