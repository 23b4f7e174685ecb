"""The training program the elastic tests run in a subprocess of their own (killing a host
must not touch the test session's runtime): a small Llama trained on fixed batches under
``dtorch.elastic.Elastic``, with hosts SIGKILLed at chosen steps, each at a random point of the
step. It prints one ``RESULT`` line: the losses, the events, the pids it saw and the first error.

    python elastic_program.py '{"mesh": [4], "zero": 2, "kills": [[7, 2]], "steps": 12}'

``kills``: ``[step, device]`` pairs (the host serving ``device`` is killed during ``step``);
``kill_in_recovery``: a device whose host is killed in the runtime the first recovery starts;
``batch``: the global batch's rows (12, which dp 4, 3, 2 and 1 divide); ``dropout``: the
step drops out its logits (p 0.2); ``trace``: the run
inside a ``dtorch.profiler`` trace (its elastic spans and the devices its kernels ran on come
back).
"""

from __future__ import annotations

import functools
import json
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from processes import children  # noqa: E402

F = dtorch.nn.functional
VOCAB, SEQ, BATCH = 32, 12, 12


def build(mesh, zero: int):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    torch.manual_seed(0)
    dtorch.manual_seed(0)  # (the weights are drawn on the devices: the same in every run)
    model = LlamaForCausalLM(config, device_mesh=mesh).train()
    if zero == 3:
        for layer in model.model.layers:
            dtorch.nn.fully_shard(layer)
        dtorch.nn.fully_shard(model)
    opt = dtorch.optim.AdamW(model.parameters(), lr=1e-2, zero_stage=zero)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + 0.1 * k))
    return {"model": model, "optim": opt, "sched": sched}


def train_step(state, seq, dropout: float = 0.0):
    """One step of next-token prediction on ``seq`` (the global batch, Shard(0) on dp); with
    ``dropout``, its logits dropped out (dtorch's seed stream draws the masks)."""
    model, opt = state["model"], state["optim"]
    logits = model(seq[:, :-1])
    if dropout:
        logits = F.dropout(logits, dropout)
    loss = F.cross_entropy(logits.flatten(0, 1), seq[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    state["sched"].step()
    return loss


train_step_with_dropout = functools.partial(train_step, dropout=0.2)


def probe_logits(model, batch) -> list:
    """A few of ``model``'s logits on the first two sequences of ``batch`` (no gradient)."""
    with torch.no_grad():
        return model(batch[:2, :-1]).to_torch()[:, :3, :4].flatten().tolist()


def runtime_pids() -> set:
    """The controller's and hosts' pids of the runtime running now."""
    from dtorch.client import session

    s = session.running()
    return {s.controller.pid, *children(s.controller.pid)} if s is not None else set()


def host_pid(index: int) -> int | None:
    """The pid of this program's host ``index`` (``--index`` on its command line)."""
    from dtorch.client import session

    s = session.running()
    if s is None:
        return None
    for pid in children(s.controller.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"--index" in argv and int(argv[argv.index(b"--index") + 1]) == index:
            return pid
    return None


def main(plan: dict) -> dict:
    rng = random.Random(plan.get("seed", 0))
    g = torch.Generator().manual_seed(1)
    rows = plan.get("batch", BATCH)
    batches = [torch.randint(0, VOCAB, (rows, SEQ), generator=g) for _ in range(plan["steps"])]
    kills = {step: device for step, device in plan.get("kills", [])}
    hosts = int(os.environ.get("DTORCH_CPU_HOSTS", "1"))
    killed, step_times, timers = [], [], []

    def kill(device: int) -> None:
        pid = host_pid(device % hosts)
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            killed.append(dict(pid=pid, device=device, step=run.steps + 1,
                               recovering=run.recovering))

    def kill_when_up(device: int) -> None:
        """Kills the host of ``device`` in the runtime a recovery starts, once it is up."""
        dead = {k["pid"] for k in killed}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            pid = host_pid(device % hosts)
            seen.update(runtime_pids())
            if pid is not None and pid not in dead:
                time.sleep(0.3 * rng.random())
                return kill(device)
            time.sleep(0.01)

    def on_event(event) -> None:
        events.append(event._asdict())
        if event.kind == "lost" and plan.get("kill_in_recovery") is not None:
            timer = threading.Thread(target=kill_when_up, args=[plan.pop("kill_in_recovery")])
            timers.append(timer)
            timer.start()

    events: list = []
    run = dtorch.elastic.Elastic(
        lambda mesh: build(mesh, plan.get("zero", 0)), tuple(plan["mesh"]),
        plan.get("names", ["dp"]), spare_devices=plan.get("spares", ()),
        shrink=plan.get("shrink", True), snapshot_every=plan.get("every", 1), on_event=on_event)
    losses, error, probe, seen, trace = [], None, {}, set(), None
    if plan.get("trace"):
        dtorch.profiler.start()
    try:
        for k, batch in enumerate(batches, 1):
            if k in kills:  # at a random point of step k: a delay within a step's time
                delay = rng.random() * (statistics.median(step_times[1:])
                                        if len(step_times) > 1 else 0.05)
                timer = threading.Timer(delay, kill, [kills.pop(k)])
                timers.append(timer)
                timer.start()
            t0 = time.perf_counter()
            seen.update(runtime_pids())
            losses.append(run.step(train_step_with_dropout if plan.get("dropout")
                                   else train_step, batch))
            step_times.append(time.perf_counter() - t0)
            if k in plan.get("probe_after", ()):
                probe[k] = probe_logits(run.state["model"], batches[0])
    except dtorch.elastic.Unrecoverable as e:
        error = dict(message=str(e), snapshot=e.snapshot, step=e.step)
        if plan.get("read_snapshot"):  # the last completed step's state, on one device
            mesh = dtorch.DeviceMesh("cpu", [0])
            one = build(mesh, 0)["model"]
            dtorch.load_checkpoint(one, e.snapshot, key_map=lambda k: k[len("model/"):]
                                   if k.startswith("model/") else None)
            error["logits"] = probe_logits(one, batches[0])
    for timer in timers:
        timer.join()
    if plan.get("trace"):  # the elastic track's spans, and the devices whose kernels it shows
        events_ = dtorch.profiler.stop()
        trace = dict(spans=[[e["name"], e["dur"]] for e in events_ if e["ph"] == "X"
                            and e["tid"] == dtorch.profiler.ELASTIC_TRACK
                            and e["pid"] == dtorch.profiler.CLIENT_PID],
                     devices=sorted({e["pid"] for e in events_ if e["ph"] == "X"
                                     and e["pid"] < dtorch.profiler.CLIENT_PID}))
    if not plan.get("keep_snapshot"):
        run.close()
    dtorch.shutdown()
    return dict(losses=losses, events=events, killed=killed, error=error, times=step_times,
                probe=probe, trace=trace, pids=sorted(seen | {k["pid"] for k in killed}))


if __name__ == "__main__":  # one plan, or a list of them run one after the other
    plans = json.loads(sys.argv[1])
    results = [main(p) for p in (plans if isinstance(plans, list) else [plans])]
    print("RESULT " + json.dumps(results if isinstance(plans, list) else results[0]),
          flush=True)
