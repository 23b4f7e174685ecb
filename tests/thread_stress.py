"""Threads issuing on one runtime at once: ``THREADS`` workers, each issuing ``--ops`` operators
whose shapes are new (every call binds: new specs, call templates and call sites' records race
with the other threads' operators), half of them inside a ``with dtorch.Graph():`` of their own,
and a data-loading thread whose tensors the main thread computes with. Every value is compared
with torch's, bit for bit (each result is computed whole on one device: rows sharded, or
replicated). The interpreter switches threads every few microseconds, not every 5 ms, so that
the races a real program meets once an hour happen many times a run.

Run by tests/test_threads.py; by hand: ``python tests/thread_stress.py --runs 20`` prints one
line per run and exits 1 at the first run that is wrong.
"""

from __future__ import annotations

import argparse
import contextlib
import queue
import sys
import threading
import time

import torch

import dtorch
from dtorch import Replicate, Shard

THREADS = 4
OPS_PER_STEP = 5  # from_torch, mul, add, relu, sum


def worker(k: int, ops: int, mesh, failures: list) -> None:
    """Issues ``ops`` operators of new shapes and checks every result against torch's."""
    g = torch.Generator().manual_seed(k)
    with dtorch.Graph() if k % 2 else contextlib.nullcontext():
        made = []
        for i in range(ops // OPS_PER_STEP):
            # (rows, cols) never repeats within a thread, and every thread meets it at about
            # the same time: the threads race to define its spec and its calls
            shape = (1 + i % 37, 1 + i // 37)
            t = torch.randn(shape, generator=g)
            x = dtorch.from_torch(t, device_mesh=mesh,
                                  placements=[Shard(0) if i % 2 else Replicate()])
            y = (x * (i % 5 - 2.0) + k).relu().sum(dim=1)
            made.append((y, (t * (i % 5 - 2.0) + k).relu().sum(dim=1)))
        for n, (y, want) in enumerate(made):
            got = y.to_torch()
            if not torch.equal(got, want):
                failures.append(f"thread {k}, step {n}: {got} != {want}")
                return


def loader(batches: int, mesh, out: queue.Queue) -> None:
    """A data-loading thread: it makes the dtorch tensors that another thread consumes."""
    g = torch.Generator().manual_seed(99)
    for i in range(batches):
        t = torch.randn(8 + i % 3, 6, generator=g)
        out.put((t, dtorch.from_torch(t, device_mesh=mesh, placements=[Shard(0)])))
    out.put(None)


def run_once(ops: int) -> list:
    mesh = dtorch.DeviceMesh("cpu", [0, 1])
    failures: list = []
    batches: queue.Queue = queue.Queue(maxsize=8)
    threads = [threading.Thread(target=worker, args=(k, ops, mesh, failures))
               for k in range(THREADS)]
    threads.append(threading.Thread(target=loader, args=(ops // 50, mesh, batches)))
    for t in threads:
        t.start()
    w = torch.randn(6, 4, generator=torch.Generator().manual_seed(7))
    dw = dtorch.from_torch(w, device_mesh=mesh, placements=[Replicate()])
    consumed = []
    while (batch := batches.get()) is not None:  # the main thread computes with them
        t, x = batch
        consumed.append(((x @ dw).relu(), (t @ w).relu()))
    for t in threads:
        t.join()
    for n, (y, want) in enumerate(consumed):
        if not torch.equal(y.to_torch(), want):
            failures.append(f"loaded batch {n} differs")
    return failures


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ops", type=int, default=10_000, help="operators per thread")
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()
    sys.setswitchinterval(1e-6)
    for run in range(args.runs):
        t0 = time.perf_counter()
        failures = run_once(args.ops)
        print(f"run {run + 1}: {THREADS} threads x {args.ops} operators + a loader: "
              f"{'wrong: ' + failures[0] if failures else 'torch values'} "
              f"({time.perf_counter() - t0:.1f} s)", flush=True)
        if failures:
            return 1
        dtorch.shutdown()  # the next run binds every shape anew, on a fresh runtime
    return 0


if __name__ == "__main__":
    sys.exit(main())
