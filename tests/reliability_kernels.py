"""Kernels for tests/test_reliability.py (imported by name on the hosts)."""

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
