"""Per-device memory of parameters + gradients + AdamW state under ZeRO-0, 1, 2 and 3, dp=4.

    python benchmarks/bench_zero.py

A 4-layer Llama (hidden 256) on a dp=4 mesh. After an AdamW step (gradients still held), each
device's stored bytes (``Graph.get_memory_stats``: every blob, each storage once) are compared
with the theory for P parameter bytes: ZeRO-0 holds P + P (gradient) + 2P (moments) = 4P;
ZeRO-1 shards the moments, P + P + 2P/dp; ZeRO-2 the gradients too, P + P/dp + 2P/dp; ZeRO-3
(``dtorch.nn.fully_shard`` on each decoder layer and the root, ``zero_stage=3``) the parameters
too, 4P/dp. Goal: within 10% of the theory. The peak is the most a device's blobs held during the
step (forward, backward, update).

What the hosts' saved graphs keep for the backward is no blob, so the last column measures it
another way: how much the host processes' resident memory grows during the forward, per device
(glibc's mmap threshold fixed, so freed blocks go back to the system at once). ZeRO-3 must grow
like ZeRO-2, by the activations only: its gathered weights are not kept for the backward
(``autograd.tape.gathered``), which would add (1 - 1/dp) P.
"""

from __future__ import annotations

import os

os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 << 10))  # inherited by the hosts

import torch  # noqa: E402
import transformers  # noqa: E402
from procmem import children, status_kb  # noqa: E402

import dtorch  # noqa: E402
from dtorch.models.llama import LlamaForCausalLM  # noqa: E402

DP = 4
CONFIG = dict(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
              num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256)


def resident_bytes() -> int:
    """The resident bytes of this program's runtime processes (its descendants)."""
    pids, stack = [], children(os.getpid())
    while stack:
        pid = stack.pop()
        pids.append(pid)
        stack += children(pid)
    return sum(status_kb(pid, "VmRSS") for pid in pids) << 10


def held_bytes(zero: int) -> tuple:
    """(bytes held per device after the step, the peak during it, the hosts' growth per
    device during the forward, P)."""
    mesh = dtorch.init_device_mesh("cpu", (DP,), mesh_dim_names=["dp"])
    model = LlamaForCausalLM(transformers.LlamaConfig(**CONFIG), device_mesh=mesh)
    if zero == 3:
        for layer in model.model.layers:
            dtorch.nn.fully_shard(layer)
        dtorch.nn.fully_shard(model)
    opt = dtorch.optim.AdamW(model.parameters(), lr=1e-3, zero_stage=zero)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CONFIG["vocab_size"], (DP, 64), generator=g)
    labels = torch.randint(0, CONFIG["vocab_size"], (DP, 64), generator=g)
    inputs = model.place_tokens(ids)
    target = dtorch.from_torch(labels, device_mesh=mesh, placements=inputs.placements)
    dtorch.default_graph.get_memory_stats(mesh, reset_peak=True)
    before = resident_bytes()
    loss = dtorch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), target.flatten())
    dtorch.sync()
    growth = (resident_bytes() - before) / DP
    loss.backward()
    opt.step()
    del loss, inputs, target
    stats = dtorch.default_graph.get_memory_stats(mesh)
    params = sum(p.numel() * p.dtype.itemsize for p in model.parameters())
    per_device = max(stats.find(d).memory_allocated for d in mesh.devices)
    peak = max(stats.find(d).max_memory_allocated for d in mesh.devices)
    return per_device, peak, growth, params


def main() -> None:
    theory = {0: 4.0, 1: 2.0 + 2.0 / DP, 2: 1.0 + 3.0 / DP, 3: 4.0 / DP}
    print(f"AdamW, dp={DP}: per-device bytes after a step (params + grads + moments), in units "
          f"of the parameters' bytes P; the peak during the step; the hosts' growth per device "
          f"during the forward")
    for zero in (0, 1, 2, 3):
        held, peak, growth, params = held_bytes(zero)
        ratio = held / params
        print(f"  ZeRO-{zero}: {held / 2**20:7.2f} MB = {ratio:.3f} P   theory {theory[zero]:.3f} P"
              f"   ({ratio / theory[zero] - 1:+.1%})   peak {peak / params:.3f} P   forward "
              f"+{growth / params:.3f} P")


if __name__ == "__main__":
    main()
