"""An MMDiT block (Stable Diffusion 3's ``JointTransformerBlock``) written with ``dtorch.nn``,
its parameters named as diffusers names them, so ``load_state_dict(block.state_dict())`` of a
diffusers block loads it.

The layout comes from the mesh and the inputs: on ``tp`` the heads split (the query, key and
value projections of both streams column-parallel, the output projections row-parallel, one
all-reduce each) and so do the feed-forwards' hidden features; on ``dp`` the batch; on the
context-parallel dims (``ulysess_cp``, ``ring_cp``) the sequence of both streams. Joint
attention concatenates the image and the text tokens along the sequence, attends over all of
them and splits the result back: under context parallelism the concatenation is a sub-split
Shard (each device holds its block of the image tokens, then its block of the text tokens), and
slicing at the image length gives each stream back in its own Shard.
"""

from __future__ import annotations

import dtorch
from dtorch import nn
from dtorch.nn import functional as F

EPS = 1e-6


class AdaLayerNormZero(nn.Module):
    """A layer norm shifted and scaled by the conditioning, with the gates of the residuals."""

    def __init__(self, dim: int):
        super().__init__()
        self.silu = nn.SiLU()
        self.linear = nn.ColumnParallelLinearWithReplicateOutput(dim, 6 * dim)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=EPS)

    def forward(self, x, emb):
        emb = self.linear(self.silu(emb))
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = emb.chunk(6, dim=1)
        x = self.norm(x) * (1 + scale_msa[:, None]) + shift_msa[:, None]
        return x, gate_msa, shift_mlp, scale_mlp, gate_mlp


class AdaLayerNormContinuous(nn.Module):
    """The last block's context norm: shifted and scaled, no gates."""

    def __init__(self, dim: int):
        super().__init__()
        self.silu = nn.SiLU()
        self.linear = nn.ColumnParallelLinearWithReplicateOutput(dim, 2 * dim)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=EPS)

    def forward(self, x, emb):
        scale, shift = self.linear(self.silu(emb).to(x.dtype)).chunk(2, dim=1)
        return self.norm(x) * (1 + scale)[:, None, :] + shift[:, None, :]


class JointAttention(nn.Module):
    """Attention over the image and text tokens together, each stream with its own
    projections."""

    def __init__(self, dim: int, heads: int, head_dim: int, context_pre_only: bool,
                 qk_norm: str | None):
        super().__init__()
        inner = heads * head_dim
        self.heads, self.head_dim = heads, head_dim
        for name in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"):
            setattr(self, name, nn.ColumnParallelLinear(dim, inner))
        for name in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
            setattr(self, name, nn.RMSNorm(head_dim, eps=EPS) if qk_norm == "rms_norm" else None)
        self.to_out = nn.ModuleList([nn.RowParallelLinearWithReplicateOutput(inner, dim),
                                     nn.Dropout(0.0)])
        self.to_add_out = (None if context_pre_only
                           else nn.RowParallelLinearWithReplicateOutput(inner, dim))

    def _heads(self, x, proj, norm):
        """``[b, s, dim]`` -> ``[b, heads, s, head_dim]``, normalised per head."""
        t = proj(x)
        t = t.view(t.shape[0], -1, self.heads, self.head_dim).transpose(1, 2)
        return t if norm is None else norm(t)

    def forward(self, hidden_states, encoder_hidden_states):
        batch, image_len = hidden_states.shape[:2]
        q = dtorch.cat([self._heads(hidden_states, self.to_q, self.norm_q),
                        self._heads(encoder_hidden_states, self.add_q_proj,
                                    self.norm_added_q)], dim=2)
        k = dtorch.cat([self._heads(hidden_states, self.to_k, self.norm_k),
                        self._heads(encoder_hidden_states, self.add_k_proj,
                                    self.norm_added_k)], dim=2)
        v = dtorch.cat([self._heads(hidden_states, self.to_v, None),
                        self._heads(encoder_hidden_states, self.add_v_proj, None)], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=False)
        out = out.transpose(1, 2).reshape(batch, -1, self.heads * self.head_dim)
        image, text = out[:, :image_len], out[:, image_len:]
        image = self.to_out[1](self.to_out[0](image))
        return image, (text if self.to_add_out is None else self.to_add_out(text))


class GELU(nn.Module):
    """diffusers' ``GELU``: a projection, then the activation."""

    def __init__(self, dim_in: int, dim_out: int, approximate: str):
        super().__init__()
        self.proj = nn.ColumnParallelLinear(dim_in, dim_out)
        self.approximate = approximate

    def forward(self, x):
        return F.gelu(self.proj(x), approximate=self.approximate)


class FeedForward(nn.Module):
    def __init__(self, dim: int, mult: int = 4):
        super().__init__()
        self.net = nn.ModuleList([GELU(dim, dim * mult, "tanh"), nn.Dropout(0.0),
                                  nn.RowParallelLinearWithReplicateOutput(dim * mult, dim)])

    def forward(self, x):
        for layer in self.net:
            x = layer(x)
        return x


class JointTransformerBlock(nn.Module):
    """``diffusers.models.attention.JointTransformerBlock`` (without SD3.5's dual attention):
    ``(encoder_hidden_states, hidden_states)`` from both streams and the conditioning ``temb``;
    the last block of a model (``context_pre_only``) returns no text stream."""

    def __init__(self, dim: int, num_attention_heads: int, attention_head_dim: int,
                 context_pre_only: bool = False, qk_norm: str | None = None):
        super().__init__()
        self.context_pre_only = context_pre_only
        self.norm1 = AdaLayerNormZero(dim)
        self.norm1_context = (AdaLayerNormContinuous(dim) if context_pre_only
                              else AdaLayerNormZero(dim))
        self.attn = JointAttention(dim, num_attention_heads, attention_head_dim,
                                   context_pre_only, qk_norm)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=EPS)
        self.ff = FeedForward(dim)
        if not context_pre_only:
            self.norm2_context = nn.LayerNorm(dim, elementwise_affine=False, eps=EPS)
            self.ff_context = FeedForward(dim)

    def forward(self, hidden_states, encoder_hidden_states, temb):
        norm_hidden, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(hidden_states, temb)
        if self.context_pre_only:
            norm_context = self.norm1_context(encoder_hidden_states, temb)
        else:
            norm_context, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(
                encoder_hidden_states, temb)
        attn_output, context_attn_output = self.attn(norm_hidden, norm_context)

        hidden_states = hidden_states + gate_msa.unsqueeze(1) * attn_output
        norm_hidden = self.norm2(hidden_states) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
        hidden_states = hidden_states + gate_mlp.unsqueeze(1) * self.ff(norm_hidden)
        if self.context_pre_only:
            return None, hidden_states

        encoder_hidden_states = encoder_hidden_states + c_gate_msa.unsqueeze(1) * \
            context_attn_output
        norm_context = (self.norm2_context(encoder_hidden_states) * (1 + c_scale_mlp[:, None])
                        + c_shift_mlp[:, None])
        encoder_hidden_states = encoder_hidden_states + c_gate_mlp.unsqueeze(1) * \
            self.ff_context(norm_context)
        return encoder_hidden_states, hidden_states
