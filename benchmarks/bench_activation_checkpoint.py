"""Activation checkpointing on the Llama of ``bench_train.py``: step time and the host's peak
memory, without checkpointing, with it (``gradient_checkpointing_enable()``) and selective
(torchtitan's policy: keep the products' outputs, ``create_selective_checkpoint_contexts``
with ``aten.mm``), and against torch's own.

    python benchmarks/bench_activation_checkpoint.py [rounds=5] [batch=8]

A 1-device mesh whose host gets every core (``DTORCH_CPU_HOSTS=1``, as eager torch has them).
Each step (forward, backward, AdamW) of the two dtorch models alternates, after a warm-up;
reported: the median step time over ``rounds``, and, in a fresh process for each case, the
computing process's peak resident memory over 3 steps above what it held with the model built
(``VmHWM``: the activations a step keeps, and what its host keeps for reuse). The same for HF's
model in torch eager, in the same three modes (``torch.utils.checkpoint``, non-reentrant for
the selective one, as torch requires), for the ratios torch itself gets. Goal: with
checkpointing, the step at most 1.35x the time without, and less peak memory; selective
between the two.
"""

from __future__ import annotations

import functools
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("DTORCH_CPU_HOSTS", "1")

import torch  # noqa: E402

from bench_train import BATCH, CONFIG, SEQ, hf_model  # noqa: E402
from procmem import children, reset_peak, status_kb  # noqa: E402


MODES = ("plain", "full", "selective")


def checkpointing(model, mode: str) -> None:
    """HF's switch on ``model`` (dtorch's or HF's) for ``mode``."""
    if mode == "full":
        model.gradient_checkpointing_enable()
    elif mode == "selective":
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        keep = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": keep})


def build(side: str, mode: str, batch: int):
    """``(step, pid)``: a training step of ``side``'s Llama (``step()`` returns the loss), and
    the process that computes it."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CONFIG["vocab_size"], (batch, SEQ), generator=g)
    labels = torch.randint(0, CONFIG["vocab_size"], (batch * SEQ,), generator=g)
    ref = hf_model().train()
    if side == "torch":
        checkpointing(ref, mode)
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
    checkpointing(model, mode)
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


def peak_case(side: str, mode: str, batch: int) -> float:
    """In a fresh process: the computing process's peak resident memory over 3 steps above
    what it held with the model built (MiB)."""
    step, pid = build(side, mode, batch)
    before = status_kb(pid, "VmRSS")
    reset_peak(pid)
    for _ in range(3):
        step()
    return (status_kb(pid, "VmHWM") - before) / 1024


def main(rounds: int, batch: int) -> None:
    steps = {(side, m): build(side, m, batch)[0] for side in ("dtorch", "torch") for m in MODES}
    times = {key: [] for key in steps}
    losses = {}
    for k in range(rounds + 1):  # the sides and modes alternate; the first round warms up
        for key, step in steps.items():
            t0 = time.perf_counter()
            losses[key] = step()
            if k:
                times[key].append(time.perf_counter() - t0)
    for side in ("dtorch", "torch"):
        plain = losses[(side, "plain")]
        for mode in MODES[1:]:
            again = losses[(side, mode)]
            assert abs(plain - again) <= 1e-4 * abs(plain), (side, mode, plain, again)
    peaks = {}
    for key in steps:
        out = subprocess.run([sys.executable, __file__, "--case", *key, str(batch)],
                             capture_output=True, text=True, check=True)
        peaks[key] = float(out.stdout.split("RESULT ")[-1])
    print(f"Llama {CONFIG['num_hidden_layers']} layers, hidden {CONFIG['hidden_size']}, batch "
          f"{batch} x {SEQ}; step times: medians of {rounds}, alternating; peaks: 3 steps in a "
          f"fresh process; x: against the same side without checkpointing")
    print(f"{'':8} {'mode':>9} {'step ms':>9} {'time x':>7} {'peak MiB':>9} {'peak x':>7}")
    ratios = {}
    for side in ("dtorch", "torch"):
        t0, m0 = statistics.median(times[(side, "plain")]), peaks[(side, "plain")]
        for mode in MODES:
            t, m = statistics.median(times[(side, mode)]), peaks[(side, mode)]
            ratios[(side, mode)] = t / t0, m / m0
            print(f"{side:8} {mode:>9} {t * 1e3:9.1f} {t / t0:7.2f} {m:9.1f} {m / m0:7.2f}")
    (full_t, full_m), (sel_t, sel_m) = ratios[("dtorch", "full")], ratios[("dtorch", "selective")]
    print(f"goals: step with checkpointing <= 1.35x: {full_t <= 1.35}; less peak memory: "
          f"{full_m < 1}; selective between (faster than full, less peak than none): "
          f"{sel_t < full_t and sel_m < 1}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--case"]:
        side, mode, batch = sys.argv[2], sys.argv[3], int(sys.argv[4])
        print(f"RESULT {peak_case(side, mode, batch)}", flush=True)
    else:
        args = [int(a) for a in sys.argv[1:3]]
        main(*(args + [5, BATCH * 2][len(args):]))
