"""Activation checkpointing on the Llama of ``bench_train.py``: step time and the host's peak
memory, with and without ``gradient_checkpointing_enable()``, and against torch's own.

    python benchmarks/bench_activation_checkpoint.py [rounds=5] [batch=8]

A 1-device mesh whose host gets every core (``DTORCH_CPU_HOSTS=1``, as eager torch has them).
Each step (forward, backward, AdamW) of the two dtorch models alternates, after a warm-up;
reported: the median step time over ``rounds``, and, in a fresh process for each case, the
computing process's peak resident memory over 3 steps above what it held with the model built
(``VmHWM``: the activations a step keeps, and what its host keeps for reuse). The same for HF's
model in torch eager, with and without ``model.gradient_checkpointing_enable()``
(``torch.utils.checkpoint``), for the ratios torch itself gets. Goal: with checkpointing, the
step at most 1.35x the time without, and less peak memory.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("DTORCH_CPU_HOSTS", "1")

import torch  # noqa: E402

from bench_train import BATCH, CONFIG, SEQ, hf_model  # noqa: E402
from procmem import children, reset_peak, status_kb  # noqa: E402


def build(side: str, checkpointed: bool, batch: int):
    """``(step, pid)``: a training step of ``side``'s Llama (``step()`` returns the loss), and
    the process that computes it."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CONFIG["vocab_size"], (batch, SEQ), generator=g)
    labels = torch.randint(0, CONFIG["vocab_size"], (batch * SEQ,), generator=g)
    ref = hf_model().train()
    if side == "torch":
        if checkpointed:
            ref.gradient_checkpointing_enable()
        opt = torch.optim.AdamW(ref.parameters(), lr=1e-4)

        def torch_step():
            loss = torch.nn.functional.cross_entropy(ref(ids).logits.flatten(0, 1), labels)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.item()

        return torch_step, os.getpid()
    import transformers

    import dtorch
    from dtorch.client import session
    from dtorch.models.llama import LlamaForCausalLM

    mesh = dtorch.DeviceMesh("cpu", [0])
    model = LlamaForCausalLM(transformers.LlamaConfig(**CONFIG), device_mesh=mesh).train()
    model.load_state_dict(ref.state_dict())
    if checkpointed:
        model.gradient_checkpointing_enable()
    d_opt = dtorch.optim.AdamW(model.parameters(), lr=1e-4)
    d_labels = dtorch.from_torch(labels, device_mesh=mesh)
    F = dtorch.nn.functional

    def dtorch_step():
        loss = F.cross_entropy(model(ids).flatten(0, 1), d_labels)
        loss.backward()
        d_opt.step()
        d_opt.zero_grad()
        return loss.item()

    dtorch.sync()
    return dtorch_step, children(session._current.controller.pid)[0]


def peak_case(side: str, checkpointed: bool, batch: int) -> float:
    """In a fresh process: the computing process's peak resident memory over 3 steps above
    what it held with the model built (MiB)."""
    step, pid = build(side, checkpointed, batch)
    before = status_kb(pid, "VmRSS")
    reset_peak(pid)
    for _ in range(3):
        step()
    return (status_kb(pid, "VmHWM") - before) / 1024


def main(rounds: int, batch: int) -> None:
    steps = {(side, c): build(side, c, batch)[0] for side in ("dtorch", "torch")
             for c in (False, True)}
    times = {key: [] for key in steps}
    losses = {}
    for k in range(rounds + 1):  # the sides and modes alternate; the first round warms up
        for key, step in steps.items():
            t0 = time.perf_counter()
            losses[key] = step()
            if k:
                times[key].append(time.perf_counter() - t0)
    for side in ("dtorch", "torch"):
        plain, again = losses[(side, False)], losses[(side, True)]
        assert abs(plain - again) <= 1e-4 * abs(plain), (side, plain, again)
    peaks = {}
    for side in ("dtorch", "torch"):
        for c in (False, True):
            out = subprocess.run([sys.executable, __file__, "--case", side, str(int(c)),
                                  str(batch)], capture_output=True, text=True, check=True)
            peaks[(side, c)] = float(out.stdout.split("RESULT ")[-1])
    print(f"Llama {CONFIG['num_hidden_layers']} layers, hidden {CONFIG['hidden_size']}, batch "
          f"{batch} x {SEQ}; step times: medians of {rounds}, alternating; peaks: 3 steps in a "
          f"fresh process")
    print(f"{'':8} {'plain ms':>9} {'ckpt ms':>9} {'time x':>7} {'plain MiB':>10} "
          f"{'ckpt MiB':>9} {'peak x':>7}")
    for side in ("dtorch", "torch"):
        t0, t1 = (statistics.median(times[(side, c)]) for c in (False, True))
        m0, m1 = peaks[(side, False)], peaks[(side, True)]
        print(f"{side:8} {t0 * 1e3:9.1f} {t1 * 1e3:9.1f} {t1 / t0:7.2f} {m0:10.1f} {m1:9.1f} "
              f"{m1 / m0:7.2f}")
    t0, t1 = (statistics.median(times[("dtorch", c)]) for c in (False, True))
    print(f"goals: step with checkpointing <= 1.35x: {t1 / t0 <= 1.35}; less peak memory: "
          f"{peaks[('dtorch', True)] < peaks[('dtorch', False)]}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--case"]:
        side, checkpointed, batch = sys.argv[2], bool(int(sys.argv[3])), int(sys.argv[4])
        print(f"RESULT {peak_case(side, checkpointed, batch)}", flush=True)
    else:
        args = [int(a) for a in sys.argv[1:3]]
        main(*(args + [5, BATCH * 2][len(args):]))
