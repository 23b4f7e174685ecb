"""A small Llama on a 1-device CPU mesh against HF transformers' eager model, same weights.

    python benchmarks/bench_llama.py [rounds=7]

Measured in this one invocation, the two sides interleaved round by round (this machine is
shared and noisy), medians over ``rounds``:
1. client time of one forward: ``model(ids)`` returning (every op issued, nothing waited for),
   against HF's eager forward (``torch.no_grad``). Goal <= 0.35x.
2. end-to-end forward: issued and finished (``dtorch.sync()``), against HF's forward.
   Goal <= 1.1x.
3. greedy ``generate`` tokens/s, against HF's ``generate(do_sample=False)``, both with a KV
   cache and the same number of new tokens: dtorch's default static cache (decode steps
   replay) and its growing one (``cache_implementation="dynamic"``), HF's default (dynamic).
   Goal <= 1.0x.
4. peak memory of a forward: in fresh interpreters, the peak bytes of the tensors alive during
   one forward above the loaded model (``LiveBytes`` for HF, ``get_memory_stats`` for the
   dtorch device). Goal <= 1.0x.

The host gets every core (``DTORCH_CPU_HOSTS=1``: one host process, ``cpu_count`` torch
threads), as eager torch does.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("DTORCH_CPU_HOSTS", "1")  # before dtorch is imported

import torch  # noqa: E402

CONFIG = dict(vocab_size=4096, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
              num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512)
BATCH, SEQ, NEW_TOKENS = 2, 128, 16


def build():
    import transformers

    import dtorch
    from dtorch.models.llama import LlamaForCausalLM

    config = transformers.LlamaConfig(**CONFIG)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    mesh = dtorch.DeviceMesh("cpu", [0])
    model = LlamaForCausalLM(config, device_mesh=mesh)
    model.load_state_dict(hf.state_dict())
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=torch.Generator()
                        .manual_seed(1))
    dtorch.sync()
    return hf, model, ids


def timings(rounds: int) -> dict:
    import dtorch

    hf, model, ids = build()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).to_torch(), hf(ids).logits, atol=1e-4, rtol=1e-4)
    # (both forwards below run under no_grad; generate runs under inference_mode on both)
    times = {k: [] for k in ("hf_forward", "client", "forward", "hf_generate", "generate",
                             "generate_dynamic")}
    mask = torch.ones_like(ids)
    for _ in range(rounds):
        with torch.no_grad():
            t0 = time.perf_counter()
            _ = hf(ids).logits
            times["hf_forward"].append(time.perf_counter() - t0)
        with torch.no_grad():  # as HF's side: no tape
            t0 = time.perf_counter()
            logits = model(ids)  # held until synced: an unread result would be dead code
            t1 = time.perf_counter()
            dtorch.sync()
            t2 = time.perf_counter()
        del logits
        times["client"].append(t1 - t0)
        times["forward"].append(t2 - t0)
        t0 = time.perf_counter()
        expected = hf.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                               attention_mask=mask, pad_token_id=0, eos_token_id=None)
        times["hf_generate"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        got = model.generate(ids, max_new_tokens=NEW_TOKENS, eos_token_id=[])
        times["generate"].append(time.perf_counter() - t0)
        assert torch.equal(got, expected)
        t0 = time.perf_counter()
        got = model.generate(ids, max_new_tokens=NEW_TOKENS, eos_token_id=[],
                             cache_implementation="dynamic")
        times["generate_dynamic"].append(time.perf_counter() - t0)
        assert torch.equal(got, expected)
    return {k: statistics.median(v) for k, v in times.items()}


class LiveBytes:
    """The peak bytes of tensors alive between eager ops, above those alive at the start: every
    op's outputs counted once per storage until the last tensor on it dies (a
    ``TorchDispatchMode``). dtorch's host counts the tensors it stores the same way
    (``get_memory_stats``); neither sees a kernel's internal scratch."""

    def __init__(self):
        import weakref

        from torch.utils._python_dispatch import TorchDispatchMode

        live, owners = [0, 0], {}  # [bytes now, peak]; storage -> its live tensors

        def release(key):
            owners[key] -= 1
            if owners[key] == 0:
                del owners[key]
                live[0] -= key[1]

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in out if isinstance(out, (tuple, list)) else (out,):
                    if isinstance(t, torch.Tensor):
                        storage = t.untyped_storage()
                        key = (storage.data_ptr(), storage.nbytes())
                        if key not in owners:
                            owners[key] = 0
                            live[0] += key[1]
                            live[1] = max(live)
                        owners[key] += 1
                        weakref.finalize(t, release, key)
                return out

        self.mode, self.live = Mode(), live


def peak_hf() -> dict:
    hf, _, ids = build()
    with torch.no_grad():
        hf(ids)  # warm, as dtorch's side
        tracker = LiveBytes()
        with tracker.mode:
            logits = hf(ids).logits
        del logits
    return {"mb": tracker.live[1] / 2**20}


@torch.no_grad()
def peak_dtorch() -> dict:
    import dtorch

    _, model, ids = build()
    logits = model(ids)  # warm: the runtime's caches
    del logits
    before = dtorch.default_graph.get_memory_stats(reset_peak=True).find(0)
    logits = model(ids)  # held until read: an unread result would be dead code
    after = dtorch.default_graph.get_memory_stats().find(0)
    del logits
    return {"mb": (after.max_memory_allocated - before.memory_allocated) / 2**20}


def run_case(name: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--case", name], capture_output=True,
                         text=True, timeout=900)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"case {name} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")


def main(rounds: int) -> None:
    t = timings(rounds)
    tokens = BATCH * NEW_TOKENS
    print(f"Llama {CONFIG['num_hidden_layers']} layers, hidden {CONFIG['hidden_size']}, "
          f"batch {BATCH} x seq {SEQ}; 1-device mesh; medians of {rounds} rounds")
    rows = [
        ("client time of one forward / HF forward", t["client"], t["hf_forward"], "<= 0.35x"),
        ("end-to-end forward / HF forward", t["forward"], t["hf_forward"], "<= 1.1x"),
        (f"generate {NEW_TOKENS} tokens / HF generate", t["generate"], t["hf_generate"],
         "<= 1.0x"),
        ("  the same, dynamic cache", t["generate_dynamic"], t["hf_generate"], ""),
    ]
    for label, mine, theirs, goal in rows:
        print(f"{label:44s} {mine * 1e3:9.1f} ms vs {theirs * 1e3:9.1f} ms  "
              f"{mine / theirs:5.2f}x  {goal}")
    print(f"{'generate tokens/s':44s} {tokens / t['generate']:9.1f}    vs "
          f"{tokens / t['hf_generate']:9.1f}")
    mine, theirs = run_case("dtorch")["mb"], run_case("hf")["mb"]
    print(f"{'peak tensor memory of a forward':44s} {mine:9.1f} MB vs {theirs:9.1f} MB"
          f"  {mine / theirs:5.2f}x  <= 1.0x")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--case"]:
        result = peak_dtorch() if sys.argv[2] == "dtorch" else peak_hf()
        print("RESULT " + json.dumps(result), flush=True)
        sys.exit(0)
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 7)
