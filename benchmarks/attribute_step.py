"""Where a 1-device training step's time goes, kernel by kernel, against torch's on the same
step: dtorch's profiler (each device's kernels, named by op) beside ``torch.profiler`` on HF's
eager step (aten ops), both grouped by what the op computes.

    python benchmarks/attribute_step.py [steps=3]

The Llama of ``bench_train.py``, one device whose host gets every core (``DTORCH_CPU_HOSTS=1``,
as eager torch has them). After a warm-up, ``steps`` traced steps of each; printed per group:
the milliseconds a step spends in it on each side, and the ratio. Groups: matmuls (``linear``,
``matmul``, ``mm``/``addmm``/``bmm`` and their backwards), attention, norms, elementwise,
softmax and loss, the optimizer, and the rest. dtorch's chained kernels (``a+b+c``) and
replayed windows are split by name where the trace names them, else counted whole under
their first op; the wall time of the step is printed too, so the kernels' sum against it
shows what is not kernel time (the host's Python between kernels, waits).
"""

from __future__ import annotations

import collections
import os
import statistics
import sys
import time

os.environ.setdefault("DTORCH_CPU_HOSTS", "1")

import torch  # noqa: E402

from bench_train import CONFIG, data, hf_model  # noqa: E402

GROUPS = (  # (group, name fragments), first match wins
    ("attention", ("attention", "sdpa", "scaled_dot", "flash")),
    ("matmul", ("linear", "matmul", "addmm", "mm", "bmm", "baddbmm")),
    ("norm", ("rms_norm", "layer_norm", "rsqrt", "pow", "mean")),
    ("softmax/loss", ("softmax", "cross_entropy", "nll", "log_softmax")),
    ("optimizer", ("adam", "foreach", "lerp", "addcmul", "addcdiv", "sqrt")),
    ("embedding", ("embedding",)),
    ("elementwise", ("mul", "add", "silu", "neg", "cat", "sub", "div", "exp", "sigmoid")),
)


def group_of(name: str) -> str:
    low = name.lower()
    for group, fragments in GROUPS:
        if any(f in low for f in fragments):
            return group
    return "other"


def dtorch_profile(steps: int) -> tuple:
    import dtorch
    from dtorch.models.llama import LlamaForCausalLM

    hf = hf_model()
    mesh = dtorch.DeviceMesh("cpu", [0])
    model = LlamaForCausalLM(hf.config, device_mesh=mesh).train()
    model.load_state_dict(hf.state_dict())
    opt = dtorch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(k):
        ids, labels = data(k)
        logits = model(ids)
        loss = dtorch.nn.functional.cross_entropy(
            logits.flatten(0, 1), dtorch.from_torch(labels, device_mesh=mesh))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    for k in range(2):
        step(k)
    totals, walls, others = collections.Counter(), [], collections.Counter()
    with dtorch.profiler.profile() as prof:
        for k in range(steps):
            t0 = time.perf_counter()
            step(k)
            walls.append(time.perf_counter() - t0)
    for e in prof.kernels():
        if e["pid"] != 0:
            continue
        parts = e["name"].split("+")
        for part in parts:  # a chain's time, shared evenly among its kernels
            ms = e["dur"] / 1e3 / len(parts) / steps
            totals[group_of(part)] += ms
            if group_of(part) == "other":
                others[part] += ms
    dtorch.shutdown()
    return totals, statistics.median(walls) * 1e3, others


def torch_profile(steps: int) -> tuple:
    from torch.profiler import ProfilerActivity, profile

    model = hf_model().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(k):
        ids, labels = data(k)
        loss = torch.nn.functional.cross_entropy(model(ids).logits.flatten(0, 1), labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    for k in range(2):
        step(k)
    walls = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for k in range(steps):
            t0 = time.perf_counter()
            step(k)
            walls.append(time.perf_counter() - t0)
    totals, others = collections.Counter(), collections.Counter()
    for e in prof.key_averages():
        # self time: an op's own, not its children's (aten ops nest)
        ms = e.self_cpu_time_total / 1e3 / steps
        totals[group_of(e.key)] += ms
        if group_of(e.key) == "other":
            others[e.key] += ms
    return totals, statistics.median(walls) * 1e3, others


def main(steps: int) -> None:
    mine, my_wall, my_others = dtorch_profile(steps)
    theirs, their_wall, their_others = torch_profile(steps)
    print(f"Llama {CONFIG['num_hidden_layers']} layers, hidden {CONFIG['hidden_size']}, one "
          f"device, {torch.get_num_threads()} torch threads; ms a step, {steps} traced steps")
    print(f"{'group':14} {'dtorch':>9} {'torch':>9} {'ratio':>7}")
    for group in [g for g, _ in GROUPS] + ["other"]:
        a, b = mine.get(group, 0.0), theirs.get(group, 0.0)
        print(f"{group:14} {a:9.1f} {b:9.1f} {a / b if b else float('nan'):7.2f}")
    a, b = sum(mine.values()), sum(theirs.values())
    print(f"{'kernels':14} {a:9.1f} {b:9.1f} {a / b:7.2f}")
    print(f"{'step (wall)':14} {my_wall:9.1f} {their_wall:9.1f} {my_wall / their_wall:7.2f}")
    for side, others in (("dtorch", my_others), ("torch", their_others)):
        print(f"{side}'s largest 'other': " + ", ".join(
            f"{name} {ms:.1f}" for name, ms in others.most_common(5)))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
