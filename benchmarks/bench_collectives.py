"""All-gather and all-reduce of 16 MB on a 2-device CPU mesh vs raw torch.distributed gloo.

dtorch: ``redistribute`` S(0) -> R (all-gather) and P -> R (all-reduce) of a 16 MB float32
tensor, each result read by a one-element op (an unread result would be dead code, which the
controller rightly does not run), synced once after the timed iterations. Baseline: two processes calling
``torch.distributed.all_gather`` / ``all_reduce`` on gloo directly, same sizes, in this same run.
Goal: dtorch reaches >= 0.9x the raw bandwidth.
"""

import os
import time

import torch

import dtorch
from baseline import run_on_gloo_ranks

NUMEL = 4 * 1024 * 1024  # 16 MB of float32
ITERS = int(os.environ.get("BENCH_ITERS", "10"))


def _raw_rank(rank):
    """Seconds per call of all_gather and all_reduce, straight on the gloo process group."""
    import torch.distributed as dist

    shard = torch.ones(NUMEL // 2)
    full = torch.ones(NUMEL)
    parts = [torch.empty(NUMEL // 2) for _ in range(2)]
    dist.all_gather(parts, shard)
    dist.all_reduce(full)
    results = {}
    for name, fn in (("all_gather", lambda: (dist.all_gather(parts, shard), torch.cat(parts))),
                     ("all_reduce", lambda: dist.all_reduce(full.clone()))):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(ITERS):
            fn()
        dist.barrier()
        results[name] = (time.perf_counter() - t0) / ITERS
    return results


def time_raw():
    return run_on_gloo_ranks(_raw_rank)


def time_dtorch():
    mesh = dtorch.DeviceMesh("cpu", [0, 1])
    sharded = dtorch.ones(NUMEL, device_mesh=mesh, placements=[dtorch.Shard(0)])
    partial = dtorch.ones(NUMEL, device_mesh=mesh, placements=[dtorch.Partial()])
    results = {}
    for name, x in (("all_gather", sharded), ("all_reduce", partial)):
        x.redistribute(placements=[dtorch.Replicate()])  # groups created, memory warm
        dtorch.sync()
        t0 = time.perf_counter()
        # each result is read (by a copy of its first element) and then freed, as the raw
        # baseline's are: 16 MB of fresh pages per iteration would cost more than the collective
        kept = [x.redistribute(placements=[dtorch.Replicate()])[:1] + 0 for _ in range(ITERS)]
        dtorch.sync()
        results[name] = (time.perf_counter() - t0) / ITERS
        del kept
    return results


def main():
    raw = time_raw()
    ours = time_dtorch()
    mb = NUMEL * 4 / 1e6
    for name in ("all_gather", "all_reduce"):
        print(f"{name:10s} 16 MB: gloo {mb / raw[name]:7.1f} MB/s   "
              f"dtorch {mb / ours[name]:7.1f} MB/s   ratio {raw[name] / ours[name]:.2f}x "
              "(goal >= 0.9x)")


if __name__ == "__main__":
    main()
