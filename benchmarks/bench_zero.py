"""Per-device memory of parameters + gradients + AdamW state under ZeRO-0, 1 and 2, dp=4.

    python benchmarks/bench_zero.py

A 4-layer Llama (hidden 256) on a dp=4 mesh. After an AdamW step (gradients still held), each
device's stored bytes (``Graph.get_memory_stats``: every blob, each storage once) are compared
with the theory for P parameter bytes: ZeRO-0 holds P + P (gradient) + 2P (moments) = 4P;
ZeRO-1 shards the moments, P + P + 2P/dp; ZeRO-2 the gradients too, P + P/dp + 2P/dp. Goal:
within 10% of the theory. (ZeRO-3, parameters sharded, is not implemented yet.)
"""

from __future__ import annotations

import torch
import transformers

import dtorch
from dtorch.models.llama import LlamaForCausalLM

DP = 4
CONFIG = dict(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
              num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256)


def held_bytes(zero: int) -> tuple:
    mesh = dtorch.init_device_mesh("cpu", (DP,), mesh_dim_names=["dp"])
    model = LlamaForCausalLM(transformers.LlamaConfig(**CONFIG), device_mesh=mesh)
    opt = dtorch.optim.AdamW(model.parameters(), lr=1e-3, zero_stage=zero)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CONFIG["vocab_size"], (DP, 64), generator=g)
    labels = torch.randint(0, CONFIG["vocab_size"], (DP, 64), generator=g)
    inputs = model.place_tokens(ids)
    target = dtorch.from_torch(labels, device_mesh=mesh, placements=inputs.placements)
    loss = dtorch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), target.flatten())
    loss.backward()
    opt.step()
    del loss, inputs, target
    stats = dtorch.default_graph.get_memory_stats(mesh)
    params = sum(p.numel() * p.dtype.itemsize for p in model.parameters())
    per_device = max(stats.find(d).memory_allocated for d in mesh.devices)
    return per_device, params


def main() -> None:
    theory = {0: 4.0, 1: 2.0 + 2.0 / DP, 2: 1.0 + 3.0 / DP}
    print(f"AdamW, dp={DP}: per-device bytes after a step (params + grads + moments), in units "
          f"of the parameters' bytes P")
    for zero in (0, 1, 2):
        held, params = held_bytes(zero)
        ratio = held / params
        print(f"  ZeRO-{zero}: {held / 2**20:7.2f} MB = {ratio:.3f} P   theory {theory[zero]:.3f} P"
              f"   ({ratio / theory[zero] - 1:+.1%})")


if __name__ == "__main__":
    main()
