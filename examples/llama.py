"""Llama on a CPU mesh with any mix of data, tensor, pipeline and context parallelism.

Needs transformers (for the config): ``pip install -e ".[llama]"``.

    python examples/llama.py --tp 2 --pp 2                 # a small random model, 4 devices
    python examples/llama.py --dp 2 --tp 2 --ring-cp 2     # 8 devices
    python examples/llama.py --checkpoint DIR --tp 2       # an HF checkpoint directory

The random model is built locally from a small ``LlamaConfig`` (no network). The logits and the
greedily generated tokens are compared with HF's ``LlamaForCausalLM`` on the same weights.
"""

import argparse
import time

import torch
import transformers

import dtorch
from dtorch.models.llama import LlamaForCausalLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name in ("dp", "tp", "pp", "ulysses-cp", "ring-cp"):
        parser.add_argument(f"--{name}", type=int, default=1, help=f"{name} size")
    parser.add_argument("--checkpoint", help="an HF checkpoint directory (default: random)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=12)
    parser.add_argument("--new-tokens", type=int, default=8)
    args = parser.parse_args()

    sizes = (args.dp, args.tp, args.pp, args.ulysses_cp, args.ring_cp)
    mesh = dtorch.init_device_mesh("cpu", sizes, mesh_dim_names=[
        "dp", "tp", "pp", "ulysess_cp", "ring_cp"])
    print(f"mesh {dict(zip(mesh.dim_names, mesh.shape))}: {mesh.size()} devices")

    started = time.perf_counter()
    if args.checkpoint:
        hf = transformers.LlamaForCausalLM.from_pretrained(args.checkpoint).eval()
        model = LlamaForCausalLM.from_pretrained(args.checkpoint, device_mesh=mesh)
    else:
        config = transformers.LlamaConfig(
            vocab_size=512, hidden_size=128, intermediate_size=256,
            num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
            max_position_embeddings=256)
        torch.manual_seed(0)
        hf = transformers.LlamaForCausalLM(config).eval()
        model = LlamaForCausalLM(config, device_mesh=mesh)
        model.load_state_dict(hf.state_dict())
    print(f"built and loaded in {time.perf_counter() - started:.1f} s")

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, hf.config.vocab_size, (args.batch, args.seq), generator=g)
    logits = model(ids)  # a dtorch tensor
    with torch.no_grad():
        expected = hf(ids).logits
    error = (logits.to_torch() - expected).abs().max().item()
    print(f"logits {tuple(logits.shape)}: max |dtorch - HF| = {error:.2e}")

    tokens = model.generate(ids, max_new_tokens=args.new_tokens)
    hf_tokens = hf.generate(ids, max_new_tokens=args.new_tokens, do_sample=False,
                            attention_mask=torch.ones_like(ids),
                            pad_token_id=hf.config.eos_token_id)
    print("generated:", tokens[:, args.seq:].tolist())
    print("equal to HF generate:", torch.equal(tokens, hf_tokens))


if __name__ == "__main__":
    main()
