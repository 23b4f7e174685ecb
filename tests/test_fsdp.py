"""ZeRO-3 (``dtorch.nn.fully_shard``): parameters stored Shard on dp and gathered around each
layer's forward; gradients reduce-scattered into sharded ``.grad``; training, memory and
checkpoints against torch and HF. The models and loops are test_training's."""

import functools
import gc

import pytest
import test_llama as L
import test_training as T
import torch

import dtorch
from dtorch import Partial, Replicate, Shard, buckets
from dtorch.client import dispatch
from dtorch.models.llama import LlamaForCausalLM
from dtorch.nn import fully_shard
from dtorch.redistribute import COMM_STEPS, plan_redistribute

R, S0, S1 = Replicate(), Shard(0), Shard(1)

# mesh sizes and names, the MLP's placements once sharded: dp shards the first dim no other mesh
# dim shards; the column-parallel bias has none on dp2·tp2 (tp splits its one dim): Replicate
MESHES = {
    "dp2": ((2,), ["dp"], {"up.weight": [S0], "up.bias": [S0], "down.weight": [S0],
                           "down.bias": [S0]}),
    "dp2-tp2": ((2, 2), ["dp", "tp"], {"up.weight": [S1, S0], "up.bias": [R, S0],
                                       "down.weight": [S0, S1], "down.bias": [S0, Partial()]}),
}


def shard(model):
    """FSDP2's recipe: each child (a layer), then the root."""
    for child in model.children():
        fully_shard(child)
    return fully_shard(model)


def placed(mesh, *tensors):
    """Torch tensors as dtorch ones, the batch split over dp."""
    layout = [S0] + [R] * (mesh.ndim - 1)
    return [dtorch.from_torch(t, device_mesh=mesh, placements=layout) for t in tensors]


def same_objects(a, b) -> bool:
    a, b = list(a), list(b)
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


@pytest.mark.parametrize("layout", list(MESHES))
def test_mlp_gradients_land_sharded_as_torch(layout, monkeypatch):
    """The Parameter objects stay (re-laid), and the module holds them again after a forward;
    each gradient reaches ``.grad`` laid out as its parameter through a reduce-scatter on dp
    (the dual of its all-gather; the sharded ones joined in one bucket), with torch's values;
    AdamW with zero_stage=3 then trains as torch's, its state laid out as the parameters."""
    sizes, names, expected = MESHES[layout]
    mesh = dtorch.init_device_mesh("cpu", sizes, mesh_dim_names=names)
    ref, model = T.TorchMLP(), T.MLP(mesh)
    model.load_state_dict(ref.state_dict())
    params = list(model.parameters())
    shard(model)
    assert same_objects(model.parameters(), params)
    assert {n: p.placements for n, p in model.named_parameters()} == expected
    (x, y), = T.batches(1)
    torch.nn.functional.mse_loss(ref(x), y).backward()
    loss = dtorch.nn.functional.mse_loss(model(placed(mesh, x)[0]), placed(mesh, y)[0])
    assert same_objects(model.parameters(), params)
    moves, bind = [], dispatch.bind_redistribute
    monkeypatch.setattr(dispatch, "bind_redistribute",
                        lambda s, src, dst: moves.append((src, dst)) or bind(s, src, dst))
    bucketed, scatter = [], buckets.reduce_scatter_coalesced
    monkeypatch.setattr(buckets, "reduce_scatter_coalesced",
                        lambda ts, *a: bucketed.append(len(ts)) or scatter(ts, *a))
    loss.backward()
    monkeypatch.undo()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert p.grad.placements == p.placements, name
        torch.testing.assert_close(p.grad.to_torch(), q.grad, atol=1e-6, rtol=1e-5, msg=name)
    on_dp = [step.kind for src, dst in moves if src.shape  # (a scalar: the mean's own)
             for step in plan_redistribute(src.placements, dst.placements)
             if step.mesh_dim == 0 and step.kind in COMM_STEPS]
    sharded = sum(p.placements[0] != R for p in params)
    # dp2·tp2's Partial bias is the one reduced alone: its .grad is laid out as it (Partial)
    assert len(bucketed) == 1 and sum(bucketed) + on_dp.count("reduce_scatter") == sharded
    assert on_dp.count("all_reduce") == len(params) - sharded  # dp2·tp2's Replicate bias

    ref.zero_grad()
    model.zero_grad()
    data = T.batches(3, seed=4)
    opt = dtorch.optim.AdamW(model.parameters(), lr=0.05, zero_stage=3)
    losses = []
    for x, y in data:
        loss = dtorch.nn.functional.mse_loss(model(placed(mesh, x)[0]), placed(mesh, y)[0])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    expected_losses = T.train(ref, torch.optim.AdamW(ref.parameters(), lr=0.05), data, torch)
    assert losses == pytest.approx(expected_losses, rel=1e-5, abs=1e-6)
    T.assert_same_params(model, ref)
    up = model.up.weight
    assert opt.state[up]["exp_avg"].placements == up.placements


def test_a_layer_is_gathered_in_one_collective_forward_and_backward():
    """Each group's parameters (a layer's weight and bias) are gathered by one all-gather in the
    forward and one again in the backward, and their gradients reduce-scattered by one (the
    layers' together: the bucket is not full): FSDP2's flat all-gathers, not one collective per
    parameter. Values as torch's."""
    mesh = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["dp"])
    ref, model = T.TorchMLP(), T.MLP(mesh)
    model.load_state_dict(ref.state_dict())
    shard(model)
    (x, y), = T.batches(1, seed=2)
    torch.nn.functional.mse_loss(ref(x), y).backward()
    with dtorch.profiler.profile() as prof:
        loss = dtorch.nn.functional.mse_loss(model(placed(mesh, x)[0]), placed(mesh, y)[0])
        loss.backward()
        dtorch.sync()
    comm = [e["name"] for e in prof.kernels() if e["pid"] == 0 and e["cat"] == "comm"]
    assert comm.count("all_gather_coalesced") == 4 and "step:all_gather" not in comm, comm
    assert comm.count("reduce_scatter_coalesced") == 1 and "step:reduce_scatter" not in comm
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad.to_torch(), q.grad, atol=1e-6, rtol=1e-5, msg=name)


def test_the_backward_gathers_the_weights_again():
    """The hosts' saved graphs keep no gathered weight (``tape.gathered``): the backward gathers
    it again from the shard, as torch's FSDP does. Shown by changing the shards between the
    forward and the backward: the input's gradient, ``g @ W``, then reads the new weights
    (torch's own autograd would refuse the change; a kept copy would give the old ones)."""
    mesh = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["dp"])
    layer = dtorch.nn.Linear(4, 6, bias=False, device_mesh=mesh)
    fully_shard(layer)
    w = layer.weight.to_torch()
    x = dtorch.from_torch(torch.randn(8, 4), device_mesh=mesh, placements=[S0])
    x.requires_grad_()
    y = layer(x)
    with torch.no_grad():
        layer.weight.mul_(3.0)
    grad = torch.randn(8, 6)
    y.backward(dtorch.from_torch(grad, device_mesh=mesh, placements=[S0]))
    torch.testing.assert_close(x.grad.to_torch(), grad @ (3.0 * w))
    torch.testing.assert_close(layer.weight.grad.to_torch(), grad.T @ x.to_torch())


def test_a_weight_tied_across_groups_gets_both_gradients():
    """One Parameter registered by two fully_shard'ed layers: sharded once, gathered by each
    layer in its forward; its gradient is the sum of both uses."""
    mesh = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["dp"])
    torch.manual_seed(1)
    ref = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
    ref[2].weight = ref[0].weight
    model = dtorch.nn.Sequential(dtorch.nn.Linear(4, 4, device_mesh=mesh), dtorch.nn.Tanh(),
                                 dtorch.nn.Linear(4, 4, device_mesh=mesh))
    model[2].weight = model[0].weight
    model.load_state_dict(ref.state_dict())
    shard(model)
    assert model[2].weight is model[0].weight and model[0].weight.placements == [S0]
    x = torch.randn(6, 4)
    ref(x).pow(2).sum().backward()
    model(placed(mesh, x)[0]).pow(2).sum().backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad.to_torch(), q.grad, atol=1e-5, rtol=1e-5, msg=name)


def test_refusals_name_the_fix():
    mesh = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["dp"])
    model = T.MLP(mesh)
    fully_shard(model.up)
    with pytest.raises(ValueError, match="fully_shard to the model"):  # down is not sharded
        dtorch.optim.AdamW(model.parameters(), zero_stage=3)
    fully_shard(model)
    assert fully_shard(model) is model  # a second call changes nothing
    with pytest.raises(ValueError, match="bottom-up"):
        fully_shard(model.down)
    layer = dtorch.nn.Linear(4, 2, device_mesh=mesh)
    layer(dtorch.ones((2, 4), device_mesh=mesh)).sum().backward()
    with pytest.raises(ValueError, match="zero_grad"):
        fully_shard(layer)


def sharded_llama(config, device_mesh):
    """test_training's Llama with each decoder layer fully_shard'ed, then the root."""
    model = LlamaForCausalLM(config, device_mesh=device_mesh)
    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_llama_trains_as_hf_on_dp2_zero3(tied, monkeypatch):
    """test_training's 20 AdamW steps against HF (first gradients, every loss, the final
    weights) on a "dp2-zero3" layout: the model fully_shard'ed, zero_stage=3; with
    ``tie_word_embeddings`` too."""
    monkeypatch.setitem(T.TRAIN_LAYOUTS, "dp2-zero3", ((2, 1, 1, 1, 1), 1, 3))
    monkeypatch.setattr(L, "LlamaForCausalLM", sharded_llama)
    if tied:
        monkeypatch.setattr(L, "config", functools.partial(L.config, tie_word_embeddings=True))
    T.test_llama_trains_as_hf("dp2-zero3")


def held(mesh) -> list:
    gc.collect()  # garbage (other tests', ours) must not land between two readings
    stats = dtorch.default_graph.get_memory_stats(mesh)
    return [stats.find(d).memory_allocated for d in mesh.devices]


def test_each_device_holds_its_shard_of_the_parameters():
    """After fully_shard a device holds 1/dp of the parameters' bytes P (and the buffers,
    replicated); a forward without grad frees what it gathered; after a backward the gradients
    add P/dp, nothing more."""
    mesh = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["dp"])
    empty = held(mesh)
    model = sharded_llama(L.config(), mesh)  # every size even: exact halves
    size = sum(p.numel() * p.dtype.itemsize for p in model.parameters())
    buffers = sum(b.numel() * b.dtype.itemsize for b in model.buffers())
    after = held(mesh)
    assert [a - e for a, e in zip(after, empty)] == [size // 2 + buffers] * 2
    ids = torch.randint(0, 96, (4, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids)
    assert held(mesh) == after
    loss = model(ids).sum()
    loss.backward()
    del loss
    assert [h - a for h, a in zip(held(mesh), after)] == [size // 2] * 2


def test_checkpoint_round_trip_of_a_sharded_model(tmp_path):
    """state_dict() holds the sharded Parameters (HF's keys, the tied head's skipped);
    save_checkpoint writes each device's shard, which loads back into a sharded model and into
    an unsharded one on one device."""
    hf = L.hf_model(L.config(tie_word_embeddings=True), seed=2)
    mesh = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["dp"])
    model = sharded_llama(hf.config, mesh)
    model.load_state_dict(hf.state_dict())
    state = model.state_dict()
    assert set(state) == set(hf.state_dict()) - {"lm_head.weight"}
    assert all(state[name].placements == p.placements == [S0]
               for name, p in model.named_parameters())
    dtorch.save_checkpoint(model, tmp_path)
    twin = sharded_llama(hf.config, mesh)
    one = LlamaForCausalLM(hf.config, device_mesh=dtorch.DeviceMesh("cpu", [0]))
    for target in (twin, one):
        dtorch.load_checkpoint(target, tmp_path)
        for key, value in target.state_dict().items():
            assert torch.equal(value.to_torch(), hf.state_dict()[key]), key
