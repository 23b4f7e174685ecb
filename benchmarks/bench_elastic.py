"""Elastic training's costs: the steady-state cost of its snapshots, the time to recover from a
killed host, and the steps a loss costs.

    DTORCH_CPU_HOSTS=4 python benchmarks/bench_elastic.py [steps=20] [hidden=256] [zero=0]

A Llama (``hidden``, 2 layers, vocabulary 512, sequences of 64, batch 16) on a dp4 CPU mesh,
AdamW (ZeRO ``zero``), in this one run:

1. ``steps`` steps in a plain loop (the same step function, its loss read each step as
   ``Elastic.step`` reads it): the median step;
2. the same under ``dtorch.elastic.Elastic`` with a snapshot every step (the redundancy that
   makes a loss cost one step), then every 2 and every 10 steps: median and mean step, and
   their ratios to (1) (a snapshot every k steps costs one step in k, which the mean shows);
3. a run that loses a host (SIGKILL at a random point of a step): the time from the loss to
   the run going again (``ElasticEvent.seconds``: the runtime started anew on fewer devices,
   the state built and loaded from the snapshot, the steps since it replayed) and the steps
   re-run.

Goal (the issue): a step with the redundancy at most 1.1x one without; recovery within 10 s.
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import sys
import threading
import time

import torch
import transformers

import dtorch
from dtorch.models.llama import LlamaForCausalLM

F = dtorch.nn.functional
VOCAB, SEQ, BATCH = 512, 64, 16


def build(mesh, hidden: int, zero: int) -> dict:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    dtorch.manual_seed(0)
    model = LlamaForCausalLM(config, device_mesh=mesh).train()
    return {"model": model, "optim": dtorch.optim.AdamW(model.parameters(), lr=1e-3,
                                                        zero_stage=zero)}


def train_step(state, seq):
    logits = state["model"](seq[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), seq[:, 1:].flatten())
    loss.backward()
    state["optim"].step()
    state["optim"].zero_grad()
    return loss


def host_pid(index: int) -> int:
    from dtorch.client import session

    s = session.running()
    for pid in os.listdir(f"/proc/{s.controller.pid}/task"):
        with open(f"/proc/{s.controller.pid}/task/{pid}/children") as f:
            for child in f.read().split():
                with open(f"/proc/{child}/cmdline", "rb") as c:
                    argv = c.read().split(b"\0")
                if b"--index" in argv and int(argv[argv.index(b"--index") + 1]) == index:
                    return int(child)
    raise LookupError(index)


def main(steps: int, hidden: int, zero: int) -> None:
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(steps + 3)]
    print(f"dp4, Llama hidden {hidden}, ZeRO-{zero}, {steps} steps, "
          f"{os.environ.get('DTORCH_CPU_HOSTS', 'default')} host processes, "
          f"torch threads per host: {max(1, (os.cpu_count() or 1) // 4)}")

    mesh = dtorch.init_device_mesh("cpu", (4,), mesh_dim_names=["dp"])
    state = build(mesh, hidden, zero)
    plain = []
    for k, batch in enumerate(batches):
        t0 = time.perf_counter()
        train_step(state, dtorch.from_torch(batch, mesh, [dtorch.Shard(0)])).item()
        if k >= 3:  # warm-up: the moments exist, the rules are cached
            plain.append(time.perf_counter() - t0)
    del state
    dtorch.shutdown()
    base, base_mean = statistics.median(plain), statistics.mean(plain)
    print(f"plain loop           median step {base * 1e3:7.1f} ms; mean {base_mean * 1e3:7.1f} ms")

    for every in (1, 2, 10):
        with dtorch.elastic.Elastic(lambda m: build(m, hidden, zero), (4,), ["dp"],
                                    snapshot_every=every) as run:
            times = []
            for k, batch in enumerate(batches):
                t0 = time.perf_counter()
                run.step(train_step, batch)
                if k >= 3:
                    times.append(time.perf_counter() - t0)
        dtorch.shutdown()
        # a snapshot every k steps costs one step in k: its mean shows it, a median may not
        median, mean = statistics.median(times), statistics.mean(times)
        print(f"snapshot every {every:<2d}    median step {median * 1e3:7.1f} ms  "
              f"{median / base:5.2f}x plain; mean {mean * 1e3:7.1f} ms  {mean / base_mean:5.2f}x")

    rng = random.Random(0)
    with dtorch.elastic.Elastic(lambda m: build(m, hidden, zero), (4,), ["dp"]) as run:
        for k, batch in enumerate(batches):
            if k == 5:
                timer = threading.Timer(rng.random() * base,
                                        lambda: os.kill(host_pid(2), signal.SIGKILL))
                timer.start()
            run.step(train_step, batch)
        timer.join()
        recovered = [e for e in run.events if e.kind == "recovered"]
    dtorch.shutdown()
    for e in recovered:
        print(f"host of device 2 killed in step {e.step + 1}: recovered in {e.seconds:.2f} s "
              f"on dp{e.mesh_shape[0]}; restored step {e.restored}, re-ran "
              f"{e.step - e.restored + 1} step(s) ({e.replayed} replayed before the lost one)")


if __name__ == "__main__":
    args = dict(a.split("=") for a in sys.argv[1:])
    main(int(args.get("steps", 20)), int(args.get("hidden", 256)), int(args.get("zero", 0)))
