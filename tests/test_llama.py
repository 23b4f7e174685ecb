"""dtorch.models.llama against HF transformers' LlamaForCausalLM with the same random weights
(built locally from a small config: no hub), on every parallel layout the model supports."""

import pytest
import torch

import dtorch
from dtorch import Replicate, Shard
from dtorch.models.llama import LlamaForCausalLM, StaticKVCache

transformers = pytest.importorskip("transformers")

R = Replicate()
DIMS = ["dp", "tp", "pp", "ulysess_cp", "ring_cp"]
# (dp, tp, pp, ulysess_cp, ring_cp)
LAYOUTS = {
    "one": (1, 1, 1, 1, 1),
    "dp2": (2, 1, 1, 1, 1),
    "tp2": (1, 2, 1, 1, 1),
    "pp2": (1, 1, 2, 1, 1),
    "ulysses2": (1, 1, 1, 2, 1),
    "ring2": (1, 1, 1, 1, 2),
    "tp2-pp2-ulysses2": (1, 2, 2, 2, 1),
    "dp2-tp2-pp2-ulysses2": (2, 2, 2, 2, 1),
    "dp2-tp2-pp2-ring2": (2, 2, 2, 1, 2),
    # size-1 dims among the five, and both kinds of context parallelism at once
    "dp2-ring2": (2, 1, 1, 1, 2),
    "tp2-ring2": (1, 2, 1, 1, 2),
    "ulysses2-ring2": (1, 1, 1, 2, 2),
    "pp2-ulysses2-ring2": (1, 1, 2, 2, 2),
    "dp2-tp2-ulysses2-ring2": (2, 2, 1, 2, 2),
}


def config(**overrides):
    base = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                rms_norm_eps=1e-6)
    base.update(overrides)
    return transformers.LlamaConfig(**base)


def hf_model(cfg, seed=0):
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # HF initialises norms to 1: random ones test that they load
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def mesh_of(layout):
    return dtorch.init_device_mesh("cpu", LAYOUTS[layout], mesh_dim_names=DIMS)


@pytest.fixture(scope="module")
def gqa():
    """4 query heads read 2 key/value heads."""
    return hf_model(config())


@pytest.fixture(scope="module")
def tokens():
    g = torch.Generator().manual_seed(7)
    # 3 sequences (dp2 splits them 2 + 1) of 9 tokens (CP 2 splits them 5 + 4)
    return torch.randint(0, 96, (3, 9), generator=g)


def hf_logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logits_equal_hf(layout, gqa, tokens):
    model = LlamaForCausalLM(gqa.config, device_mesh=mesh_of(layout))
    model.load_state_dict(gqa.state_dict())
    logits = model(tokens)
    assert isinstance(logits, dtorch.Tensor) and logits.shape == (3, 9, 96)
    expected = hf_logits(gqa, tokens)
    if layout == "one":  # the same kernels in the same order: bit for bit
        assert torch.equal(logits.to_torch(), expected)
    else:
        torch.testing.assert_close(logits.to_torch(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_greedy_generate_equals_hf(layout, gqa, tokens):
    model = LlamaForCausalLM(gqa.config, device_mesh=mesh_of(layout))
    model.load_state_dict(gqa.state_dict())
    expected = gqa.generate(tokens, max_new_tokens=6, do_sample=False,
                            attention_mask=torch.ones_like(tokens), pad_token_id=0)
    assert torch.equal(model.generate(tokens, max_new_tokens=6, pad_token_id=0), expected)


@pytest.mark.parametrize("layout", ["one", "tp2-pp2-ulysses2"])
def test_the_growing_cache_generates_as_the_static_one(layout, gqa, tokens):
    model = LlamaForCausalLM(gqa.config, device_mesh=mesh_of(layout))
    model.load_state_dict(gqa.state_dict())
    expected = gqa.generate(tokens, max_new_tokens=6, do_sample=False,
                            attention_mask=torch.ones_like(tokens), pad_token_id=0)
    got = model.generate(tokens, max_new_tokens=6, pad_token_id=0,
                         cache_implementation="dynamic")
    assert torch.equal(got, expected)
    with pytest.raises(ValueError, match="cache_implementation"):
        model.generate(tokens, max_new_tokens=2, cache_implementation="sliding")


def test_static_decode_steps_replay_and_give_hfs_logits(gqa, tokens):
    """A static cache's decode steps are one program (the controller replays them: the trace
    shows replays); each step's logits, made inside the replayed windows, equal HF's with its
    own cache to float rounding (the masked slots take no part)."""
    model = LlamaForCausalLM(gqa.config, device_mesh=mesh_of("one"))
    model.load_state_dict(gqa.state_dict())
    with torch.inference_mode():
        hf_out = gqa(tokens, use_cache=True)
        past, ids = hf_out.past_key_values, hf_out.logits[:, -1:].argmax(-1)
        cache = StaticKVCache(tokens.shape[1] + 24)
        mine = model(tokens, cache, last_only=True)
        torch.testing.assert_close(mine.to_torch()[:, -1], hf_out.logits[:, -1], atol=1e-5,
                                   rtol=1e-5)
        with dtorch.profiler.profile() as prof:
            for step in range(24):
                hf_out = gqa(ids, past_key_values=past, use_cache=True)
                past = hf_out.past_key_values
                logits = model(ids, cache, last_only=True)
                torch.testing.assert_close(logits.to_torch()[:, -1], hf_out.logits[:, -1],
                                           atol=1e-5, rtol=1e-5, msg=f"step {step}")
                ids = hf_out.logits[:, -1:].argmax(-1)
            dtorch.sync()
        with pytest.raises(ValueError, match="max_len"):
            model(ids, cache)
    assert any(e["name"].startswith("replay") for e in prof.kernels() if e["pid"] == 0)


def test_generate_stops_at_eos_as_hf(gqa, tokens):
    """A sequence that emits EOS is padded after it, and decoding stops once all have."""
    model = LlamaForCausalLM(gqa.config, device_mesh=mesh_of("one"))
    model.load_state_dict(gqa.state_dict())
    # the EOS: the token the first sequence emits third, so it ends early
    free = model.generate(tokens, max_new_tokens=8, eos_token_id=[])
    eos = int(free[0, tokens.shape[1] + 2])
    expected = gqa.generate(tokens, max_new_tokens=8, do_sample=False, eos_token_id=eos,
                            pad_token_id=5, attention_mask=torch.ones_like(tokens))
    got = model.generate(tokens, max_new_tokens=8, eos_token_id=eos, pad_token_id=5)
    assert torch.equal(got, expected)
    assert (got[0, tokens.shape[1] + 3:] == 5).all()


def test_multi_head_attention_with_tied_embeddings(tokens):
    """No GQA (as many key/value heads as query heads), the LM head tied to the embedding and
    held by another pipeline stage."""
    hf = hf_model(config(num_key_value_heads=4, tie_word_embeddings=True), seed=1)
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    model = LlamaForCausalLM(hf.config, device_mesh=mesh_of("tp2-pp2-ulysses2"))
    assert model.load_state_dict(hf.state_dict()).missing_keys == []
    assert "lm_head.weight" not in model.state_dict()
    torch.testing.assert_close(model(tokens).to_torch(), hf_logits(hf, tokens), atol=1e-4,
                               rtol=1e-4)


def test_from_pretrained_reads_an_hf_checkpoint(tmp_path, gqa, tokens):
    gqa.save_pretrained(tmp_path)
    model = LlamaForCausalLM.from_pretrained(tmp_path, device_mesh=mesh_of("tp2"))
    assert model.model.layers[0].self_attn.q_proj.weight.placements[1] == dtorch.Shard(0)
    torch.testing.assert_close(model(tokens).to_torch(), hf_logits(gqa, tokens), atol=1e-4,
                               rtol=1e-4)


def test_logits_follow_a_dtorch_input(gqa, tokens):
    """A dtorch input on some mesh: the logits come back there, laid out as the input."""
    mesh = mesh_of("dp2-tp2-pp2-ring2")
    model = LlamaForCausalLM(gqa.config, device_mesh=mesh)
    model.load_state_dict(gqa.state_dict())
    other = dtorch.DeviceMesh("cpu", [3, 5])
    ids = dtorch.from_torch(tokens, device_mesh=other, placements=[dtorch.Shard(0)])
    logits = model(ids)
    assert logits.device_mesh == other and logits.placements == [dtorch.Shard(0)]
    torch.testing.assert_close(logits.to_torch(), hf_logits(gqa, tokens), atol=1e-4, rtol=1e-4)


def test_bfloat16_checkpoint_matches_hf_in_bfloat16(tmp_path, gqa, tokens):
    """Both load a float32 checkpoint as bfloat16 (the RoPE frequencies stay float32 in
    both)."""
    gqa.save_pretrained(tmp_path)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    model = LlamaForCausalLM.from_pretrained(tmp_path, device_mesh=mesh_of("one"),
                                             dtype=torch.bfloat16)
    logits = model(tokens)
    assert logits.dtype == torch.bfloat16
    assert torch.equal(logits.to_torch(), hf_logits(hf, tokens))


def sequence_everywhere(mesh):
    """Token ids as DTorch's own programs lay them out: the batch on ``dp`` and the sequence on
    both context-parallel dims, whatever their sizes."""
    return [Shard(0) if name == "dp" else Shard(1) if name in ("ulysess_cp", "ring_cp") else R
            for name in mesh.dim_names]


def as_read_back(placements, mesh):
    """A Shard on a mesh dim of one device reads back as Replicate."""
    return [R if p.is_shard() and n == 1 else p for p, n in zip(placements, mesh.shape)]


# meshes with dims of one device among the five, where a sequence Shard sits on one
SIZE_ONE_LAYOUTS = ["tp2-pp2-ulysses2", "dp2-ring2", "tp2-ring2", "dp2-tp2-pp2-ulysses2"]


@pytest.mark.parametrize("layout", SIZE_ONE_LAYOUTS)
def test_sequence_shard_on_a_dim_of_one_device(layout, gqa, tokens):
    """Token ids sharded along the sequence on every CP dim, one of them of size 1 (where the
    Shard is a Replicate): the logits equal HF's and come back in the ids' layout."""
    model = LlamaForCausalLM(gqa.config, device_mesh=mesh_of(layout))
    model.load_state_dict(gqa.state_dict())
    first = model.first_stage_mesh()
    ids = dtorch.from_torch(tokens, device_mesh=first, placements=sequence_everywhere(first))
    assert ids.placements == as_read_back(sequence_everywhere(first), first)
    logits = model(ids)
    assert logits.device_mesh == first and logits.placements == ids.placements
    torch.testing.assert_close(logits.to_torch(), hf_logits(gqa, tokens), atol=1e-4, rtol=1e-4)


def test_one_training_step_on_dims_of_one_device(gqa, tokens):
    """A cross-entropy loss's gradients on tp2·pp2·ulysses2 (dp and ring_cp of one device, the
    labels sharded along the sequence on both CP dims) equal HF's."""
    hf = hf_model(config())
    labels = torch.roll(tokens, -1, dims=1)
    torch.nn.functional.cross_entropy(hf(tokens).logits.flatten(0, 1), labels.flatten()).backward()
    model = LlamaForCausalLM(hf.config, device_mesh=mesh_of("tp2-pp2-ulysses2"))
    model.load_state_dict(hf.state_dict())
    first = model.first_stage_mesh()
    ids, target = (dtorch.from_torch(t, device_mesh=first, placements=sequence_everywhere(first))
                   for t in (tokens, labels))
    # classes in dim 1: batch and sequence keep their shards
    dtorch.nn.functional.cross_entropy(model(ids).transpose(1, 2), target).backward()
    grads = dict(hf.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.to_torch(), grads[name].grad, atol=1e-5, rtol=1e-4,
                                   msg=name)


def test_refusals_name_the_fix(gqa):
    with pytest.raises(ValueError, match=r"heads \(4\) and key/value heads \(2\) to divide by 4"):
        LlamaForCausalLM(gqa.config, device_mesh=dtorch.init_device_mesh(
            "cpu", (4,), mesh_dim_names=["tp"]))
    with pytest.raises(ValueError, match="expert"):
        LlamaForCausalLM(gqa.config, device_mesh=dtorch.init_device_mesh(
            "cpu", (2,), mesh_dim_names=["expert"]))
    model = LlamaForCausalLM(gqa.config, device_mesh=mesh_of("one"))
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        model(torch.zeros(4, dtype=torch.long))
    with pytest.raises(NotImplementedError, match="greedy"):
        model.generate(torch.zeros(1, 3, dtype=torch.long), do_sample=True)
    assert model(torch.zeros(1, 3, dtype=torch.long)).shape == (1, 3, 96)  # still usable
