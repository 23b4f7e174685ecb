"""TensorFuture: a value that the runtime is still computing; VoidFutureCollect: work it is
still running (``Graph.sync_future()``).

Completed by the client's receiver thread; waiting blocks on a condition (``get``/``wait``/
``wait_for``) or is awaited in asyncio through a loop future completed with
``call_soon_threadsafe`` (no polling). Unlike DTorch's (a C++ ``std::future``), ``get()`` may be
called any number of times: it returns the same value, or raises the same error, each time, and
``is_ready()`` stays True.

>>> import dtorch
>>> fut = dtorch.ones(2, 2).sum().to_torch_async()
>>> fut.get(), fut.get(), fut.is_ready()
(tensor(4.), tensor(4.), True)
"""

from __future__ import annotations

import asyncio
import threading
import time

from . import logs

log = logs.client


class TensorFuture:
    __slots__ = ("_done", "_value", "_error", "_callbacks", "_lock", "_check")

    def __init__(self, check=None):
        self._done = threading.Event()
        self._value = self._error = None
        self._callbacks = []
        self._lock = threading.Lock()
        # check(own error): raises it, or else the errors reported before the value (session's)
        self._check = check

    # -- completion (receiver thread) -----------------------------------------------------------
    def _finish(self, value=None, error=None):
        with self._lock:
            if self._done.is_set():
                return
            self._value, self._error = value, error
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            try:
                fn(self)
            except Exception:  # logged: a user's callback must not end the receiver thread
                log.exception("dtorch: a future's callback %r raised", fn)

    # -- user API -------------------------------------------------------------------------------
    def is_ready(self) -> bool:
        return self._done.is_set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until the value is ready or ``timeout`` seconds pass; returns ``is_ready()``."""
        return self._done.wait(timeout)

    def wait_for(self, timeout_ms: float) -> bool:
        """DTorch's form: blocks at most ``timeout_ms`` milliseconds; returns ``is_ready()``."""
        return self._done.wait(max(timeout_ms, 0) / 1000)

    def get(self, timeout: float | None = None):
        """The value (a torch.Tensor); raises the kernel error that prevented it, or one reported
        before it. Any number of calls give the same value (or raise the same error)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"value not ready after {timeout} s")
        check = self._check
        if check is not None:
            # the session's errors are raised once there; this future keeps the one it raised
            self._check = None
            try:
                check(self._error)
            except Exception as e:  # noqa: BLE001 - kept, raised again on the next get()
                self._error = e
                raise
        if self._error is not None:
            raise self._error
        return self._value

    result = get

    def add_done_callback(self, fn) -> None:
        """Calls ``fn(future)`` once the value is ready (at once if it already is)."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def __await__(self):
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()

        def wake(_):
            # runs on the receiver thread, maybe long after the awaiting task gave up (a
            # wait_for that timed out, a cancelled task, a loop that has closed since): then
            # there is no one left to wake, and raising here would kill the receiver thread
            if loop.is_closed():
                return
            try:
                loop.call_soon_threadsafe(_settle, waiter)
            except RuntimeError:  # the loop closed between the check and the call
                pass

        self.add_done_callback(wake)
        yield from waiter.__await__()
        return self.get()

    def __repr__(self) -> str:
        state = "ready" if self.is_ready() else "pending"
        return f"TensorFuture({state})"


class VoidFutureCollect:
    """Work still running on the devices, collected from one or more futures
    (``Graph.sync_future()``): ready once all of them are. ``get``, ``wait`` and ``await`` give
    None; ``get`` (any number of times) raises the first kernel error the work reported.

    >>> import dtorch
    >>> y = dtorch.ones(3) * 2
    >>> done = dtorch.default_graph.sync_future()
    >>> done.wait_for(10_000), done.get(), done.is_ready()
    (True, None, True)
    """

    __slots__ = ("_futures",)

    def __init__(self, futures=()):
        self._futures = tuple(futures)

    def is_ready(self) -> bool:
        return all(f.is_ready() for f in self._futures)

    done = is_ready

    def wait(self) -> None:
        """Blocks until every collected future is ready (raises nothing)."""
        for f in self._futures:
            f.wait()

    def wait_for(self, timeout_ms: float) -> bool:
        """Blocks at most ``timeout_ms`` milliseconds in all; returns ``is_ready()``."""
        deadline = time.monotonic() + max(timeout_ms, 0) / 1000
        for f in self._futures:
            if not f.wait(max(deadline - time.monotonic(), 0)):
                return False
        return True

    def get(self) -> None:
        """Blocks until ready; raises the first error of a collected future."""
        for f in self._futures:
            f.get()

    result = get

    def __await__(self):
        for f in self._futures:
            yield from f.__await__()  # woken by the receiver thread, never polled
        return None

    def __repr__(self) -> str:
        state = "ready" if self.is_ready() else "pending"
        return f"VoidFutureCollect({state})"


def _settle(waiter) -> None:
    """Wakes an awaiting task, unless it was cancelled (or woken) already."""
    if not waiter.done():
        waiter.set_result(None)
