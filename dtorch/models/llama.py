"""Llama (``LlamaForCausalLM``) written with ``dtorch.nn``: the same model on one device or on
any mix of data, tensor, pipeline and context parallelism, chosen by the mesh alone.

The mesh's dims are named from ``MESH_DIMS``; a dim the mesh lacks, or of size 1, is that
parallelism off:

| dim | what is split | how |
|---|---|---|
| ``dp`` | the batch | ``input_ids`` ``Shard(0)``; every weight ``Replicate`` |
| ``tp`` | heads and the MLP's hidden features | q/k/v, gate/up column-parallel, o/down row-parallel (one all-reduce per block), the embedding's columns, the LM head's vocabulary |
| ``pp`` | the layers | ``mesh.unbind("pp")`` gives the stage meshes; the layers of a stage are built on its mesh and activations hop with ``redistribute(device_mesh=...)`` |
| ``ulysess_cp`` / ``ring_cp`` | the sequence | ``input_ids`` ``Shard(1)``; attention runs Ulysses or Ring context parallelism (``F.scaled_dot_product_attention``) |

Nothing else in the code depends on the layout: placements flow through the ops. Tensor
parallelism needs the query and key/value head counts to divide by the tp size.

The numerics are HF transformers' (``transformers.LlamaForCausalLM``): RMSNorm in float32, RoPE
tables in float32 cast to the activations' dtype, GQA by repeating the key/value heads. The
weights' names are HF's, so ``load_state_dict(hf_model.state_dict())`` and ``from_pretrained``
(an HF checkpoint directory) load them; each host reads only its slices.

``generate`` decodes greedily with a key/value cache, issuing every step without waiting: the
client reads the tokens once, at the end.
"""

from __future__ import annotations

import os

import torch

import dtorch

from ..checkpoint import load_checkpoint
from ..mesh import DeviceMesh, assign_layers_to_stages
from ..placement import Replicate, Shard
from ..tensor import Tensor
from ..type import RING_CP, ULYSSES_CP
from .. import nn
from ..nn import functional as F
from ..nn.pipeline import hop
from .kv_cache import CP_DIMS, KVCache, StaticKVCache

__all__ = ["LlamaForCausalLM", "LlamaModel", "LlamaDecoderLayer", "LlamaAttention", "LlamaMLP",
           "LlamaRMSNorm", "LlamaRotaryEmbedding", "KVCache", "StaticKVCache", "MESH_DIMS"]

MESH_DIMS = ("dp", "tp", "pp", ULYSSES_CP, "ulysses_cp", RING_CP)
R = Replicate()

ACTIVATIONS = {
    "silu": F.silu, "swish": F.silu, "relu": F.relu, "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def _guard(mesh: DeviceMesh):
    return dtorch.Graph.default_graph().device_mesh_guard(mesh)


def whole_along(x: Tensor, placement) -> Tensor:
    """``x`` with ``placement`` (a Shard) made Replicate on every mesh dim that holds it."""
    whole = [R if p == placement else p for p in x.placements]
    return x if whole == list(x.placements) else x.redistribute(placements=whole)


def token_placements(mesh: DeviceMesh, shard_sequence: bool = True) -> dict:
    """How token ids ``[batch, seq]`` are laid out: the batch over ``dp``, the sequence over the
    context-parallel dims (when ``shard_sequence``), whole on the others."""
    layout = {"dp": Shard(0)}
    if shard_sequence:
        layout.update({name: Shard(1) for name in CP_DIMS})
    return {name: p for name, p in layout.items() if mesh.has_dim_name(name)}


def rope_parameters(config) -> tuple:
    """``(inv_freq, attention_scaling)`` of the config's RoPE: the default one computed here, the
    scaled kinds (llama3, linear, yarn, ...) by transformers' own initialisers."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if not rope:  # transformers < 5 keeps them as attributes
        rope = dict(getattr(config, "rope_scaling", None) or {})
        rope.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        dim = _head_dim(config)
        base = rope["rope_theta"]
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    if kind == "dynamic":
        raise NotImplementedError("LlamaForCausalLM: dynamic RoPE (rescaled by the sequence "
                                  "length as it grows) is not supported")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
    return inv_freq.float(), float(scaling)


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _tp_size(mesh: DeviceMesh) -> int:
    index = mesh.dim_name_index("tp") if mesh.has_dim_name("tp") else None
    return 1 if index is None else mesh.shape[index]


# -- layers ---------------------------------------------------------------------------------------


class LlamaRMSNorm(nn.Module):
    """HF's ``LlamaRMSNorm``: normalised in float32, scaled in the input's dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(dtorch.ones(hidden_size, dtype=dtype))
        self.variance_epsilon = eps

    def forward(self, hidden_states: Tensor) -> Tensor:
        dtype = hidden_states.dtype
        h = hidden_states.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * dtorch.rsqrt(variance + self.variance_epsilon)
        return self.weight * h.to(dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class LlamaRotaryEmbedding(nn.Module):
    """The RoPE tables ``(cos, sin)`` for given positions, in float32 and cast to ``x``'s dtype."""

    def __init__(self, config):
        super().__init__()
        inv_freq, self.attention_scaling = rope_parameters(config)
        mesh = dtorch.get_default_device_mesh()
        self.inv_freq = nn.Buffer(dtorch.from_torch(inv_freq, device_mesh=mesh),
                                  persistent=False)

    def forward(self, x: Tensor, position_ids: Tensor) -> tuple:
        freqs = position_ids.unsqueeze(-1).to(torch.float32) * self.inv_freq
        emb = dtorch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(x.dtype), sin.to(x.dtype)


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return dtorch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_pos_emb(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple:
    """RoPE on ``[batch, heads, seq, head_dim]`` queries and keys; ``cos``, ``sin`` are
    ``[batch or 1, seq, head_dim]``."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """``[batch, kv_heads, seq, d]`` -> ``[batch, kv_heads * n_rep, seq, d]``, each key/value
    head repeated for the query heads that read it (HF's ``repeat_kv``)."""
    if n_rep == 1:
        return x
    batch, heads, seq, dim = x.shape
    return x[:, :, None].expand(batch, heads, n_rep, seq, dim).reshape(batch, heads * n_rep,
                                                                        seq, dim)


class LlamaAttention(nn.Module):
    """Multi-head attention with GQA and RoPE; the heads split over ``tp``."""

    def __init__(self, config, layer_idx: int, dtype=None):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = _head_dim(config)
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        tp = _tp_size(dtorch.get_default_device_mesh())
        if self.num_heads % tp or self.num_key_value_heads % tp:
            raise ValueError(f"LlamaAttention: tensor parallelism over {tp} devices needs the "
                             f"query heads ({self.num_heads}) and key/value heads "
                             f"({self.num_key_value_heads}) to divide by {tp}; choose a tp size "
                             f"that divides both")
        hidden, bias = config.hidden_size, config.attention_bias
        q_out, kv_out = self.num_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        self.q_proj = nn.ColumnParallelLinear(hidden, q_out, bias=bias, dtype=dtype)
        self.k_proj = nn.ColumnParallelLinear(hidden, kv_out, bias=bias, dtype=dtype)
        self.v_proj = nn.ColumnParallelLinear(hidden, kv_out, bias=bias, dtype=dtype)
        self.o_proj = nn.RowParallelLinearWithReplicateOutput(q_out, hidden, bias=bias,
                                                              dtype=dtype)

    def forward(self, hidden_states: Tensor, position_embeddings: tuple,
                cache: KVCache | None = None) -> Tensor:
        batch, seq, _ = hidden_states.shape

        def heads(t):  # [b, s, h * d] -> [b, h, s, d]: the tp shard moves to the heads
            return t.view(batch, seq, -1, self.head_dim).transpose(1, 2)

        q = heads(self.q_proj(hidden_states))
        k = heads(self.k_proj(hidden_states))
        v = heads(self.v_proj(hidden_states))
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        past, mask = 0 if cache is None else cache.seen(self.layer_idx), None
        if cache is not None:
            k, v, mask = cache.update(self.layer_idx, k, v)
        k = repeat_kv(k, self.num_key_value_groups)
        v = repeat_kv(v, self.num_key_value_groups)
        # a prefill is causal; a decode step's one query sees every cached position (a static
        # cache's: those its mask marks)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                             is_causal=past == 0 and seq > 1,
                                             scale=self.scaling)
        out = out.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, config, dtype=None):
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.ColumnParallelLinear(hidden, inner, bias=bias, dtype=dtype)
        self.up_proj = nn.ColumnParallelLinear(hidden, inner, bias=bias, dtype=dtype)
        self.down_proj = nn.RowParallelLinearWithReplicateOutput(inner, hidden, bias=bias,
                                                                 dtype=dtype)
        try:
            self.act_fn = ACTIVATIONS[config.hidden_act]
        except KeyError:
            raise NotImplementedError(f"LlamaMLP: hidden_act={config.hidden_act!r} is not "
                                      f"supported; one of {sorted(ACTIVATIONS)}") from None

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, dtype=None):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, dtype)
        self.mlp = LlamaMLP(config, dtype)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps,
                                                     dtype)

    def forward(self, hidden_states: Tensor, position_embeddings: tuple,
                cache: KVCache | None = None) -> Tensor:
        h = hidden_states + self.self_attn(self.input_layernorm(hidden_states),
                                           position_embeddings, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    """The decoder stack. With a ``pp`` dim, the layers are spread over the stage meshes
    (``assign_layers_to_stages``): the embedding and RoPE on the first, the final norm on the
    last."""

    def __init__(self, config, device_mesh: DeviceMesh, dtype=None):
        super().__init__()
        self.stage_meshes = device_mesh.unbind("pp")
        self.layer_stage_ids = assign_layers_to_stages(config.num_hidden_layers,
                                                       len(self.stage_meshes))
        with _guard(self.stage_meshes[0]):
            self.embed_tokens = nn.EmbeddingWithReplicateOutput(
                config.vocab_size, config.hidden_size, getattr(config, "pad_token_id", None),
                dtype=dtype)
            self.rotary_emb = LlamaRotaryEmbedding(config)
        self.layers = nn.ModuleList()
        for i, stage in enumerate(self.layer_stage_ids):
            with _guard(self.stage_meshes[stage]):
                self.layers.append(LlamaDecoderLayer(config, i, dtype))
        with _guard(self.stage_meshes[-1]):
            self.norm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        # each layer's activations recomputed in the backward (HF's name; training only), and
        # the arguments ``nn.checkpoint`` gets (HF's ``gradient_checkpointing_kwargs``)
        self.gradient_checkpointing, self.checkpoint_kwargs = False, {}

    def forward(self, input_ids: Tensor, cache: KVCache | None = None) -> Tensor:
        h = self.embed_tokens(input_ids)
        positions = (KVCache() if cache is None else cache).positions(input_ids.shape[1],
                                                                       h.device_mesh)
        tables = {h.device_mesh: self.rotary_emb(h, positions)}  # moved once per stage
        for layer, stage in zip(self.layers, self.layer_stage_ids):
            mesh = self.stage_meshes[stage]
            h = hop(h, mesh)
            if mesh not in tables:
                tables[mesh] = tuple(hop(t, mesh) for t in tables[self.stage_meshes[0]])
            if self.gradient_checkpointing and self.training and cache is None:
                h = nn.checkpoint(layer, h, tables[mesh], **self.checkpoint_kwargs)
            else:
                h = layer(h, tables[mesh], cache)
        if cache is not None:
            cache.advance(input_ids.shape[1])
        return self.norm(hop(h, self.stage_meshes[-1]))


class TiedLMHead(nn.Module):
    """The LM head of ``tie_word_embeddings``: the embedding's table, laid out as a column-
    parallel head on the last stage (a no-op without pipeline or tensor parallelism; otherwise
    one redistribute per call). A checkpoint's copy of the table (``lm_head.weight``) is the
    embedding's, so loading skips it."""

    def __init__(self, embedding: nn.Module, device_mesh: DeviceMesh):
        super().__init__()
        self._embedding = (embedding,)  # not a submodule: its parameter belongs to the model
        self.device_mesh = device_mesh
        tp = device_mesh.dim_name_index("tp") if device_mesh.has_dim_name("tp") else None
        self.placements = [Shard(0) if i == tp else R for i in range(device_mesh.ndim)]

    def forward(self, h: Tensor) -> Tensor:
        table = self._embedding[0].weight
        if table.device_mesh != self.device_mesh or table.placements != self.placements:
            table = table.redistribute(device_mesh=self.device_mesh, placements=self.placements)
        return F.linear(h, table)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        state_dict.pop(prefix + "weight", None)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)


class LlamaForCausalLM(nn.Module):
    """HF's ``LlamaForCausalLM`` on a dtorch mesh. ``config`` is a ``transformers.LlamaConfig``;
    ``device_mesh`` (default: the graph's) has dims named from ``MESH_DIMS``. ``dtype``: the
    parameters' dtype (default: float32).

    ``model(input_ids)`` takes token ids ``[batch, seq]`` (a torch tensor, or a dtorch tensor
    on any mesh) and returns the logits ``[batch, seq, vocab]`` as a dtorch tensor: on the input
    tensor's mesh, laid out as it was (a torch input: Replicate on the first stage's mesh)."""

    def __init__(self, config, device_mesh: DeviceMesh | None = None, dtype=None):
        super().__init__()
        mesh = dtorch.get_default_device_mesh(device_mesh=device_mesh)
        mesh.check_all_dim_names_in_set(set(MESH_DIMS))
        self.config, self.device_mesh = config, mesh
        self.model = LlamaModel(config, mesh, dtype)
        last = self.model.stage_meshes[-1]
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head = TiedLMHead(self.model.embed_tokens, last)
        else:
            with _guard(last):
                self.lm_head = nn.ColumnParallelLinear(config.hidden_size, config.vocab_size,
                                                       bias=False, dtype=dtype)

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None) -> None:
        """HF's switch: in training mode each decoder layer's activations are recomputed in
        the backward (``dtorch.nn.checkpoint``, given ``gradient_checkpointing_kwargs``: a
        ``context_fn`` of torch's ``create_selective_checkpoint_contexts`` keeps what its
        policy saves) instead of kept."""
        self.model.gradient_checkpointing = True
        self.model.checkpoint_kwargs = dict(gradient_checkpointing_kwargs or {})

    def gradient_checkpointing_disable(self) -> None:
        self.model.gradient_checkpointing = False

    @property
    def is_gradient_checkpointing(self) -> bool:
        return self.model.gradient_checkpointing

    @classmethod
    def from_pretrained(cls, path, device_mesh: DeviceMesh | None = None, dtype=None,
                        progress=None):
        """The model of an HF checkpoint directory (``config.json`` and safetensors files),
        read locally: each host reads only the slices its devices hold. ``dtype``: the
        parameters' (default float32); as in HF, the RoPE frequencies stay float32. The model
        is built without values (``dtorch.nn.init_empty``: nothing drawn, nothing allocated),
        so each host's memory grows by its share of the weights as they are read."""
        from transformers import LlamaConfig

        config = LlamaConfig.from_pretrained(os.fspath(path))
        with dtorch.nn.init_empty():
            model = cls(config, device_mesh, dtype)
        tied = getattr(config, "tie_word_embeddings", False)
        # each value is cast to its parameter's dtype (the model was built in ``dtype``)
        load_checkpoint(model, path, progress=progress,
                        key_map=(lambda k: None if k == "lm_head.weight" else k) if tied
                        else None)
        return model

    # -- the call -------------------------------------------------------------------------------
    def first_stage_mesh(self) -> DeviceMesh:
        return self.model.stage_meshes[0]

    def place_tokens(self, input_ids, shard_sequence: bool = True) -> Tensor:
        """Token ids laid out for the first stage (see ``token_placements``)."""
        mesh = self.first_stage_mesh()
        if isinstance(input_ids, torch.Tensor):
            input_ids = dtorch.from_torch(input_ids, device_mesh=mesh)
        if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
            raise ValueError(f"LlamaForCausalLM: input_ids must be a [batch, seq] tensor of "
                             f"token ids, got {getattr(input_ids, 'shape', type(input_ids))}")
        layout = dict.fromkeys(range(mesh.ndim), R)
        layout.update({mesh.dim_name_index(n): p
                       for n, p in token_placements(mesh, shard_sequence).items()})
        placements = [layout[i] for i in range(mesh.ndim)]
        if input_ids.device_mesh == mesh and list(input_ids.placements) == placements:
            return input_ids
        return input_ids.redistribute(device_mesh=mesh, placements=placements)

    def __call__(self, input_ids, *args, **kwargs):
        source = input_ids if isinstance(input_ids, Tensor) else None
        logits = super().__call__(self.place_tokens(input_ids), *args, **kwargs)
        if source is None:
            mesh, placements = self.first_stage_mesh(), [R] * self.first_stage_mesh().ndim
        else:
            mesh, placements = source.device_mesh, list(source.placements)
        return logits.redistribute(device_mesh=mesh, placements=placements)

    def forward(self, input_ids: Tensor, cache: KVCache | None = None,
                last_only: bool = False) -> Tensor:
        h = self.model(input_ids, cache)
        if last_only:  # decoding needs the last position's logits only
            h = whole_along(h, Shard(1))[:, -1:]  # the sequence, split over CP, made whole
        return self.lm_head(h)

    # -- decoding -------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, input_ids, max_new_tokens: int = 20, do_sample: bool = False,
                 eos_token_id=None, pad_token_id=None, cache_implementation: str = "static",
                 **kwargs) -> torch.Tensor:
        """Greedy decoding, as HF's ``generate(do_sample=False)``: ``max_new_tokens`` tokens
        after ``input_ids`` (a ``[batch, seq]`` torch or dtorch tensor), a sequence that reached
        ``eos_token_id`` (default: the config's) padded with ``pad_token_id`` after it, and the
        output cut where every sequence has ended. Returns a torch tensor ``[batch, seq + n]``.

        Every step is issued without a wait (the next token's ids stay on the devices); the
        tokens are read once, at the end. ``cache_implementation``: ``"static"`` (a cache of
        the prompt's and the new tokens' positions, whose decode steps replay:
        ``models/kv_cache.py``) or ``"dynamic"`` (one that grows by a ``cat`` each step)."""
        if do_sample:
            raise NotImplementedError("LlamaForCausalLM.generate: only greedy decoding "
                                      "(do_sample=False) is supported")
        if kwargs:
            raise TypeError(f"LlamaForCausalLM.generate: unsupported arguments "
                            f"{sorted(kwargs)}")
        if cache_implementation not in ("static", "dynamic"):
            raise ValueError(f"LlamaForCausalLM.generate: cache_implementation must be "
                             f"'static' or 'dynamic', got {cache_implementation!r}")
        prompt = input_ids.to_torch() if isinstance(input_ids, Tensor) else input_ids
        cache = KVCache() if cache_implementation == "dynamic" else StaticKVCache(
            prompt.shape[1] + max_new_tokens)
        tokens = []
        ids = self.place_tokens(prompt)
        for step in range(max_new_tokens):
            logits = super().__call__(ids, cache, last_only=True)
            # [batch], on the last stage; the tp head's vocabulary made whole first
            # [batch, 1] (no view of a step's tensor outlives the step, so steps replay)
            next_ids = whole_along(logits[:, -1], Shard(1)).argmax(-1, keepdim=True)
            tokens.append(next_ids)
            if step == 0:
                cache.gather_sequence()
            ids = self.place_tokens(next_ids, shard_sequence=False)
        if not tokens:
            return prompt.clone()
        new = dtorch.cat(tokens, dim=1).to_torch()  # the one read
        return torch.cat([prompt, _stop_at_eos(new, self._eos(eos_token_id), pad_token_id)],
                         dim=1)

    def _eos(self, eos_token_id) -> list:
        eos = self.config.eos_token_id if eos_token_id is None else eos_token_id
        if eos is None:
            return []
        return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def _stop_at_eos(new: torch.Tensor, eos: list, pad_token_id) -> torch.Tensor:
    """HF's stopping: after a sequence's first EOS its tokens are ``pad_token_id`` (default: the
    first EOS), and decoding stops at the step where the last sequence ends."""
    if not eos:
        return new
    pad = eos[0] if pad_token_id is None else int(pad_token_id)
    out = new.clone()
    unfinished = torch.ones(new.shape[0], dtype=torch.bool)
    for step in range(new.shape[1]):
        out[:, step] = torch.where(unfinished, new[:, step], pad)
        unfinished &= ~torch.isin(out[:, step], torch.tensor(eos))
        if not unfinished.any():
            return out[:, :step + 1]
    return out
