"""All-gather and all-reduce of 16 MB on a 2-device CPU mesh vs raw torch.distributed gloo.

dtorch: ``redistribute`` S(0) -> R (all-gather) and P -> R (all-reduce) of a 16 MB float32
tensor, synced after the timed iterations. Baseline: two processes calling
``torch.distributed.all_gather`` / ``all_reduce`` on gloo directly, same sizes, in this same run.
Goal: dtorch reaches >= 0.9x the raw bandwidth.
"""

import os
import socket
import time

import torch

import dtorch

NUMEL = 4 * 1024 * 1024  # 16 MB of float32
ITERS = int(os.environ.get("BENCH_ITERS", "10"))


def _raw_rank(rank, port, out):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
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
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def time_raw():
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_raw_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = out.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    return results


def time_dtorch():
    mesh = dtorch.DeviceMesh("cpu", [0, 1])
    sharded = dtorch.ones(NUMEL, device_mesh=mesh, placements=[dtorch.Shard(0)])
    partial = dtorch.ones(NUMEL, device_mesh=mesh, placements=[dtorch.Partial()])
    results = {}
    for name, x in (("all_gather", sharded), ("all_reduce", partial)):
        x.redistribute(placements=[dtorch.Replicate()])  # groups created, memory warm
        dtorch.sync()
        t0 = time.perf_counter()
        for _ in range(ITERS):
            # sync before dropping the result: a result released unread in the batch that made
            # it is dead code, which the controller would rightly not run
            y = x.redistribute(placements=[dtorch.Replicate()])
            dtorch.sync()
            del y
        results[name] = (time.perf_counter() - t0) / ITERS
    return results


def main():
    raw = time_raw()
    ours = time_dtorch()
    mb = NUMEL * 4 / 1e6
    for name in ("all_gather", "all_reduce"):
        print(f"{name:10s} 16 MB: gloo {mb / raw[name]:7.1f} MB/s   dtorch {mb / ours[name]:7.1f} MB/s"
              f"   ratio {raw[name] / ours[name]:.2f}x (goal >= 0.9x)")


if __name__ == "__main__":
    main()
