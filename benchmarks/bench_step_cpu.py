"""The CPU a training step costs the client, the controller and the hosts, per step, on the
small Llama of ``bench_train.py`` (forward, backward, AdamW, a learning-rate scheduler): the
step run as Python each time, against the same step under ``dtorch.replayed_step`` (its records
sent again with fresh ids once two calls in a row issued the same ones), and its wall time.

    python benchmarks/bench_step_cpu.py [rounds=10] [mesh=2]

Each line: CPU ms per step by process (``proccpu.CpuMeter``: all of each process's threads),
the step's median wall time, the records a step's batches bring the controller and the windows
it replayed; then the ratios. Goal (issue 27): the client's and the controller's CPU per step
fall by >= 5x. Run against another checkout (``PYTHONPATH=/path/to/it``) to compare with it.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from bench_train import llama_step
from proccpu import CpuMeter


def cpu_per_step(devices: int, rounds: int, replayed_step: bool) -> dict:
    """CPU seconds per step by role, over ``rounds`` steps after warm-ups (six: a replayed
    step learns for four calls), and the median step's wall seconds (``wall``)."""
    import dtorch

    dtorch.shutdown()
    dtorch.config.cpu_hosts = devices
    step, train = llama_step((devices,), replayed=replayed_step, schedule=True)
    meter, walls = CpuMeter(), []
    meter.start()
    for k in range(rounds):
        t = time.perf_counter()
        step(k)
        walls.append(time.perf_counter() - t)
    shares = meter.stop()
    with dtorch.profiler.profile() as prof:  # one more step: what its batches replayed
        step(rounds)
        dtorch.sync()
    dtorch.shutdown()
    per_step: dict = {}
    for key, seconds in shares.items():
        who = key.split(":")[0]
        who = "hosts" if who.startswith("host") else who
        per_step[who] = per_step.get(who, 0.0) + seconds / rounds
    per_step["replay"] = replayed(prof)
    per_step["wall"] = statistics.median(walls)
    if replayed_step:
        assert train.replays >= rounds, "the step did not replay"
    return per_step


def replayed(prof) -> tuple:
    """``(records, windows replayed, steps lowered from their record)`` of a profiled step's
    batches, from the controller's spans (``passes: N records -> M[, K windows replayed][, a
    step lowered from its record]``)."""
    from dtorch.profiler import CONTROLLER_PID

    records = windows = steps = 0
    for e in prof.events:
        name = e.get("name", "")
        if e.get("pid") == CONTROLLER_PID and name.startswith("passes: "):
            records += int(name.split()[1])
            if "windows replayed" in name:
                windows += int(name.split(", ")[1].split()[0])
            steps += "a step lowered from its record" in name
    return records, windows, steps


def line(label: str, shares: dict) -> str:
    parts = ", ".join(f"{k} {shares.get(k, 0.0) * 1e3:7.1f}" for k in
                      ("client", "controller", "hosts"))
    records, windows, steps = shares["replay"]
    return (f"  {label:16s} {parts}  (ms per step; step {shares['wall'] * 1e3:6.1f} ms; "
            f"{records} records a step, {windows} windows replayed"
            + (", lowered from its Step record" if steps else "") + ")")


def main(rounds: int, devices: int) -> None:
    print(f"CPU per training step, dp{devices} (small Llama, AdamW), {rounds} steps, "
          f"{torch.get_num_threads()} torch threads:")
    before = cpu_per_step(devices, rounds, replayed_step=False)
    after = cpu_per_step(devices, rounds, replayed_step=True)
    print(line("Python each step", before))
    print(line("replayed_step", after))
    for who in ("client", "controller"):
        ratio = before.get(who, 0.0) / max(after.get(who, 0.0), 1e-9)
        print(f"  {who} CPU per step falls {ratio:5.2f}x  (goal >= 5x)")
    print(f"  step time {after['wall'] / before['wall']:5.2f}x")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10, int(sys.argv[2]) if len(sys.argv) > 2
         else 2)
