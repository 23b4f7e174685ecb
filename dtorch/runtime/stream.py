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
    """A device's queue of kernels, run in order on a thread of its own.

    ``on_error(name)`` is called, in the ``except`` block (so ``traceback.format_exc()`` names
    the cause), whenever something raises outside a kernel: an item that raised (kernels catch
    their own errors, so this is a runtime bug), or the thread's own set-up or loop. Work queued
    on a stream that no longer runs it would leave its waiters (a peer's collective, a sync)
    hanging for good, so such a failure must be reported, never die with the thread.
    """

    def __init__(self, name: str, device: torch.device, on_error):
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.pending: list = []
        self.device = device
        self._on_error = on_error
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def put(self, item) -> None:
        """Queues a callable: it runs after everything queued before it, once ``submit`` has
        handed the host's current batch to the thread."""
        self.pending.append(item)

    def submit(self) -> None:
        # One hand-off per batch rather than per kernel: the stream thread then runs a whole
        # list without waking the host's main thread, which would fight it for the GIL.
        if self.pending:
            self.queue.put(self.pending)
            self.pending = []

    def _run(self) -> None:
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
                with torch.cuda.stream(torch.cuda.Stream(self.device)):
                    self._drain()
            else:
                self._drain()
        except BaseException:  # noqa: BLE001 - the thread ends here: the host must say so
            self._on_error(self.thread.name)

    def _drain(self) -> None:
        get = self.queue.get
        while (items := get()) is not None:
            for item in items:
                try:
                    item()
                except Exception:  # noqa: BLE001 - kernels catch their own errors, so this is
                    # a runtime bug; the stream goes on, for a dead stream would hang its waiters
                    self._on_error(self.thread.name)
            # while it waits for more, the stream must not keep the last kernels' blobs alive
            items = item = None

    def close(self) -> None:
        self.queue.put(None)
