"""Train a small random Llama to copy sequences, on a CPU mesh of any parallel layout.

Needs transformers (for the config): ``pip install -e ".[llama]"``.

    python examples/train_llama.py                       # 1 device
    python examples/train_llama.py --dp 2 --tp 2         # 4 devices
    python examples/train_llama.py --pp 2 --zero 1 --dp 2
    python examples/train_llama.py --dp 2 --zero 3       # parameters sharded (fully_shard)
    python examples/train_llama.py --dp 2 --accum 4      # 4 micro-batches a step, one reduction
    python examples/train_llama.py --replayed            # the step under dtorch.replayed_step

Each sample is ``prefix, prefix`` (random tokens, then the same again): the second half is
predictable from the first, so the loss on it falls from ln(vocab) towards 0 as the model learns
to copy. The loop is the one a torch user writes; ``loss.item()`` (every ``--log-every`` steps) is
the only wait, and the throughput (tokens a second) is measured between those waits. With
``--accum K`` each step's batch runs as K micro-batches, the first K - 1 inside DDP's
``model.no_sync()``, so the gradients are reduced once a step. With ``--replayed`` the step
(forward, backward, clipping, the update) is a ``dtorch.replayed_step``: once two calls issued
the same records, each step is one record (the batch is placed outside it). At the end the model is saved (``save_checkpoint`` plus the HF config) and
reloaded with ``LlamaForCausalLM.from_pretrained``, which must give the same logits.
"""

import argparse
import contextlib
import math
import os
import tempfile
import time

import torch
import transformers
from tqdm import tqdm

import dtorch
from dtorch.models.llama import LlamaForCausalLM

F = dtorch.nn.functional


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name in ("dp", "tp", "pp"):
        parser.add_argument(f"--{name}", type=int, default=1, help=f"{name} size")
    parser.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3),
                        help="ZeRO stage (3: the model fully_shard'ed, layer by layer)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--accum", type=int, default=1,
                        help="micro-batches a step (gradient accumulation; divides --batch)")
    parser.add_argument("--half", type=int, default=8, help="tokens to copy")
    parser.add_argument("--vocab", type=int, default=32)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--out", default=None, help="checkpoint directory (default: a temp dir)")
    parser.add_argument("--replayed", action="store_true",
                        help="run the step under dtorch.replayed_step (not with --accum)")
    args = parser.parse_args()

    mesh = dtorch.init_device_mesh("cpu", (args.dp, args.tp, args.pp),
                                   mesh_dim_names=["dp", "tp", "pp"])
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config, device_mesh=mesh).train()  # modules start in eval mode
    if args.zero == 3:  # FSDP2's order: each decoder layer, then the root
        for layer in model.model.layers:
            dtorch.nn.fully_shard(layer)
        dtorch.nn.fully_shard(model)
    opt = dtorch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01,
                             zero_stage=args.zero)
    # (a replayed step takes each step's learning rate and AdamW's betas, which this
    # schedule cycles, from the optimizer)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=args.steps)
    g = torch.Generator().manual_seed(1)

    if args.batch % args.accum:
        parser.error(f"--accum {args.accum} does not divide --batch {args.batch}")
    if args.replayed and args.accum > 1:
        parser.error("--replayed steps have one micro-batch (no_sync's held gradients are "
                     "Python state a replay would not see)")

    @dtorch.replayed_step
    def replayed_step(inputs, target):
        loss = F.cross_entropy(copied_logits(model, inputs, args.half), target)
        loss.backward()
        dtorch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss

    micro = args.batch // args.accum
    tokens_per_step = args.batch * (2 * args.half - 1)

    first = None
    since, start, rates = 0, time.perf_counter(), []
    bar = tqdm(range(args.steps), desc="train", unit="step")
    for step in bar:
        prefix = torch.randint(0, args.vocab, (args.batch, args.half), generator=g)
        seq = torch.cat([prefix, prefix], dim=1)
        if args.replayed:
            loss = replayed_step(*placed(model, seq, args.half))
        else:
            for k in range(args.accum):
                # the last micro-batch's backward reduces the gradients the others summed
                sync = contextlib.nullcontext() if k == args.accum - 1 else model.no_sync()
                with sync:
                    inputs, target = placed(model, seq[k * micro:(k + 1) * micro], args.half)
                    loss = F.cross_entropy(copied_logits(model, inputs, args.half), target)
                    loss = loss / args.accum
                    loss.backward()
            dtorch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        sched.step()
        since += 1
        if step % args.log_every == 0 or step == args.steps - 1:
            value = loss.item() * args.accum  # the last micro-batch's loss: the wait of the step
            now = time.perf_counter()
            rate = since * tokens_per_step / (now - start)
            rates += [rate] if step else []  # the first includes the runtime's start
            since, start = 0, now
            first = value if first is None else first
            bar.set_postfix(loss=f"{value:.3f}", tok_s=f"{rate:,.0f}")
    median = sorted(rates)[len(rates) // 2] if rates else float("nan")
    print(f"loss: {first:.3f} at the start (ln {args.vocab} = {math.log(args.vocab):.3f}), "
          f"{value:.3f} after {args.steps} steps; {median:,.0f} tokens/s "
          f"(median over logging intervals, {tokens_per_step} tokens a step)"
          + (f"; {replayed_step.replays} steps replayed" if args.replayed else ""))

    out = args.out or tempfile.mkdtemp(prefix="dtorch-llama-")
    dtorch.save_checkpoint(model, out)
    config.save_pretrained(out)
    reloaded = LlamaForCausalLM.from_pretrained(out, device_mesh=mesh)
    probe = torch.randint(0, args.vocab, (2, 2 * args.half), generator=g)
    with torch.no_grad():
        same = torch.equal(model(probe).to_torch(), reloaded(probe).to_torch())
    print(f"saved to {out} ({len(os.listdir(out))} files); reloaded logits equal: {same}")


def placed(model, seq, half: int):
    """A (micro-)batch of ``seq`` on the mesh: the inputs (all tokens but the last), and the
    targets of the copied half, laid out as the inputs (the batch Shard(0) on dp)."""
    inputs = model.place_tokens(seq[:, :-1])
    target = dtorch.from_torch(seq[:, half:], device_mesh=inputs.device_mesh,
                               placements=inputs.placements).flatten()
    return inputs, target


def copied_logits(model, inputs, half: int):
    """The logits that predict the copied half (the loss is taken on it only: the first half
    is random, nothing to learn there); the model predicts token t + 1 from tokens <= t."""
    return model(inputs)[:, half - 1:].flatten(0, 1)


if __name__ == "__main__":
    main()
