"""Two machines on loopback: all-reduce bandwidth against raw gloo, and the client's per-op cost
on a 2-machine mesh against a 1-machine mesh.

The "machines" are node agents (``dtorch node``) bound to 127.0.0.2 and 127.0.0.3, two CPU
devices each, one host process per device; this program is their main node at 127.0.0.1.

1. All-reduce of 16 MB of float32 across the two machines: dtorch's ``redistribute`` P -> R, each
   result read by a one-element op (an unread result would be dead code), synced once after the
   timed iterations. Baseline: two processes bound to the same two addresses running
   ``ProcessGroupGloo.allreduce`` on the same sizes, in this same run. Goal: >= 0.9x.
2. Per-op cost: ``x = x + 1.0`` issued N times on a mesh of two devices, one per machine
   (devices 0 and 2), and on a mesh of the first machine's two (0 and 1): the same work, on one
   machine or across two. ``issue`` is the user's thread alone (the hot path); ``end to end``
   includes the wait for every op to run on every device (the controller sends one copy of each
   batch per machine, whose agent relays it to its hosts). Goal: <= 1.1x.
"""

import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import dtorch
from dtorch.launcher import auth, node

NUMEL = 4 * 1024 * 1024  # 16 MB of float32
ITERS = int(os.environ.get("BENCH_ITERS", "10"))
N_OPS = int(os.environ.get("BENCH_OPS", "20000"))
ADDRESSES = ("127.0.0.2", "127.0.0.3")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- raw gloo between the two addresses -----------------------------------------------------------
def _raw_rank(rank, port, out):
    import datetime

    from torch._C._distributed_c10d import ProcessGroupGloo, TCPStore

    store = TCPStore("127.0.0.1", port, 2, rank == 0, datetime.timedelta(seconds=120))
    opts = ProcessGroupGloo._Options()
    opts._devices = [ProcessGroupGloo.create_device(hostname=ADDRESSES[rank])]
    opts._timeout = datetime.timedelta(seconds=120)
    pg = ProcessGroupGloo(store, rank, 2, opts)
    full = torch.ones(NUMEL)
    pg.allreduce([full.clone()]).wait()
    pg.barrier().wait()
    t0 = time.perf_counter()
    for _ in range(ITERS):
        pg.allreduce([full.clone()]).wait()  # a fresh buffer each time, as dtorch's result is
    pg.barrier().wait()
    if rank == 0:
        out.put((time.perf_counter() - t0) / ITERS)


def time_raw() -> float:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_raw_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    result = out.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    return result


# -- dtorch ---------------------------------------------------------------------------------------
def time_all_reduce(mesh) -> float:
    partial = dtorch.ones(NUMEL, device_mesh=mesh, placements=[dtorch.Partial()])
    partial.redistribute(placements=[dtorch.Replicate()])[:1].sum().item()  # groups made
    t0 = time.perf_counter()
    kept = [partial.redistribute(placements=[dtorch.Replicate()])[:1] + 0 for _ in range(ITERS)]
    dtorch.sync()
    elapsed = (time.perf_counter() - t0) / ITERS
    del kept
    return elapsed


def per_op(mesh, repeats: int = 5) -> tuple:
    """Median seconds per op: (issue only, end to end)."""
    issue, total = [], []
    for _ in range(repeats):
        x = dtorch.ones(8, device_mesh=mesh)
        dtorch.sync()
        t0 = time.perf_counter()
        for _ in range(N_OPS):
            x = x + 1.0
        t1 = time.perf_counter()
        dtorch.sync()
        t2 = time.perf_counter()
        issue.append((t1 - t0) / N_OPS)
        total.append((t2 - t0) / N_OPS)
    return statistics.median(issue), statistics.median(total)


def main():
    with tempfile.TemporaryDirectory(prefix="dtorch-bench-") as tmp:
        token = os.path.join(tmp, "token")
        auth.write_token(token)
        main_address = f"127.0.0.1:{_free_port()}"
        env = {**os.environ, "DTORCH_CPU_HOSTS": "2"}
        agents = [subprocess.Popen(node.command("--main", main_address, "--token-file", token,
                                                "--bind", a, "--cpu-devices", 2),
                                   env=env, stderr=subprocess.DEVNULL) for a in ADDRESSES]
        try:
            dtorch.MainNode.set_address(main_address)
            dtorch.MainNode.set_token_file(token)
            if not dtorch.MainNode.wait_cluster_ready(2, timeout_second=300):
                raise SystemExit("the two node agents did not join within 300 s")
            both = dtorch.DeviceMesh("cpu", [0, 2])  # devices 0-1 on one machine, 2-3 on the other
            first = dtorch.DeviceMesh("cpu", [0, 1])
            ours = time_all_reduce(both)
            one = per_op(first)
            two = per_op(both)
        finally:
            dtorch.shutdown()
            for a in agents:
                a.terminate()
            for a in agents:
                a.wait(60)
    raw = time_raw()
    mb = NUMEL * 4 / 1e6
    print(f"all_reduce 16 MB across 2 machines: gloo {mb / raw:7.1f} MB/s   dtorch "
          f"{mb / ours:7.1f} MB/s   ratio {raw / ours:.2f}x (goal >= 0.9x)")
    for what, k in (("issue", 0), ("end to end", 1)):
        print(f"per-op {what:10s}: 1 machine {one[k] * 1e6:6.2f} us   2 machines "
              f"{two[k] * 1e6:6.2f} us   ratio {two[k] / one[k]:.2f}x (goal <= 1.1x)")


if __name__ == "__main__":
    sys.exit(main())
