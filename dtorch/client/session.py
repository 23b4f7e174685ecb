"""The client session: the user's side of the runtime.

It owns the record buffer that operators append to, flushes it to the controller as one msgpack
frame (on a sync point, when it grows past ``flush_records``, and shortly after the first record
of a batch so a device never starves while the user's code runs on), and runs a receiver thread
that completes TensorFutures, collects kernel errors and watches the controller's heartbeat.
The controller process is started on first use and dies with this process (see
``cluster/local.py``); its sockets admit only this runtime's processes (``cluster/auth.py``).

Nothing the user issued is lost: a batch taken from the buffer is always sent (Ctrl-C waits for
that), a record that cannot be serialized is taken out and reported at the user's next call with
its call site, and the flusher thread survives any error. Flow control:
every ``max_inflight_ops / MARKS`` records the client sends a *mark* (a sync that raises
nothing), and once ``MARKS`` marks are outstanding the user's thread waits for the oldest, so
however far ahead a program runs, at most about ``max_inflight_ops`` records are in flight.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections import deque

import zmq

from .. import config, protocol as P
from ..cluster import auth, local
from ..future import TensorFuture
from .assemble import assemble, piece_count

_current = None
_lock = threading.Lock()
# Tensor ids are unique across sessions, so a tensor that outlives a dtorch.shutdown() can never
# name (or, when dropped, release) a tensor of the next runtime.
_tensor_ids = itertools.count(1)
MAX_ERRORS = 16  # distinct kernel errors kept for the next wait; later ones are only counted
MAX_REPORTED = 4096  # failed kernels remembered, so each is raised once however many report it
MAX_CODES = 4096  # code objects whose call sites the client keeps looked up
MARKS = 4  # flow-control marks in flight at most (see the module docstring)
log = logging.getLogger("dtorch")


def current() -> Session:
    s = _current
    if s is None or s.closed:
        with _lock:
            s = _current
            if s is None or s.closed:
                s = _start()
    if s.alarm:
        s.raise_alarm()
    return s


def _start() -> Session:
    global _current
    _current = Session()
    return _current


def fetch(tensor) -> TensorFuture:
    """``Tensor.to_torch_async``: a TensorFuture of the full logical value (shards joined,
    partials reduced)."""
    return current().fetch(tensor)


def release(tensor) -> None:
    """``Tensor.__del__``: queue the release of its id with the operators. Like an operator, the
    first record of a batch wakes the flusher, or a drop followed by no other call would keep
    the memory on the hosts until the next one. Unlike ``Session.append`` it never flushes:
    ``__del__`` may run inside a flush (a garbage collection there), whose lock is held."""
    release_id(tensor._id)


def release_id(tensor_id: int) -> None:
    """``release`` of an id (a tensor's, or a tape node's: the hosts drop what they keep for
    it)."""
    s = _current
    if s is not None and not s.closed:
        records = s.records
        if not records:
            s.wake()
        records.append(tensor_id)


def shutdown() -> None:
    """Stops the controller and hosts; the next operator starts a fresh runtime."""
    global _current
    with _lock:
        s, _current = _current, None
    if s is not None:
        s.close()


atexit.register(shutdown)


class Session:
    def __init__(self):
        self.records = deque()
        self.ids = _tensor_ids  # tensor ids; the controller uses negative ones
        self.requests = itertools.count(1)
        self.sites: dict = {}  # (file, line) -> index in site_names
        self.code_sites: dict = {}  # id(code) -> {bytecode offset: site index}, or _INSIDE
        self.codes: list = []  # the code objects of code_sites, kept alive
        self.site_names: list = ["<unknown>"]
        self.pending: dict = {}  # request -> (future, spec, pieces)
        self.traces: dict = {}  # request -> the TraceEvents received for a trace stop
        self.tracing = None  # while tracing, the client's spans: [(name, -2, 0, t0, t1, 0)]
        self.batch_started = 0  # while tracing, time.time_ns() at the batch's first record
        self.errors: list = []  # kernel errors not raised yet (at most MAX_ERRORS)
        self.more_errors = 0  # how many more were reported
        self.failures: dict = {}  # site -> its first kernel error (names a peer's poison)
        self.reported: dict = {}  # ids of failed kernels already seen (an ordered set)
        self.fatal = None
        self.unsent: list = []  # errors of records that could not be serialized, for the next call
        self.alarm = False  # fatal or unsent: the next call must look (one check on the hot path)
        self.marks: deque = deque()  # futures of the flow-control marks in flight
        self.unmarked = 0  # records sent since the last mark
        self.closed = False
        self.graph = 0
        # per-session caches: the wire ids they hold mean nothing to another controller
        self.bound: dict = {}  # call key -> dispatch.Bound
        self.spec_ids: dict = {}
        self.mesh_ids: dict = {}
        self.call_defs: list = []
        self._flush_lock = threading.Lock()
        # the flusher's wake-ups: a SimpleQueue, whose put is reentrant, since a release may come
        # from a __del__ that a garbage collection runs anywhere, inside another put too (an
        # Event's set takes a lock of its own, and deadlocked there)
        self._wake: queue.SimpleQueue = queue.SimpleQueue()
        self.keys = keys = auth.Keys.generate()  # this runtime's (see cluster/auth.py)
        self.ctx = zmq.Context()
        self._gatekeeper = auth.Gatekeeper(self.ctx, keys)
        self.ops = self.ctx.socket(zmq.PUSH)
        self.ops.setsockopt(zmq.LINGER, 0)
        ops_addr = _bind(self.ops, keys)
        self.results = self.ctx.socket(zmq.PULL)
        self.results.setsockopt(zmq.LINGER, 0)
        results_addr = _bind(self.results, keys)
        self.controller = local.start_controller(ops_addr, results_addr, keys)
        # torch imports its meta kernels (hundreds of modules, about a second) on first use;
        # do that while the controller starts rather than at the user's first operator
        # (not a daemon: one still inside torch's import when the interpreter exits aborts it)
        threading.Thread(target=_warm_meta_kernels, name="dtorch-warm").start()
        self._receiver = threading.Thread(target=self._receive, name="dtorch-receiver", daemon=True)
        self._receiver.start()
        self._flusher = threading.Thread(target=self._flush_soon, name="dtorch-flusher", daemon=True)
        self._flusher.start()

    # -- sending --------------------------------------------------------------------------------
    def append(self, record) -> None:
        records = self.records
        if not records:
            self.wake()
        records.append(record)
        if len(records) >= config.flush_records:
            self.flush()

    def wake(self) -> None:
        """A batch starts: the flusher sends it soon unless a flush comes first."""
        self._wake.put(None)
        if self.tracing is not None:
            self.batch_started = time.time_ns()

    def flush(self, block: bool = True) -> None:
        """Sends the buffered records as one frame. ``block``: the user's thread waits here while
        ``MARKS`` flow-control marks are in flight; the flusher thread leaves such a flush to
        it (and is woken when a mark completes)."""
        with self._flush_lock:
            records, marks = self.records, self.marks
            n = len(records)
            if not n or self.closed:
                return
            while marks and marks[0].done():
                marks.popleft()
            if len(marks) >= MARKS:
                if not block:
                    return
                marks.popleft().get()  # raises if the runtime failed meanwhile
            # Popped, not iterated: ``release`` appends from ``__del__`` on any thread meanwhile.
            # Ctrl-C waits for the send, so a batch taken from the buffer is always sent.
            with _sigint_deferred():
                spans = self.tracing  # the flusher thread may run this while a trace stops
                # read before the records are taken: a record appended after that (by the
                # user's thread) starts the next batch
                started, flushed = self.batch_started, time.time_ns() if spans is not None \
                    else 0
                batch = [records.popleft() for _ in range(n)]
                if records and flushed:  # appended meanwhile: the next batch began about now
                    self.batch_started = flushed
                try:
                    frame = P.pack(batch)
                except Exception:  # noqa: BLE001 - one bad record must not take the batch along
                    frame = P.pack(self._take_unsendable(batch))
                self._send(frame)
                if flushed:
                    spans += [(f"issue {n} records", P.CLIENT, 0, started, flushed, 0),
                                     (f"flush {n} records", P.CLIENT, 1, flushed,
                                      time.time_ns(), 0)]
            self.unmarked += n
            if self.unmarked * MARKS >= config.max_inflight_ops:
                self._mark()

    def _take_unsendable(self, batch: list) -> list:
        """The records of ``batch`` that serialize; each other one becomes an error raised at
        the user's next call (and at the next wait), naming its operator and call site."""
        sendable = []
        for rec in batch:
            try:
                P.pack(rec)
            except Exception as e:  # noqa: BLE001
                self.unsent.append(self._describe_unsendable(rec, e))
                self.alarm = True
            else:
                sendable.append(rec)
        return sendable

    def _describe_unsendable(self, rec, error: Exception) -> str:
        if isinstance(rec, tuple) and rec and rec[0] == P.OP:
            op = self.call_defs[rec[1] - 1]
            return self._describe(rec[2], op, f"its arguments could not be sent ({error})")
        return f"a dtorch record could not be sent ({error}): {rec!r:.200}"

    def _mark(self) -> None:
        request = next(self.requests)
        future = TensorFuture()
        future.add_done_callback(lambda _: self._wake.put(None))  # a flush may wait for it
        self.pending[request] = (future, None, None)
        self._send(P.pack([P.Sync(P.SYNC, request)]))
        self.marks.append(future)
        self.unmarked = 0

    def _send(self, frame) -> None:
        # A PUSH socket blocks while it has no peer, and a dead controller must not hang the
        # user: wait for room in short polls, giving up once the runtime is known to be dead.
        while True:
            try:
                return self.ops.send(frame, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                if self.fatal is not None:
                    return
                self.ops.poll(100, zmq.POLLOUT)

    def _flush_soon(self) -> None:
        # Batches form while the user's thread runs ahead; this bounds how long the first record
        # of a batch waits when the user's code stops issuing without syncing. This thread
        # must outlive any error, or records would wait here forever.
        while not self.closed:
            self._wake.get()
            while not self._wake.empty():  # wake-ups that came meanwhile: one flush for all
                self._wake.get()
            if self.closed:
                return
            threading.Event().wait(config.flush_delay_s)
            try:
                self.flush(block=False)
            except Exception as e:  # noqa: BLE001 - told at the user's next call
                self.unsent.append(f"dtorch's flusher failed: {type(e).__name__}: {e}")
                self.alarm = True

    # -- definitions (sent once per session) ----------------------------------------------------
    def define_call(self, op_name: str, inputs, outputs, static: tuple, flags: int) -> int:
        """The id of a new call template: operand specs (a Python type for a scalar), output
        specs, the static args that travel, the op's flags."""
        blob = P.pack_static(static)  # first: a static arg that cannot be sent raises, unsent
        call_id = len(self.call_defs) + 1
        self.call_defs.append(op_name)
        self.append(P.DefineCall(
            P.DEFINE_CALL, call_id, op_name,
            [self.spec_id(i) if not isinstance(i, type) else 0 for i in inputs],
            [self.spec_id(o) for o in outputs], blob, flags,
        ))
        return call_id

    def spec_id(self, spec) -> int:
        i = self.spec_ids.get(spec)
        if i is None:
            mesh = self.mesh_id(spec.mesh)
            i = self.spec_ids[spec] = len(self.spec_ids) + 1
            self.append(P.define_spec(i, spec, mesh))
        return i

    def mesh_id(self, mesh) -> int:
        i = self.mesh_ids.get(mesh)
        if i is None:
            i = self.mesh_ids[mesh] = len(self.mesh_ids) + 1
            self.append(P.DefineMesh(P.DEFINE_MESH, i, mesh.device_type, list(mesh.shape),
                                     list(mesh.devices)))
        return i

    def set_graph(self, graph: int) -> None:
        if graph != self.graph:
            self.graph = graph
            self.append(P.SetGraph(P.SET_GRAPH, graph))

    def site(self, depth: int = 2) -> int:
        """Index of the user's ``file:line``: the first frame outside dtorch, from ``depth``
        frames up (2: the caller of dispatch). Found by the frame's code object and bytecode
        offset, both free to read: a line number costs a walk of the code's line table, paid
        once per call site."""
        try:
            f = sys._getframe(depth)
        except ValueError:  # called from C with no user frame below (a thread's target)
            return 0
        by_code = self.code_sites
        while True:
            sites = by_code.get(id(f.f_code))
            if sites is None:
                sites = self._code_sites(f.f_code)
            if sites is not _INSIDE:
                break
            f = f.f_back
            if f is None:
                return 0  # "<unknown>"
        index = sites.get(f.f_lasti)
        if index is None:
            index = sites[f.f_lasti] = self._site_index(f.f_code.co_filename, f.f_lineno)
        return index

    def _code_sites(self, code) -> dict:
        """``code_sites``'s entry for a code object met for the first time: ``_INSIDE`` for
        dtorch's own code, else its call sites by bytecode offset. The code is kept alive, so its
        id names no other while it stands here. A cache: past ``MAX_CODES`` (code compiled
        again and again, by ``exec``) it starts again, the sites' indices stay."""
        if len(self.codes) >= MAX_CODES:
            self.codes.clear()
            self.code_sites.clear()
        self.codes.append(code)
        sites = _INSIDE if code.co_filename.startswith(_PACKAGE_DIR) else {}
        self.code_sites[id(code)] = sites
        return sites

    def _site_index(self, filename: str, line: int) -> int:
        # keyed by name, not code object: equal code elsewhere compares equal
        key = (filename, line)
        index = self.sites.get(key)
        if index is None:
            index = self.sites[key] = len(self.site_names)
            self.site_names.append(f"{filename}:{line}")
        return index

    # -- waits ----------------------------------------------------------------------------------
    def fetch(self, tensor) -> TensorFuture:
        request = next(self.requests)
        # get() raises the fetch's own failure, or a kernel error reported before it
        future = TensorFuture(check=self.raise_errors)
        self.pending[request] = (future, tensor._spec, {})
        self.append(P.Fetch(P.FETCH, tensor._id, request))
        self.flush()
        if self.fatal is not None:
            self._fail_all()
        return future

    def sync_async(self, compiles: bool = False) -> TensorFuture:
        """A sync that does not wait: the future completes once every operator issued so far
        has run (and, with ``compiles``, every kernel fusion they started is compiled and in
        use, or given up); its get() raises the kernel errors reported before it."""
        request = next(self.requests)
        future = TensorFuture(check=self.raise_errors)
        self.pending[request] = (future, None, None)
        self.append(P.Sync(P.SYNC, request, int(compiles)))
        self.flush()
        if self.fatal is not None:
            self._fail_all()
        return future

    def sync(self, compiles: bool = False) -> None:
        self.sync_async(compiles).get()

    def trace(self, on: bool):
        """Starts kernel recording on every host (None), or stops it and returns each host's
        TraceEvents (``protocol.Trace``): they all arrive before the sync that follows."""
        if on:
            self.tracing, self.batch_started = [], time.time_ns()  # (a batch may be under way)
            self.append(P.Trace(P.TRACE, True, 0))
            self.flush()
            return None
        request = next(self.requests)
        self.traces[request] = []
        try:
            self.append(P.Trace(P.TRACE, False, request))
            self.sync()
        finally:
            received = self.traces.pop(request)
            spans, self.tracing = self.tracing or [], None
        return [P.TraceEvents(*m) for m in received] + [
            P.TraceEvents(P.TRACE_EVENTS, request, P.CLIENT, os.getpid(), 0, spans)]

    def raise_alarm(self) -> None:
        """The runtime's failure, or the records that could not be sent (then the runtime
        stays usable)."""
        if self.fatal is not None:
            raise RuntimeError(f"dtorch runtime failed: {self.fatal}. Call dtorch.shutdown() to "
                               "restart.")
        unsent, self.unsent, self.alarm = self.unsent, [], False
        if unsent:
            more = f" ({len(unsent) - 1} more records could not be sent)" if len(unsent) > 1 else ""
            raise TypeError(f"{unsent[0]}{more}")

    def raise_errors(self, error: Exception | None = None) -> None:
        """Raises a fetch's own failure (``error``), or else the kernel errors reported since
        the last wait. Either way the user has now been told: it is not raised again."""
        if error is not None:
            with contextlib.suppress(ValueError):
                self.errors.remove(str(error))
            raise error
        if self.alarm:
            self.raise_alarm()
        if self.errors:
            errors, self.errors = self.errors, []
            n_more, self.more_errors = len(errors) - 1 + self.more_errors, 0
            more = f" ({n_more} more kernel errors)" if n_more else ""
            raise RuntimeError(f"{errors[0]}{more}")

    # -- receiving (receiver thread) ------------------------------------------------------------
    def _receive(self) -> None:
        poller = zmq.Poller()
        poller.register(self.results, zmq.POLLIN)
        poller.register(self.controller.life_fd, zmq.POLLIN)
        interval_ms = int(config.heartbeat_interval_s * 1000)
        controller = self.controller
        while not self.closed:
            events = dict(poller.poll(interval_ms))
            if self.results in events and not self._receive_ready(0):
                return
            if controller.life_fd in events and not controller.read_life():  # it exited
                # its last words (a Fatal naming the cause) may still be on the way
                if self.closed or not self._receive_ready(200):
                    return
                self._die(f"the controller process exited ({controller.describe_exit()})")
                return
            if self.fatal is None and controller.is_silent():
                controller.kill()
                self._die(controller.describe_silence())

    def _receive_ready(self, timeout_ms: int) -> bool:
        """Handles every message that arrives within ``timeout_ms``; False once closed."""
        while self.results.poll(timeout_ms):
            try:
                frames = self.results.recv_multipart(copy=False)
            except zmq.ZMQError:
                return False
            try:
                msg = P.unpack(frames[0].buffer)
            except Exception as e:  # noqa: BLE001 - drop it; the sender is authenticated
                log.error("dtorch: dropped a message that does not decode: %s", e)
                continue
            try:
                self._handle(msg, frames[1:])
            except Exception:  # noqa: BLE001 - a dead receiver would hang every wait
                self._die("the client's receiver failed:\n" + traceback.format_exc())
        return True

    def _handle(self, msg, data) -> None:
        tag = msg[0]
        if tag == P.VALUE:
            _, request, coord, shape, dtype = msg
            entry = self.pending.get(request)
            if entry is None:  # another piece already failed the fetch
                return
            future, spec, pieces = entry
            pieces[tuple(coord)] = _tensor_from(data[0], shape, dtype)
            if len(pieces) == piece_count(spec):
                del self.pending[request]
                try:
                    future._finish(assemble(spec, pieces))
                except Exception as e:  # noqa: BLE001 - hand it to the waiter
                    future._finish(error=e)
        elif tag == P.FETCH_FAILED:
            _, request, site, op, message = msg
            entry = self.pending.pop(request, None)
            if entry:
                entry[0]._finish(error=RuntimeError(self._describe(site, op, message)))
        elif tag == P.KERNEL_ERROR:
            _, site, op, message, kernel = msg
            if kernel in self.reported:  # another device's report of a failure already seen
                return
            self.reported[kernel] = None
            if len(self.reported) > MAX_REPORTED:
                del self.reported[next(iter(self.reported))]
            text = self._describe(site, op, message)
            self.failures.setdefault(site, text)
            if text not in self.errors:
                if len(self.errors) < MAX_ERRORS:
                    self.errors.append(text)
                else:
                    self.more_errors += 1
        elif tag == P.TRACE_EVENTS:
            received = self.traces.get(msg[1])
            if received is not None:
                received.append(msg)
        elif tag == P.SYNCED:
            entry = self.pending.pop(msg[1], None)
            if entry:
                entry[0]._finish(None)
        elif tag == P.FATAL:
            self._die(msg[1])

    def _describe(self, site: int, op: str | None, message: str | None) -> str:
        where = self.site_names[site] if 0 <= site < len(self.site_names) else "<runtime>"
        if op is None:  # poisoned by a peer's failure in a collective (see runtime/host.py)
            return self.failures.get(site, f"an operator called at {where} failed on a device")
        return f"dtorch.{op} failed (called at {where}): {message}"

    def _die(self, message: str) -> None:
        if self.fatal is None:  # the first cause is the one to report
            if self.errors:  # e.g. the collectives a dead host broke, with their call sites
                message += f". Reported before that: {self.errors[0]}"
            self.fatal, self.alarm = message, True
        self._fail_all()

    def _fail_all(self) -> None:
        error = RuntimeError(f"dtorch runtime failed: {self.fatal}")
        while self.pending:  # popitem is atomic: the user's thread may be adding a wait
            _, (future, _, _) = self.pending.popitem()
            future._finish(error=error)

    # -- lifecycle ------------------------------------------------------------------------------
    def close(self) -> None:
        if self.closed:
            return
        try:
            if self.fatal is None:
                self.flush()
                self._send(P.pack([P.SHUTDOWN]))
        except zmq.ZMQError:
            pass
        self.closed = True
        # the cause that waits still pending will see (the hosts' deaths that follow are not)
        self._die("dtorch.shutdown() was called")
        self._wake.put(None)
        self.controller.stop(timeout=config.shutdown_timeout_s)
        self.ops.close(0)
        self._receiver.join(timeout=1)
        self._fail_all()  # no value still awaited can arrive now
        self.results.close(0)
        self.ctx.term()


def _warm_meta_kernels() -> None:
    import torch

    torch.empty(1, device="meta") + 1.0


def _bind(sock, keys) -> str:
    auth.serve(sock, keys)
    sock.bind(f"tcp://{config.bind_host}:*")
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


@contextlib.contextmanager
def _sigint_deferred():
    """Holds back Ctrl-C for the few microseconds of a send and its bookkeeping, so an
    interrupted flush neither loses a batch nor sends it twice. (Python runs signal handlers in
    the main thread only, so other threads need nothing.)"""
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):  # another thread, or no Python handler to hold back
        yield
        return
    caught = []
    signal.signal(signal.SIGINT, lambda *a: caught.append(a))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            previous(*caught[0])


def _tensor_from(frame, shape, dtype):
    import torch

    from ..tensor import DTYPES

    dt = DTYPES[dtype]
    buf = frame.buffer
    if len(buf) == 0:
        return torch.empty(shape, dtype=dt)
    return torch.frombuffer(bytearray(buf), dtype=torch.uint8).view(dt).reshape(shape)


_INSIDE = {}  # code_sites' mark for dtorch's own code
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
