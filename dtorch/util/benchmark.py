"""``Benchmark.run``: the time a function takes per call, once the devices have run its work,
and the memory the run used.

>>> import dtorch
>>> from dtorch.util.benchmark import Benchmark
>>> x = dtorch.ones(8)
>>> metric, out = Benchmark.run(lambda: x + 1, warmup=1, count=2)
>>> metric.duration > 0, out.sum().item()
(True, 16.0)
"""

from __future__ import annotations

import asyncio
import inspect
import resource
import sys
import time
from dataclasses import dataclass

import torch

import dtorch


@dataclass(frozen=True)
class Metric:
    """One benchmark's figures: seconds per call; the peak memory, in MB, torch allocated on
    this process's CUDA device (0 without CUDA) and dtorch on the default mesh's devices (the
    largest device peak); this process's peak resident memory, in MB."""

    duration: float
    torch_gpu_memory: float
    dtorch_gpu_memory: float
    cpu_memory: float


class Benchmark:
    @staticmethod
    def run(func, warmup: int = 1, count: int = 3):
        """``(Metric, the last call's result)`` of ``warmup`` untimed calls then ``count``
        timed ones of ``func`` (a coroutine function runs on one event loop). A ``func`` that
        takes ``benchmark_last_round`` gets True on the last call of each phase. The timing
        ends when every operator issued has run (``dtorch.sync()``, and CUDA's)."""
        if warmup < 0 or count < 1:
            raise ValueError(f"Benchmark.run: need warmup >= 0 and count >= 1, got "
                             f"warmup={warmup}, count={count}")
        tells_last = "benchmark_last_round" in inspect.signature(func).parameters
        if inspect.iscoroutinefunction(func):
            return asyncio.run(_timed_async(func, warmup, count, tells_last))
        dtorch.default_graph.empty_cache()
        _calls(func, warmup, tells_last)
        begin = _settle(reset_peaks=True)
        out = _calls(func, count, tells_last)
        return _metric(begin, count), out


def _calls(func, n: int, tells_last: bool):
    out = None
    for i in range(n):
        out = func(benchmark_last_round=True) if tells_last and i == n - 1 else func()
    return out


async def _timed_async(func, warmup: int, count: int, tells_last: bool):
    dtorch.default_graph.empty_cache()
    for i in range(warmup):
        await (func(benchmark_last_round=True) if tells_last and i == warmup - 1 else func())
    begin = _settle(reset_peaks=True)
    out = None
    for i in range(count):
        out = await (func(benchmark_last_round=True) if tells_last and i == count - 1
                     else func())
    return _metric(begin, count), out


def _settle(reset_peaks: bool = False) -> float:
    """Waits for the devices (and the peaks start again); returns the time then."""
    dtorch.sync()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        if reset_peaks:
            torch.cuda.reset_peak_memory_stats()
    if reset_peaks:
        dtorch.default_graph.get_memory_stats(reset_peak=True)
    return time.perf_counter()


def _metric(begin: float, count: int) -> Metric:
    duration = (_settle() - begin) / count
    torch_peak = torch.cuda.max_memory_allocated() / 1e6 if torch.cuda.is_available() else 0.0
    stats = dtorch.default_graph.get_memory_stats(reset_peak=True)
    dtorch_peak = max((s.max_memory_allocated for s in stats.values()), default=0) / 1e6
    # ru_maxrss is in kilobytes on Linux, in bytes on macOS
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cpu = rss / 1e6 if sys.platform == "darwin" else rss / 1e3
    dtorch.default_graph.empty_cache()
    return Metric(duration, torch_peak, dtorch_peak, cpu)
