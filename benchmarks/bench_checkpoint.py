"""Loading a safetensors checkpoint: time and peak memory per process.

    python benchmarks/bench_checkpoint.py [size_mb=1024] [runs=3]

Writes a checkpoint of about ``size_mb`` MB (float32 weights of at most 32 MB each, half laid out
Shard(0) and half Shard(1) on a TP mesh, as column- and row-parallel layers are) and loads it:
1. with ``safetensors.torch.load_file`` plus ``torch.nn.Module.load_state_dict`` (the baseline);
2. with ``dtorch.checkpoint.load_checkpoint`` on 1, 2 and 4 CPU devices, one host process each.
Each case runs in a fresh interpreter (its own runtime), so peaks are its own; all run in this
invocation, from the same warm page cache. Reported per case: the median load time over
``runs`` loads (after one warm-up) and its throughput, and each process's peak resident memory
above what it held before the model existed (``VmHWM`` after resetting it through
``/proc/<pid>/clear_refs``).

Goals (asserted; the script exits non-zero when one fails):
- 1 device: at least 0.8x the baseline's throughput;
- per host: a peak under N/TP plus the largest tensor (N: the checkpoint's bytes), so it falls
  as 1/TP;
- the client: under 50 MB added.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

from procmem import children, reset_peak, status_kb

MB = 1 << 20
DIRECTORY = "/tmp/dtorch_bench_checkpoint"
PATH = os.path.join(DIRECTORY, "model.safetensors")
LARGEST = 32 * MB


def shapes(size_mb: int) -> dict:
    """Names and shapes of about ``size_mb`` MB of float32 weights, each at most 32 MB."""
    total = size_mb * MB
    per = min(LARGEST, max(total // 8, 4096))
    cols = 2048
    rows = max(1, per // (cols * 4))
    out = {f"layers.{i}.weight": (rows, cols) for i in range(max(1, total // (rows * cols * 4)))}
    out.update({f"layers.{i}.bias": (cols,) for i in range(len(out))})
    return out


def write_checkpoint(size_mb: int) -> int:
    import torch
    from safetensors.torch import save_file

    os.makedirs(DIRECTORY, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    tensors = {k: torch.randn(s, generator=g) for k, s in shapes(size_mb).items()}
    save_file(tensors, PATH)
    return sum(t.numel() * 4 for t in tensors.values())


# -- measuring a process ----------------------------------------------------------------------


# -- the cases, each in a fresh interpreter ---------------------------------------------------


def timed(load, runs: int) -> float:
    load()  # warm-up: the runtime's caches, the page cache
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        load()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def case_baseline(size_mb: int, runs: int) -> dict:
    import torch
    from safetensors.torch import load_file

    base = status_kb("self", "VmRSS")
    reset_peak("self")
    module = torch.nn.Module()
    for key, shape in shapes(size_mb).items():
        module.register_parameter(key.replace(".", "_"), torch.nn.Parameter(torch.zeros(shape)))

    def load():
        state = load_file(PATH)
        module.load_state_dict({k.replace(".", "_"): v for k, v in state.items()})

    seconds = timed(load, runs)
    return {"seconds": seconds, "client_mb": (status_kb("self", "VmHWM") - base) / 1024}


def case_dtorch(size_mb: int, runs: int, n: int) -> dict:
    import dtorch
    from dtorch.checkpoint import load_checkpoint
    from dtorch.client import session

    mesh = dtorch.DeviceMesh("cpu", list(range(n)))
    dtorch.ones(n, device_mesh=mesh, placements=[dtorch.Shard(0)]).to_torch()  # hosts up
    hosts = children(session._current.controller.pid)
    base = {pid: status_kb(pid, "VmRSS") for pid in hosts}
    for pid in hosts:
        reset_peak(pid)
    module = dtorch.nn.Module()
    for i, (key, shape) in enumerate(shapes(size_mb).items()):
        # column- and row-parallel in turn (a bias follows its weight's rows)
        dim = 0 if len(shape) == 1 or i % 2 == 0 else 1
        p = dtorch.zeros(shape, device_mesh=mesh, placements=[dtorch.Shard(dim)])
        module.register_parameter(key.replace(".", "_"), dtorch.nn.Parameter(p))
    dtorch.sync()
    client_base = status_kb("self", "VmRSS")
    reset_peak("self")
    key_map = lambda k: k.replace(".", "_")  # noqa: E731
    seconds = timed(lambda: load_checkpoint(module, PATH, key_map=key_map), runs)
    peaks = [(status_kb(pid, "VmHWM") - base[pid]) / 1024 for pid in hosts]
    return {"seconds": seconds, "host_mb": peaks,
            "client_mb": (status_kb("self", "VmHWM") - client_base) / 1024}


def run_case(args: list, env=None) -> dict:
    out = subprocess.run([sys.executable, __file__, "--case", *map(str, args)],
                         capture_output=True, text=True, env={**os.environ, **(env or {})},
                         timeout=1800)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"case {args} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")


def main(size_mb: int, runs: int) -> int:
    nbytes = write_checkpoint(size_mb)
    n_mb = nbytes / MB
    largest_mb = max(4 * __import__("math").prod(s) for s in shapes(size_mb).values()) / MB
    print(f"checkpoint: {n_mb:.0f} MB in {len(shapes(size_mb))} tensors (largest "
          f"{largest_mb:.0f} MB), {runs} runs each, median")
    base = run_case(["baseline", size_mb, runs])
    rate = n_mb / base["seconds"]
    print(f"{'load_file + load_state_dict':32s} {base['seconds']:7.3f} s {rate:8.0f} MB/s   "
          f"client peak +{base['client_mb']:.0f} MB")
    failures = []
    for n in (1, 2, 4):
        r = run_case(["dtorch", size_mb, runs, n], env={"DTORCH_CPU_HOSTS": str(n)})
        ratio = base["seconds"] / r["seconds"]
        hosts = " ".join(f"{m:.0f}" for m in r["host_mb"])
        bound = n_mb / n + largest_mb
        print(f"{f'dtorch load_checkpoint, {n} dev':32s} {r['seconds']:7.3f} s "
              f"{n_mb / r['seconds']:8.0f} MB/s ({ratio:.2f}x)   host peaks +[{hosts}] MB "
              f"(bound {bound:.0f})   client +{r['client_mb']:.0f} MB")
        if n == 1 and ratio < 0.8:
            failures.append(f"1 device: {ratio:.2f}x the baseline's throughput (goal 0.8x)")
        if max(r["host_mb"]) >= bound:
            failures.append(f"{n} devices: a host peaked at +{max(r['host_mb']):.0f} MB "
                            f"(bound {bound:.0f} MB)")
        if r["client_mb"] >= 50:
            failures.append(f"{n} devices: the client grew by {r['client_mb']:.0f} MB")
    for f in failures:
        print("FAILED:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--case"]:
        kind, size, runs, *rest = sys.argv[2:]
        if kind == "baseline":
            result = case_baseline(int(size), int(runs))
        else:
            result = case_dtorch(int(size), int(runs), int(rest[0]))
        print("RESULT " + json.dumps(result), flush=True)
        sys.exit(0)
    args = [int(a) for a in sys.argv[1:]]
    sys.exit(main(*(args + [1024, 3][len(args):])))
