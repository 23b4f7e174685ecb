"""The client session: the user's side of the runtime.

It owns the record buffer that operators append to, flushes it to the controller as one msgpack
frame (on a sync point, when it grows past ``flush_records``, and shortly after the first record
of a batch so a device never starves while the user's code runs on), and runs a receiver thread
that completes TensorFutures, collects kernel errors and watches the controller's heartbeat.
The controller process is started on first use and dies with this process (see
``launcher/local.py``); its sockets admit only this runtime's processes (``launcher/auth.py``).

Nothing the user issued is lost: a batch taken from the buffer is always sent (Ctrl-C waits for
that), a record that cannot be serialized is taken out and reported at the user's next call with
its call site, and the flusher thread survives any error.

Threads. Any number of the user's threads may issue at once. A record is appended in one step
(``deque.append``), and every id another thread may read is published only after the record
that defines it is in the buffer (``_define_lock``: call templates, specs, meshes; a call
site's index is taken under a lock of its own, ``client/sites.py``),
so a record never reaches the controller before the definitions it uses. Each record names its
thread's graph (``current.per_thread``). Each zmq socket is used by one thread only, as zmq
requires: the sender thread alone sends (``flush`` hands it the frames, in order), the receiver
thread alone receives. Flow control:
every ``max_inflight_ops / MARKS`` records the client sends a *mark* (a sync that raises
nothing), and once ``MARKS`` marks are outstanding the user's thread waits for the oldest, so
however far ahead a program runs, at most about ``max_inflight_ops`` records are in flight.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import queue
import signal
import threading
import time
import traceback
from collections import deque

import zmq
import zmq.utils.garbage  # (see _send_frames: imported before atexit.register below)

from .. import config, logs, protocol as P
from ..cluster import main_node
from ..launcher import auth, local
from ..future import TensorFuture
from ..mesh import check_devices_present
from .receiving import Receiving
from .sites import CallSites

_current = None
_lock = threading.Lock()
# Tensor ids are unique across sessions, so a tensor that outlives a dtorch.shutdown() can never
# name (or, when dropped, release) a tensor of the next runtime.
_tensor_ids = itertools.count(1)
MARKS = 4  # flow-control marks in flight at most (see the module docstring)
_STOP = object()  # the sender's last item: it closes the socket
_recorder = None  # what a new session's ``recorder`` is (``install_recorder``)
log = logs.client


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


def running() -> Session | None:
    """The running session, or None; starts nothing."""
    s = _current
    return s if s is not None and not s.closed else None


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
    if s is not None and not s.closed and tensor_id > s.first_id:  # (not an ended runtime's)
        _queue(s, tensor_id)
        if s.watch is not None:
            s.watch(tensor_id)


def release_step(template_id: int) -> None:
    """A ``ReplayedStep`` is gone: the controller and the hosts forget its template and what
    they learnt of it. Queued as ``release`` queues an id."""
    s = _current
    if s is not None and not s.closed:
        _queue(s, [P.DROP_STEP, template_id])


def _queue(s, record) -> None:
    """``record`` after the buffered ones, never flushing (a garbage collection may run this
    inside a flush, whose lock is held); the first record of a batch wakes the flusher."""
    records = s.records
    if not records:
        s.wake()
    records.append(record)


def install_recorder(recorder) -> None:
    """Every session from now on, the current one included, hands its calls to ``recorder``
    (``Session.recorder``: autograd's tape installs itself once a tensor requires grad)."""
    global _recorder
    _recorder = recorder
    s = _current
    if s is not None:
        s.recorder = recorder


def shutdown() -> None:
    """Stops the controller and hosts; the next operator starts a fresh runtime."""
    global _current
    with _lock:
        s, _current = _current, None
    if s is not None:
        s.close()


def _at_exit() -> None:
    """At interpreter exit, what the program issued runs before the runtime stops, as it would
    have with torch (a kernel may have effects outside the program: a user's op that writes a
    file), and a kernel error that no wait raised is told; then ``shutdown``. (An explicit
    ``dtorch.shutdown()`` stops at once: the program has said it wants nothing more.)"""
    s = _current
    if s is not None and not s.closed and s.fatal is None:
        try:
            s.sync_async().wait()
        except (Exception, KeyboardInterrupt):  # noqa: BLE001 - failed or interrupted: stop
            pass
        if s.errors and s.fatal is None:
            log.error("dtorch: a kernel error was not raised before the program exited: %s%s",
                      s.errors[0], f" ({len(s.errors) - 1} more)" if len(s.errors) > 1 else "")
    shutdown()


atexit.register(_at_exit)


class Session(Receiving):
    def __init__(self):
        self.records = deque()
        self.flush_at = config.flush_records  # a batch's size, read as it begins (append)
        self.inflight_bound = config.max_inflight_ops  # (as flush_at: a flush may run on the
        # flusher thread, which does not see the user's ``config.Context``)
        self.ids = _tensor_ids  # tensor ids; the controller uses negative ones
        # ids are the process's: a tensor of an ended runtime (any id up to this one) that
        # dies during this one's life has nothing here to release
        self.first_id = next(_tensor_ids)
        self.requests = itertools.count(1)
        self.call_sites = CallSites()
        self.site, self.site_names = self.call_sites.site, self.call_sites.names
        self.pending: dict = {}  # request -> (future, spec, pieces)
        self.traces: dict = {}  # request -> the TraceEvents received for a trace stop
        self.tracing = None  # while tracing, the client's spans: [(name, -2, 0, t0, t1, 0)]
        self.batch_started = 0  # while tracing, time.time_ns() at the batch's first record
        self.errors: list = []  # kernel errors not raised yet (receiving.MAX_ERRORS at most)
        self.more_errors = 0  # how many more were reported
        self.failures: dict = {}  # site -> its first kernel error (names a peer's poison)
        self.reported: dict = {}  # ids of failed kernels already seen (an ordered set)
        self.fatal = None
        self.lost_devices = ()  # the devices whose death failed the runtime
        self.unsent: list = []  # errors of records that could not be serialized, for the next call
        self.alarm = False  # fatal or unsent: the next call must look (one check on the hot path)
        self.marks: deque = deque()  # futures of the flow-control marks in flight
        self.unmarked = 0  # records sent since the last mark
        self.closed = False
        self.stopping = False  # close() has handed the sender its last frames
        # per-session caches: the wire ids they hold mean nothing to another controller
        self.bound: dict = {}  # call key -> dispatch.Bound
        self.spec_ids: dict = {}
        self.mesh_ids: dict = {}
        self.call_defs: list = []  # (call's name, how many results) per call template
        self.id_operands: list = []  # per call template: the operands that are ids (tensors,
        # and a VJP's key, which travels as a value)
        # a replayed step learning (``step_replay``): sees every record appended, None otherwise
        self.watch = None
        # autograd's tape once a tensor requires grad (``install_recorder``): the hot path's
        # one test (``dispatch``), None while nothing is recorded
        self.recorder = _recorder
        self.unsent_ids: dict = {}  # id -> why: results of records that could not be sent
        self._flush_lock = threading.Lock()  # one batch taken and handed over at a time
        self._define_lock = threading.RLock()  # see the module docstring (define_call nests)
        self._errors_lock = threading.Lock()  # the receiver adds errors, a waiter takes them
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # frames for the sender thread
        # the flusher's wake-ups: a SimpleQueue, whose put is reentrant, since a release may come
        # from a __del__ that a garbage collection runs anywhere, inside another put too (an
        # Event's set takes a lock of its own, and deadlocked there)
        self._wake: queue.SimpleQueue = queue.SimpleQueue()
        self.keys = keys = auth.Keys.generate()  # this runtime's (see launcher/auth.py)
        self.ctx = zmq.Context()
        self._gatekeeper = auth.Gatekeeper(self.ctx, keys)
        self.ops = self.ctx.socket(zmq.PUSH)
        self.ops.setsockopt(zmq.LINGER, 0)
        ops_addr = _bind(self.ops, keys)
        self.results = self.ctx.socket(zmq.PULL)
        self.results.setsockopt(zmq.LINGER, 0)
        results_addr = _bind(self.results, keys)
        # the cluster's settings, checked here: a bad token file raises at the user's call
        self.controller = local.start_controller(ops_addr, results_addr, keys,
                                                 config.RuntimeFacts(config.cpu_hosts),
                                                 main_node.cluster_settings())
        # torch imports its meta kernels (hundreds of modules, about a second) on first use;
        # do that while the controller starts rather than at the user's first operator
        # (not a daemon: one still inside torch's import when the interpreter exits aborts it)
        threading.Thread(target=_warm_meta_kernels, name="dtorch-warm").start()
        self._receiver = threading.Thread(target=self._receive, name="dtorch-receiver", daemon=True)
        self._receiver.start()
        self._sender = threading.Thread(target=self._send_frames, name="dtorch-sender",
                                        daemon=True)
        self._sender.start()
        self._flusher = threading.Thread(target=self._flush_soon, name="dtorch-flusher", daemon=True)
        self._flusher.start()

    # -- sending --------------------------------------------------------------------------------
    def append(self, record) -> None:
        records = self.records
        if not records:
            self.wake()
            # read once a batch, in the user's thread: a knob read costs a call
            self.flush_at, self.inflight_bound = config.flush_records, config.max_inflight_ops
        records.append(record)
        if self.watch is not None:
            self.watch(record)
        if len(records) >= self.flush_at:
            self.flush()

    def wake(self) -> None:
        """A batch starts: the flusher sends it soon unless a flush comes first."""
        self._wake.put(None)
        if self.tracing is not None:
            self.batch_started = time.time_ns()

    def flush(self, block: bool = True) -> None:
        """Hands the buffered records to the sender thread as one frame. ``block``: the
        caller waits here while ``MARKS`` flow-control marks are in flight; the flusher thread
        leaves such a flush to the user's thread (and is woken when a mark completes)."""
        with self._flush_lock:
            self._flush_locked(block)

    def _flush_locked(self, block: bool, then: tuple = (), weight: int = 0) -> None:
        """The flush (under its lock) of the buffered records, followed in the same frame by
        ``then``, which flow control counts as ``weight`` records."""
        records, marks = self.records, self.marks
        buffered = len(records)
        n = buffered + len(then)
        if not n or self.stopping:
            return
        while marks and marks[0].done():
            marks.popleft()
        if len(marks) >= MARKS:
            if not block:
                return
            marks.popleft().get()  # raises if the runtime failed meanwhile
        # Popped, not iterated: other threads append meanwhile (operators, and releases from
        # ``__del__``). Ctrl-C waits for the hand-over, so a batch taken from the buffer is
        # always sent.
        with _sigint_deferred():
            spans = self.tracing  # the flusher thread may run this while a trace stops
            # read before the records are taken: a record appended after that starts the
            # next batch
            started, flushed = self.batch_started, time.time_ns() if spans is not None else 0
            batch = [records.popleft() for _ in range(buffered)]
            batch += then
            if records and flushed:  # appended meanwhile: the next batch began about now
                self.batch_started = flushed
            try:
                frame = P.pack(batch)
            except Exception:  # noqa: BLE001 - one bad record must not take the batch along
                frame = P.pack(self._take_unsendable(batch))
            self._outbox.put(frame)
            if flushed:
                spans += [(f"issue {n} records", P.CLIENT, 0, started, flushed, 0),
                          (f"flush {n} records", P.CLIENT, 1, flushed, time.time_ns(), 0)]
        self.unmarked += buffered + weight
        if self.unmarked * MARKS >= self.inflight_bound:
            self._mark()

    def send_batch(self, batch: list, weight: int = 0) -> None:
        """Sends what is buffered and then ``batch`` (records made at once: a replayed step's)
        as one frame; flow control counts ``batch`` as ``weight`` records (a Step record
        stands for its step's). One frame, not two: the controller's cost per batch is paid
        once (a step's inputs are placed just before it)."""
        with self._flush_lock:
            self._flush_locked(True, batch, weight or len(batch))

    def _take_unsendable(self, batch: list) -> list:
        """The records of ``batch`` that serialize; each other one becomes an error raised at
        the user's next call (and at the next wait), naming its operator and call site."""
        sendable = []
        for rec in batch:
            try:
                P.pack(rec)
            except Exception as e:  # noqa: BLE001
                message = self._describe_unsendable(rec, e)
                self._tell_next_call(message)
                if isinstance(rec, tuple) and rec and rec[0] == P.OP:  # its results never come
                    n_out = self.call_defs[rec[P.OP_CALL] - 1][1]
                    self.unsent_ids.update(dict.fromkeys(P.op_outs(rec, n_out), message))
            else:
                sendable.append(rec)
        return sendable

    def _tell_next_call(self, message: str) -> None:
        """An error the user's next call raises (``raise_alarm``); the runtime stays usable."""
        with self._errors_lock:
            self.unsent.append(message)
            self.alarm = True

    def _describe_unsendable(self, rec, error: Exception) -> str:
        if isinstance(rec, tuple) and rec and rec[0] == P.OP:
            op, _ = self.call_defs[rec[P.OP_CALL] - 1]
            return self._describe(rec[P.OP_SITE], op,
                                  f"its arguments could not be sent ({error})")
        return f"a dtorch record could not be sent ({error}): {rec!r:.200}"

    def _mark(self) -> None:
        request = next(self.requests)
        future = TensorFuture()
        future.add_done_callback(lambda _: self._wake.put(None))  # a flush may wait for it
        self.pending[request] = (future, None, None)
        self._outbox.put(P.pack([P.Sync(P.SYNC, request)]))
        self.marks.append(future)
        self.unmarked = 0

    def _send_frames(self) -> None:
        """The sender thread: sends the frames handed to it, in order, and alone uses (and at
        the end closes) the ops socket. A frame of 64 KiB or more is sent without a copy, which
        pyzmq tracks on its garbage-collector thread; that thread stops at interpreter exit in
        an atexit hook, registered at import (above) so that it runs after dtorch's
        ``shutdown``, and the frames of ``close`` are copied anyway, so the last flush never
        needs it."""
        sock, outbox = self.ops, self._outbox
        try:
            while True:
                frame = outbox.get()
                if frame is _STOP:
                    return
                # A PUSH socket blocks while it has no peer, and a dead controller must not
                # hang anyone: wait for room in short polls, giving up once the runtime is
                # known to be dead.
                while True:
                    try:
                        sock.send(frame, zmq.NOBLOCK, copy=self.stopping)
                        break
                    except zmq.Again:
                        if self.fatal is not None:
                            break
                        sock.poll(100, zmq.POLLOUT)
        except Exception:  # noqa: BLE001 - a dead sender would hang every wait
            self._die("the client's sender failed:\n" + traceback.format_exc())
        finally:
            sock.close(0)

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
                self._tell_next_call(f"dtorch's flusher failed: {type(e).__name__}: {e}")

    # -- definitions (sent once per session) ----------------------------------------------------
    def define_call(self, target, inputs, outputs, static: tuple, flags: int,
                    kind: P.CallKind = P.CallKind.OPERATOR) -> int:
        """The id of a new call template: its ``target`` (an operator's name, for ``kind``
        OPERATOR), operand specs (a Python type for a scalar), output specs, the static args
        that travel, the op's flags."""
        blob = P.pack_static(static)  # first: a static arg that cannot be sent raises, unsent
        with self._define_lock:
            inputs = [self.spec_id(i) if not isinstance(i, type) else 0 for i in inputs]
            outputs = [self.spec_id(o) for o in outputs]
            call_id = len(self.call_defs) + 1
            self.append(P.DefineCall(P.DEFINE_CALL, call_id, target, inputs, outputs, blob,
                                     P.wire_bits(flags), kind))
            self.call_defs.append((P.call_name(kind, target), len(outputs)))
            self.id_operands.append(tuple(k for k, i in enumerate(inputs)
                                          if i or (k == 0 and kind == P.CallKind.VJP)))
        return call_id

    def spec_id(self, spec) -> int:
        i = self.spec_ids.get(spec)
        if i is None:
            with self._define_lock:
                i = self.spec_ids.get(spec)
                if i is None:
                    mesh = self.mesh_id(spec.mesh)
                    i = len(self.spec_ids) + 1
                    self.append(P.define_spec(i, spec, mesh))
                    self.spec_ids[spec] = i  # published once its record is in the buffer
        return i

    def mesh_id(self, mesh) -> int:
        i = self.mesh_ids.get(mesh)
        if i is None:
            # a mesh's first use: a mesh naming GPUs this machine lacks is refused here, at the
            # user's line, before the hosts hear of it
            check_devices_present(mesh)
            with self._define_lock:
                i = self.mesh_ids.get(mesh)
                if i is None:
                    i = len(self.mesh_ids) + 1
                    self.append(P.DefineMesh(P.DEFINE_MESH, i, mesh.device_type,
                                             list(mesh.shape), list(mesh.devices)))
                    self.mesh_ids[mesh] = i
        return i

    # -- waits ----------------------------------------------------------------------------------
    def fetch(self, tensor) -> TensorFuture:
        """A TensorFuture of ``tensor``'s value. A tensor whose record could not be sent (no
        value will ever come) raises its error here, at once."""
        self._refuse_unsent(tensor)
        request = next(self.requests)
        # get() raises the fetch's own failure, or a kernel error reported before it
        future = TensorFuture(check=self.raise_errors)
        self.pending[request] = (future, tensor._spec, {})
        self.append(P.Fetch(P.FETCH, tensor._id, request))
        self.flush()  # (its own record may be the batch's one that cannot be sent)
        if self.fatal is not None:
            self._fail_all()
        elif tensor._id in self.unsent_ids:
            self.pending.pop(request, None)
            self._refuse_unsent(tensor)
        return future

    def _refuse_unsent(self, tensor) -> None:
        message = self.unsent_ids.get(tensor._id)
        if message is not None:
            with self._errors_lock:  # told now: not again at the next call
                with contextlib.suppress(ValueError):
                    self.unsent.remove(message)
                self.alarm = bool(self.unsent) or self.fatal is not None
            raise TypeError(message)

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
            raise self.failed(". Call dtorch.shutdown() to restart.")
        with self._errors_lock:
            unsent, self.unsent, self.alarm = self.unsent, [], self.fatal is not None
        if unsent:
            more = f" ({len(unsent) - 1} more records could not be sent)" if len(unsent) > 1 else ""
            raise TypeError(f"{unsent[0]}{more}")

    def raise_errors(self, error: Exception | None = None) -> None:
        """Raises a fetch's own failure (``error``), or else the kernel errors reported since
        the last wait. Either way the user has now been told: it is not raised again."""
        if error is not None:
            with self._errors_lock, contextlib.suppress(ValueError):
                self.errors.remove(str(error))
            raise error
        if self.alarm:
            self.raise_alarm()
        if self.errors:
            with self._errors_lock:
                errors, self.errors = self.errors, []
                n_more, self.more_errors = len(errors) - 1 + self.more_errors, 0
            if not errors:  # another thread's wait took them
                return
            more = f" ({n_more} more kernel errors)" if n_more else ""
            raise RuntimeError(f"{errors[0]}{more}")

    # -- lifecycle ------------------------------------------------------------------------------
    def close(self) -> None:
        """Sends what was issued and a shutdown, waits (a bounded time) for the sender to have
        sent them, then stops the processes and the threads; each thread closes its socket."""
        if self.closed:
            return
        with self._flush_lock:  # no batch is handed over after the sender's last item
            if self.fatal is None:
                with contextlib.suppress(RuntimeError):  # the runtime failed meanwhile
                    self._flush_locked(block=True)
                self._outbox.put(P.pack([P.SHUTDOWN]))
            self.stopping = True
            self._outbox.put(_STOP)
        timeout = config.shutdown_timeout_s
        self._sender.join(timeout)  # a live controller takes what was issued
        self.closed = True
        # the cause that waits still pending will see (the hosts' deaths that follow are not)
        self._die("dtorch.shutdown() was called")
        self._wake.put(None)
        self.controller.stop(timeout=timeout)
        self._sender.join(1)  # (``_die`` lets it give up a frame no one takes)
        self._receiver.join(1 + config.heartbeat_interval_s)
        self._fail_all()  # no value still awaited can arrive now
        if self._sender.is_alive() or self._receiver.is_alive():
            log.error("dtorch: a client thread did not stop; its socket stays open until exit")
            return
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
