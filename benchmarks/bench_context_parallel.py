"""Ring context parallelism: per-device peak memory and time against torch's own attention on
one device, causal, float32.

Each ring member is a process of its own on a gloo group (``baseline.run_on_gloo_ranks``) that
runs the ring kernel's math, ``dtorch.ops.context_parallel.ring_attention`` (the causal balance,
the ring, the online softmax), on its block: its query, key and value blocks are made in the process (never the whole sequence), so
what it holds is what a device of dtorch's ring holds. torch's attention on the whole inputs
runs in a process of its own too. Peak memory is the process's resident high-water mark
(``VmHWM``, reset through ``/proc/self/clear_refs`` once torch and gloo are warm) above its
resident size then: torch's CPU allocations go through malloc, so tracemalloc would not see
them. Allocations of 1 MiB and more are mmapped (``MALLOC_MMAP_THRESHOLD_``, which also stops
glibc from raising the threshold as blocks are freed), so they are given back when freed and
the mark tracks live tensors. One thread per device.

The claim to check: the ring's peak per device is a constant number of query blocks
(``peak / block`` stays put as L grows and as the ring grows), so it grows as L / ring, where
torch's on one device grows as L. Time: on this machine's cores the ring members share the
CPU (4 members on 2 cores run two at a time), so wall time says little beyond 2 members.

    python benchmarks/bench_context_parallel.py [--lengths 4096 8192 16384] [--rings 2 4 8]
"""

from __future__ import annotations

import argparse
import math
import os
import re
import time

import torch

from baseline import run_on_gloo_ranks

HEADS, EMBED = 4, 64


def _hwm_bytes() -> int:
    status = open("/proc/self/status").read()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024


def _rss_bytes() -> int:
    status = open("/proc/self/status").read()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024


def _reset_peak() -> int:
    """Resets the high-water mark to the resident size now, and returns that size."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _rss_bytes()


def _blocks(length: int, rank: int, seed: int = 0):
    """This member's query, key and value blocks, drawn in place."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    shape = (1, HEADS, length, EMBED)
    return tuple(torch.randn(shape, generator=g) for _ in range(3))


def ring_member(rank: int, length: int):
    import torch.distributed as dist

    from dtorch.ops.context_parallel import ring_attention
    from dtorch.placement import chunk_range

    torch.set_num_threads(1)
    pg = dist.distributed_c10d._get_default_group()
    size = pg.size()

    def run(total):
        blocks = [[chunk_range(total, size, i)] for i in range(size)]
        q, k, v = _blocks(blocks[rank][0][1], rank)
        return ring_attention(pg, rank, q, k, v, blocks, blocks, True, 1 / math.sqrt(EMBED))

    run(64 * size)  # gloo's pairs connected, torch's kernels warm
    dist.barrier()
    base = _reset_peak()
    t0 = time.perf_counter()
    run(length)
    seconds = time.perf_counter() - t0
    stats = torch.tensor([_hwm_bytes() - base, seconds], dtype=torch.float64)
    dist.all_reduce(stats, dist.ReduceOp.MAX)  # the busiest member
    return stats.tolist()


def torch_one_device(rank: int, length: int):
    torch.set_num_threads(1)
    torch.nn.functional.scaled_dot_product_attention(*_blocks(64, 0), is_causal=True)
    base = _reset_peak()
    t0 = time.perf_counter()
    torch.nn.functional.scaled_dot_product_attention(*_blocks(length, 0), is_causal=True)
    seconds = time.perf_counter() - t0
    return [_hwm_bytes() - base, seconds]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--rings", type=int, nargs="+", default=[2, 4, 8])
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(2 ** 20)  # the spawned processes' malloc
    mib = 2 ** 20
    print(f"causal attention, float32, [1, {HEADS}, L, {EMBED}], one thread per device; "
          f"block = one device's query block (L / devices x {HEADS * EMBED * 4} bytes)")
    print(f"{'L':>6} {'devices':>7} {'kernel':>10} {'peak/device MiB':>15} {'peak/block':>10} "
          f"{'vs torch':>8} {'time s':>7} {'vs torch':>8}")
    for length in args.lengths:
        peak1, time1 = run_on_gloo_ranks(torch_one_device, length, world_size=1)
        rows = [(1, "torch", peak1, time1)]
        for ring in args.rings:
            peak, seconds = run_on_gloo_ranks(ring_member, length, world_size=ring)
            rows.append((ring, "dtorch ring", peak, seconds))
        for devices, kernel, peak, seconds in rows:
            block = math.ceil(length / devices) * HEADS * EMBED * 4
            print(f"{length:>6} {devices:>7} {kernel:>10} {peak / mib:>15.1f} "
                  f"{peak / block:>10.2f} {peak / peak1:>8.2f} {seconds:>7.2f} "
                  f"{seconds / time1:>8.2f}")


if __name__ == "__main__":
    main()
