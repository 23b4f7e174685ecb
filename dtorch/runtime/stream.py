"""Blob, Stream and Event: the execution resources of one device.

A Stream runs its queue of kernels in order on a thread of its own (on CUDA the thread also
enters a ``torch.cuda.Stream``, so kernels from two streams overlap on the GPU). An Event is
recorded by one stream and waited for by another; on CUDA it carries a ``torch.cuda.Event`` too,
so the waiting stream waits on the GPU rather than on the CPU. A CPU device's Memory counts the
bytes its blobs hold (``Graph.get_memory_stats``).
"""

from __future__ import annotations

import collections
import ctypes
import queue
import threading
import time

import torch


def record_uses(blobs) -> None:
    """Tells torch's CUDA caching allocator that the current stream uses each blob's tensor
    (``Tensor.record_stream``). A blob is let go once the batch that uses it is launched, not
    run; freed then, its memory could be handed to a kernel of the stream that allocated it
    while this stream's kernel has yet to read it. Recorded, the free waits for this stream's
    work. (A tensor of the current stream's own is unaffected.)"""
    stream = torch.cuda.current_stream()
    for b in blobs:
        if type(b) is Blob and b.tensor is not None and b.tensor.is_cuda:
            b.tensor.record_stream(stream)


class Memory:
    """The bytes a CPU device's blobs hold, and their peak since the last reset.

    Counted per storage, so views of one storage (a reshape, a detach) count once: a blob notes
    its tensor's storage when a kernel stores it (``Blob.hold``) and notes it dropped when the
    blob itself goes (the last of the device's table and the queued kernels that use it lets go),
    which is when the memory is freed. Transient buffers inside a kernel are not blobs and are
    not counted. Noting costs a deque append (atomic, so stream threads and the host's main
    thread note without a lock); the notes are applied in their order, which keeps the peak
    exact, when the figures are read or every ``LIMIT`` notes.
    """

    __slots__ = ("notes", "allocated", "peak", "_storages", "_lock")
    LIMIT = 4096

    def __init__(self):
        self.notes: collections.deque = collections.deque()  # (storage, bytes); bytes 0: dropped
        self.allocated = self.peak = 0
        self._storages: dict = {}  # storage address -> [bytes, blobs holding it]
        self._lock = threading.Lock()

    def note(self, storage: int, size: int) -> None:
        notes = self.notes
        notes.append((storage, size))
        # never waits for the lock: a blob's __del__ notes too, and a garbage collection may run
        # it inside ``_apply`` on this very thread, which holds the lock (the holder drains)
        if len(notes) > self.LIMIT and self._lock.acquire(blocking=False):
            try:
                self._apply(False)
            finally:
                self._lock.release()

    def read(self, reset_peak: bool = False) -> tuple:
        """(allocated, peak) in bytes; ``reset_peak`` then starts the peak again from now."""
        with self._lock:
            return self._apply(reset_peak)

    def _apply(self, reset_peak: bool) -> tuple:
        notes, storages = self.notes, self._storages
        allocated, peak = self.allocated, self.peak
        while notes:  # only the lock's holder takes notes out (others may add more meanwhile)
            key, size = notes.popleft()
            entry = storages.get(key)
            if size:
                if entry is None:
                    storages[key] = [size, 1]
                    allocated += size
                    peak = max(peak, allocated)
                else:
                    entry[1] += 1
            else:
                entry[1] -= 1
                if not entry[1]:
                    del storages[key]
                    allocated -= entry[0]
        self.allocated, self.peak = allocated, allocated if reset_peak else peak
        return allocated, peak


class Blob:
    """A tensor a device holds (or the ``failures.Failure`` that prevented it, in ``error``).
    Kernels hold the Blob objects they use, so dropping a Blob from the device's table frees the
    memory only once the last queued kernel using it has run. ``memory``: the device's Memory,
    which counts the tensor from ``hold`` until the blob goes (None: not counted). ``view``: its
    tensor is (or would have been) a view of another blob's storage."""

    __slots__ = ("tensor", "error", "spec", "memory", "_held", "view")

    def __init__(self, spec, tensor=None, memory: Memory | None = None, view: bool = False):
        self.spec, self.tensor, self.error = spec, tensor, None
        self.memory, self._held, self.view = memory, 0, view

    def overwritable(self, ctx):
        """The tensor an OVERWRITES kernel (``protocol.OVERWRITES``: it writes every element
        of its operand 0 and reads none) writes into when this blob, its operand 0, carries a
        failure; None where the failure must go on (the kernel does not run). The one rule,
        which the step runner of kernels and replays applies (``execute.Runner.run_step``):
        the storage the blob has (an in-place kernel failed on it, leaving it); a fresh block
        where it has none and is no view (a result never made); none for a view never made,
        whose writes could not reach the base whose storage it was to share. The kernel's
        result then clears the failure (``overwritten``)."""
        if self.tensor is not None:
            return self.tensor
        if self.view or ctx is None:
            return None
        return torch.empty(ctx.out_local_shape, dtype=getattr(torch, self.spec.dtype),
                           device=ctx.device.torch_device)

    def overwritten(self, tensor) -> None:
        """An OVERWRITES kernel wrote ``tensor`` over this blob's failure: it holds a value
        again."""
        self.hold(tensor)
        self.error = None

    def hold(self, tensor) -> None:
        """Stores a kernel's result (again, for an in-place kernel: the new storage is noted
        before the old one is dropped, so an unchanged storage never leaves the count)."""
        memory = self.memory
        if memory is not None:
            held = self._held
            try:
                storage = tensor.untyped_storage()
                size = storage.nbytes()
            except (AttributeError, NotImplementedError, RuntimeError):  # no tensor, or no storage
                size = 0
            if size:
                self._held = key = storage.data_ptr()
                memory.note(key, size)
            else:
                self._held = 0
            if held:
                memory.note(held, 0)
        self.tensor = tensor

    def __del__(self):
        if self._held:
            self.memory.note(self._held, 0)


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


class TraceRecorder:
    """The kernels a host's streams ran while tracing (``dtorch.profiler``): one
    ``(name, device, stream, start_ns, end_ns, site)`` per item with a ``trace_name`` (a
    KernelRun or ProgramRun; ``site``: the client's index of the user's line that issued its
    last kernel). The span starts once the kernel's waits are over, so it is the stream's busy
    time, not its idle time. Stream threads append (atomic under the GIL); nothing is locked."""

    __slots__ = ("events",)

    def __init__(self):
        self.events: list = []

    def run(self, stream, item) -> None:
        name = getattr(item, "trace_name", None)
        if name is None:  # an event record, a sync's or fetch's callback: not a kernel
            item()
            return
        waits = item.waits
        if waits:  # waited for here, so the kernel's own wait then returns at once
            for e in waits:
                e.wait()
        t0 = time.time_ns()
        item()
        self.events.append((name, stream.label[0], stream.label[1], t0, time.time_ns(),
                            item.site))


def name_os_thread(name: str) -> None:
    """Names the calling thread for the OS too (Linux: ``top -H``, ``perf``, ``/proc``, which
    otherwise see every Python thread as "python"); 15 bytes at most. Elsewhere nothing."""
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


class Stream:
    """A device's queue of kernels, run in order on a thread of its own.

    ``on_error(name)`` is called, in the ``except`` block (so ``traceback.format_exc()`` names
    the cause), whenever something raises outside a kernel: an item that raised (kernels catch
    their own errors, so this is a runtime bug), or the thread's own set-up or loop. Work queued
    on a stream that no longer runs it would leave its waiters (a peer's collective, a sync)
    hanging for good, so such a failure must be reported, never die with the thread.

    ``tracer``: a TraceRecorder while tracing, else None (switched by items on the queue, so at a
    point of the program; the only cost when off is this one attribute check per item).
    ``label``: (device index, stream id), which the trace names.
    """

    def __init__(self, name: str, device: torch.device, on_error, label=(0, 0)):
        self.tracer = None
        self.label = label
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
        name_os_thread(self.thread.name)
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
        # On the CPU a kernel has run when it returns, so each is let go then: a blob dropped
        # from the device's table is freed when the last kernel using it has run, not when the
        # whole batch has. A CUDA kernel has only been launched by then, so there the batch
        # keeps its kernels (and their blobs) until its end.
        let_go = self.device.type != "cuda"
        while (items := get()) is not None:
            for k in range(len(items)):
                item = items[k]
                if let_go:
                    items[k] = None
                try:
                    if self.tracer is None:
                        item()
                    else:
                        self.tracer.run(self, item)
                except Exception:  # noqa: BLE001 - kernels catch their own errors, so this is
                    # a runtime bug; the stream goes on, for a dead stream would hang its waiters
                    self._on_error(self.thread.name)
            # while it waits for more, the stream must not keep the last kernel's blobs alive
            items = item = None

    def close(self) -> None:
        self.queue.put(None)
