"""Kernels for tests/test_reliability.py (imported by name on the hosts)."""

import os
import pathlib
import time

import torch


def busy(x, seconds):
    """Computes for ``seconds`` in Python, holding the GIL most of the time (the hardest case for a
    heartbeat), then returns ``x + 1``."""
    if x.device.type != "meta":
        acc = torch.zeros(())
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            acc = acc + 1
    return x + 1


def busy_until_released(x, seconds):
    """``busy`` that stops early once the file named by ``$RELIABILITY_RELEASE`` exists: the
    test creates it after its signal, so the kernel cannot end before the signal comes, however
    late a loaded machine delivers it."""
    if x.device.type != "meta":
        release = pathlib.Path(os.environ["RELIABILITY_RELEASE"])
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not release.exists():
            time.sleep(0.01)
    return x + 1


def slow_on_device_1(ctx, x, seconds):
    """``x + 1``, after ``seconds`` of sleep on device 1 only: a peer late for the collective
    that reads the result, but alive."""
    if ctx.device.index == 1:
        time.sleep(seconds)
    return x + 1
