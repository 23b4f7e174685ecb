"""An HF transformers Llama, unported, laid out on a CPU mesh and trained with dtorch.

Needs transformers: ``pip install -e ".[llama]"``.

    python examples/hf_unported.py                 # tp2
    python examples/hf_unported.py --dp 2 --tp 2   # 4 devices
    python examples/hf_unported.py --sp            # torchtitan's sequence-parallel layout

``dtorch.nn.parallelize`` turns the parameters of HF's own ``LlamaForCausalLM`` (a
``torch.nn.Module``, not dtorch's port) into dtorch tensors laid out by a plan: attention and
MLP projections column- and row-parallel on "tp", the rest replicated (data parallel on "dp"
through the batch's placement); with ``--sp``, torchtitan's layout in DTensor's style objects: a
vocabulary-parallel embedding, sequence-parallel norms, and the residual stream sharded along
the sequence between layers. HF's forward then runs unchanged: torch's functions on dtorch
tensors run dtorch's operators. The logits are compared with HF's own on the same weights, and
a few AdamW steps with HF's loss (``labels=``) train it.
"""

import argparse
import copy

import torch
import transformers

import dtorch

PLAN = {"model.layers.*.self_attn.[qkv]_proj": "colwise",
        "model.layers.*.self_attn.o_proj": "rowwise",
        "model.layers.*.mlp.[gu][ap]*_proj": "colwise",  # gate_proj, up_proj
        "model.layers.*.mlp.down_proj": "rowwise"}
SEQUENCE = dtorch.Shard(1)  # the residual stream's layout on tp between layers, with --sp
SP_PLAN = {"model.embed_tokens": dtorch.nn.RowwiseParallel(output_layouts=SEQUENCE),
           "model.layers.*.*_layernorm": dtorch.nn.SequenceParallel(),
           "model.layers.*.self_attn.[qkv]_proj": dtorch.nn.ColwiseParallel(),
           "model.layers.*.self_attn.o_proj": dtorch.nn.RowwiseParallel(output_layouts=SEQUENCE),
           "model.layers.*.mlp.[gu][ap]*_proj": dtorch.nn.ColwiseParallel(),
           "model.layers.*.mlp.down_proj": dtorch.nn.RowwiseParallel(output_layouts=SEQUENCE),
           "model.norm": dtorch.nn.SequenceParallel(),
           "lm_head": dtorch.nn.ColwiseParallel(output_layouts=dtorch.Replicate())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--sp", action="store_true", help="sequence parallelism on tp")
    args = parser.parse_args()

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config)
    model = dtorch.nn.parallelize(copy.deepcopy(hf), dtorch.init_device_mesh(
        "cpu", (args.dp, args.tp), mesh_dim_names=["dp", "tp"]), SP_PLAN if args.sp else PLAN)
    mesh = model.model.embed_tokens.weight.device_mesh
    print("q_proj:", model.model.layers[0].self_attn.q_proj.weight.placements,
          "o_proj:", model.model.layers[0].self_attn.o_proj.weight.placements)

    ids = torch.randint(0, config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))
    batch = dtorch.from_torch(ids, mesh, [dtorch.Shard(0), dtorch.Replicate()])
    with torch.no_grad():
        logits = model(batch, use_cache=False).logits
        want = hf(ids, use_cache=False).logits
    diff = (logits.to_torch() - want).abs().max().item()
    print(f"logits {tuple(logits.shape)} {logits.placements}; max difference from HF {diff:.2e}")

    model.train()
    opt = dtorch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        loss = model(batch, labels=batch, use_cache=False).loss  # HF's own loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"step {step}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
