"""``MoE``: a Mixtral-style mixture-of-experts layer with expert parallelism.

A router (``gate``: a replicated ``Linear(hidden, E, bias=False)``) scores every token; the
gating follows Mixtral (HF ``MixtralSparseMoeBlock``): ``softmax(logits)`` in float32, the
top-k experts, and those k weights renormalised to sum to one (``renormalize=False`` keeps the
softmax values, as Qwen-MoE's ``norm_topk_prob=False``), cast to the input's dtype. Each
expert is a SwiGLU MLP ``w2 (silu(w1 x) * (w3 x))``, stacked: ``w1, w3 [E, f, d]``,
``w2 [E, d, f]``. The output is the weighted sum of each token's k experts.

Layout, on a mesh with any of the dims ``ep_dim`` (default ``"ep"``), ``tp_dim`` (``"tp"``) and
others (data parallel):

| | ``ep`` | ``tp`` | other dims |
|---|---|---|---|
| ``w1, w3`` / ``w2`` | ``S(0)`` (the experts) | ``S(1)`` / ``S(2)`` (the hidden ``f``) | ``R`` |
| ``gate.weight`` | ``R`` | ``R`` | ``R`` |
| tokens ``x`` | ``S(0)`` (or ``R``) | ``R`` | ``S(0)`` or ``R`` |
| output | as ``x`` | ``R`` (gathered) | as ``x`` |

Tokens ``S(0)`` on ``ep`` are dispatched to their experts' devices and back inside one host
kernel (``dtorch.nn.functional.moe_experts``, ``ops/moe.py``): the all-to-all's split sizes
come from the router's values, which the hosts exchange among themselves, so the layer issues
without any sync, pads nothing and drops no token. Under ``tp`` each tp rank sends only its
block of the hidden columns over ``ep`` (the experts' Partial rows are reduce-scattered over
``tp`` before they travel back), and the output is all-gathered over ``tp``. Tokens ``R`` on
``ep`` need no dispatch:
each device computes its experts' share and the output is all-reduced. ``E`` must be a multiple
of the ``ep`` size. See ``docs/parallelism.md`` (expert parallelism) for the trade-offs.

``load_state_dict`` takes this module's keys (``gate.weight``, ``w1``, ``w2``, ``w3``) or a
dense reference's per-expert ones in HF Mixtral's layout (``experts.{i}.w1.weight`` ``[f, d]``,
``w2`` ``[d, f]``, ``w3`` ``[f, d]``), stacked on the client and sliced to each device's block.

>>> import dtorch, torch
>>> mesh = dtorch.DeviceMesh("cpu", [0, 1], mesh_dim_names=["ep"])
>>> moe = MoE(8, 16, num_experts=4, top_k=2, device_mesh=mesh)
>>> moe.w1.shape, moe.w1.placements
(torch.Size([4, 16, 8]), [Shard(dim=0)])
>>> x = dtorch.from_torch(torch.randn(5, 8), device_mesh=mesh, placements=[dtorch.Shard(0)])
>>> y = moe(x)
>>> y.shape, y.placements
(torch.Size([5, 8]), [Shard(dim=0)])
"""

from __future__ import annotations

import math

import torch

import dtorch

from ...placement import Replicate, Shard, is_int
from ...tensor import Tensor
from .. import functional as F
from ..parameter import Parameter
from .. import init
from .linear import Linear, resolve_tp_dim
from .module import Module

__all__ = ["MoE"]


class MoE(Module):
    """Top-k mixture of SwiGLU experts, the experts sharded over ``ep_dim`` (see the module
    docstring). ``forward(x)`` takes ``[tokens, hidden]`` or ``[batch, seq, hidden]``."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_experts: int,
                 top_k: int = 2, *, renormalize: bool = True, device=None, dtype=None,
                 device_mesh=None, ep_dim="ep", tp_dim="tp"):
        super().__init__()
        mesh = dtorch.get_default_device_mesh(device, device_mesh)
        for name, v in (("hidden_size", hidden_size), ("ffn_hidden_size", ffn_hidden_size),
                        ("num_experts", num_experts), ("top_k", top_k)):
            if not is_int(v) or v < 1:
                raise ValueError(f"MoE: {name} must be a positive int, got {v!r}")
        if top_k > num_experts:
            raise ValueError(f"MoE: top_k={top_k} exceeds num_experts={num_experts}")
        self.ep_dim = resolve_tp_dim(mesh, ep_dim)
        self.tp_dim = resolve_tp_dim(mesh, tp_dim)
        if self.ep_dim is not None and self.ep_dim == self.tp_dim:
            raise ValueError(f"MoE: ep_dim and tp_dim are the same mesh dim ({self.ep_dim})")
        if self.ep_dim is not None and num_experts % mesh.shape[self.ep_dim]:
            n = mesh.shape[self.ep_dim]
            raise ValueError(f"MoE: num_experts={num_experts} does not divide over the {n} "
                             f"devices of the expert-parallel mesh dim {self.ep_dim}; use a "
                             f"multiple of {n}")
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.gate = Linear(hidden_size, num_experts, bias=False, dtype=dtype, device_mesh=mesh)

        def expert_param(shape, tp_placement):
            placements = [Replicate()] * mesh.ndim
            if self.ep_dim is not None:
                placements[self.ep_dim] = Shard(0)
            if self.tp_dim is not None:
                placements[self.tp_dim] = tp_placement
            return Parameter(dtorch.empty(shape, dtype=dtype, device_mesh=mesh,
                                          placements=placements))

        E, d, f = num_experts, hidden_size, ffn_hidden_size
        self.w1 = expert_param((E, f, d), Shard(1))
        self.w2 = expert_param((E, d, f), Shard(2))
        self.w3 = expert_param((E, f, d), Shard(1))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each expert as ``nn.Linear`` starts: uniform within ``1 / sqrt(fan_in)``."""
        self.gate.reset_parameters()
        for w, fan_in in ((self.w1, self.hidden_size), (self.w3, self.hidden_size),
                          (self.w2, self.ffn_hidden_size)):
            init.uniform_(w, -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))

    # -- state ----------------------------------------------------------------------------------
    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        """Per-expert keys (``experts.{i}.w1.weight``, HF Mixtral's) are stacked into ``w1``,
        ``w2``, ``w3`` first; this module's own keys load as they are."""
        experts = prefix + "experts."
        if any(k.startswith(experts) for k in state_dict):
            state_dict = dict(state_dict)
            for name in ("w1", "w2", "w3"):
                keys = [f"{experts}{i}.{name}.weight" for i in range(self.num_experts)]
                found = [k for k in keys if k in state_dict]
                if not found:
                    continue
                if len(found) != len(keys):
                    error_msgs.append(f"MoE {prefix or '(root)'}: {name} of experts "
                                      f"{[i for i, k in enumerate(keys) if k not in found]} "
                                      f"missing from the per-expert state")
                    for k in found:
                        del state_dict[k]
                    continue
                values = [state_dict.pop(k) for k in keys]
                values = [v.to_torch() if isinstance(v, Tensor) else torch.as_tensor(v)
                          for v in values]
                state_dict[prefix + name] = torch.stack(values)
            for k in [k for k in state_dict if k.startswith(experts)]:
                if strict:
                    unexpected_keys.append(k)
                del state_dict[k]
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    # -- the call -------------------------------------------------------------------------------
    def redistribute_input(self, input):
        """Checks ``input``: a dtorch tensor ``[tokens, hidden]`` or ``[batch, seq, hidden]`` on
        the layer's mesh, ``S(0)`` or ``R`` on every dim but ``tp``, where it must be ``R``."""
        if not isinstance(input, Tensor):
            raise TypeError(f"{self.qualified_name()}: expects a dtorch.Tensor input, got "
                            f"{type(input).__name__}; make one with dtorch.from_torch(t, "
                            f"device_mesh=..., placements=...)")
        if input.dim() not in (2, 3) or input.shape[-1] != self.hidden_size:
            raise ValueError(f"{self.qualified_name()}: expects [tokens, {self.hidden_size}] "
                             f"or [batch, seq, {self.hidden_size}], got shape "
                             f"{tuple(input.shape)}")
        mesh = self.w1.device_mesh
        if input.device_mesh != mesh:
            raise ValueError(f"{self.qualified_name()}: the input is on {input.device_mesh!r}, "
                             f"the experts on {mesh!r}; move it first")
        fix = list(input.placements)
        for i, p in enumerate(input.placements):
            if i == self.tp_dim:
                fix[i] = Replicate()
            elif p not in (Shard(0), Replicate()):
                fix[i] = Shard(0)
        if fix != list(input.placements):
            raise ValueError(f"{self.qualified_name()}: input placements {input.placements}; "
                             f"tokens must be Shard(0) or Replicate, and Replicate on the tp "
                             f"dim; add x = x.redistribute(placements={fix!r}) before the call")
        return (input,), {}

    def route(self, x: Tensor):
        """``(weights [T, k], indices [T, k], logits [T, E])`` for tokens ``x [T, d]``."""
        logits = F.linear(x, self.gate.weight)
        probs = F.softmax(logits.float(), dim=-1)
        weights, indices = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), indices, logits

    def forward(self, input: Tensor) -> Tensor:
        x = input.reshape(-1, self.hidden_size) if input.dim() == 3 else input
        weights, indices, _ = self.route(x)
        out = F.moe_experts(x, indices, weights, self.w1, self.w3, self.w2)
        # tp: the column blocks (dispatched tokens) or Partial sums; ep with R tokens: Partial
        fix = {i: p for i, (p, q) in enumerate(zip(x.placements, out.placements)) if p != q}
        if fix:
            out = out.redistribute_by_dict(None, fix, default_placement_mode="keep")
        return out.reshape(input.shape) if input.dim() == 3 else out

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
                f"num_experts={self.num_experts}, top_k={self.top_k}, "
                f"renormalize={self.renormalize}, ep_dim={self.ep_dim}, tp_dim={self.tp_dim}")
