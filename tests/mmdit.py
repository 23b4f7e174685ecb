"""MMDiT blocks (Stable Diffusion 3's ``JointTransformerBlock``, Flux's double- and single-stream
blocks) written with ``dtorch.nn``, their parameters named as diffusers names them, so
``load_state_dict(block.state_dict())`` of a diffusers block loads it.

The layout comes from the mesh and the inputs: on ``tp`` the heads split (the query, key and
value projections of both streams column-parallel, the output projections row-parallel, one
all-reduce each) and so do the feed-forwards' hidden features; on ``dp`` the batch; on the
context-parallel dims (``ulysess_cp``, ``ring_cp``) the sequence of both streams. Joint
attention concatenates the image and the text tokens along the sequence, attends over all of
them and splits the result back: under context parallelism the concatenation is a sub-split
Shard (each device holds its block of the first stream's tokens, then its block of the
second's), and slicing at the first stream's length gives each stream back in its own Shard.
"""

from __future__ import annotations

import dtorch
from dtorch import nn
from dtorch.nn import functional as F

EPS = 1e-6


class AdaptiveLayerNorm(nn.Module):
    """A layer norm without weights, shifted and scaled by ``CHUNKS`` projections of the
    conditioning (the others are gates)."""

    CHUNKS = 2

    def __init__(self, dim: int):
        super().__init__()
        self.silu = nn.SiLU()
        self.linear = nn.ColumnParallelLinearWithReplicateOutput(dim, self.CHUNKS * dim)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=EPS)

    def modulate(self, x, shift, scale):
        return modulated(self.norm(x), shift, scale)

    def chunks(self, emb, dtype=None) -> tuple:
        emb = self.silu(emb)
        return self.linear(emb if dtype is None else emb.to(dtype)).chunk(self.CHUNKS, dim=1)


def modulated(normed, shift, scale):
    return normed * (1 + scale[:, None]) + shift[:, None]


class AdaLayerNormZero(AdaptiveLayerNorm):
    """With the gates of the attention's and the MLP's residuals, and the MLP's shift and
    scale."""

    CHUNKS = 6

    def forward(self, x, emb):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.chunks(emb)
        return self.modulate(x, shift_msa, scale_msa), gate_msa, shift_mlp, scale_mlp, gate_mlp


class SD35AdaLayerNormZeroX(AdaLayerNormZero):
    """SD3.5's, for a block with a second attention over the image tokens: a second
    modulation of the same norm, and its gate."""

    CHUNKS = 9

    def forward(self, x, emb):
        (shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp, shift_msa2, scale_msa2,
         gate_msa2) = self.chunks(emb)
        normed = self.norm(x)
        return (modulated(normed, shift_msa, scale_msa), gate_msa, shift_mlp, scale_mlp, gate_mlp,
                modulated(normed, shift_msa2, scale_msa2), gate_msa2)


class AdaLayerNormContinuous(AdaptiveLayerNorm):
    """SD3's last context norm: no gates."""

    def forward(self, x, emb):
        scale, shift = self.chunks(emb, x.dtype)
        return self.modulate(x, shift, scale)


class AdaLayerNormZeroSingle(AdaptiveLayerNorm):
    """Flux's single-stream norm, with the gate of the residual."""

    CHUNKS = 3

    def forward(self, x, emb):
        shift, scale, gate = self.chunks(emb)
        return self.modulate(x, shift, scale), gate


def apply_rotary_emb(x, freqs):
    """Flux's RoPE on ``[b, heads, s, head_dim]``: ``freqs`` is ``(cos, sin)``, ``[s,
    head_dim]`` each, the channel pairs interleaved."""
    cos, sin = (t[None, None] for t in freqs)
    x_real, x_imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    rotated = dtorch.stack([-x_imag, x_real], dim=-1).flatten(3)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def _rms_norm(qk_norm: str | None, head_dim: int):
    return nn.RMSNorm(head_dim, eps=EPS) if qk_norm == "rms_norm" else None


class Attention(nn.Module):
    """Self-attention over one stream; ``pre_only`` (Flux's single blocks) leaves out the
    output projection."""

    def __init__(self, dim: int, heads: int, head_dim: int, qk_norm: str | None,
                 pre_only: bool = False):
        super().__init__()
        inner = heads * head_dim
        self.heads, self.head_dim = heads, head_dim
        self.to_q, self.to_k, self.to_v = (nn.ColumnParallelLinear(dim, inner) for _ in "qkv")
        self.norm_q, self.norm_k = _rms_norm(qk_norm, head_dim), _rms_norm(qk_norm, head_dim)
        self.to_out = None if pre_only else nn.ModuleList(
            [nn.RowParallelLinearWithReplicateOutput(inner, dim), nn.Dropout(0.0)])

    def _heads(self, x, proj, norm):
        """``[b, s, dim]`` -> ``[b, heads, s, head_dim]``, normalised per head."""
        t = proj(x)
        t = t.view(t.shape[0], -1, self.heads, self.head_dim).transpose(1, 2)
        return t if norm is None else norm(t)

    def project(self, x) -> tuple:
        return (self._heads(x, self.to_q, self.norm_q), self._heads(x, self.to_k, self.norm_k),
                self._heads(x, self.to_v, None))

    def attend(self, q, k, v, image_rotary_emb=None):
        """``[b, s, heads * head_dim]``: every position attends to every other."""
        if image_rotary_emb is not None:
            q, k = apply_rotary_emb(q, image_rotary_emb), apply_rotary_emb(k, image_rotary_emb)
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=False)
        return out.transpose(1, 2).reshape(q.shape[0], -1, self.heads * self.head_dim)

    def forward(self, hidden_states, image_rotary_emb=None):
        out = self.attend(*self.project(hidden_states), image_rotary_emb)
        return out if self.to_out is None else self.to_out[1](self.to_out[0](out))


class JointAttention(Attention):
    """Attention over the image and text tokens together, each stream with its own
    projections; the tokens are concatenated image first (SD3) or text first (Flux, whose
    RoPE tables cover the joint sequence)."""

    def __init__(self, dim: int, heads: int, head_dim: int, context_pre_only: bool,
                 qk_norm: str | None, text_first: bool = False):
        super().__init__(dim, heads, head_dim, qk_norm)
        inner = heads * head_dim
        self.text_first = text_first
        self.add_q_proj, self.add_k_proj, self.add_v_proj = (
            nn.ColumnParallelLinear(dim, inner) for _ in "qkv")
        self.norm_added_q = _rms_norm(qk_norm, head_dim)
        self.norm_added_k = _rms_norm(qk_norm, head_dim)
        self.to_add_out = (None if context_pre_only
                           else nn.RowParallelLinearWithReplicateOutput(inner, dim))

    def project_context(self, x) -> tuple:
        return (self._heads(x, self.add_q_proj, self.norm_added_q),
                self._heads(x, self.add_k_proj, self.norm_added_k),
                self._heads(x, self.add_v_proj, None))

    def forward(self, hidden_states, encoder_hidden_states, image_rotary_emb=None):
        image, text = self.project(hidden_states), self.project_context(encoder_hidden_states)
        first, second = (text, image) if self.text_first else (image, text)
        out = self.attend(*(dtorch.cat([a, b], dim=2) for a, b in zip(first, second)),
                          image_rotary_emb)
        length = first[0].shape[2]
        first, second = out[:, :length], out[:, length:]
        image, text = (second, first) if self.text_first else (first, second)
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
    """``diffusers.models.attention.JointTransformerBlock``: ``(encoder_hidden_states,
    hidden_states)`` from both streams and the conditioning ``temb``. The last block of a model
    (``context_pre_only``) returns no text stream; SD3.5's ``use_dual_attention`` adds a second
    attention over the image tokens alone."""

    TEXT_FIRST = False

    def __init__(self, dim: int, num_attention_heads: int, attention_head_dim: int,
                 context_pre_only: bool = False, qk_norm: str | None = None,
                 use_dual_attention: bool = False):
        super().__init__()
        self.context_pre_only = context_pre_only
        self.norm1 = SD35AdaLayerNormZeroX(dim) if use_dual_attention else AdaLayerNormZero(dim)
        self.norm1_context = (AdaLayerNormContinuous(dim) if context_pre_only
                              else AdaLayerNormZero(dim))
        self.attn = JointAttention(dim, num_attention_heads, attention_head_dim,
                                   context_pre_only, qk_norm, self.TEXT_FIRST)
        self.attn2 = (Attention(dim, num_attention_heads, attention_head_dim, qk_norm)
                      if use_dual_attention else None)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=EPS)
        self.ff = FeedForward(dim)
        if not context_pre_only:
            self.norm2_context = nn.LayerNorm(dim, elementwise_affine=False, eps=EPS)
            self.ff_context = FeedForward(dim)

    def forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None):
        norm_hidden, gate_msa, shift_mlp, scale_mlp, gate_mlp, *second = self.norm1(
            hidden_states, temb)
        if self.context_pre_only:
            norm_context = self.norm1_context(encoder_hidden_states, temb)
        else:
            norm_context, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(
                encoder_hidden_states, temb)
        attn_output, context_attn_output = self.attn(norm_hidden, norm_context,
                                                     image_rotary_emb)

        hidden_states = hidden_states + gate_msa.unsqueeze(1) * attn_output
        if self.attn2 is not None:
            norm_hidden2, gate_msa2 = second
            hidden_states = hidden_states + gate_msa2.unsqueeze(1) * self.attn2(norm_hidden2)
        norm_hidden = modulated(self.norm2(hidden_states), shift_mlp, scale_mlp)
        hidden_states = hidden_states + gate_mlp.unsqueeze(1) * self.ff(norm_hidden)
        if self.context_pre_only:
            return None, hidden_states

        encoder_hidden_states = encoder_hidden_states + c_gate_msa.unsqueeze(1) * \
            context_attn_output
        norm_context = modulated(self.norm2_context(encoder_hidden_states), c_shift_mlp,
                                 c_scale_mlp)
        encoder_hidden_states = encoder_hidden_states + c_gate_mlp.unsqueeze(1) * \
            self.ff_context(norm_context)
        return encoder_hidden_states, hidden_states


class FluxTransformerBlock(JointTransformerBlock):
    """``diffusers``' ``FluxTransformerBlock``: SD3's block with the text tokens first and RoPE
    (``image_rotary_emb``, the ``(cos, sin)`` tables of the joint sequence)."""

    TEXT_FIRST = True

    def __init__(self, dim: int, num_attention_heads: int, attention_head_dim: int,
                 qk_norm: str = "rms_norm"):
        super().__init__(dim, num_attention_heads, attention_head_dim, False, qk_norm)


class FluxSingleTransformerBlock(nn.Module):
    """``diffusers``' ``FluxSingleTransformerBlock``: one stream (the text and image tokens
    concatenated), attention and an MLP side by side, their outputs concatenated along the
    features (on ``tp`` each device holds its heads' block and its MLP block: the output
    projection gathers them)."""

    def __init__(self, dim: int, num_attention_heads: int, attention_head_dim: int,
                 mlp_ratio: float = 4.0):
        super().__init__()
        hidden = int(dim * mlp_ratio)
        self.norm = AdaLayerNormZeroSingle(dim)
        self.proj_mlp = nn.ColumnParallelLinear(dim, hidden)
        self.act_mlp = nn.GELU(approximate="tanh")
        self.proj_out = nn.ColumnParallelLinearWithReplicateInputOutput(dim + hidden, dim)
        self.attn = Attention(dim, num_attention_heads, attention_head_dim, "rms_norm",
                              pre_only=True)

    def forward(self, hidden_states, temb, image_rotary_emb=None):
        norm_hidden, gate = self.norm(hidden_states, temb)
        mlp = self.act_mlp(self.proj_mlp(norm_hidden))
        both = dtorch.cat([self.attn(norm_hidden, image_rotary_emb), mlp], dim=2)
        return hidden_states + gate.unsqueeze(1) * self.proj_out(both)
