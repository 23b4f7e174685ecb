"""Training while a checkpoint is written: ``save_checkpoint(..., async_=True)`` against steps
with no save, and against a blocking save.

    python benchmarks/bench_async_checkpoint.py [layers=8] [width=2048] [steps=12]

A stack of ``layers`` ``Linear(width, width)`` + ReLU on a 2-device data-parallel mesh (2 host
processes), AdamW; the checkpoint is the model and both AdamW moments (3 x layers x width^2 x
4 bytes). Measured in this one run, in turn:

1. ``steps`` training steps with no save: the median step;
2. an async save issued, then steps until its future is done: the median step while it ran,
   how many steps it spanned and how long the save took;
3. a blocking save: the time the program waits for it.

Goal: a step during an async save at most 1.1x a step without.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time

import torch

import dtorch


def main(layers: int, width: int, steps: int) -> None:
    mesh = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["dp"])
    model = dtorch.nn.Sequential(*[m for _ in range(layers) for m in (
        dtorch.nn.Linear(width, width, device_mesh=mesh), dtorch.nn.ReLU())]).train()
    opt = dtorch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    x = dtorch.from_torch(torch.randn(256, width, generator=g), mesh, [dtorch.Shard(0)])

    def step() -> float:
        t0 = time.perf_counter()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss.item()
        return time.perf_counter() - t0

    def state() -> dict:
        out = dict(model.state_dict())
        for name, p in model.named_parameters():
            for moment in ("exp_avg", "exp_avg_sq"):
                out[f"{name}.{moment}"] = opt.state[p][moment]
        return out

    for _ in range(3):
        step()  # warm-up: the moments exist, the host's blocks are kept
    directory = tempfile.mkdtemp(prefix="dtorch-bench-async-")
    try:
        plain = [step() for _ in range(steps)]
        t0 = time.perf_counter()
        future = dtorch.save_checkpoint(state(), directory, async_=True)
        issued = time.perf_counter() - t0
        during = []
        while not future.done() or not during:
            during.append(step())
        future.result()
        saved = time.perf_counter() - t0
        t0 = time.perf_counter()
        dtorch.save_checkpoint(state(), directory)
        blocking = time.perf_counter() - t0
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    mb = 3 * layers * width * width * 4 / 2 ** 20
    base, busy = statistics.median(plain), statistics.median(during)
    print(f"{layers} x Linear({width}) on dp2, AdamW; a checkpoint of {mb:.0f} MiB")
    print(f"step without a save (median of {steps}):  {base * 1e3:8.1f} ms")
    print(f"step during an async save (median of {len(during)}): {busy * 1e3:8.1f} ms  "
          f"{busy / base:.2f}x  (goal <= 1.1x)")
    print(f"async save: issued in {issued * 1e3:.1f} ms, done after {saved:.2f} s")
    print(f"blocking save: the program waits {blocking:.2f} s "
          f"({blocking / base:.1f} steps' time)")


if __name__ == "__main__":
    given = [int(a) for a in sys.argv[1:4]]
    main(*(given + [8, 2048, 12][len(given):]))
