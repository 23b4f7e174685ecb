"""HF text encoders ported to ``dtorch.nn`` (tests/text_encoders.py): a T5-like encoder (relative
position bias, T5's norm, gated-gelu feed-forward) and a CLIP-like text model (causal attention,
quick gelu, pooled at the largest id) load the state dict of HF's own tiny random models and
equal them on one device, tp2, dp2 x tp2 and context parallelism (uneven batch and sequence)."""

import pytest
import torch
from text_encoders import CLIPText, T5Encoder

import dtorch

transformers = pytest.importorskip("transformers")

LAYOUTS = {  # mesh dims by name
    "one": {"dp": 1},
    "tp2": {"tp": 2},
    "dp2xtp2": {"dp": 2, "tp": 2},
    "ulysses2": {"ulysess_cp": 2},
    "ring2": {"ring_cp": 2},
    "dp2xtp2xring2": {"dp": 2, "tp": 2, "ring_cp": 2},
}


def mesh_of(layout):
    dims = LAYOUTS[layout]
    return dtorch.init_device_mesh("cpu", tuple(dims.values()), mesh_dim_names=list(dims))


def random_norms(model):
    """HF initialises norm weights to 1: random ones test that they load and apply."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="module")
def ids():
    # 3 sequences (dp2 splits them 2 + 1) of 9 tokens (CP2 splits them 5 + 4)
    return torch.randint(3, 90, (3, 9), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def t5():
    cfg = transformers.T5Config(vocab_size=96, d_model=32, d_kv=8, d_ff=48, num_layers=2,
                                num_heads=4, relative_attention_num_buckets=8,
                                relative_attention_max_distance=12, dropout_rate=0.0,
                                feed_forward_proj="gated-gelu")
    torch.manual_seed(0)
    return random_norms(transformers.T5EncoderModel(cfg).eval())


@pytest.fixture(scope="module")
def clip():
    cfg = transformers.CLIPTextConfig(vocab_size=96, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      max_position_embeddings=16, hidden_act="quick_gelu",
                                      bos_token_id=0, pad_token_id=1, eos_token_id=2,
                                      attention_dropout=0.0)
    torch.manual_seed(1)
    return random_norms(transformers.CLIPTextModel(cfg).eval())


def clip_state(clip):
    """HF's CLIP state dict under its ``text_model.`` names (transformers 5 leaves them out of
    ``CLIPTextModel.state_dict()``, 4 keeps them)."""
    return {k if k.startswith("text_model.") else f"text_model.{k}": v
            for k, v in clip.state_dict().items()}


def close(actual, expected):
    torch.testing.assert_close(actual.to_torch(), expected, atol=1e-4, rtol=1e-4)


def assert_sharded_as_input(hidden):
    """The hidden states stay where the work was split: batch on dp, sequence on CP (heads and
    columns on tp are gathered back by the row-parallel layers)."""
    mesh = hidden.device_mesh
    for name, size, p in zip(mesh.mesh_dim_names, mesh.shape, hidden.placements):
        if size > 1:
            want = {"dp": dtorch.Shard(0), "tp": dtorch.Replicate()}.get(name, dtorch.Shard(1))
            assert p == want, (name, hidden.placements)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_t5_encoder_equals_hf(layout, t5, ids):
    model = T5Encoder(t5.config, mesh_of(layout))
    model.load_state_dict(t5.state_dict())
    with torch.no_grad():
        expected = t5(ids).last_hidden_state
    hidden = model(dtorch.from_torch(ids))
    assert_sharded_as_input(hidden)
    close(hidden, expected)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_clip_text_model_equals_hf(layout, clip, ids):
    model = CLIPText(clip.config, mesh_of(layout))
    model.load_state_dict(clip_state(clip))
    with torch.no_grad():
        expected = clip(ids)
    last, pooled = model(dtorch.from_torch(ids))
    assert_sharded_as_input(last)
    close(last, expected.last_hidden_state)
    close(pooled, expected.pooler_output)


def test_t5_bias_is_bidirectional_and_bucketed(t5):
    """The bias differs between a key before and after the query, and positions farther apart
    than ``relative_attention_max_distance`` share the last bucket, as in HF."""
    model = T5Encoder(t5.config, mesh_of("tp2"))
    model.load_state_dict(t5.state_dict())
    attention = model.encoder.block[0].layer[0].SelfAttention
    bias = attention.position_bias(20, model.mesh).to_torch()
    hf = t5.encoder.block[0].layer[0].SelfAttention.compute_bias(20, 20)
    torch.testing.assert_close(bias, hf, atol=0, rtol=0)
    assert not torch.equal(bias[0, :, 5, 3], bias[0, :, 3, 5])
    assert torch.equal(bias[0, :, 0, 15], bias[0, :, 0, 19])


def test_state_dicts_load_strictly(t5, clip):
    """Every HF parameter has its place (the shared T5 table under both of HF's names)."""
    for ours, state in ((T5Encoder(t5.config, mesh_of("one")), t5.state_dict()),
                        (CLIPText(clip.config, mesh_of("one")), clip_state(clip))):
        result = ours.load_state_dict(state, strict=True)
        assert result.missing_keys == [] and result.unexpected_keys == []
