"""Baselines on raw torch.distributed: run a function on gloo ranks in spawned processes.

Both the collectives and the stream benchmark compare dtorch with two gloo ranks in the same
invocation, so machine noise hits both sides alike.
"""

import os
import socket


def _rank_main(rank, world_size, port, fn, args, out):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    result = fn(rank, *args)
    if rank == 0:
        out.put(result)
    dist.destroy_process_group()


def run_on_gloo_ranks(fn, *args, world_size=2):
    """Run ``fn(rank, *args)`` in ``world_size`` spawned processes joined in one gloo process
    group, and return what rank 0's call returned. ``fn`` must be a module-level function (it is
    pickled by name into each process)."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, fn, args, out))
             for r in range(world_size)]
    for p in procs:
        p.start()
    result = out.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    return result
