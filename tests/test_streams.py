"""Stream threads (``runtime/stream.py``) report every failure outside a kernel through their
``on_error`` callback, whose host version sends the client a Fatal: a stream that died quietly
would leave its waiters (peers in a collective, a sync) hanging for good.

The streams here are built directly in the test process, with a callback that records what the
host's would send; no runtime is started. Every wait has a deadline.
"""

from __future__ import annotations

import threading
import traceback

import pytest
import torch

from dtorch.runtime.stream import Stream

DEADLINE_S = 10.0


pytestmark = pytest.mark.no_runtime  # (conftest syncs after the other tests)


class Reports:
    """An ``on_error`` callback like ``Host.on_stream_error``: it reads the traceback of the
    exception being handled, so it only sees one when called in the ``except`` block."""

    def __init__(self):
        self.reports: list = []
        self.arrived = threading.Event()

    def __call__(self, stream_name: str) -> None:
        self.reports.append((stream_name, traceback.format_exc()))
        self.arrived.set()

    def first(self) -> tuple:
        assert self.arrived.wait(DEADLINE_S), f"on_error was not called within {DEADLINE_S} s"
        return self.reports[0]


def start(device: torch.device, reports: Reports, *items) -> Stream:
    stream = Stream("dev0-stream1", device, on_error=reports)
    for item in items:
        stream.put(item)
    stream.submit()
    return stream


def ended(stream: Stream) -> bool:
    stream.thread.join(DEADLINE_S)
    return not stream.thread.is_alive()


def test_a_device_that_cannot_be_set_up_is_reported():
    """``torch.cuda.set_device`` fails before the stream runs anything (no CUDA here, or no
    device 99 where there is): the thread ends, and says why."""
    reports, ran = Reports(), threading.Event()
    stream = start(torch.device("cuda", 99), reports, ran.set)
    name, trace = reports.first()
    assert name == "dev0-stream1"
    assert "set_device" in trace and "Traceback" in trace, trace
    assert ended(stream)
    assert not ran.is_set()
    assert len(reports.reports) == 1


def broken_item():
    raise ValueError("a runtime bug outside any kernel")


def test_an_item_that_raises_is_reported_and_the_stream_goes_on():
    reports, ran = Reports(), threading.Event()
    stream = start(torch.device("cpu"), reports, broken_item, ran.set)
    name, trace = reports.first()
    assert name == "dev0-stream1"
    assert "broken_item" in trace and "ValueError: a runtime bug outside any kernel" in trace
    assert ran.wait(DEADLINE_S), "the item after the failing one did not run"
    stream.close()
    assert ended(stream)
    assert len(reports.reports) == 1


def exits():
    raise SystemExit(3)  # not an Exception: it passes every item's handler


def test_a_stream_thread_that_dies_is_reported():
    reports, ran = Reports(), threading.Event()
    stream = start(torch.device("cpu"), reports, exits, ran.set)
    _, trace = reports.first()
    assert "SystemExit: 3" in trace and "exits" in trace, trace
    assert ended(stream)
    assert not ran.is_set()


def test_a_healthy_stream_runs_in_order_and_reports_nothing():
    reports, order = Reports(), []
    stream = start(torch.device("cpu"), reports, *[lambda k=k: order.append(k) for k in range(5)])
    stream.close()
    assert ended(stream)
    assert order == list(range(5))
    assert reports.reports == []
