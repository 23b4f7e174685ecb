"""The receiver thread's half of a ``Session`` (``client/session.py``): every message from the
controller, handled by a table from tag to handler (``Receiving.HANDLERS``). Values complete
their TensorFutures as their pieces arrive, kernel errors wait for
the user's next wait (each failed kernel once, however many devices report it), a Fatal or the
controller's death or silence fails the runtime. The thread alone uses the results socket, and
closes it when it stops.
"""

from __future__ import annotations

import traceback

import zmq

from .. import config, logs, protocol as P
from .assemble import assemble, piece_count

MAX_ERRORS = 16  # distinct kernel errors kept for the next wait; later ones are only counted
MAX_REPORTED = 4096  # failed kernels remembered, so each is raised once however many report it
log = logs.client


class RuntimeFailed(RuntimeError):
    """The runtime failed: every later call raises this until ``dtorch.shutdown()``.
    ``lost_devices``: the global ids of the devices a death took (the dead host's or machine's
    devices), empty when the cause was no death (the controller's, a shutdown, ...);
    ``dtorch.elastic`` recovers from such a loss."""

    def __init__(self, message: str, lost_devices=()):
        super().__init__(message)
        self.lost_devices = tuple(lost_devices)


class Receiving:
    """The methods of a Session that its receiver thread runs (``_receive``), and the failure
    of the runtime (``_die``), which any thread may call."""

    def _receive(self) -> None:
        try:
            self._receive_until_closed()
        finally:
            self.results.close(0)

    def _receive_until_closed(self) -> None:
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
        handler = self.HANDLERS.get(msg[0])
        if handler is not None:  # (a message of another version's tag is left alone)
            handler(self, msg, data)

    def _on_value(self, msg, data) -> None:
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

    def _on_fetch_failed(self, msg, data) -> None:
        _, request, site, op, message = msg
        entry = self.pending.pop(request, None)
        if entry:
            entry[0]._finish(error=RuntimeError(self._describe(site, op, message)))

    def _on_kernel_error(self, msg, data) -> None:
        _, site, op, message, kernel = msg
        if kernel in self.reported:  # another device's report of a failure already seen
            return
        self.reported[kernel] = None
        if len(self.reported) > MAX_REPORTED:
            del self.reported[next(iter(self.reported))]
        text = self._describe(site, op, message)
        self.failures.setdefault(site, text)
        with self._errors_lock:
            if text not in self.errors:
                if len(self.errors) < MAX_ERRORS:
                    self.errors.append(text)
                else:
                    self.more_errors += 1

    def _on_trace_events(self, msg, data) -> None:
        received = self.traces.get(msg[1])
        if received is not None:
            received.append(msg)

    def _on_synced(self, msg, data) -> None:
        entry = self.pending.pop(msg[1], None)
        if entry:
            entry[0]._finish(None)

    def _on_fatal(self, msg, data) -> None:
        fatal = P.Fatal(*msg)
        broke = [P.KernelError(*e) for e in fatal.broke]
        self._die(fatal.message, [self._describe(e.site, e.op, e.message) for e in broke],
                  fatal.lost)

    # what the receiver does with each message from the controller, by tag
    HANDLERS = {
        P.VALUE: _on_value,
        P.FETCH_FAILED: _on_fetch_failed,
        P.KERNEL_ERROR: _on_kernel_error,
        P.TRACE_EVENTS: _on_trace_events,
        P.SYNCED: _on_synced,
        P.FATAL: _on_fatal,
    }

    def _describe(self, site: int, op: str | None, message: str | None) -> str:
        where = self.site_names[site] if 0 <= site < len(self.site_names) else "<runtime>"
        if op is None:  # poisoned by a peer's failure in a collective (see runtime/host.py)
            return self.failures.get(site, f"an operator called at {where} failed on a device")
        return f"dtorch.{op} failed (called at {where}): {message}"

    def _die(self, message: str, broke=(), lost=()) -> None:
        """Fails the runtime: ``message`` is the cause, ``broke`` the errors it caused (the
        collectives a dead host broke, with their call sites), told after it; ``lost`` the
        devices a death took."""
        if self.fatal is None:  # the first cause is the one to report
            before = broke or self.errors
            if before:
                message += f". Reported before that: {before[0]}"
            self.lost_devices = tuple(lost)
            self.fatal, self.alarm = message, True
        self._fail_all()

    def failed(self, suffix: str = "") -> RuntimeFailed:
        """The error every call raises once the runtime has failed."""
        return RuntimeFailed(f"dtorch runtime failed: {self.fatal}{suffix}", self.lost_devices)

    def _fail_all(self) -> None:
        error = self.failed()
        while self.pending:  # popitem is atomic: the user's thread may be adding a wait
            _, (future, _, _) = self.pending.popitem()
            future._finish(error=error)


def _tensor_from(frame, shape, dtype):
    import torch

    from ..tensor import DTYPES

    dt = DTYPES[dtype]
    buf = frame.buffer
    if len(buf) == 0:
        return torch.empty(shape, dtype=dt)
    return torch.frombuffer(bytearray(buf), dtype=torch.uint8).view(dt).reshape(shape)
