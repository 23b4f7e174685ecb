"""Kernel fusion: a hot elementwise loop body, fused by the hosts, against torch eager.

The body (``x = x * 0.999 + b; x = maximum(x - 1.0, b)``: tensor-scalar and tensor-tensor ops)
runs on a 1-device mesh for three tensor sizes: small (torch's per-op cost is a few microseconds,
so dtorch's pipeline, not the kernels, sets the pace: torch is fastest here), medium and large
(the kernels dominate, and a fused stretch reads and writes memory once instead of once per op).
Goal (issue 11): <= 0.7x torch eager once the hot body runs as fused code.

The host gets every core (``DTORCH_CPU_HOSTS=1``: one host process, ``cpu_count`` torch threads,
and fused code compiled for as many), as eager torch does and as ``bench_llama.py`` does; with
the default (one host per core) the one device of this mesh computes on one core of two.

Each dtorch runtime is warmed first: the loop runs, each time followed by
``dtorch.sync(compiles=True)`` (which waits for the compiles it started), until the trace shows
it running fused code (with fusion on; the time printed as "warm-up", compiles included, and
how many runs it took). Then every figure is the median of ``BENCH_REPEATS`` timings, torch's and
dtorch's alternating, with fusion on and then off (two runtimes).
"""

import os
import statistics
import time

os.environ.setdefault("DTORCH_CPU_HOSTS", "1")  # before dtorch is imported

import torch  # noqa: E402

import dtorch  # noqa: E402

REPEATS = int(os.environ.get("BENCH_REPEATS", "5"))
SIZES = {"small": (1_000, 5_000), "medium": (100_000, 1_000), "large": (1_000_000, 150)}
OPS_PER_ITERATION = 4
WARM_UP_S = 60


def body(x, b, iterations, maximum):
    for _ in range(iterations):
        x = x * 0.999 + b
        x = maximum(x - 1.0, b)
    return x


def time_torch(n, iterations):
    x, b = torch.ones(n), torch.full((n,), 1e-3)
    t0 = time.perf_counter()
    body(x, b, iterations, torch.maximum).sum().item()
    return time.perf_counter() - t0


def time_dtorch(x, b, iterations):
    t0 = time.perf_counter()
    body(x, b, iterations, dtorch.maximum).sum().item()
    return time.perf_counter() - t0


def run(fusion: bool) -> dict:
    os.environ["DTORCH_FUSION"] = "1" if fusion else "0"  # read by the hosts at their start
    dtorch.shutdown()
    one = dtorch.DeviceMesh("cpu", [0])
    results = {}
    for name, (n, iterations) in SIZES.items():
        x = dtorch.ones(n, device_mesh=one)
        b = dtorch.full((n,), 1e-3, device_mesh=one)
        t0, runs, fused = time.perf_counter(), 0, False
        # fusion waits until a program has cost its device config.fusion_after_s: at the medium
        # size that takes more runs than at the others, so the warm-up is bounded by time
        while runs < 3 or (fusion and not fused and time.perf_counter() - t0 < WARM_UP_S):
            with dtorch.profiler.profile() as prof:
                body(x, b, iterations, dtorch.maximum)
                dtorch.sync(compiles=True)
            runs += 1
            fused = any("fused)" in e["name"] for e in prof.kernels())
        warm = (time.perf_counter() - t0, runs, fused)
        ts, ds = [], []
        for _ in range(REPEATS):
            ts.append(time_torch(n, iterations))
            ds.append(time_dtorch(x, b, iterations))
            dtorch.sync(compiles=True)  # a late compile must not run beside torch's timing
        ops = iterations * OPS_PER_ITERATION
        results[name] = (statistics.median(ts) / ops, statistics.median(ds) / ops, warm)
    return results


def main():
    print(f"hot loop body of {OPS_PER_ITERATION} elementwise ops, 1-device mesh, medians of "
          f"{REPEATS}")
    on, off = run(fusion=True), run(fusion=False)
    os.environ.pop("DTORCH_FUSION")
    dtorch.shutdown()
    for name, (n, iterations) in SIZES.items():
        t_on, d_on, warm = on[name]
        t_off, d_off, _ = off[name]
        print(f"  {name:6s} ({n:>9,} elements, {iterations * OPS_PER_ITERATION} ops): "
              f"torch {t_on * 1e6:7.1f} us/op   fused {d_on * 1e6:7.1f} us/op = "
              f"{d_on / t_on:.2f}x (goal <= 0.7x)   unfused {d_off * 1e6:7.1f} us/op = "
              f"{d_off / t_off:.2f}x   warm-up with compiles {warm[0]:.1f} s ({warm[1]} runs"
              f"{'' if warm[2] else ', NOT FUSED'})")


if __name__ == "__main__":
    main()
