"""One training step of a small Llama (forward, backward, AdamW) against torch, same weights.

    python benchmarks/bench_train.py [rounds=5]

Measured in this one invocation, medians over ``rounds`` steps after a warm-up:
1. 1-device mesh against HF's model in torch eager, in this process, the two stepping in
   alternation, the step as Python and under ``dtorch.replayed_step``. Goal <= 1.2x (the
   training issue's: 1.1x).
2. a dp2 mesh (2 devices, one host process each) against torch DDP and FSDP2
   (``fully_shard``) on 2 gloo ranks, each rank half the batch. Goal: faster than both. Each
   against its kind: dtorch's data parallelism (ZeRO-0, as Python and replayed) against DDP,
   dtorch's ZeRO-3 (as Python and replayed)
   (``dtorch.nn.fully_shard`` per layer and the root, ``zero_stage=3``) against FSDP2 (the same
   recipe); and, for the record, ZeRO-0 against FSDP2 as well.

Each torch thread count is the same on both sides: one host process per device with
cpu_count / 2 threads against gloo ranks with as many; the 1-device case gives the host every
core, as eager torch has.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

from baseline import run_on_gloo_ranks
from proccpu import CpuMeter

CONFIG = dict(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
              num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256)
BATCH, SEQ = 4, 128


def hf_model():
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))


def data(step: int):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=g)
    return ids, torch.randint(0, CONFIG["vocab_size"], (BATCH * SEQ,), generator=g)


def torch_step(model, opt, ids, labels):
    loss = torch.nn.functional.cross_entropy(model(ids).logits.flatten(0, 1), labels)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def timed(step, rounds: int, meter=None) -> float:
    """The median of ``rounds`` steps after a warm-up; ``meter`` (a ``CpuMeter``) measures the
    CPU of those steps: its shares per step are left in ``meter.per_step``."""
    step(-1)  # warm-up
    times = []
    if meter is not None:
        meter.start()
    for k in range(rounds):
        t0 = time.perf_counter()
        step(k)
        times.append(time.perf_counter() - t0)
    if meter is not None:
        meter.per_step = {k: v / rounds for k, v in meter.stop().items()}
    return statistics.median(times)


def cpu_line(shares: dict, copies: int = 1) -> str:
    """CPU shares per step in ms, and their sum (``copies``: the baseline's ranks alike)."""
    parts = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in sorted(shares.items()) if v >= 5e-4)
    total = sum(shares.values()) * copies * 1e3
    return f"{parts}{f' (x{copies} ranks)' if copies > 1 else ''} = {total:.0f} ms in all"


def llama_step(mesh_shape, zero_stage: int = 0, replayed: bool = False,
               schedule: bool = False):
    """``(step(k), train)``: one training step of the Llama on a ``dp`` mesh of the running
    runtime (``step(k)`` places batch ``k``, trains, reads the loss; ``train`` is the part under
    ``dtorch.replayed_step`` when ``replayed``, learnt in the 6 warm-up steps run here). ``zero_stage=3``
    shards the model first (``fully_shard``); ``schedule``: a LambdaLR changes the learning
    rate every step."""
    import dtorch
    from dtorch.models.llama import LlamaForCausalLM

    hf = hf_model()
    mesh = dtorch.init_device_mesh("cpu", mesh_shape, mesh_dim_names=["dp"])
    model = LlamaForCausalLM(hf.config, device_mesh=mesh)
    model.load_state_dict(hf.state_dict())
    if zero_stage == 3:
        for layer in model.model.layers:
            dtorch.nn.fully_shard(layer)
        dtorch.nn.fully_shard(model)
    opt = dtorch.optim.AdamW(model.parameters(), lr=1e-3, zero_stage=zero_stage)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1 / (1 + k)) if schedule else None

    def train(inputs, target):
        loss = dtorch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    if replayed:
        train = dtorch.replayed_step(train)

    def step(k):
        ids, labels = data(k)
        inputs = model.place_tokens(ids)
        target = dtorch.from_torch(labels, device_mesh=inputs.device_mesh,
                                   placements=inputs.placements)
        loss = train(inputs, target)
        if sched is not None:
            sched.step()
        return loss.item()

    for k in range(6):  # warm-ups, as many either way (a replayed step learns in 4 calls)
        step(k - 8)
    return step, train


def dtorch_step_time(mesh_shape, rounds: int, beside=None, zero_stage: int = 0,
                     meter=None, replayed: bool = False) -> float:
    """One host process per device (each ``cpu_count / devices`` torch threads), in a runtime
    of its own. ``beside(k)``: a step of the baseline, timed in alternation with dtorch's
    (returns both medians). ``zero_stage=3`` shards the model first (``fully_shard``);
    ``meter``: see ``timed``; ``replayed``: the step under ``dtorch.replayed_step``, after the
    calls it learns in."""
    import dtorch

    dtorch.shutdown()
    dtorch.config.cpu_hosts = mesh_shape[0]
    step, _ = llama_step(mesh_shape, zero_stage, replayed)
    if beside is None:
        seconds = timed(step, rounds, meter)
    else:
        step(-1), beside(-1)
        mine, theirs = [], []
        for k in range(rounds):
            for fn, times in ((step, mine), (beside, theirs)):
                t0 = time.perf_counter()
                fn(k)
                times.append(time.perf_counter() - t0)
        seconds = statistics.median(mine), statistics.median(theirs)
    dtorch.shutdown()
    return seconds


def _rank_step(rank, rounds, kind):
    """On one of 2 gloo ranks: DDP or FSDP2 over half the batch each."""
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    model = hf_model()
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    half = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)

    def step(k):
        ids, labels = data(k)
        labels = labels.view(BATCH, SEQ)[half].flatten()
        return torch_step(model, opt, ids[half], labels)

    meter = CpuMeter(program=f"rank {rank}")
    seconds = timed(step, rounds, meter)
    dist.barrier()
    return seconds, meter.per_step


def main(rounds: int) -> None:
    print(f"Llama {CONFIG['num_hidden_layers']} layers, hidden {CONFIG['hidden_size']}, batch "
          f"{BATCH} x seq {SEQ}: one AdamW training step, median of {rounds}")
    hf = hf_model()
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-3)
    one, eager = dtorch_step_time((1,), rounds, lambda k: torch_step(hf, opt, *data(k)))
    print(f"{'1 device: dtorch / torch eager':36s} {one * 1e3:8.1f} ms vs {eager * 1e3:8.1f} ms"
          f"  {one / eager:5.2f}x  (goal <= 1.2x)")
    one, eager = dtorch_step_time((1,), rounds, lambda k: torch_step(hf, opt, *data(k)),
                                  replayed=True)
    print(f"{'  the same, dtorch.replayed_step':36s} {one * 1e3:8.1f} ms vs {eager * 1e3:8.1f} ms"
          f"  {one / eager:5.2f}x  (goal <= 1.1x)")
    dp2_cpu = CpuMeter()
    dp2 = dtorch_step_time((2,), rounds, meter=dp2_cpu)
    dp2_replayed = dtorch_step_time((2,), rounds, replayed=True)
    zero3 = dtorch_step_time((2,), rounds, zero_stage=3)
    zero3_replayed = dtorch_step_time((2,), rounds, zero_stage=3, replayed=True)
    ddp_cpu = None
    for kind, rows in (("ddp", [("", dp2), ("replayed_step ", dp2_replayed)]),
                       ("fsdp2", [("ZeRO-3 ", zero3), ("ZeRO-3 replayed ", zero3_replayed),
                                  ("ZeRO-0 ", dp2)])):
        try:
            theirs, cpu = run_on_gloo_ranks(_rank_step, rounds, kind)
        except Exception as e:  # noqa: BLE001 - report what could not run
            print(f"{'dp2: dtorch / ' + kind:36s} n/a ({e})")
            continue
        ddp_cpu = cpu if kind == "ddp" else ddp_cpu
        for label, mine in rows:
            print(f"{'dp2: dtorch ' + label + '/ torch ' + kind.upper():36s} "
                  f"{mine * 1e3:8.1f} ms vs {theirs * 1e3:8.1f} ms  {mine / theirs:5.2f}x  "
                  f"(goal < 1x)")
    # on a CPU machine every process shares the cores: the CPU a step takes bounds its time
    print(f"dp2 CPU per step, ms ({os.cpu_count()} cores):")
    print(f"  dtorch: {cpu_line(dp2_cpu.per_step)}")
    if ddp_cpu is not None:
        print(f"  DDP rank 0: {cpu_line(ddp_cpu, copies=2)}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
