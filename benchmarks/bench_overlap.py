"""Communication/computation overlap: an all-reduce of 64 MB beside an independent 2048^2 matmul.

    python benchmarks/bench_overlap.py [rounds=5] [trace.json]

Two devices, one host process each with one torch thread (so the matmul leaves a core's share
to the collective). Each round times the all-reduce alone, the matmul alone, and both issued
together (the all-reduce on the communication stream, the matmul on the compute stream), each
from a sync to a sync; medians. Goal: both take at most 0.75x the sum of the two alone. With a
path, the last "both" is traced (``dtorch.profiler``): its spans overlap on each device.

On 2 cores the work is CPU-bound on both sides: gloo's all-reduce adds up the buffers on the
CPU, and the two hosts' matmuls already take both cores, so the best possible is about
max(sum, CPU work / cores), not max(allreduce, matmul).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import dtorch


def main(rounds: int, path: str | None) -> None:
    mesh = dtorch.DeviceMesh("cpu", [0, 1])
    grad = dtorch.ones((16 << 20,), device_mesh=mesh, placements=[dtorch.Partial()])
    a = dtorch.randn((2048, 2048), device_mesh=mesh)

    def allreduce():
        return grad.redistribute(placements=[dtorch.Replicate()])

    def matmul():
        return a @ a

    def both():
        return allreduce(), matmul()

    def timed(fn) -> float:
        dtorch.sync()
        t0 = time.perf_counter()
        result = fn()
        dtorch.sync()
        elapsed = time.perf_counter() - t0
        del result
        return elapsed

    both(), dtorch.sync()  # warm: groups, first-touch pages
    times = {"allreduce": [], "matmul": [], "both": []}
    for _ in range(rounds):
        for name, fn in (("allreduce", allreduce), ("matmul", matmul), ("both", both)):
            times[name].append(timed(fn))
    med = {k: statistics.median(v) for k, v in times.items()}
    total = med["allreduce"] + med["matmul"]
    print(f"2 devices, 1 torch thread per host ({torch.get_num_threads()} in this process), "
          f"medians of {rounds}")
    print(f"  all-reduce 64 MB      {med['allreduce'] * 1e3:8.1f} ms")
    print(f"  matmul 2048^2         {med['matmul'] * 1e3:8.1f} ms")
    print(f"  both together         {med['both'] * 1e3:8.1f} ms = {med['both'] / total:.2f}x "
          f"the sum (goal <= 0.75x)")
    if path:
        with dtorch.profiler.trace(path) as prof:
            kept = both()
            dtorch.sync()
        del kept
        print(f"  trace: {path} ({len(prof.kernels())} kernels)")


if __name__ == "__main__":
    with dtorch.config.Context(cpu_hosts=2):
        main(int(sys.argv[1]) if len(sys.argv) > 1 else 5, sys.argv[2] if len(sys.argv) > 2
             else None)
