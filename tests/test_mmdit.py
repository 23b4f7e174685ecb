"""An MMDiT block with joint attention (``tests/mmdit.py``, written with ``dtorch.nn``) against
diffusers' SD3 ``JointTransformerBlock`` with the same random weights, on one device, tensor
and data parallel meshes, and with the sequence of both streams split over Ulysses and Ring
context parallelism, where joint attention concatenates two sharded sequences."""

import pytest
import torch

import dtorch
from dtorch import Replicate, Shard
from mmdit import JointTransformerBlock

diffusers_attention = pytest.importorskip("diffusers.models.attention")

DIM, HEADS, HEAD_DIM = 32, 4, 8
BATCH, IMAGE_LEN, TEXT_LEN = 3, 8, 6  # dp2 splits the batch 2 + 1
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
    "ulysses2-ring2": ((2, 2), ["ulysess_cp", "ring_cp"]),
}


SUB_SPLIT = pytest.mark.xfail(strict=True, reason="cat of two sequences sharded over a CP dim "
                              "needs the sub-split Shard placement")


def layout_params():
    return [pytest.param(name, marks=SUB_SPLIT) if set(names) & set(CP_DIMS) else name
            for name, (_, names) in LAYOUTS.items()]


def mesh_of(layout):
    shape, names = LAYOUTS[layout]
    return dtorch.init_device_mesh("cpu", shape, mesh_dim_names=names)


def reference_block(context_pre_only, qk_norm, seed=0):
    torch.manual_seed(seed)
    block = diffusers_attention.JointTransformerBlock(
        DIM, HEADS, HEAD_DIM, context_pre_only=context_pre_only, qk_norm=qk_norm).eval()
    with torch.no_grad():  # diffusers starts the RMSNorm weights at 1: random ones test loading
        for name, p in block.named_parameters():
            if "norm" in name and name.endswith("weight") and "linear" not in name:
                p.uniform_(0.5, 1.5)
    return block


def inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(BATCH, IMAGE_LEN, DIM, generator=g),
            torch.randn(BATCH, TEXT_LEN, DIM, generator=g),
            torch.randn(BATCH, DIM, generator=g))


def placed(t, mesh, sequence):
    """``t`` with the batch over ``dp`` and, when ``sequence``, dim 1 over the CP dims."""
    layout = [Shard(0) if name == "dp" else Shard(1) if sequence and name in CP_DIMS
              else Replicate() for name in mesh.dim_names]
    return dtorch.from_torch(t, device_mesh=mesh, placements=layout)


@pytest.mark.parametrize("layout", layout_params())
@pytest.mark.parametrize("context_pre_only,qk_norm", [(False, "rms_norm"), (True, None)],
                         ids=["block", "last-block"])
def test_joint_block_equals_diffusers(layout, context_pre_only, qk_norm):
    ref = reference_block(context_pre_only, qk_norm)
    mesh = mesh_of(layout)
    with dtorch.Graph.default_graph().device_mesh_guard(mesh):
        block = JointTransformerBlock(DIM, HEADS, HEAD_DIM, context_pre_only, qk_norm)
    block.load_state_dict(ref.state_dict())
    hidden, context, temb = inputs()
    with torch.no_grad():
        want_context, want_hidden = ref(hidden, context, temb)
    got_context, got_hidden = block(placed(hidden, mesh, True), placed(context, mesh, True),
                                    placed(temb, mesh, False))
    expected_layout = placed(hidden, mesh, True).placements
    assert got_hidden.placements == expected_layout
    torch.testing.assert_close(got_hidden.to_torch(), want_hidden, atol=1e-4, rtol=1e-4)
    if context_pre_only:
        assert got_context is None and want_context is None
    else:
        assert got_context.placements == expected_layout
        torch.testing.assert_close(got_context.to_torch(), want_context, atol=1e-4, rtol=1e-4)
