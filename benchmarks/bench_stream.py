"""End-to-end: a stream of small ops ending in a sync.

1. On a 1-device mesh vs torch eager on the same small tensor (goal: <= 1.5x), for both kinds of
   small op: tensor-scalar (``x * 0.5``, ``x + 1.0``: torch wraps the scalar, its slow case) and
   tensor-tensor (``acc + b``: torch's fastest). Each is timed in three runtimes, one after the
   other: replay with kernel fusion (the default), replay without fusion, and neither.
2. The tensor-scalar program on a 2-device mesh vs PyTorch DTensor on 2 gloo ranks (goal: >= 5x
   faster), with fusion and without. DTensor is measured on fewer ops (it is slow) and compared
   per op.

With fusion, the program is first run until the trace shows fused code (each run followed by
``dtorch.sync(compiles=True)``); that warm-up, compiles included, is printed, since a program
shorter than it never gets there. Every figure is the median of ``BENCH_REPEATS`` timings,
torch's and dtorch's alternating, so machine noise hits both sides alike.
"""

import os
import statistics
import sys
import time

import torch

import dtorch
from baseline import run_on_gloo_ranks

N = int(os.environ.get("BENCH_OPS", "100000"))
N_DTENSOR = int(os.environ.get("BENCH_DTENSOR_OPS", "3000"))
REPEATS = int(os.environ.get("BENCH_REPEATS", "5"))


def tensor_scalar(x, b, n):
    # a small elementwise chain: what an optimizer step or activation stack issues
    for _ in range(n // 2):
        x = x * 0.5
        x = x + 1.0
    return x


def tensor_tensor(x, b, n):
    for _ in range(n):
        x = x + b
    return x


PROGRAMS = {"tensor-scalar": tensor_scalar, "tensor-tensor": tensor_tensor}


def time_torch(program, n):
    x, b = torch.ones(64, 8), torch.full((64, 8), 1e-3)
    t0 = time.perf_counter()
    program(x, b, n).sum().item()
    return time.perf_counter() - t0


def time_dtorch(program, mesh, placements, n):
    x = dtorch.ones((64, 8), device_mesh=mesh, placements=placements)
    b = dtorch.full((64, 8), 1e-3, device_mesh=mesh, placements=placements)
    program(x, b, 2000).sum().item()  # hosts started, caches warm
    t0 = time.perf_counter()
    program(x, b, n).sum().item()
    return time.perf_counter() - t0


def warm_until_fused(program, mesh, placements, n, tries=20) -> str:
    """Runs ``program`` until its trace shows fused replays: how long that took."""
    t0 = time.perf_counter()
    for runs in range(1, tries + 1):
        with dtorch.profiler.profile() as prof:
            time_dtorch(program, mesh, placements, n)
            dtorch.sync(compiles=True)
        if any("fused)" in e["name"] for e in prof.kernels()):
            return f"fused after {runs} runs, {time.perf_counter() - t0:.1f} s"
    return f"not fused after {tries} runs"


def start(replay: bool, fusion: bool) -> None:
    """A new runtime with replay and fusion on or off (read by the controller and the hosts
    at their start)."""
    os.environ["DTORCH_REPLAY"] = "1" if replay else "0"
    os.environ["DTORCH_FUSION"] = "1" if fusion else "0"
    dtorch.shutdown()


def medians(program, mesh, placements, n):
    """(torch, dtorch): medians of REPEATS alternating timings, per op."""
    ts, ds = [], []
    for _ in range(REPEATS):
        ts.append(time_torch(program, n) / n)
        ds.append(time_dtorch(program, mesh, placements, n) / n)
    return statistics.median(ts), statistics.median(ds)


def _dtensor_rank(rank, n):
    """Seconds for ``tensor_scalar`` over ``n`` ops on a DTensor sharded over the gloo ranks."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2,))
    x = distribute_tensor(torch.ones(64, 8), mesh, [Shard(0)])
    tensor_scalar(x, None, 100).sum().full_tensor()
    dist.barrier()
    t0 = time.perf_counter()
    tensor_scalar(x, None, n).sum().full_tensor()
    return time.perf_counter() - t0


MODES = {"replay + fusion": (True, True), "replay only": (True, False), "neither": (False, False)}


def one_device(mode: str) -> None:
    start(*MODES[mode])
    one = dtorch.DeviceMesh("cpu", [0])
    for name, program in PROGRAMS.items():
        warm = warm_until_fused(program, one, [dtorch.Replicate()], N) if MODES[mode][1] else ""
        t, d = medians(program, one, [dtorch.Replicate()], N)
        print(f"  {name:13s} {mode:15s}: torch {t * 1e6:5.2f} us/op   dtorch {d * 1e6:5.2f} "
              f"us/op   ratio {d / t:.2f}x (goal <= 1.5x)   {warm}")


def two_devices(fusion: bool) -> float:
    start(True, fusion)
    two = dtorch.DeviceMesh("cpu", [0, 1])
    warm = warm_until_fused(tensor_scalar, two, [dtorch.Shard(0)], N) if fusion else ""
    ts = [time_dtorch(tensor_scalar, two, [dtorch.Shard(0)], N) / N for _ in range(REPEATS)]
    per_two = statistics.median(ts)
    print(f"tensor-scalar, 2-device mesh, {'replay + fusion' if fusion else 'replay only'}: "
          f"dtorch {per_two * 1e6:5.2f} us/op   {warm}")
    return per_two


def main():
    print(f"{N} small ops + sync, 1-device mesh, medians of {REPEATS}")
    for mode in MODES:
        one_device(mode)
    per_two = {fusion: two_devices(fusion) for fusion in (True, False)}
    for name in ("DTORCH_REPLAY", "DTORCH_FUSION"):
        del os.environ[name]
    dtorch.shutdown()
    if "--no-dtensor" in sys.argv:
        return
    per_dt = statistics.median(run_on_gloo_ranks(_dtensor_rank, N_DTENSOR) / N_DTENSOR
                               for _ in range(3))
    print(f"  torch DTensor, 2 ranks: {per_dt * 1e6:7.2f} us/op (over {N_DTENSOR} ops, median "
          f"of 3)   dtorch is {per_dt / per_two[True]:.1f}x faster with fusion, "
          f"{per_dt / per_two[False]:.1f}x without (goal >= 5x)")


if __name__ == "__main__":
    main()
