"""End-to-end: a stream of small ops ending in a sync.

1. 100 000 ops on a 1-device mesh vs torch eager on the same small tensor (goal: <= 1.5x).
2. The same program on a 2-device mesh vs PyTorch DTensor on 2 gloo ranks (goal: >= 5x faster).
   DTensor is measured on fewer ops (it is slow) and compared per op.
Both baselines run in this same invocation, so machine noise hits both sides alike.
"""

import os
import sys
import time

import torch

import dtorch
from baseline import run_on_gloo_ranks

N = int(os.environ.get("BENCH_OPS", "100000"))
N_DTENSOR = int(os.environ.get("BENCH_DTENSOR_OPS", "3000"))


def program(x, n):
    # a small elementwise chain: what an optimizer step or activation stack issues
    for _ in range(n // 2):
        x = x * 0.5
        x = x + 1.0
    return x


def time_torch(n):
    x = torch.ones(64, 8)
    t0 = time.perf_counter()
    program(x, n).sum().item()
    return time.perf_counter() - t0


def time_dtorch(mesh, placements, n):
    x = dtorch.ones((64, 8), device_mesh=mesh, placements=placements)
    x.sum().item()  # hosts started, caches warm
    t0 = time.perf_counter()
    program(x, n).sum().item()
    return time.perf_counter() - t0


def _dtensor_rank(rank, n):
    """Seconds for ``program`` over ``n`` ops on a DTensor sharded over the gloo ranks."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2,))
    x = distribute_tensor(torch.ones(64, 8), mesh, [Shard(0)])
    program(x, 100).sum().full_tensor()
    dist.barrier()
    t0 = time.perf_counter()
    program(x, n).sum().full_tensor()
    return time.perf_counter() - t0


def time_dtensor(n):
    return run_on_gloo_ranks(_dtensor_rank, n)


def main():
    one = dtorch.DeviceMesh("cpu", [0])
    two = dtorch.DeviceMesh("cpu", [0, 1])
    t_torch = time_torch(N)
    t_one = time_dtorch(one, [dtorch.Replicate()], N)
    t_two = time_dtorch(two, [dtorch.Shard(0)], N)
    print(f"{N} small ops + sync")
    print(f"  torch eager            : {t_torch:7.3f} s  ({t_torch / N * 1e6:5.2f} us/op)")
    print(f"  dtorch, 1-device mesh  : {t_one:7.3f} s  ({t_one / N * 1e6:5.2f} us/op)  "
          f"ratio vs torch {t_one / t_torch:.2f}x (goal <= 1.5x)")
    print(f"  dtorch, 2-device mesh  : {t_two:7.3f} s  ({t_two / N * 1e6:5.2f} us/op)")
    if "--no-dtensor" in sys.argv:
        return
    t_dt = time_dtensor(N_DTENSOR)
    per_dt, per_two = t_dt / N_DTENSOR, t_two / N
    print(f"  torch DTensor, 2 ranks : {per_dt * 1e6:7.2f} us/op (over {N_DTENSOR} ops)  "
          f"dtorch is {per_dt / per_two:.1f}x faster (goal >= 5x)")


if __name__ == "__main__":
    main()
