"""Unported torch modules on a mesh (``dtorch.nn.parallelize``): torch's own modules and HF
transformers' Llama, their parameters laid out by a plan, run and trained unchanged against
themselves on torch."""

import copy

import pytest
import torch
import transformers

import dtorch
from dtorch import Replicate, Shard

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


def test_a_meta_built_model_gets_layouts_without_values(hf_llama, tp2):
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(llama_config())
    dtorch.nn.parallelize(model, tp2, LLAMA_PLAN)
    q = model.model.layers[0].self_attn.q_proj.weight
    assert q.placements == [S0]
    with pytest.raises(RuntimeError, match="no value"):
        q.to_torch()
    model.load_state_dict(hf_llama.state_dict())
    torch.testing.assert_close(q.to_torch(), hf_llama.model.layers[0].self_attn.q_proj.weight
                               .detach())


def test_plans_that_cannot_be_laid_out_raise(tp2):
    with pytest.raises(ValueError, match="styles"):
        dtorch.nn.parallelize(mlp(), tp2, {"0": "diagonal"})
    with pytest.raises(ValueError, match="is a LayerNorm"):
        dtorch.nn.parallelize(mlp(), tp2, {"3": "colwise"})
    with pytest.raises(ValueError, match="lacks"):
        dtorch.nn.parallelize(mlp(), dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["dp"]),
                              {"0": "colwise"})


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
