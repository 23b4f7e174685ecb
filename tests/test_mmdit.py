"""MMDiT blocks with joint attention (``tests/mmdit.py``, written with ``dtorch.nn``) against
diffusers' SD3 ``JointTransformerBlock`` and Flux's ``FluxTransformerBlock`` and
``FluxSingleTransformerBlock`` with the same random weights, on one device, tensor and data
parallel meshes, and with the sequence of both streams split over Ulysses and Ring context
parallelism, where joint attention concatenates two sharded sequences (and Flux its RoPE
tables): the outputs, and the gradients of the double-stream blocks."""

import inspect

import pytest
import torch

import dtorch
from dtorch import Replicate, Shard
from mmdit import FluxSingleTransformerBlock, FluxTransformerBlock, JointTransformerBlock

diffusers_attention = pytest.importorskip("diffusers.models.attention")
diffusers_flux = pytest.importorskip("diffusers.models.transformers.transformer_flux")
diffusers_embeddings = pytest.importorskip("diffusers.models.embeddings")

DIM, HEADS, HEAD_DIM = 32, 4, 8
BATCH, IMAGE_LEN, TEXT_LEN = 3, 8, 6  # dp2 splits the batch 2 + 1
IMAGE_ROWS = 2  # Flux's image positions: a 2 x 4 grid
CP_DIMS = ("ulysess_cp", "ring_cp")
# name: (mesh shape, mesh dim names)
LAYOUTS = {
    "one": ((1,), ["tp"]),
    "tp2": ((2,), ["tp"]),
    "dp2-tp2": ((2, 2), ["dp", "tp"]),
    "ulysses2": ((2,), ["ulysess_cp"]),
    "ring2": ((2,), ["ring_cp"]),
    "tp2-ulysses2": ((2, 2), ["tp", "ulysess_cp"]),
    "dp2-ring2": ((2, 2), ["dp", "ring_cp"]),
    "ulysses2-ring2": ((2, 2), ["ulysess_cp", "ring_cp"]),  # the text's blocks 2, 2, 1, 1
    # SD3's four dims, two of one device (where the inputs' Shards are Replicate)
    "sd3-mesh-tp2-ring2": ((1, 2, 1, 2), ["dp", "tp", "ulysess_cp", "ring_cp"]),
}


def mesh_of(layout):
    shape, names = LAYOUTS[layout]
    return dtorch.init_device_mesh("cpu", shape, mesh_dim_names=names)


def randomized(module):
    """``module`` with random norm weights (diffusers starts them at 1), in eval mode."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name and name.endswith("weight") and "linear" not in name:
                p.uniform_(0.5, 1.5)
    return module.eval()


def inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(BATCH, IMAGE_LEN, DIM, generator=g),
            torch.randn(BATCH, TEXT_LEN, DIM, generator=g),
            torch.randn(BATCH, DIM, generator=g))


def placed(t, mesh, seq_dim=None, batch_dim=0):
    """``t`` with ``batch_dim`` over ``dp`` and ``seq_dim`` over the CP dims (every one, as
    DTorch's programs lay out their inputs, whatever its size)."""
    layout = [Shard(batch_dim) if name == "dp" and batch_dim is not None else
              Shard(seq_dim) if name in CP_DIMS and seq_dim is not None else Replicate()
              for name in mesh.dim_names]
    return dtorch.from_torch(t, device_mesh=mesh, placements=layout)


def build(cls, mesh, reference, *args):
    with dtorch.Graph.default_graph().device_mesh_guard(mesh):
        block = cls(DIM, HEADS, HEAD_DIM, *args)
    block.load_state_dict(reference.state_dict())
    return block


def assert_equal_diffusers(got, want, mesh, placements=None, atol=1e-4, rtol=1e-4):
    """Same values (bit for bit on one device: the same kernels in the same order), laid out
    as the block's input (batch over dp, sequence over CP) unless ``placements`` says how."""
    assert got.placements == (placed(want, mesh, 1).placements if placements is None
                              else placements)
    if mesh.size() == 1:
        assert torch.equal(got.to_torch(), want)
    else:
        torch.testing.assert_close(got.to_torch(), want, atol=atol, rtol=rtol)


def rope_tables():
    """Flux's ``(cos, sin)`` tables of the text positions (all 0) and of the image grid's."""
    pos_embed = diffusers_embeddings.FluxPosEmbed(theta=10000, axes_dim=[2, 2, 4])
    text_ids = torch.zeros(TEXT_LEN, 3)
    rows, cols = torch.meshgrid(torch.arange(IMAGE_ROWS), torch.arange(IMAGE_LEN // IMAGE_ROWS),
                                indexing="ij")
    image_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).flatten(0, 1).float()
    return pos_embed(text_ids), pos_embed(image_ids)


def joint_rope(mesh):
    """The joint sequence's tables: the text's and the image's, each over the CP dims,
    concatenated (text first, as Flux orders the tokens)."""
    text, image = rope_tables()
    return tuple(dtorch.cat([placed(a, mesh, 0, None), placed(b, mesh, 0, None)], dim=0)
                 for a, b in zip(text, image))


def torch_joint_rope():
    text, image = rope_tables()
    return tuple(torch.cat([a, b]) for a, b in zip(text, image))


# kind: (diffusers' block, ours, our block's arguments after the sizes, whether it takes RoPE)
DOUBLE_STREAM = {
    "sd3": (lambda: diffusers_attention.JointTransformerBlock(DIM, HEADS, HEAD_DIM,
                                                              qk_norm="rms_norm"),
            JointTransformerBlock, (False, "rms_norm"), False),
    "sd3-last": (lambda: diffusers_attention.JointTransformerBlock(DIM, HEADS, HEAD_DIM,
                                                                   context_pre_only=True),
                 JointTransformerBlock, (True, None), False),
    "sd35-dual": (lambda: diffusers_attention.JointTransformerBlock(
        DIM, HEADS, HEAD_DIM, qk_norm="rms_norm", use_dual_attention=True),
        JointTransformerBlock, (False, "rms_norm", True), False),
    "flux": (lambda: diffusers_flux.FluxTransformerBlock(DIM, HEADS, HEAD_DIM),
             FluxTransformerBlock, (), True),
}


def run_double_stream(kind, layout):
    """diffusers' block and ours, loaded alike, on the same inputs: (reference, ours,
    diffusers' outputs, ours), each ``(encoder_hidden_states, hidden_states)``."""
    make_reference, cls, args, rope = DOUBLE_STREAM[kind]
    torch.manual_seed(0)
    ref = randomized(make_reference())
    mesh = mesh_of(layout)
    block = build(cls, mesh, ref, *args)
    hidden, context, temb = inputs()
    want = ref(hidden, context, temb, **({"image_rotary_emb": torch_joint_rope()} if rope
                                         else {}))
    got = block(placed(hidden, mesh, 1), placed(context, mesh, 1), placed(temb, mesh),
                image_rotary_emb=joint_rope(mesh) if rope else None)
    return ref, block, want, got


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kind", list(DOUBLE_STREAM))
def test_double_stream_block_equals_diffusers(kind, layout):
    """Both streams through joint attention: SD3's block, its last block (which drops the text
    stream), SD3.5's with a second attention over the image tokens, and Flux's."""
    _, block, (want_context, want_hidden), (got_context, got_hidden) = run_double_stream(
        kind, layout)
    mesh = block.norm1.linear.weight.device_mesh
    assert_equal_diffusers(got_hidden, want_hidden.detach(), mesh)
    if want_context is None:
        assert got_context is None
    else:
        assert_equal_diffusers(got_context, want_context.detach(), mesh)


def squares(context, hidden):
    return context.square().mean() + hidden.square().mean()


@pytest.mark.parametrize("layout", ["one", "tp2", "dp2-tp2", "ulysses2", "ring2",
                                    "ulysses2-ring2"])
@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_double_stream_block_gradients_equal_diffusers(kind, layout):
    """The backward of joint attention (the sub-split concatenation, the context-parallel
    attention over it and the slices back): every parameter's gradient equals diffusers'."""
    ref, block, want, got = run_double_stream(kind, layout)
    squares(*want).backward()
    squares(*got).backward()
    grads = dict(ref.named_parameters())
    for name, p in block.named_parameters():
        assert_equal_diffusers(p.grad, grads[name].grad, p.device_mesh, p.placements,
                               atol=1e-6, rtol=1e-5)


def flux_single_reference(ref, hidden, context, temb, rope):
    """diffusers' single-stream block on the joint sequence: diffusers 0.35 and later take the
    two streams and concatenate them inside (returning both), earlier ones the joint sequence."""
    if "encoder_hidden_states" in inspect.signature(ref.forward).parameters:
        return torch.cat(ref(hidden, context, temb, image_rotary_emb=rope), dim=1)
    return ref(torch.cat([context, hidden], dim=1), temb, image_rotary_emb=rope)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_flux_single_block_equals_diffusers(layout):
    """One stream, the text and image tokens concatenated along the sequence first."""
    torch.manual_seed(3)
    ref = randomized(diffusers_flux.FluxSingleTransformerBlock(DIM, HEADS, HEAD_DIM))
    mesh = mesh_of(layout)
    block = build(FluxSingleTransformerBlock, mesh, ref)
    hidden, context, temb = inputs()
    with torch.no_grad():
        want = flux_single_reference(ref, hidden, context, temb, torch_joint_rope())
    joint = dtorch.cat([placed(context, mesh, 1), placed(hidden, mesh, 1)], dim=1)
    rope = joint_rope(mesh)
    # on a CP dim each device holds its block of the text, then its block of the image
    for i, p in enumerate(placed(hidden, mesh, 1).placements):
        if p.is_shard(1):
            assert joint.placements[i] == Shard(1, sub_split=(TEXT_LEN, IMAGE_LEN))
            assert rope[0].placements[i] == Shard(0, sub_split=(TEXT_LEN, IMAGE_LEN))
    got = block(joint, placed(temb, mesh), image_rotary_emb=rope)
    assert_equal_diffusers(got, want, mesh, joint.placements)
