"""The CPU a training step costs the client, the controller and the hosts, per step: the
optimizer's update calls one per parameter (``foreach=False``) against one per group and mesh
(the default), on the small Llama of ``bench_train.py`` (forward, backward, AdamW).

    python benchmarks/bench_step_cpu.py [rounds=5] [mesh=2]

Each line: CPU ms per step by process (``proccpu.CpuMeter``), then the ratio of the client's
and of the controller's between the two. Goal (issue 27): the client's and the controller's
CPU per step fall by >= 5x in all (the update calls are one part; a replayed step the rest).
Run against another checkout (``PYTHONPATH=/path/to/it``) to compare with it.
"""

from __future__ import annotations

import sys

from bench_train import data, hf_model
from proccpu import CpuMeter


def cpu_per_step(devices: int, rounds: int, **options) -> dict:
    """CPU seconds per step by role, over ``rounds`` steps after two warm-ups."""
    import dtorch
    from dtorch.models.llama import LlamaForCausalLM

    dtorch.shutdown()
    dtorch.config.cpu_hosts = devices
    hf = hf_model()
    mesh = dtorch.init_device_mesh("cpu", (devices,), mesh_dim_names=["dp"])
    model = LlamaForCausalLM(hf.config, device_mesh=mesh)
    model.load_state_dict(hf.state_dict())
    opt = dtorch.optim.AdamW(model.parameters(), lr=1e-3, **options)

    def step(k):
        ids, labels = data(k)
        inputs = model.place_tokens(ids)
        target = dtorch.from_torch(labels, device_mesh=inputs.device_mesh,
                                   placements=inputs.placements)
        loss = dtorch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    step(-2), step(-1)
    meter = CpuMeter()
    meter.start()
    for k in range(rounds):
        step(k)
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
    return per_step


def replayed(prof) -> tuple:
    """``(records, windows replayed)`` of a profiled step's batches, from the controller's
    spans (``passes: N records -> M[, K windows replayed]``)."""
    from dtorch.profiler import CONTROLLER_PID

    records = windows = 0
    for e in prof.events:
        name = e.get("name", "")
        if e.get("pid") == CONTROLLER_PID and name.startswith("passes: "):
            records += int(name.split()[1])
            if "windows replayed" in name:
                windows += int(name.split(", ")[1].split()[0])
    return records, windows


def line(label: str, shares: dict) -> str:
    parts = ", ".join(f"{k} {shares.get(k, 0.0) * 1e3:7.1f}" for k in
                      ("client", "controller", "hosts"))
    records, windows = shares["replay"]
    return (f"  {label:28s} {parts}  (ms per step; {records} records a step, "
            f"{windows} windows replayed)")


def main(rounds: int, devices: int) -> None:
    print(f"CPU per training step, dp{devices} (small Llama, AdamW), {rounds} steps:")
    before = cpu_per_step(devices, rounds, foreach=False)
    after = cpu_per_step(devices, rounds)
    print(line("one update per parameter", before))
    print(line("one update per group", after))
    for who in ("client", "controller"):
        ratio = before.get(who, 0.0) / max(after.get(who, 0.0), 1e-9)
        print(f"  {who} CPU per step falls {ratio:5.2f}x  (goal >= 5x with replayed steps)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5, int(sys.argv[2]) if len(sys.argv) > 2
         else 2)
