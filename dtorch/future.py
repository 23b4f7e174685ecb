"""TensorFuture: a value that the runtime is still computing.

Completed by the client's receiver thread; waiting blocks on a condition (``get``/``wait``) or is
awaited in asyncio through a loop future completed with ``call_soon_threadsafe`` (no polling).

>>> import dtorch
>>> fut = dtorch.ones(2, 2).sum().to_torch_async()
>>> fut.get()
tensor(4.)
"""

from __future__ import annotations

import asyncio
import threading
import traceback


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
            except Exception:  # noqa: BLE001 - the receiver thread completes every future:
                traceback.print_exc()  # a user's callback must not end it

    # -- user API -------------------------------------------------------------------------------
    def is_ready(self) -> bool:
        return self._done.is_set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until the value is ready or ``timeout`` seconds pass; returns ``is_ready()``."""
        return self._done.wait(timeout)

    def get(self, timeout: float | None = None):
        """The value (a torch.Tensor); raises the kernel error that prevented it."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"value not ready after {timeout} s")
        if self._check is not None:
            self._check(self._error)
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


def _settle(waiter) -> None:
    """Wakes an awaiting task, unless it was cancelled (or woken) already."""
    if not waiter.done():
        waiter.set_result(None)
