"""Client issue cost of one small op vs one torch eager op (goal: ratio <= 1.0).

Measures only the user's thread: the time to issue N ``y = x + 1.0``-style ops (the runtime
executes them concurrently in other processes), against torch doing the same ops eagerly on a
small CPU tensor, in the same run. Prints microseconds per op and the ratio.
"""

import statistics
import time

import torch

import dtorch

N = 20000


def per_op(fn, n=N, repeats=5):
    """Median of ``repeats`` timings (not the best: a lucky run is no one's cost); the runtime
    drains between them (untimed), so each timing sees the same empty pipeline."""
    times = []
    for _ in range(repeats):
        dtorch.sync()
        t0 = time.perf_counter()
        fn(n)
        times.append((time.perf_counter() - t0) / n)
    dtorch.sync()
    return statistics.median(times)


def torch_ops(n):
    x = torch.ones(8)
    for _ in range(n):
        x = x + 1.0


def dtorch_issue_only(mesh):
    def run(n):
        x = dtorch.ones(8, device_mesh=mesh)
        for _ in range(n):
            x = x + 1.0

    return run


def main():
    mesh = dtorch.DeviceMesh("cpu", [0])
    dtorch_issue_only(mesh)(100)  # start the runtime, warm caches
    t_torch = per_op(torch_ops)
    t_issue = per_op(dtorch_issue_only(mesh))
    dtorch.sync()
    print(f"torch eager x + 1.0      : {t_torch * 1e6:6.2f} us/op")
    print(f"dtorch issue x + 1.0     : {t_issue * 1e6:6.2f} us/op   ratio {t_issue / t_torch:.2f}x")


if __name__ == "__main__":
    main()
