"""Pipeline parallelism: 2 stages on 2 devices (in 2 host processes), 8 micro-batches vs 1.

The model is a stack of compute-bound Linear layers (width ``BENCH_PP_WIDTH``, default 1024),
half on each stage mesh of ``mesh.unbind("pp")``, on a batch of ``BENCH_PP_BATCH`` rows (default
1024: a micro-batch of 128 rows keeps the matmuls compute-bound, as the whole batch is; in plain
torch on this 2-core machine, 8 micro-batches of 64 rows took 1.16x the time of their whole
batch, against 1.02x for 128 rows, which would charge the pipeline for the split itself). Each host runs one torch thread, so a stage
is one core's work, and the two stages can only run at the same time if the micro-batches
really pipeline. With 1 micro-batch the stages take turns. With m micro-batches over s stages
the ideal wall time is (m + s - 1) / (m * s) of that (GPipe's bubble). Goal: <= 0.65x.

Both programs run in this same invocation, alternately, and the script prints medians over
``BENCH_PP_RUNS`` timings. It then traces one 8-micro-batch run with ``dtorch.profiler`` and
writes ``BENCH_PP_TRACE`` (default ``pipeline_trace.json``, open it in https://ui.perfetto.dev).
From that trace it prints how much of stage 1's busy time overlaps stage 0's.

The machine is shared, so two cores are not always two free cores. Each round of the same run
also times plain torch on 2 processes, one thread each: each process computing one stage at the
same time, against one process computing both stages. That ratio is 0.5 on two free cores and
1.0 with no parallelism left, and it bounds what any pipeline could reach on the machine then.
(``--no-torch`` skips it.)
"""

import os
import statistics
import sys
import time

os.environ.setdefault("DTORCH_CPU_HOSTS", "2")  # device d runs in host d % 2: one per stage

import torch  # noqa: E402

import dtorch  # noqa: E402
from dtorch import profiler  # noqa: E402

WIDTH = int(os.environ.get("BENCH_PP_WIDTH", "1024"))
LAYERS = int(os.environ.get("BENCH_PP_LAYERS", "8"))  # in all, half per stage
BATCH = int(os.environ.get("BENCH_PP_BATCH", "1024"))
RUNS = int(os.environ.get("BENCH_PP_RUNS", "7"))
M = int(os.environ.get("BENCH_PP_MICROBATCHES", "8"))
TRACE = os.environ.get("BENCH_PP_TRACE", "pipeline_trace.json")


class Stage(dtorch.nn.Module):
    def __init__(self, n_layers, mesh):
        super().__init__()
        self.layers = dtorch.nn.ModuleList(
            [dtorch.nn.Linear(WIDTH, WIDTH, bias=False, device_mesh=mesh)
             for _ in range(n_layers)])

    def forward(self, h):
        for layer in self.layers:
            h = dtorch.nn.functional.relu(layer(h))
        return h


@torch.no_grad()  # a forward-only benchmark: no autograd tape
def run(stages, x, m):
    # one forward pass per timing: a second one would fill the first one's drain bubble, and
    # the ideal below is for one batch
    return dtorch.nn.pipeline(stages, x, microbatches=m)


def timed(stages, x, m):
    t0 = time.perf_counter()
    run(stages, x, m).sum().item()
    return time.perf_counter() - t0


def _torch_rank(rank, port, layers, width, batch, commands, results):
    """Plain torch, one thread, in process ``rank`` of 2 (gloo for the barriers). On each
    command it times "alone" (rank 0 computes both stages while rank 1 waits) or "together"
    (each rank computes one stage at the same time); rank 0 puts the seconds in ``results``."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(rank)
    weights = [torch.randn(width, width, generator=g) for _ in range(layers // 2)]
    x = torch.randn(batch, width, generator=g)

    def stage():
        h = x
        for w in weights:
            h = torch.relu(torch.nn.functional.linear(h, w))
        return h

    stage()
    dist.barrier()
    if rank == 0:
        results.put(None)  # both ready
    while (command := commands[rank].get()) is not None:
        dist.barrier()
        t0 = time.perf_counter()
        if command == "together" or rank == 0:
            stage()
            if command == "alone":
                stage()
        dist.barrier()
        if rank == 0:
            results.put(time.perf_counter() - t0)
    dist.destroy_process_group()


class TorchPair:
    """Two plain-torch processes, timed on demand between dtorch's timings, so that both
    sides of each round see the same machine."""

    def __init__(self):
        import socket

        import torch.multiprocessing as mp

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        ctx = mp.get_context("spawn")
        self.commands, self.results = [ctx.Queue(), ctx.Queue()], ctx.Queue()
        self.procs = [ctx.Process(target=_torch_rank, args=(r, port, LAYERS, WIDTH, BATCH,
                                                             self.commands, self.results))
                      for r in range(2)]
        for proc in self.procs:
            proc.start()
        self.results.get(timeout=600)

    def time(self, command: str) -> float:
        for q in self.commands:
            q.put(command)
        return self.results.get(timeout=600)

    def close(self):
        for q in self.commands:
            q.put(None)
        for proc in self.procs:
            proc.join(timeout=60)


def busy_intervals(events, devices):
    """Merged [start, end) intervals (µs) of the kernels on the compute streams of ``devices``
    (a transfer on the communication stream spends most of its span waiting for its peer)."""
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                   if e["ph"] == "X" and e["pid"] in devices and e["tid"] != 0)
    merged = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


def overlap(a, b) -> float:
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def main():
    mesh = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["pp"])
    meshes = mesh.unbind("pp")
    stage_of = dtorch.assign_layers_to_stages(LAYERS, len(meshes))
    stages = [Stage(stage_of.count(s), m) for s, m in enumerate(meshes)]
    x = dtorch.rand((BATCH, WIDTH), device_mesh=meshes[0])
    run(stages, x, M).sum().item()  # hosts started, process groups made, caches warm
    run(stages, x, 1).sum().item()
    pair = None if "--no-torch" in sys.argv else TorchPair()
    one, many, alone, together = [], [], [], []
    for _ in range(RUNS):
        one.append(timed(stages, x, 1))
        many.append(timed(stages, x, M))
        if pair is not None:
            alone.append(pair.time("alone"))
            together.append(pair.time("together"))
    if pair is not None:
        pair.close()
    t1, tm = statistics.median(one), statistics.median(many)
    s = len(meshes)
    ideal = (M + s - 1) / (M * s)
    print(f"{s} stages x {LAYERS // s} Linear({WIDTH}, {WIDTH}) layers, batch {BATCH}, "
          f"median of {RUNS} alternate timings of one forward pass + sync")
    for label, t, runs in ((" 1 micro-batch ", t1, one), (f"{M} micro-batches", tm, many)):
        print(f"  {label}: {t * 1e3:8.1f} ms  (runs: {', '.join(f'{r * 1e3:.0f}' for r in runs)})")
    print(f"  ratio {tm / t1:.2f}x (goal <= 0.65x, ideal (m+s-1)/(m*s) = {ideal:.2f}x)")
    if alone:
        ta, tt = statistics.median(alone), statistics.median(together)
        print(f"  the machine, same rounds: plain torch, both stages in 1 process "
              f"{ta * 1e3:.1f} ms, one stage in each of 2 processes at once {tt * 1e3:.1f} ms: "
              f"{tt / ta:.2f}x (two free cores: 0.50x)")
    with profiler.trace() as prof_one:
        run(stages, x, 1).sum().item()
    with profiler.trace(TRACE) as prof:
        run(stages, x, M).sum().item()
    events = prof.events
    threads = sorted({(e["args"]["host"], e["args"]["torch_threads"]) for e in events
                      if e["ph"] == "M" and e["name"] == "process_name" and "host" in e["args"]})
    devices = [set(m.devices) for m in meshes]
    busy = [busy_intervals(events, d) for d in devices]
    total = [sum(b - a for a, b in intervals) for intervals in busy]
    alone = [sum(b - a for a, b in busy_intervals(prof_one.events, d)) for d in devices]
    both = overlap(busy[0], busy[1])
    span0 = busy[0][-1][1] - busy[0][0][0]
    print(f"  trace {TRACE}: {len(prof.kernels())} kernels; torch threads per host "
          f"{dict(threads)}")
    print(f"  stage 1 computes {total[1] / 1e3:.1f} ms, of which {both / 1e3:.1f} ms "
          f"({both / total[1]:.0%}) while stage 0 computes; stage 0 is busy "
          f"{total[0] / span0:.0%} of its span")
    print(f"  compute per stage, 1 micro-batch: {' / '.join(f'{a / 1e3:.1f}' for a in alone)} ms;"
          f" {M} micro-batches: {' / '.join(f'{a / 1e3:.1f}' for a in total)} ms (running at "
          f"once, the stages take {sum(total) / sum(alone):.2f}x as long: the cores they share)")
    if "--check" in sys.argv and tm / t1 > 0.65:
        sys.exit(1)


if __name__ == "__main__":
    main()
