"""Unported torch modules on a mesh (``dtorch.nn.parallelize``): torch's own modules and HF
transformers' Llama, their parameters laid out by a plan, run and trained unchanged against
themselves on torch."""

import copy
import functools

import pytest
import torch
import transformers
from torch.utils.checkpoint import create_selective_checkpoint_contexts

import dtorch
from dtorch import Replicate, Shard
from dtorch.autograd import checkpoint as checkpointing
from dtorch.autograd import selective

R, S0 = Replicate(), Shard(0)
LLAMA_PLAN = {"model.layers.*.self_attn.[qkv]_proj": "colwise",
              "model.layers.*.self_attn.o_proj": "rowwise",
              "model.layers.*.mlp.[gu][ap]*_proj": "colwise",  # gate_proj, up_proj
              "model.layers.*.mlp.down_proj": "rowwise"}


@pytest.fixture(scope="module")
def tp2():
    return dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["tp"])


@pytest.fixture(scope="module")
def dp2tp2():
    return dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "tp"])


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 6),
                               torch.nn.LayerNorm(6))


@pytest.mark.parametrize("layout", ["tp2", "dp2xtp2"])
def test_a_torch_mlp_laid_out_by_a_plan_equals_itself(layout, tp2, dp2tp2):
    mesh = tp2 if layout == "tp2" else dp2tp2
    ref, model = mlp(), mlp()
    assert dtorch.nn.parallelize(model, mesh, {"0": "colwise", "2": "rowwise"}) is model
    tp = mesh.ndim - 1
    assert model[0].weight.placements[tp] == S0 and model[0].bias.placements[tp] == S0
    assert model[2].weight.placements[tp] == Shard(1) and model[2].bias.placements[tp] == R
    assert model[3].weight.placements == [R] * mesh.ndim  # unplanned: replicated
    x = torch.randn(10, 6, generator=torch.Generator().manual_seed(1))
    batch = [S0, R] if mesh.ndim == 2 else [R]
    out = model(dtorch.from_torch(x, mesh, batch))
    assert out.placements == batch  # the rowwise output reduced to Replicate on tp
    torch.testing.assert_close(out.to_torch(), ref(x), atol=1e-6, rtol=1e-5)
    assert set(model.state_dict()) == set(ref.state_dict())
    torch.testing.assert_close(model.state_dict()["2.weight"].to_torch(), ref[2].weight.detach())


SIZES = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def llama_config():
    return transformers.LlamaConfig(**SIZES)


@pytest.fixture(scope="module")
def hf_llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(llama_config())


@pytest.fixture(scope="module")
def hf_qwen2():
    torch.manual_seed(0)  # (its attention projections have biases, Llama's not)
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SIZES))


def ids(seed=1):
    return torch.randint(0, 96, (4, 7), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("layout", ["one", "tp2", "dp2xtp2"])
def test_hf_decoders_unported_equal_hf(kind, layout, request, one, tp2, dp2tp2):
    mesh = {"one": one, "tp2": tp2, "dp2xtp2": dp2tp2}[layout]
    hf = request.getfixturevalue(f"hf_{kind}")
    model = copy.deepcopy(hf).eval()
    dtorch.nn.parallelize(model, mesh, LLAMA_PLAN if mesh.has_dim_name("tp") else {})
    batch = [S0, R] if mesh.ndim == 2 else [R]
    x = ids()
    use_cache = layout == "tp2"  # HF's DynamicCache: a cat of torch's empty start tensor
    with torch.no_grad():
        got = model(dtorch.from_torch(x, mesh, batch), use_cache=use_cache).logits
        want = hf.eval()(x, use_cache=use_cache).logits
    assert isinstance(got, dtorch.Tensor)
    if layout == "one":  # the same kernels: bit for bit
        assert torch.equal(got.to_torch(), want)
    else:
        torch.testing.assert_close(got.to_torch(), want, atol=1e-5, rtol=1e-5)


def test_hf_llama_unported_trains_as_hf(hf_llama, dp2tp2):
    """20 AdamW steps with HF's own loss (``labels=``): every loss and the final weights."""
    ref = copy.deepcopy(hf_llama).train()
    model = copy.deepcopy(hf_llama).train()
    dtorch.nn.parallelize(model, dp2tp2, LLAMA_PLAN)
    opt = dtorch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(20):
        x = ids(100 + step)
        d = dtorch.from_torch(x, dp2tp2, [S0, R])
        loss = model(d, labels=d, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        want = ref(x, labels=x, use_cache=False).loss
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert loss.item() == pytest.approx(want.item(), abs=1e-5), step
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.to_torch(), q.detach(), atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("reentrant", [True, False, "selective"])
@pytest.mark.parametrize("enabled", ["before", "after"])
def test_hf_gradient_checkpointing_recomputes_with_hfs_gradients(reentrant, enabled, hf_llama,
                                                                  dp2tp2, monkeypatch):
    """HF's gradient checkpointing, reentrant or not, switched on before or after
    ``parallelize``, recomputes each layer through ``dtorch.nn.checkpoint`` (torch's own would
    give the reentrant form no gradients and keep everything in the other) and gives the
    gradients HF's model gets from torch's checkpoint; with torchtitan's selective policy
    (HF's ``context_fn``), each layer's 7 projections are taken from the forward."""
    recomputed, taken = [], []
    real = checkpointing._recompute
    monkeypatch.setattr(checkpointing, "_recompute",
                        lambda *a: recomputed.append(a[0]) or real(*a))
    substitute = selective.Region._substitute
    monkeypatch.setattr(selective.Region, "_substitute",
                        lambda self, b, *a: taken.append(b.op.name) or substitute(self, b, *a))
    ref, model = copy.deepcopy(hf_llama).train(), copy.deepcopy(hf_llama).train()
    kwargs = {"use_reentrant": reentrant}
    if reentrant == "selective":
        kwargs = {"use_reentrant": False, "context_fn": functools.partial(
            create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])}
    for m in (ref, model) if enabled == "before" else (ref,):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    dtorch.nn.parallelize(model, dp2tp2, LLAMA_PLAN)
    if enabled == "after":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    x = ids(9)
    d = dtorch.from_torch(x, dp2tp2, [S0, R])
    model(d, labels=d, use_cache=False).loss.backward()
    ref(x, labels=x, use_cache=False).loss.backward()
    assert len(recomputed) == hf_llama.config.num_hidden_layers
    layers = hf_llama.config.num_hidden_layers
    assert taken == (["linear"] * 7 * layers if reentrant == "selective" else [])
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad.to_torch(), q.grad, atol=1e-6, rtol=1e-5)


def test_a_meta_built_model_gets_layouts_without_values(hf_llama, tp2):
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(llama_config())
    with pytest.warns(UserWarning, match="non-persistent"):
        dtorch.nn.parallelize(model, tp2, LLAMA_PLAN)
    q = model.model.layers[0].self_attn.q_proj.weight
    assert q.placements == [S0]
    with pytest.raises(RuntimeError, match="no value"):
        q.to_torch()
    model.load_state_dict(hf_llama.state_dict())
    torch.testing.assert_close(q.to_torch(), hf_llama.model.layers[0].self_attn.q_proj.weight
                               .detach())


@pytest.mark.parametrize("layout", ["tp2", "dp2xtp2"])
def test_a_meta_built_model_loads_a_checkpoint_in_its_layouts(layout, hf_llama, tp2, dp2tp2,
                                                              tmp_path):
    """HF's model built on torch's meta device, parallelized (torchtitan's sequence-parallel
    plan) and filled by ``load_checkpoint`` from HF's own ``save_pretrained`` files, each host
    reading its blocks; the rotary frequencies, a non-persistent buffer no checkpoint holds,
    are named by a warning and copied in: logits equal HF's."""
    mesh = tp2 if layout == "tp2" else dp2tp2
    hf_llama.save_pretrained(tmp_path)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(llama_config()).eval()
    with pytest.warns(UserWarning, match=r"rotary_emb\.inv_freq, model\.rotary_emb\.original_"
                                         r"inv_freq are non-persistent"):
        dtorch.nn.parallelize(model, mesh, SP_PLAN)
    dtorch.load_checkpoint(model, tmp_path)
    for name in ("inv_freq", "original_inv_freq"):
        getattr(model.model.rotary_emb, name).copy_(getattr(hf_llama.model.rotary_emb, name))
    x = ids(7)
    with torch.no_grad():
        got = model(dtorch.from_torch(x, mesh, [S0, R] if mesh.ndim == 2 else [R]),
                    use_cache=False).logits
        want = hf_llama.eval()(x, use_cache=False).logits
    torch.testing.assert_close(got.to_torch(), want, atol=1e-5, rtol=1e-5)


def test_plans_that_cannot_be_laid_out_raise(tp2):
    with pytest.raises(ValueError, match="styles"):
        dtorch.nn.parallelize(mlp(), tp2, {"0": "diagonal"})
    with pytest.raises(ValueError, match="is a LayerNorm"):
        dtorch.nn.parallelize(mlp(), tp2, {"3": "colwise"})
    with pytest.raises(ValueError, match="is a LayerNorm"):
        dtorch.nn.parallelize(mlp(), tp2, {"3": dtorch.nn.RowwiseParallel()})
    with pytest.raises(ValueError, match="no max_norm"):
        dtorch.nn.parallelize(torch.nn.Embedding(5, 2, max_norm=1.0), tp2, {"": "rowwise"})
    with pytest.raises(ValueError, match="lacks"):
        dtorch.nn.parallelize(mlp(), dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["dp"]),
                              {"0": "colwise"})


@pytest.mark.parametrize("layout", ["tp2", "dp2xtp2"])
def test_a_vocabulary_parallel_embedding_equals_torch(layout, tp2, dp2tp2):
    """``"rowwise"`` on an ``nn.Embedding`` (DTensor's meaning) splits its rows, the
    vocabulary, unevenly here (97 rows on 2): each device looks up what its block holds, and
    the sum of the blocks' rows and zeros is torch's lookup bit for bit; the gradient lands in
    the owners' rows (none in the padding row), as torch's."""
    mesh = tp2 if layout == "tp2" else dp2tp2
    torch.manual_seed(0)
    ref = torch.nn.Embedding(97, 8, padding_idx=3)
    emb = dtorch.nn.parallelize(copy.deepcopy(ref), mesh, {"": "rowwise"})
    assert emb.weight.placements == [R] * (mesh.ndim - 1) + [S0]
    ids = torch.tensor([[96, 0, 3, 48], [49, 50, 3, 1], [7, 7, 95, 60]])
    got = emb(dtorch.from_torch(ids, mesh, [S0, R] if mesh.ndim == 2 else [R]))
    assert got.placements[-1] == R and torch.equal(got.to_torch(), ref(ids))
    u = torch.randn(3, 4, 8)
    (got * dtorch.from_torch(u, mesh)).sum().backward()
    (ref(ids) * u).sum().backward()
    assert torch.equal(emb.weight.grad.to_torch(), ref.weight.grad)


SP_PLAN = {"model.embed_tokens": dtorch.nn.RowwiseParallel(output_layouts=Shard(1)),
           "model.layers.*.input_layernorm": dtorch.nn.SequenceParallel(),
           "model.layers.*.post_attention_layernorm": "sequence",
           "model.layers.*.self_attn.[qkv]_proj": "colwise",
           "model.layers.*.self_attn.o_proj": dtorch.nn.RowwiseParallel(output_layouts=Shard(1)),
           "model.layers.*.mlp.[gu][ap]*_proj": "colwise",
           "model.layers.*.mlp.down_proj": dtorch.nn.RowwiseParallel(output_layouts=Shard(1)),
           "model.norm": dtorch.nn.SequenceParallel(),
           "lm_head": dtorch.nn.ColwiseParallel(output_layouts=Replicate())}


@pytest.mark.parametrize("layout", ["tp2", "dp2xtp2"])
def test_hf_llama_with_sequence_parallelism_equals_hf(layout, hf_llama, tp2, dp2tp2):
    """torchtitan's layout of a Llama: a vocabulary-parallel embedding, sequence-parallel norms,
    the attention's and MLP's outputs reduce-scattered along the sequence (9 tokens on 2: an
    uneven split), so the residual stream between layers stays sharded on tp; logits and HF's
    loss's gradients equal HF's."""
    mesh = tp2 if layout == "tp2" else dp2tp2
    ref, model = copy.deepcopy(hf_llama).train(), copy.deepcopy(hf_llama).train()
    dtorch.nn.parallelize(model, mesh, SP_PLAN)
    between = []
    model.model.layers[0].register_forward_hook(lambda m, a, out: between.append(
        (out[0] if isinstance(out, tuple) else out).placements))
    x = ids(9)
    d = dtorch.from_torch(x, mesh, [S0, R] if mesh.ndim == 2 else [R])
    out = model(d, labels=d, use_cache=False)
    want = ref(x, labels=x, use_cache=False)
    assert between[0][-1] == Shard(1)
    torch.testing.assert_close(out.logits.to_torch(), want.logits, atol=1e-5, rtol=1e-5)
    out.loss.backward()
    want.loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.to_torch(), q.grad, atol=1e-6, rtol=1e-5, msg=name)


def test_tied_weights_stay_one_tensor(tp2):
    """An embedding and a head holding one weight hold one dtorch tensor after it (its
    gradient the sum of both uses); a plan that lays the two holders out differently raises."""
    def tied():
        torch.manual_seed(0)
        model = torch.nn.ModuleDict({"emb": torch.nn.Embedding(10, 4),
                                     "head": torch.nn.Linear(4, 10, bias=False)})
        model.head.weight = model.emb.weight
        return model

    model, ref = tied(), tied()
    dtorch.nn.parallelize(model, tp2, {})
    assert model.emb.weight is model.head.weight and len(list(model.parameters())) == 1
    x = torch.tensor([[1, 2, 3]])
    model.head(model.emb(dtorch.from_torch(x, tp2))).square().sum().backward()
    ref.head(ref.emb(x)).square().sum().backward()
    torch.testing.assert_close(model.emb.weight.grad.to_torch(), ref.emb.weight.grad)
    with pytest.raises(ValueError, match="'head.weight' is the tensor 'emb.weight' holds"):
        dtorch.nn.parallelize(tied(), tp2, {"emb": "replicate", "head": "colwise"})


@pytest.mark.parametrize("layout", ["tp2", "dp2xtp2"])
def test_hf_generate_unported_equals_hf(layout, hf_llama, tp2, dp2tp2):
    """HF's own greedy ``generate`` (its DynamicCache, its stopping and padding code) on the
    parallelized model, token for token."""
    mesh = tp2 if layout == "tp2" else dp2tp2
    model = copy.deepcopy(hf_llama).eval()
    dtorch.nn.parallelize(model, mesh, LLAMA_PLAN)
    x = ids(5)
    batch = [S0, R] if mesh.ndim == 2 else [R]
    got = model.generate(dtorch.from_torch(x, mesh, batch), max_new_tokens=6, do_sample=False,
                         pad_token_id=0)
    want = hf_llama.eval().generate(x, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(got.to_torch() if isinstance(got, dtorch.Tensor) else got, want)


# -- encoders and a CNN ---------------------------------------------------------------------------
T5_PLAN = {"encoder.block.*.layer.0.SelfAttention.[qkv]": "colwise",
           "encoder.block.*.layer.0.SelfAttention.o": "rowwise",
           "encoder.block.*.layer.1.DenseReluDense.wi": "colwise",
           "encoder.block.*.layer.1.DenseReluDense.wo": "rowwise"}
CLIP_PLAN = {"text_model.encoder.layers.*.self_attn.[qkv]_proj": "colwise",
             "text_model.encoder.layers.*.self_attn.out_proj": "rowwise",
             "text_model.encoder.layers.*.mlp.fc1": "colwise",
             "text_model.encoder.layers.*.mlp.fc2": "rowwise"}


@pytest.fixture(scope="module")
def hf_t5():
    """T5's attention adds a relative position bias of every head (a replicated mask, which
    attention chunks to the query's head blocks on tp)."""
    torch.manual_seed(0)
    return transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, dropout_rate=0.0))


@pytest.fixture(scope="module")
def hf_clip():
    torch.manual_seed(0)
    return transformers.CLIPTextModel(transformers.CLIPTextConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=16, bos_token_id=0, eos_token_id=2))


@pytest.mark.parametrize("kind", ["t5", "clip"])
@pytest.mark.parametrize("layout", ["one", "tp2", "dp2xtp2"])
def test_hf_encoders_unported_equal_hf(kind, layout, request, one, tp2, dp2tp2):
    mesh = {"one": one, "tp2": tp2, "dp2xtp2": dp2tp2}[layout]
    hf = request.getfixturevalue(f"hf_{kind}")
    model = copy.deepcopy(hf).eval()
    dtorch.nn.parallelize(model, mesh, (T5_PLAN if kind == "t5" else CLIP_PLAN)
                          if mesh.has_dim_name("tp") else {})
    x = ids(3)
    with torch.no_grad():
        got = model(dtorch.from_torch(x, mesh, [S0, R] if mesh.ndim == 2 else [R]))
        want = hf.eval()(x)
    outputs = ["last_hidden_state"] + (["pooler_output"] if kind == "clip" else [])
    for name in outputs:
        g = getattr(got, name)
        assert isinstance(g, dtorch.Tensor), name
        if layout == "one":
            assert torch.equal(g.to_torch(), getattr(want, name)), name
        else:
            torch.testing.assert_close(g.to_torch(), getattr(want, name), atol=1e-5, rtol=1e-5)


def test_t5_gradients_flow_through_the_chunked_position_bias(hf_t5, dp2tp2):
    """The position bias's embedding gets its gradient back through the mask's chunk."""
    ref, model = copy.deepcopy(hf_t5).train(), copy.deepcopy(hf_t5).train()
    dtorch.nn.parallelize(model, dp2tp2, T5_PLAN)
    x = ids(4)
    model(dtorch.from_torch(x, dp2tp2, [S0, R])).last_hidden_state.square().mean().backward()
    ref(x).last_hidden_state.square().mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert "relative_attention_bias" in " ".join(grads)
    for name, q in ref.named_parameters():
        torch.testing.assert_close(grads[name].to_torch(), q.grad, atol=1e-6, rtol=1e-5,
                                   msg=name)


def cnn():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.MaxPool2d(2), torch.nn.Conv2d(8, 16, 3, stride=2), torch.nn.BatchNorm2d(16),
        torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
        torch.nn.Linear(16, 10))


@pytest.fixture(scope="module")
def dp2():
    return dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["dp"])


@pytest.mark.parametrize("layout", ["one", "dp2"])
def test_a_torch_cnn_with_batch_norm_trains_unported(layout, one, dp2):
    """torch's Conv2d/BatchNorm2d/MaxPool2d/AdaptiveAvgPool2d CNN, its batch of 5 sharded
    unevenly on dp2: batch norm's statistics are the global batch's (as on one device), and 5
    SGD steps with momentum give torch's losses, weights and running statistics (the
    training-mode norm is dtorch's operators, not torch's fused kernel: equal within float32's
    rounding); in eval mode the output is torch's bit for bit on one device."""
    mesh = one if layout == "one" else dp2
    ref, model = cnn(), cnn()
    dtorch.nn.parallelize(model, mesh)
    g = torch.Generator().manual_seed(2)
    batch = [S0] if layout == "dp2" else [R]
    x = torch.randn(5, 3, 12, 12, generator=g)
    with torch.no_grad():
        got = model.eval()(dtorch.from_torch(x, mesh, batch)).to_torch()
        want = ref.eval()(x)
    if layout == "one":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    model.train(), ref.train()
    opt = dtorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(5):
        x, y = torch.randn(5, 3, 12, 12, generator=g), torch.randint(0, 10, (5,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(dtorch.from_torch(x, mesh, batch)),
                                                 dtorch.from_torch(y, mesh, batch))
        loss.backward()
        opt.step()
        opt.zero_grad()
        want = torch.nn.functional.cross_entropy(ref(x), y)
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert loss.item() == pytest.approx(want.item(), abs=1e-5), step
    for (name, t), want in zip(model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(t.to_torch(), want, atol=1e-5, rtol=1e-5, msg=name)


SD3_PLAN = {"transformer_blocks.*.attn.to_[qkv]": "colwise",
            "transformer_blocks.*.attn.add_[qkv]_proj": "colwise",
            "transformer_blocks.*.attn.to_out.0": "rowwise",
            "transformer_blocks.*.attn.to_add_out": "rowwise",
            "transformer_blocks.*.ff*.net.0.proj": "colwise",
            "transformer_blocks.*.ff*.net.2": "rowwise"}


@pytest.fixture(scope="module")
def sd3():
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    return diffusers.SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
        num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=32,
        pooled_projection_dim=16, out_channels=4, pos_embed_max_size=16).eval()


@pytest.mark.parametrize("layout", ["one", "dp2", "tp2", "dp2xtp2"])
def test_diffusers_sd3_transformer_unported_equals_itself(layout, sd3, one, dp2, tp2, dp2tp2):
    """diffusers' SD3 transformer (joint attention over image and text tokens, AdaLayerNorm,
    patch and timestep embeddings), its attention and feed-forwards tensor-parallel. On one
    device it differs from torch's by a rounding (2.4e-7: a GEMM of a few rows, whose result
    changes with torch's thread count too), so every layout is compared at 1e-5."""
    mesh = {"one": one, "dp2": dp2, "tp2": tp2, "dp2xtp2": dp2tp2}[layout]
    model = copy.deepcopy(sd3)
    dtorch.nn.parallelize(model, mesh, SD3_PLAN if mesh.has_dim_name("tp") else {})
    assert model.transformer_blocks[0].attn.to_q.weight.placements[-1] == (
        S0 if mesh.has_dim_name("tp") else R)
    g = torch.Generator().manual_seed(4)
    inputs = dict(hidden_states=torch.randn(2, 4, 8, 8, generator=g),
                  encoder_hidden_states=torch.randn(2, 5, 32, generator=g),
                  pooled_projections=torch.randn(2, 16, generator=g),
                  timestep=torch.tensor([3.0, 500.0]))
    batch = [S0 if mesh.mesh_dim_names[k] == "dp" else R for k in range(mesh.ndim)] \
        if mesh.mesh_dim_names else [R]
    with torch.no_grad():
        got = model(**{k: dtorch.from_torch(v, mesh, batch) for k, v in inputs.items()}).sample
        want = sd3(**inputs).sample
    assert isinstance(got, dtorch.Tensor)
    torch.testing.assert_close(got.to_torch(), want, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def cp_meshes():
    make = dtorch.init_device_mesh
    return {"ring_cp2": make("cpu", (2,), mesh_dim_names=["ring_cp"]),
            "ulysses_cp2": make("cpu", (2,), mesh_dim_names=["ulysess_cp"]),
            "dp2xring_cp2": make("cpu", (2, 2), mesh_dim_names=["dp", "ring_cp"]),
            "tp2xulysses_cp2": make("cpu", (2, 2), mesh_dim_names=["tp", "ulysess_cp"])}


def cp_batch(mesh):
    """The ids sharded on batch over dp, on sequence over a CP dim, whole elsewhere."""
    return [S0 if n == "dp" else Shard(1) if n.endswith("_cp") else R
            for n in mesh.mesh_dim_names]


@pytest.mark.parametrize("layout", ["ring_cp2", "ulysses_cp2", "dp2xring_cp2", "tp2xulysses_cp2"])
def test_hf_llama_unported_runs_context_parallel(layout, cp_meshes, hf_llama):
    """HF's attention calls torch's scaled_dot_product_attention (causal, no mask): with the
    sequence sharded on a mesh dim named for Ring or Ulysses CP, that call runs dtorch's
    context-parallel attention, so the unported model runs CP as it is; logits keep the
    sequence sharded."""
    mesh = cp_meshes[layout]
    model = copy.deepcopy(hf_llama).eval()
    dtorch.nn.parallelize(model, mesh, LLAMA_PLAN if mesh.has_dim_name("tp") else {})
    x = ids(6)
    with torch.no_grad():
        got = model(dtorch.from_torch(x, mesh, cp_batch(mesh)), use_cache=False).logits
        want = hf_llama.eval()(x, use_cache=False).logits
    assert Shard(1) in got.placements
    torch.testing.assert_close(got.to_torch(), want, atol=1e-5, rtol=1e-5)


def test_hf_llama_unported_trains_context_parallel(hf_llama, cp_meshes):
    """5 AdamW steps on dp2 x ring_cp2 (torch's K-dimensional cross-entropy keeps batch and
    sequence sharded): every loss and the final weights are torch's. In float64: the ring's
    online softmax rounds otherwise than torch's attention, and Adam turns a rounding of a
    gradient near zero into a step of up to lr (float32 gave 1.4e-5 in 2 of 1024 weights)."""
    mesh = cp_meshes["dp2xring_cp2"]
    ref, model = (copy.deepcopy(hf_llama).double().train() for _ in range(2))
    dtorch.nn.parallelize(model, mesh)
    opt = dtorch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(5):
        x = ids(200 + step)
        d = dtorch.from_torch(x, mesh, cp_batch(mesh))
        loss = torch.nn.functional.cross_entropy(
            model(d, use_cache=False).logits.transpose(1, 2), d)
        loss.backward()
        opt.step()
        opt.zero_grad()
        want = torch.nn.functional.cross_entropy(ref(x, use_cache=False).logits.transpose(1, 2),
                                                 x)
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert loss.item() == pytest.approx(want.item(), abs=1e-12), step
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.to_torch(), q.detach(), atol=1e-10, rtol=1e-10)
