"""The four collectives of 16 MB on a 2-device CPU mesh vs raw torch.distributed gloo.

dtorch: ``redistribute`` of a 16 MB float32 tensor, S(0) -> R (all-gather), P -> R (all-reduce),
P -> S(0) (reduce-scatter) and S(0) -> S(1) (all-to-all), synced once after the timed
iterations. Each round's results are kept until its end (a result released unread would be dead
code, which the controller rightly does not run). Baseline: two processes calling
``torch.distributed`` on gloo directly with the same sizes, each making its result afresh and
keeping it to the round's end as dtorch does, in this same run.
Every figure is the median of ``BENCH_ROUNDS`` rounds of ``BENCH_ITERS`` calls.
Goal: dtorch reaches >= 0.9x the raw bandwidth.

A second pass frees each result at once instead (the two collectives with a Replicate result,
each read by a one-element op in dtorch), so both sides' allocators may hand the same memory back
and the cost of fresh pages drops out.
"""

import os
import statistics
import time

import torch

import dtorch
from baseline import run_on_gloo_ranks

NUMEL = 4 * 1024 * 1024  # 16 MB of float32
ITERS = int(os.environ.get("BENCH_ITERS", "10"))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "5"))
NAMES = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all")


def _raw_rank(rank, keep: bool):
    """Seconds per call of each collective, straight on the gloo process group (medians)."""
    import torch.distributed as dist

    shard = torch.ones(NUMEL // 2)
    full = torch.ones(NUMEL)
    square = torch.ones(2048, 2048)  # 16 MB, S(0) on 2 ranks: 1024 x 2048 each

    def all_gather():
        parts = [torch.empty(NUMEL // 2) for _ in range(2)]
        dist.all_gather(parts, shard)
        return torch.cat(parts)

    def all_reduce():
        out = full.clone()
        dist.all_reduce(out)
        return out

    def reduce_scatter():
        out = torch.empty(NUMEL // 2)
        dist.reduce_scatter(out, list(full.chunk(2)))
        return out

    def all_to_all():
        block = square[rank * 1024:(rank + 1) * 1024]  # this rank's rows
        send = torch.stack(block.chunk(2, dim=1))  # column chunk j goes to rank j
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        return torch.cat(list(recv), 0)

    fns = {"all_gather": all_gather, "all_reduce": all_reduce,
           "reduce_scatter": reduce_scatter, "all_to_all": all_to_all}
    results = {}
    for name in NAMES if keep else NAMES[:2]:
        fns[name]()
        rounds = []
        for _ in range(ROUNDS):
            dist.barrier()
            t0 = time.perf_counter()
            kept = [fns[name]() if keep else fns[name]()[:1] + 0 for _ in range(ITERS)]
            dist.barrier()
            del kept
            rounds.append((time.perf_counter() - t0) / ITERS)
        results[name] = statistics.median(rounds)
    return results


def time_dtorch(keep: bool):
    mesh = dtorch.DeviceMesh("cpu", [0, 1])
    S0, S1, R, P = dtorch.Shard(0), dtorch.Shard(1), dtorch.Replicate(), dtorch.Partial()
    cases = {
        "all_gather": (dtorch.ones(NUMEL, device_mesh=mesh, placements=[S0]), [R]),
        "all_reduce": (dtorch.ones(NUMEL, device_mesh=mesh, placements=[P]), [R]),
        "reduce_scatter": (dtorch.ones(NUMEL, device_mesh=mesh, placements=[P]), [S0]),
        "all_to_all": (dtorch.ones(2048, 2048, device_mesh=mesh, placements=[S0]), [S1]),
    }
    results = {}
    for name in NAMES if keep else NAMES[:2]:
        x, target = cases[name]
        x.redistribute(placements=target)  # groups created, memory warm
        rounds = []
        for _ in range(ROUNDS):
            dtorch.sync()
            t0 = time.perf_counter()
            kept = [x.redistribute(placements=target) if keep else
                    x.redistribute(placements=target)[:1] + 0 for _ in range(ITERS)]
            dtorch.sync()
            rounds.append((time.perf_counter() - t0) / ITERS)
            del kept
        results[name] = statistics.median(rounds)
    return results


def main():
    mb = NUMEL * 4 / 1e6
    print(f"16 MB collectives on 2 devices, medians of {ROUNDS} rounds of {ITERS}")
    for keep in (True, False):
        raw = run_on_gloo_ranks(_raw_rank, keep)
        ours = time_dtorch(keep)
        print("results kept to the round's end:" if keep else "each result freed at once:")
        for name in raw:
            print(f"  {name:14s}: gloo {mb / raw[name]:7.1f} MB/s   dtorch "
                  f"{mb / ours[name]:7.1f} MB/s   ratio {raw[name] / ours[name]:.2f}x "
                  "(goal >= 0.9x)")


if __name__ == "__main__":
    main()
