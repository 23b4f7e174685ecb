"""Pipeline schedules for training: GPipe, 1F1B and interleaved 1F1B, 2 stages on 2 devices (2 host
processes of one torch thread each), a training step (forward, backward) of m micro-batches.

    python benchmarks/bench_schedules.py [rounds=5] [microbatches=8]

Each stage is ``LAYERS / 2`` compute-bound ``Linear(WIDTH, WIDTH)`` + ReLU layers; the batch of
``BATCH`` rows (1024 of width 1024 by default) splits into m micro-batches. Reported:

1. the step time of each schedule, and of one micro-batch (no pipelining), medians of
   ``rounds`` alternating steps;
2. each device's bubble, from a trace of one step: the share of the step (first computing
   kernel to last, over both devices) that the device ran no computing kernel (a hop's time,
   mostly waiting for its peer, counts as idle), against the theory's
   ``(p - 1) / (m + p - 1)`` (GPipe, 1F1B) and ``(p - 1) / (v m + p - 1)`` (interleaved 1F1B
   with ``v = 2`` virtual stages a device: the same layers as 4 stages, round-robin);
3. each host's peak resident memory over the first step above what it held with the model
   built, in a fresh process per schedule whose malloc gives back what is freed (glibc's mmap
   threshold fixed at 128 kB: a host's resident memory is then what it holds live): the
   gradients, and the activations kept for the backward, of every micro-batch under GPipe,
   of at most p - s under 1F1B.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("DTORCH_CPU_HOSTS", "2")  # device d runs in host d % 2: one per stage
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

import dtorch  # noqa: E402

WIDTH = int(os.environ.get("BENCH_PP_WIDTH", "1024"))
LAYERS = int(os.environ.get("BENCH_PP_LAYERS", "8"))
BATCH = int(os.environ.get("BENCH_PP_BATCH", "1024"))
SCHEDULES = {"GPipe": dtorch.nn.ScheduleGPipe, "1F1B": dtorch.nn.Schedule1F1B,
             "Interleaved1F1B": dtorch.nn.ScheduleInterleaved1F1B}


def stage(mesh, n):
    layers = []
    for _ in range(n):
        layers += [dtorch.nn.Linear(WIDTH, WIDTH, bias=False, device_mesh=mesh),
                   dtorch.nn.ReLU()]
    return dtorch.nn.Sequential(*layers)


def setup(microbatches):
    mesh = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["pp"])
    meshes = mesh.unbind("pp")
    halves = [stage(m, LAYERS // 2) for m in meshes]
    # the same layers as 4 virtual stages, round-robin (interleaved 1F1B, 2 chunks a device):
    # device 0's first half, device 1's, device 0's second half, device 1's (the same work,
    # in another order)
    quarters = [dtorch.nn.Sequential(*(list(halves[k % 2])[:LAYERS // 2] if k < 2 else
                                       list(halves[k % 2])[LAYERS // 2:])) for k in range(4)]
    stages = {name: quarters if name == "Interleaved1F1B" else halves for name in SCHEDULES}
    g = torch.Generator().manual_seed(0)
    x = dtorch.from_torch(torch.randn(BATCH, WIDTH, generator=g), meshes[0])
    t = dtorch.from_torch(torch.randn(BATCH, WIDTH, generator=g), meshes[1])

    def loss_fn(y, target):
        return ((y - target) ** 2).mean()

    def run(name, m):
        SCHEDULES[name](stages[name], m, loss_fn=loss_fn).step(x, target=t)
        for s in halves:
            for p in s.parameters():
                p.grad = None
        dtorch.sync()

    return run, meshes


def computes(event) -> bool:
    """Whether a kernel event computes: a hop (``step:move``) or a collective's kernel spends
    its time in a transfer, much of it waiting for the peer."""
    return not event["name"].startswith("step:") and "coalesced" not in event["name"]


def bubbles(run, name, m, meshes) -> list:
    """Each stage's idle share of one traced step: the time its device ran no computing
    kernel on any stream (the union of their spans), over the step's span."""
    with dtorch.profiler.profile() as prof:
        run(name, m)
    events = prof.kernels()
    devices = [mesh.mesh.flatten().tolist()[0] for mesh in meshes]
    mine = [sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                   if e["pid"] == d and computes(e)) for d in devices]
    start = min(a for spans in mine for a, _ in spans)
    end = max(b for spans in mine for _, b in spans)
    out = []
    for spans in mine:
        busy, reach = 0.0, start
        for a, b in spans:
            busy += max(0.0, b - max(a, reach))
            reach = max(reach, b)
        out.append(1 - busy / (end - start))
    return out


def peak_case(name: str, m: int) -> list:
    """In this fresh process: each host's peak resident memory over a step (MiB)."""
    from dtorch.client import session
    from procmem import children, reset_peak, status_kb

    run, _ = setup(m)
    dtorch.sync()
    hosts = children(session._current.controller.pid)
    before = {pid: status_kb(pid, "VmRSS") for pid in hosts}
    for pid in hosts:
        reset_peak(pid)
    run(name, m)  # the first step: later ones reuse the blocks the host kept
    return [(status_kb(pid, "VmHWM") - before[pid]) / 1024 for pid in hosts]


def main(rounds: int, m: int) -> None:
    run, meshes = setup(m)
    cases = [("GPipe", 1)] + [(name, m) for name in SCHEDULES]
    times = {c: [] for c in cases}
    for k in range(rounds + 1):
        for c in cases:
            t0 = time.perf_counter()
            run(*c)
            if k:
                times[c].append(time.perf_counter() - t0)
    p = 2
    print(f"2 stages x {LAYERS // 2} Linear({WIDTH}) + ReLU, batch {BATCH}, training step; "
          f"medians of {rounds}")
    base = statistics.median(times[("GPipe", 1)])
    print(f"{'1 micro-batch':20} {base * 1e3:8.1f} ms")
    for name in SCHEDULES:
        t = statistics.median(times[(name, m)])
        bub = bubbles(run, name, m, meshes)
        v = 2 if name == "Interleaved1F1B" else 1
        theory = (p - 1) / (v * m + p - 1)
        # glibc's mmap threshold fixed at 128 kB in the case's processes: a freed activation
        # goes back to the system, so a host's resident memory is what it holds live
        out = subprocess.run([sys.executable, __file__, "--case", name, str(m)],
                             capture_output=True, text=True, check=True,
                             env={**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 << 10)})
        peaks = [float(v) for v in out.stdout.split("RESULT ")[-1].split()]
        print(f"{name + f' m={m}':20} {t * 1e3:8.1f} ms ({t / base:.2f}x of 1 micro-batch); "
              f"bubble stage 0 {bub[0]:.2f}, stage 1 {bub[1]:.2f} (theory {theory:.2f}); "
              f"host peaks over a step {' / '.join(f'{v:.0f}' for v in peaks)} MiB")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--case"]:
        print("RESULT " + " ".join(f"{v:.1f}" for v in peak_case(sys.argv[2], int(sys.argv[3]))),
              flush=True)
    else:
        args = [int(a) for a in sys.argv[1:3]]
        main(*(args + [5, 8][len(args):]))
