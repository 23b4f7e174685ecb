"""What the controller tells the client, in the order it learns it, held back while a failure
may be a death's.

A host that dies during a collective breaks it for its peers, and their reports of the failed
collective (gloo's ``Connection reset by peer``) can reach the controller before the death does:
the dying process's sockets and its life pipe close in one sweep of the kernel, but in no fixed
order, and a machine's death is learnt only when the main node finds its connection closed. So a
collective's failure report starts a *hold*: it and everything after it (values, sync
acknowledgements, other errors) wait, in order, until either

- a death is found: the client is told the death in one ``Fatal`` that carries the held kernel
  errors, and nothing else held, so the first error the user sees names the death, then the
  collective it broke with its call site (one message: no wait in between can see the
  collective's error alone); or
- every host has shown it is alive (a heartbeat written after the hold began), or
  ``DEATH_GRACE_S`` has passed: the held messages go on as they came.

An error of any other kernel is not held: no peer's death can be behind it, and it reaches the
user at once. A death found first waits ``DEATH_GRACE_S`` for its peers' reports (the hold again),
so that the client's error still names the collective it broke.

>>> sent = []
>>> reports = Reports(lambda frames: sent.append(frames[0]))
>>> reports.send(P.KERNEL_ERROR, [P.pack(["gloo failed"])], report=True)
>>> reports.send(P.SYNCED, [b"synced"])
>>> sent, reports.holding, reports.has_report
([], True, True)
>>> reports.fatal("host 1 died")
>>> [P.unpack(frame) for frame in sent]  # the death with the report it broke, not the sync
[[16, 'host 1 died', [['gloo failed']], []]]
"""

from __future__ import annotations

import time

from .. import protocol as P

# How long a collective's failure report waits for a death to blame, and a death for the reports
# of the collectives it broke.
DEATH_GRACE_S = 0.5


class Reports:
    def __init__(self, send):
        self._send = send  # frames -> None: the client's socket
        self.held: list = []  # (tag, frames), in the order they came
        self.until = None  # while holding: when the hold ends at the latest
        self.since = 0.0  # when the hold began
        self.has_report = False  # a collective's failure report (or a host's Fatal) is held

    @property
    def holding(self) -> bool:
        return self.until is not None

    def hold(self) -> None:
        """Holds what comes from now on (unless already holding), for ``DEATH_GRACE_S`` at
        most."""
        if self.until is None:
            self.since = time.monotonic()
            self.until = self.since + DEATH_GRACE_S

    def send(self, tag: int, frames: list, report: bool = False) -> None:
        """A message for the client; ``report``: a failure that a peer's death may be behind,
        which starts a hold."""
        if report:
            self.hold()
            self.has_report = True
        if self.until is None:
            self._send(frames)
        else:
            self.held.append((tag, frames))

    def left_s(self, now: float) -> float | None:
        """Seconds until the hold ends at the latest (None: not holding)."""
        return None if self.until is None else max(self.until - now, 0.0)

    def release(self) -> None:
        """No death came: what was held goes on, in order."""
        held, self.held, self.until, self.has_report = self.held, [], None, False
        for _, frames in held:
            self._send(frames)

    def fatal(self, message: str, lost=()) -> None:
        """The runtime failed: one Fatal naming the cause and carrying the held kernel errors
        (the collectives a death broke, which the client names after the death). The rest held
        (values, acknowledgements, failed fetches) would reach the user before the death's
        name: it goes, and the Fatal fails whatever awaits them."""
        broke = [P.unpack(memoryview(frames[0])) for tag, frames in self.held
                 if tag == P.KERNEL_ERROR]
        self.held, self.until, self.has_report = [], None, False
        self._send([P.pack(P.Fatal(P.FATAL, message, broke, list(lost)))])


def collective_names(calls) -> frozenset:
    """The names under which hosts report the failure of a collective, of the call shapes
    ``calls`` (CallInfo by id): a COMM call's op (a redistribute step, ``step:all_gather``, or an
    operator that runs collectives), and its backward's (``runtime/calls.py`` names a VJP's
    failure after its forward)."""
    names = {c.op for c in calls.values() if c.flags & P.COMM}
    return frozenset(names | {f"{name} (backward)" for name in names})
