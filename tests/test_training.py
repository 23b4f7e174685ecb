"""Training loops against torch's on the same values: optimizers (param groups, schedulers,
state), gradient clipping across meshes, gradient accumulation, and the Llama trained on
parallel layouts."""

import copy

import gc

import pytest
import torch

import dtorch
from dtorch import Replicate, Shard

R, S0, S1 = Replicate(), Shard(0), Shard(1)


@pytest.fixture(scope="module")
def grid():
    return dtorch.DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=["dp", "tp"])


class TorchMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(6, 10)
        self.down = torch.nn.Linear(10, 3)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


class MLP(dtorch.nn.Module):
    """Column- then row-parallel on tp; replicated on dp."""

    def __init__(self, mesh):
        super().__init__()
        self.up = dtorch.nn.ColumnParallelLinear(6, 10, device_mesh=mesh)
        self.down = dtorch.nn.RowParallelLinearWithReplicateOutput(10, 3, device_mesh=mesh)

    def forward(self, x):
        return self.down(dtorch.nn.functional.gelu(self.up(x)))


def batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(n)]


def train(model, opt, data, lib, mesh=None, sched=None, clip=None):
    losses = []
    for x, y in data:
        if lib is dtorch:
            x = dtorch.from_torch(x, device_mesh=mesh, placements=[S0, R])
            y = dtorch.from_torch(y, device_mesh=mesh, placements=[S0, R])
        loss = lib.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if clip:
            lib.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if sched:
            sched.step()
        losses.append(loss)
    return [float(v.item()) for v in losses]


def pair(grid):
    ref = TorchMLP()
    model = MLP(grid)
    model.load_state_dict(ref.state_dict())
    return ref, model


def assert_same_params(model, ref, atol=1e-5):
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.to_torch(), q.detach(), atol=atol, rtol=1e-5, msg=name)


OPTIMIZERS = [
    ("SGD", dict(lr=0.1)),
    ("SGD", dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
    ("SGD", dict(lr=0.1, momentum=0.9, nesterov=True)),
    ("SGD", dict(lr=0.1, momentum=0.5, dampening=0.3, maximize=True)),
    ("Adam", dict(lr=0.05)),
    ("Adam", dict(lr=0.05, betas=(0.8, 0.99), weight_decay=0.1)),
    ("AdamW", dict(lr=0.05, weight_decay=0.1)),
]


@pytest.mark.parametrize("name,kwargs", OPTIMIZERS, ids=[f"{n}-{i}" for i, (n, _) in
                                                         enumerate(OPTIMIZERS)])
def test_optimizers_follow_torch_on_a_dp_tp_mesh(name, kwargs, grid):
    ref, model = pair(grid)
    data = batches(4)
    expected = train(ref, getattr(torch.optim, name)(ref.parameters(), **kwargs), data, torch)
    got = train(model, getattr(dtorch.optim, name)(model.parameters(), **kwargs), data, dtorch,
                grid)
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert_same_params(model, ref)


def test_param_groups_scheduler_and_clipping(grid):
    ref, model = pair(grid)

    def make(lib, m):
        opt = lib.optim.AdamW([{"params": m.up.parameters(), "lr": 0.02},
                               {"params": m.down.parameters()}], lr=0.05, weight_decay=0.05)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    data = batches(4, seed=1)
    opt_t, sched_t = make(torch, ref)
    opt_d, sched_d = make(dtorch, model)
    expected = train(ref, opt_t, data, torch, sched=sched_t, clip=0.3)
    got = train(model, opt_d, data, dtorch, grid, sched=sched_d, clip=0.3)
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert_same_params(model, ref)
    assert opt_d.param_groups[0]["lr"] == opt_t.param_groups[0]["lr"] == 0.02 / 16


def test_clip_grad_norm_spans_meshes_without_a_read(monkeypatch):
    """Gradients on two pipeline stages: one total norm, as torch's over all of them."""
    a_mesh, b_mesh = dtorch.DeviceMesh("cpu", [0, 1]), dtorch.DeviceMesh("cpu", [2, 3])
    ta, tb = torch.randn(5, 3), torch.randn(4)
    a = dtorch.nn.Parameter(dtorch.from_torch(ta, a_mesh, [S0]))
    b = dtorch.nn.Parameter(dtorch.from_torch(tb, b_mesh, [R]))
    ra, rb = ta.clone().requires_grad_(), tb.clone().requires_grad_()
    ((ra * 3).sum() + (rb ** 2).sum()).backward()
    ((a * 3).sum() + (b ** 2).sum().redistribute(device_mesh=a_mesh, placements=[R])).backward()
    from dtorch.client import session

    monkeypatch.setattr(session.Session, "fetch", lambda *a, **k: pytest.fail("a read"))
    norm = dtorch.nn.utils.clip_grad_norm_([a, b], 1.0)
    monkeypatch.undo()
    expected = torch.nn.utils.clip_grad_norm_([ra, rb], 1.0)
    torch.testing.assert_close(norm.to_torch(), expected)
    torch.testing.assert_close(a.grad.to_torch(), ra.grad)
    torch.testing.assert_close(b.grad.to_torch(), rb.grad)
    inf = dtorch.nn.utils.clip_grad_norm_([a, b], 1.0, norm_type=float("inf"))
    torch.testing.assert_close(inf.to_torch(), torch.nn.utils.clip_grad_norm_(
        [ra, rb], 1.0, norm_type=float("inf")))


def test_gradient_accumulation_equals_one_batch(grid):
    ref, model = pair(grid)
    x, y = batches(1)[0]
    torch.nn.functional.mse_loss(ref(x), y).backward()
    for half in (slice(0, 4), slice(4, 8)):  # two micro-batches, each half the loss
        xd = dtorch.from_torch(x[half], device_mesh=grid, placements=[S0, R])
        yd = dtorch.from_torch(y[half], device_mesh=grid, placements=[S0, R])
        (dtorch.nn.functional.mse_loss(model(xd), yd) / 2).backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad.to_torch(), q.grad, atol=1e-6, rtol=1e-5, msg=name)


def test_optimizer_state_dict_round_trip(grid):
    ref, model = pair(grid)
    data = batches(4, seed=2)
    opt = dtorch.optim.Adam(model.parameters(), lr=0.05)
    train(model, opt, data[:2], dtorch, grid)
    saved = copy.copy(opt.state_dict())
    first = saved["state"][0]
    assert isinstance(first["exp_avg"], dtorch.Tensor) and float(first["step"]) == 2
    assert first["exp_avg"].placements == list(model.up.weight.placements)
    twin = MLP(grid)
    twin.load_state_dict(model.state_dict())
    opt2 = dtorch.optim.Adam(twin.parameters(), lr=0.05)
    opt2.load_state_dict(saved)
    a = train(model, opt, data[2:], dtorch, grid)
    b = train(twin, opt2, data[2:], dtorch, grid)
    assert a == b


def test_refusals():
    mesh = dtorch.DeviceMesh("cpu", [0])
    with pytest.raises(TypeError, match="optimizes dtorch tensors"):
        dtorch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1)
    with pytest.raises(NotImplementedError, match="amsgrad"):
        dtorch.optim.Adam([dtorch.nn.Parameter(dtorch.zeros(2, device_mesh=mesh))], amsgrad=True)
    with pytest.raises(ValueError, match="Nesterov"):
        dtorch.optim.SGD([dtorch.nn.Parameter(dtorch.zeros(2, device_mesh=mesh))], lr=0.1,
                         nesterov=True)


def test_a_thousand_steps_keep_memory_flat():
    mesh = dtorch.DeviceMesh("cpu", [0, 1])
    w = dtorch.nn.Parameter(dtorch.randn(16, 16, device_mesh=mesh, placements=[S0]))
    x = dtorch.randn(8, 16, device_mesh=mesh)
    opt = dtorch.optim.SGD([w], lr=0.01, momentum=0.9)

    def steps(n):
        for _ in range(n):
            (x @ w.T).tanh().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

    steps(20)
    gc.collect()  # other tests' garbage must not land inside the window
    before = dtorch.default_graph.get_memory_stats(mesh)
    steps(1000)
    gc.collect()
    after = dtorch.default_graph.get_memory_stats(mesh)
    for d in mesh.devices:
        assert after.find(d).memory_allocated == before.find(d).memory_allocated


# layout -> (mesh sizes over (dp, tp, pp, ulysess_cp, ring_cp), micro-batches, ZeRO stage)
TRAIN_LAYOUTS = {
    "one": ((1, 1, 1, 1, 1), 1, 0),
    "dp2": ((2, 1, 1, 1, 1), 1, 0),
    "tp2": ((1, 2, 1, 1, 1), 1, 0),
    "dp2-tp2": ((2, 2, 1, 1, 1), 1, 0),
    "pp2-4-microbatches": ((1, 1, 2, 1, 1), 4, 0),
    "ulysses_cp2": ((1, 1, 1, 2, 1), 1, 0),  # a sequence of 9: uneven blocks
    "ring_cp2": ((1, 1, 1, 1, 2), 1, 0),
    "dp2-tp2-ring_cp2": ((2, 2, 1, 1, 2), 1, 0),
    "dp2-zero1": ((2, 1, 1, 1, 1), 1, 1),
    "dp2-zero2": ((2, 1, 1, 1, 1), 1, 2),
    "dp2-tp2-pp2": ((2, 2, 2, 1, 1), 1, 0),
}


@pytest.mark.parametrize("layout", list(TRAIN_LAYOUTS))
def test_llama_trains_as_hf(layout):
    """20 AdamW steps on a cross-entropy loss: the first step's gradients, every loss and the
    final weights equal HF's model trained in torch on one device. With micro-batches, each
    one's loss (a quarter of the mean) is backpropagated as it is issued, the stages overlapping,
    and the gradients accumulate."""
    pytest.importorskip("transformers")
    import test_llama as L

    sizes, microbatches, zero = TRAIN_LAYOUTS[layout]
    hf = L.hf_model(L.config())
    mesh = dtorch.init_device_mesh("cpu", sizes, mesh_dim_names=L.DIMS)
    model = L.LlamaForCausalLM(hf.config, device_mesh=mesh)
    model.load_state_dict(hf.state_dict())
    opt_t = torch.optim.AdamW(hf.parameters(), lr=1e-3)
    opt_d = dtorch.optim.AdamW(model.parameters(), lr=1e-3, zero_stage=zero)
    g = torch.Generator().manual_seed(3)
    for step in range(20):
        ids = torch.randint(0, 96, (4, 9), generator=g)
        labels = torch.randint(0, 96, (4, 9), generator=g)
        expected = torch.nn.functional.cross_entropy(hf(ids).logits.flatten(0, 1),
                                                     labels.flatten())
        expected.backward()
        losses = []
        for part, part_labels in zip(ids.chunk(microbatches), labels.chunk(microbatches)):
            inputs = model.place_tokens(part)
            logits = model(inputs)
            target = dtorch.from_torch(part_labels, device_mesh=inputs.device_mesh,
                                       placements=inputs.placements)
            # classes in dim 1 (torch's K-dimensional form): batch and sequence keep their
            # shards (flatten(0, 1) would need the sequence whole under context parallelism)
            loss = dtorch.nn.functional.cross_entropy(logits.transpose(1, 2), target)
            (loss / microbatches).backward()
            losses.append(loss)
        if step == 0:
            for (name, p), (_, q) in zip(model.named_parameters(), hf.named_parameters()):
                torch.testing.assert_close(p.grad.to_torch(), q.grad, atol=1e-6, rtol=1e-5,
                                           msg=name)
        opt_t.step(), opt_d.step()
        opt_t.zero_grad(), opt_d.zero_grad()
        got = sum(v.item() for v in losses) / microbatches
        assert got == pytest.approx(expected.item(), rel=1e-5), step
    assert_same_params(model, hf, atol=1e-5)


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_shards_state_and_gradients_on_dp(stage, grid):
    """ZeRO-1: the optimizer state is Shard on dp (half the bytes per device); ZeRO-2: the
    gradients too (reduce-scattered). The training is torch's either way."""
    ref, model = pair(grid)
    data = batches(3, seed=4)
    opt = dtorch.optim.AdamW(model.parameters(), lr=0.05, zero_stage=stage)
    expected = train(ref, torch.optim.AdamW(ref.parameters(), lr=0.05), data, torch)
    x, y = (dtorch.from_torch(t, device_mesh=grid, placements=[S0, R]) for t in data[0])
    dtorch.nn.functional.mse_loss(model(x), y).backward()
    up = model.up.weight  # [R, S0]: ZeRO shards its first free dim, 1, on dp
    assert up.grad.placements == ([R, S0] if stage == 1 else [S1, S0])
    opt.zero_grad()
    got = train(model, opt, data, dtorch, grid)
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert_same_params(model, ref)
    state = opt.state[up]
    assert state["exp_avg"].placements == [S1, S0]
    with pytest.raises(ValueError, match="zero_stage=3.*apply dtorch.nn.fully_shard"):
        dtorch.optim.SGD(model.parameters(), lr=0.1, zero_stage=3)  # parameters not sharded
    with pytest.raises(ValueError, match="zero_stage must be 0, 1, 2 or 3"):
        dtorch.optim.SGD(model.parameters(), lr=0.1, zero_stage=4)


@pytest.mark.parametrize("stage", [1, 2])
def test_a_zero_step_gathers_the_updated_chunks_in_one_collective(stage, grid):
    """Each device updates its chunk of every parameter; the chunks of the weights return to
    them through one all-gather (``all_gather_coalesced``), not one each (the column-parallel
    bias has no dim tp leaves free, so it is updated whole; the row-parallel bias, Partial on
    tp, goes back alone: its change is more than an all-gather); ZeRO-2's gradients reach their
    shards through one reduce-scatter. Values as torch's."""
    ref, model = pair(grid)
    (x, y), = batches(1, seed=7)
    opt = dtorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, zero_stage=stage)
    torch.nn.functional.mse_loss(ref(x), y).backward()
    torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9).step()
    x, y = (dtorch.from_torch(t, device_mesh=grid, placements=[S0, R]) for t in (x, y))
    with dtorch.profiler.profile() as prof:
        dtorch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        dtorch.sync()
    names = [e["name"] for e in prof.kernels() if e["pid"] == 0 and e["cat"] == "comm"]
    assert names.count("all_gather_coalesced") == 1 and names.count("step:all_gather") == 1, names
    assert names.count("reduce_scatter_coalesced") == (stage == 2), names
    assert_same_params(model, ref)


def test_master_weights_keep_bfloat16_parameters_in_float32(grid):
    """bfloat16 parameters, float32 master copies and moments: torch's AdamW on a float32
    master fed the bfloat16 gradients, then rounded into the parameter each step."""
    start = torch.randn(4, 6, generator=torch.Generator().manual_seed(5))
    xs = batches(3, seed=6)
    master = start.to(torch.bfloat16).float().requires_grad_()  # the master starts as w does
    opt_t = torch.optim.AdamW([master], lr=0.01)
    low = start.to(torch.bfloat16)
    for x, _ in xs:
        leaf = low.clone().requires_grad_()
        (leaf @ x.T.to(torch.bfloat16)).float().pow(2).mean().backward()
        master.grad = leaf.grad.float()
        opt_t.step()
        low = master.detach().to(torch.bfloat16)
    w = dtorch.nn.Parameter(dtorch.from_torch(start.to(torch.bfloat16), grid, [R, S0]))
    opt = dtorch.optim.AdamW([w], lr=0.01, master_weights=True, zero_stage=1)
    for x, _ in xs:
        xd = dtorch.from_torch(x.to(torch.bfloat16), grid, [R, R])
        (w @ xd.T).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    assert w.dtype == torch.bfloat16 and opt.state[w]["master"].dtype == torch.float32
    assert opt.state[w]["exp_avg"].dtype == torch.float32
    torch.testing.assert_close(opt.state[w]["master"].to_torch(), master.detach())
    assert torch.equal(w.to_torch(), low)


def test_grad_scaler_follows_torch_through_an_overflow(grid):
    """A float16 loss whose gradients overflow on one step: that step is skipped and the scale
    backs off; later steps grow it again, as torch's GradScaler does (float32 parameters, as
    torch requires)."""
    start = torch.randn(4, 6, generator=torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(8)
    xs = [torch.randn(4, 6, generator=g) for _ in range(5)]
    xs[1] = xs[1] * 1e4  # overflows float16 once scaled

    def run(lib, w, opt, scaler, place):
        scales = []
        for x in xs:
            loss = (w.to(torch.float16) * place(x)).sum()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            scales.append(scaler.get_scale())
        return scales

    tw = start.clone().requires_grad_()
    t_scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=2)
    expected = run(torch, tw, torch.optim.SGD([tw], lr=0.1), t_scaler,
                   lambda x: x.to(torch.float16))
    w = dtorch.nn.Parameter(dtorch.from_torch(start, grid, [R, S0]))
    scaler = dtorch.amp.GradScaler(init_scale=8.0, growth_interval=2)
    got = run(dtorch, w, dtorch.optim.SGD([w], lr=0.1), scaler,
              lambda x: dtorch.from_torch(x.to(torch.float16), grid, [R, S0]))
    assert got == expected and 4.0 in got
    torch.testing.assert_close(w.to_torch(), tw.detach())
    low = dtorch.nn.Parameter(dtorch.zeros(2, dtype=torch.float16, device_mesh=grid))
    (low * 2).sum().backward()
    with pytest.raises(ValueError, match="unscale FP16 gradients"):
        scaler.unscale_(dtorch.optim.SGD([low], lr=0.1))
