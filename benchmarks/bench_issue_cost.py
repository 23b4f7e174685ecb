"""Client issue cost of one small op vs one torch eager op (goal: ratio <= 1.0), for both kinds:
tensor-scalar ``x + 1.0`` (torch wraps the scalar: its slow small op) and tensor-tensor
``x + b`` (torch's fastest).

Measures only the user's thread: the time to issue N ops (the runtime executes them
concurrently in other processes, on the same cores), against torch doing the same ops eagerly on
a small CPU tensor, in the same run. Prints microseconds per op and the ratio.
"""

import statistics
import time

import torch

import dtorch

N = 20000


def per_op(fn, n=N, repeats=7):
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


def torch_ops(scalar: bool):
    def run(n):
        x, b = torch.ones(8), torch.ones(8)
        other = 1.0 if scalar else b
        for _ in range(n):
            x = x + other

    return run


def dtorch_issue_only(mesh, scalar: bool):
    def run(n):
        x, b = dtorch.ones(8, device_mesh=mesh), dtorch.ones(8, device_mesh=mesh)
        other = 1.0 if scalar else b
        for _ in range(n):
            x = x + other

    return run


def main():
    mesh = dtorch.DeviceMesh("cpu", [0])
    dtorch_issue_only(mesh, True)(100)  # start the runtime, warm caches
    for scalar, name in ((True, "x + 1.0"), (False, "x + b  ")):
        dtorch_issue_only(mesh, scalar)(2000)
        t_torch = per_op(torch_ops(scalar))
        t_issue = per_op(dtorch_issue_only(mesh, scalar))
        print(f"{name}: torch eager {t_torch * 1e6:6.2f} us/op   dtorch issue "
              f"{t_issue * 1e6:6.2f} us/op   ratio {t_issue / t_torch:.2f}x (goal <= 1.0x)")


if __name__ == "__main__":
    main()
