"""A T5-like encoder and a CLIP-like text model written with ``dtorch.nn``, whose parameter names
are HF's (``T5EncoderModel``, ``CLIPTextModel``), so an HF ``state_dict`` loads into them
strictly. They run on any mesh with dims named from ("dp", "tp", "ulysess_cp", "ring_cp"):
the batch on ``dp``, heads and MLP columns on ``tp``, the sequence on the CP dims.

T5's attention adds a relative position bias to its scores, which the CP attention kernels do not
take (they refuse a mask), so under CP each device keeps its block of queries and gathers the keys
and values (the bias rows are then its block's rows). CLIP's causal attention is
``scaled_dot_product_attention(is_causal=True)``: Ulysses or Ring attention on the CP dims.
"""

from __future__ import annotations

import math

import dtorch
from dtorch import Graph, Replicate, Shard, nn

CP_DIMS = ("ulysess_cp", "ring_cp")


def input_layout(x, mesh):
    """Token ids ``[batch, seq]`` as the models take them: batch on dp, sequence on CP."""
    layout = {"dp": Shard(0), "tp": Replicate(), **{d: Shard(1) for d in CP_DIMS}}
    return x.redistribute_by_dict(mesh, layout)


def whole_sequence(x, seq_dim: int):
    """``x`` with its sequence dim gathered on the CP dims (other mesh dims kept)."""
    placements = [Replicate() if name in CP_DIMS and p == Shard(seq_dim) else p
                  for name, p in zip(x.device_mesh.mesh_dim_names or (), x.placements)]
    return x.redistribute(x.device_mesh, placements) if placements else x


class _Encoder(nn.Module):
    """Builds its parameters on ``device_mesh`` and takes token ids in any layout."""

    def __init__(self, device_mesh):
        super().__init__()
        self.mesh = device_mesh

    def redistribute_input(self, input_ids):
        return (input_layout(input_ids, self.mesh),), {}


# -- T5 ----------------------------------------------------------------------------------------


class T5LayerNorm(nn.Module):
    """Scales by the root mean square, without centring or bias (T5's norm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(dtorch.ones(dim))
        self.eps = eps

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * dtorch.rsqrt(variance + self.eps))


def relative_position_bucket(relative, num_buckets: int, max_distance: int):
    """T5's bidirectional buckets: half for each sign, exact up to ``num_buckets / 4`` apart,
    then logarithmic up to ``max_distance``."""
    num_buckets //= 2
    buckets = (relative > 0).long() * num_buckets
    distance = relative.abs()
    max_exact = num_buckets // 2
    scaled = dtorch.log(distance.float() / max_exact) / math.log(max_distance / max_exact)
    large = dtorch.clamp(max_exact + (scaled * (num_buckets - max_exact)).long(),
                         max=num_buckets - 1)
    return buckets + dtorch.where(distance < max_exact, distance, large)


class T5Attention(nn.Module):
    def __init__(self, cfg, has_bias: bool):
        super().__init__()
        self.heads, self.d_kv = cfg.num_heads, cfg.d_kv
        inner = self.heads * self.d_kv
        self.q = nn.ColumnParallelLinear(cfg.d_model, inner, bias=False)
        self.k = nn.ColumnParallelLinear(cfg.d_model, inner, bias=False)
        self.v = nn.ColumnParallelLinear(cfg.d_model, inner, bias=False)
        self.o = nn.RowParallelLinearWithReplicateOutput(inner, cfg.d_model, bias=False)
        self.buckets, self.max_distance = (cfg.relative_attention_num_buckets,
                                           cfg.relative_attention_max_distance)
        if has_bias:  # a plain Embedding: its columns, the heads, shard on tp as the scores do
            self.relative_attention_bias = nn.Embedding(self.buckets, self.heads)

    def position_bias(self, length: int, mesh):
        position = dtorch.arange(length, device_mesh=mesh)
        relative = position[None, :] - position[:, None]  # key position - query position
        bucket = relative_position_bucket(relative, self.buckets, self.max_distance)
        return self.relative_attention_bias(bucket).permute(2, 0, 1).unsqueeze(0)

    def split_heads(self, x):
        b, s, _ = x.shape
        return x.view(b, s, self.heads, self.d_kv).transpose(1, 2)

    def forward(self, x, bias):
        q, k, v = (self.split_heads(proj(x)) for proj in (self.q, self.k, self.v))
        if bias is None:
            bias = self.position_bias(x.shape[1], x.device_mesh)
        k, v = whole_sequence(k, 2), whole_sequence(v, 2)
        scores = dtorch.matmul(q, k.transpose(3, 2)) + bias  # T5 does not scale its scores
        out = dtorch.matmul(scores.softmax(dim=-1), v).transpose(1, 2)
        return self.o(out.reshape(x.shape[0], x.shape[1], -1)), bias


class T5SelfAttentionLayer(nn.Module):
    def __init__(self, cfg, has_bias: bool):
        super().__init__()
        self.SelfAttention = T5Attention(cfg, has_bias)
        self.layer_norm = T5LayerNorm(cfg.d_model, cfg.layer_norm_epsilon)

    def forward(self, x, bias):
        out, bias = self.SelfAttention(self.layer_norm(x), bias)
        return x + out, bias


class T5GatedGeluDense(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.wi_0 = nn.ColumnParallelLinear(cfg.d_model, cfg.d_ff, bias=False)
        self.wi_1 = nn.ColumnParallelLinear(cfg.d_model, cfg.d_ff, bias=False)
        self.wo = nn.RowParallelLinearWithReplicateOutput(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x):  # HF's "gelu_new" is the tanh approximation
        return self.wo(nn.functional.gelu(self.wi_0(x), approximate="tanh") * self.wi_1(x))


class T5FeedForwardLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.DenseReluDense = T5GatedGeluDense(cfg)
        self.layer_norm = T5LayerNorm(cfg.d_model, cfg.layer_norm_epsilon)

    def forward(self, x):
        return x + self.DenseReluDense(self.layer_norm(x))


class T5Block(nn.Module):
    def __init__(self, cfg, has_bias: bool):
        super().__init__()
        self.layer = nn.ModuleList([T5SelfAttentionLayer(cfg, has_bias), T5FeedForwardLayer(cfg)])

    def forward(self, x, bias):
        x, bias = self.layer[0](x, bias)
        return self.layer[1](x), bias


class T5Stack(nn.Module):
    def __init__(self, cfg, embed_tokens):
        super().__init__()
        self.embed_tokens = embed_tokens
        # only the first block holds the bias table; the others reuse its bias
        self.block = nn.ModuleList([T5Block(cfg, i == 0) for i in range(cfg.num_layers)])
        self.final_layer_norm = T5LayerNorm(cfg.d_model, cfg.layer_norm_epsilon)

    def forward(self, input_ids):
        x, bias = self.embed_tokens(input_ids), None
        for block in self.block:
            x, bias = block(x, bias)
        return self.final_layer_norm(x)


class T5Encoder(_Encoder):
    """HF's ``T5EncoderModel`` (gated-gelu feed-forward): the last hidden state."""

    def __init__(self, cfg, device_mesh):
        super().__init__(device_mesh)
        with Graph.default_graph().device_mesh_guard(device_mesh):
            self.shared = nn.EmbeddingWithReplicateOutput(cfg.vocab_size, cfg.d_model)
            self.encoder = T5Stack(cfg, self.shared)

    def forward(self, input_ids):
        return self.encoder(input_ids)


# -- CLIP ----------------------------------------------------------------------------------------


class CLIPAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        dim, self.heads = cfg.hidden_size, cfg.num_attention_heads
        self.q_proj, self.k_proj, self.v_proj = (nn.ColumnParallelLinear(dim, dim)
                                                 for _ in range(3))
        self.out_proj = nn.RowParallelLinearWithReplicateOutput(dim, dim)

    def forward(self, x):
        b, s, dim = x.shape
        q, k, v = (p(x).view(b, s, self.heads, -1).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(out.transpose(1, 2).reshape(b, s, dim))


class CLIPMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.fc1 = nn.ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.RowParallelLinearWithReplicateOutput(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(h * dtorch.sigmoid(1.702 * h))  # quick gelu


class CLIPEncoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.self_attn, self.mlp = CLIPAttention(cfg), CLIPMLP(cfg)
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x):
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEmbeddings(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.token_embedding = nn.EmbeddingWithReplicateOutput(cfg.vocab_size, cfg.hidden_size)
        self.position_embedding = nn.EmbeddingWithReplicateOutput(cfg.max_position_embeddings,
                                                                  cfg.hidden_size)

    def forward(self, input_ids):
        positions = dtorch.arange(input_ids.shape[1], device_mesh=input_ids.device_mesh)
        return self.token_embedding(input_ids) + self.position_embedding(positions)


class CLIPEncoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.layers = nn.ModuleList([CLIPEncoderLayer(cfg) for _ in range(cfg.num_hidden_layers)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class CLIPTextTransformer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embeddings, self.encoder = CLIPEmbeddings(cfg), CLIPEncoder(cfg)
        self.final_layer_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, input_ids):
        last = self.final_layer_norm(self.encoder(self.embeddings(input_ids)))
        # the pooled state is the one at the largest id (the end token, in CLIP's vocabulary):
        # gathered per sequence, so a dp-sharded batch stays sharded
        at = whole_sequence(input_ids, 1).argmax(dim=-1)
        index = at[:, None, None].expand(-1, 1, last.shape[-1])
        return last, dtorch.gather(whole_sequence(last, 1), 1, index).squeeze(1)


class CLIPText(_Encoder):
    """HF's ``CLIPTextModel``: (last hidden state, pooled output)."""

    def __init__(self, cfg, device_mesh):
        super().__init__(device_mesh)
        with Graph.default_graph().device_mesh_guard(device_mesh):
            self.text_model = CLIPTextTransformer(cfg)

    def forward(self, input_ids):
        return self.text_model(input_ids)
