"""Parameter initialization: the in-place random fills (``uniform_``, ``normal_``), torch's
``torch.nn.init`` on dtorch tensors (``dtorch.nn.init``), and deferred initialization
(``dtorch.nn.init_empty``: tensors without values until a full write).

Values are compared with torch's for the same ``torch.Generator``, bit for bit (every device
draws the whole tensor), over 1-D and 2-D meshes, Shard/Replicate/Partial/sub-split layouts,
uneven blocks and whole tensors on both sides of the size from which a whole is drawn into a
mapping of its own (``blocks.SCRATCH_BYTES``)."""

import math
import mmap
import threading

import pytest
import torch

import dtorch
from dtorch import Partial, Replicate, Shard
from dtorch import blocks
from dtorch.nn import init

R, S0, S1 = Replicate(), Shard(0), Shard(1)
BIG = (700, 450)  # 1.2 MiB of float32: over SCRATCH_BYTES; its halves are not
SMALL = (7, 5)


def gen(seed=1):
    return torch.Generator().manual_seed(seed)


def layouts(mesh1, mesh2):
    """(mesh, placements) pairs: 3 devices (uneven blocks of 7 and 700), and 2 x 2."""
    return [(mesh1, [S0]), (mesh1, [S1]), (mesh1, [R]), (mesh1, [Partial()]),
            (mesh2, [S0, S1]), (mesh2, [S1, S1]), (mesh2, [R, S0]), (mesh2, [Partial(), S1])]


@pytest.mark.parametrize("shape", [SMALL, BIG], ids=["small", "big"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("fill", ["uniform_", "normal_"])
def test_fills_equal_torch_in_every_layout(fill, dtype, shape, mesh1, mesh2):
    args = (-0.5, 2.0) if fill == "uniform_" else (0.25, 3.0)
    want = getattr(torch.empty(shape, dtype=dtype), fill)(*args, generator=gen())
    for mesh, placements in layouts(mesh1, mesh2):
        t = dtorch.empty(shape, dtype=dtype, device_mesh=mesh, placements=placements)
        assert getattr(t, fill)(*args, generator=gen()) is t
        assert t.placements == placements
        assert torch.equal(t.to_torch(), want), (mesh, placements)


def test_a_partial_tensor_holds_the_values_once(mesh1):
    """Device 0 holds the values, the others zeros: the sum is the values (not 3 times)."""
    t = dtorch.empty(SMALL, device_mesh=mesh1, placements=[Partial()]).normal_(generator=gen())
    want = torch.empty(SMALL).normal_(generator=gen())
    assert torch.equal(t.redistribute(placements=[R]).to_torch(), want)


def test_a_sub_split_tensor_draws_its_whole(mesh1):
    a = dtorch.zeros((4, 5), device_mesh=mesh1, placements=[S0])
    b = dtorch.zeros((5, 5), device_mesh=mesh1, placements=[S0])
    t = dtorch.cat([a, b])  # each device holds its block of a, then of b
    assert t.placements[0].is_shard() and t.placements != [S0]
    t.uniform_(generator=gen())
    assert torch.equal(t.to_torch(), torch.empty(9, 5).uniform_(generator=gen()))


def test_the_generator_advances_as_torch_does(mesh1):
    g, ref = gen(5), gen(5)
    dtorch.empty(BIG, device_mesh=mesh1, placements=[S0]).uniform_(generator=g)
    torch.empty(BIG).uniform_(generator=ref)
    dtorch.empty(SMALL, device_mesh=mesh1, placements=[S1]).normal_(generator=g)
    torch.empty(SMALL).normal_(generator=ref)
    assert torch.equal(torch.rand(4, generator=g), torch.rand(4, generator=ref))


def test_without_a_generator_dtorch_seeds_the_draws(mesh1):
    dtorch.manual_seed(3)
    first = dtorch.empty(SMALL, device_mesh=mesh1, placements=[S0]).uniform_().to_torch()
    dtorch.manual_seed(3)
    again = dtorch.empty(SMALL, device_mesh=mesh1, placements=[R]).uniform_().to_torch()
    other = dtorch.empty(SMALL, device_mesh=mesh1, placements=[R]).uniform_().to_torch()
    assert torch.equal(first, again) and not torch.equal(again, other)
    assert 0 <= first.min() and first.max() < 1


@pytest.mark.parametrize("call, error", [
    (lambda t, g: t.uniform_(1.0, 0.0, generator=g), RuntimeError),
    (lambda t, g: t.normal_(0.0, -1.0, generator=g), RuntimeError),
    (lambda t, g: t.long().uniform_(generator=g), NotImplementedError),
    (lambda t, g: t.uniform_(generator=3), TypeError),
    (lambda t, g: dtorch.nn.init.uniform_(t, generator=object()), TypeError),
])
def test_bad_fills_raise_as_torch_at_the_call_and_leave_the_generator(call, error, mesh1):
    t = dtorch.zeros(SMALL, device_mesh=mesh1, placements=[S0])
    g = gen(7)
    with pytest.raises(error):
        call(t, g)
    with pytest.raises(error):  # torch raises the same for the same call
        call(torch.zeros(SMALL), gen(7))
    assert torch.equal(g.get_state(), gen(7).get_state())
    assert torch.equal(t.to_torch(), torch.zeros(SMALL))  # the runtime goes on, t untouched


@pytest.mark.parametrize("name, kwargs", [
    ("uniform_", dict(a=-2.0, b=3.0)), ("normal_", dict(mean=1.0, std=0.5)),
    ("kaiming_uniform_", dict(a=math.sqrt(5))), ("kaiming_normal_", dict(mode="fan_out")),
    ("xavier_uniform_", dict(gain=2.0)), ("xavier_normal_", {}),
    ("trunc_normal_", dict(std=0.5, a=-0.6, b=0.6)),  # most of the mass inside: redraws
    ("trunc_normal_", dict(mean=0.0, std=1.0, a=2.0, b=2.5)),  # little inside: acceptance
])
@pytest.mark.parametrize("layout", ["S0", "S1xS1", "P"])
def test_init_functions_are_torchs(name, kwargs, layout, mesh1, mesh2):
    mesh, placements = {"S0": (mesh1, [S0]), "S1xS1": (mesh2, [S1, S1]),
                        "P": (mesh1, [Partial()])}[layout]
    shape = (30, 7, 3)  # conv-like: fans over the receptive field
    t = dtorch.empty(shape, device_mesh=mesh, placements=placements)
    want = getattr(torch.nn.init, name)(torch.empty(shape), **kwargs, generator=gen())
    assert getattr(init, name)(t, **kwargs, generator=gen()) is t
    assert torch.equal(t.to_torch(), want)


def test_constant_fills_and_what_is_not_supported(mesh1):
    t = dtorch.empty(SMALL, device_mesh=mesh1, placements=[S0])
    assert torch.equal(init.constant_(t, 2.5).to_torch(), torch.full(SMALL, 2.5))
    assert torch.equal(init.zeros_(t).to_torch(), torch.zeros(SMALL))
    assert torch.equal(init.ones_(t).to_torch(), torch.ones(SMALL))
    assert init.calculate_gain("tanh") == torch.nn.init.calculate_gain("tanh")
    for name in ("orthogonal_", "eye_", "dirac_", "sparse_"):
        with pytest.raises(NotImplementedError, match=f"init.{name}"):
            getattr(init, name)(t)


def test_a_whole_is_drawn_apart_only_when_big_and_not_the_block(monkeypatch):
    maps = []
    real = mmap.mmap
    monkeypatch.setattr(blocks.mmap, "mmap", lambda *a: maps.append(a) or real(*a))

    def draw(shape, pieces):
        return blocks.block_of_whole(shape, torch.float32, pieces,
                                     lambda t: t.uniform_(generator=gen()))

    half = ((0, BIG[0] // 2),), ((0, BIG[1]),)
    want = torch.empty(BIG).uniform_(generator=gen())
    assert torch.equal(draw(BIG, half), want[:BIG[0] // 2]) and len(maps) == 1
    assert torch.equal(draw(BIG, (((0, BIG[0]),), ((0, BIG[1]),))), want) and len(maps) == 1
    small = (256, 1023)  # one float less than a MiB
    assert torch.equal(draw(small, (((0, 128),), ((0, 1023),))),
                       torch.empty(small).uniform_(generator=gen())[:128]) and len(maps) == 1
    out = torch.empty(BIG[0] - 100, BIG[1])
    assert blocks.block_of_whole(BIG, torch.float32, (((100, BIG[0] - 100),), ((0, BIG[1]),)),
                                 lambda t: t.uniform_(generator=gen()), out=out) is out
    assert torch.equal(out, want[100:]) and len(maps) == 2


def test_modules_initialize_as_torch_within_its_bounds(mesh2):
    """Uniform in torch's bound: every value inside it, and the spread of a uniform draw. The
    sample std of n values uniform in [-b, b] is about b / sqrt(3) = 0.58 b, with an sd of
    about 0.26 b / sqrt(n) (0.016 b for the 256 biases here): b / 3 is some 15 sds below. For
    the 8 biases of a smaller layer 2.5% of draws fall under it (a run of the suite did)."""
    lin = dtorch.nn.Linear(40, 256, device_mesh=mesh2, tp_shard_type="col")
    conv = dtorch.nn.Conv2d(3, 256, 3)
    emb = dtorch.nn.Embedding(12, 6, padding_idx=2, device_mesh=mesh2, tp_dim="tp")
    for w, bound in ((lin.weight, 1 / math.sqrt(40)), (lin.bias, 1 / math.sqrt(40)),
                     (conv.weight, 1 / math.sqrt(27)), (conv.bias, 1 / math.sqrt(27))):
        v = w.to_torch()
        assert v.abs().max() <= bound and v.std() > bound / 3  # uniform in the bound
    e = emb.weight.to_torch()
    assert not e[2].any() and e.std() > 0.5


# -- deferred initialization ----------------------------------------------------------------------


class Net(dtorch.nn.Module):
    def __init__(self, mesh):
        super().__init__()
        self.emb = dtorch.nn.Embedding(50, 16, device_mesh=mesh)
        self.up = dtorch.nn.Linear(16, 32, device_mesh=mesh, tp_shard_type="col")
        self.down = dtorch.nn.Linear(32, 16, device_mesh=mesh, tp_shard_type="row")
        self.norm = dtorch.nn.LayerNorm(16, device_mesh=mesh)

    def forward(self, ids):
        h = self.emb(ids)  # embedding dim S(-1) on tp
        h = h.redistribute(placements=[h.placements[0], R])
        o = self.down(self.up(h).relu())  # row-parallel: a Partial sum on tp
        return self.norm(h + o.redistribute(placements=[o.placements[0], R]))


def allocated(mesh) -> list:
    stats = dtorch.default_graph.get_memory_stats(mesh)
    return [stats.find(d).memory_allocated for d in mesh.mesh.flatten().tolist()]


def torch_state(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = {"emb.weight": (50, 16), "up.weight": (32, 16), "up.bias": (32,),
              "down.weight": (16, 32), "down.bias": (16,), "norm.weight": (16,),
              "norm.bias": (16,)}
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def test_init_empty_allocates_nothing_and_loads_into_each_layout(mesh2, tmp_path):
    before = allocated(mesh2)
    with dtorch.nn.init_empty():
        net = Net(mesh2)
    dtorch.sync()  # a tensor without a value is no error
    grew = [a - b for a, b in zip(allocated(mesh2), before)]
    norm_params = 2 * 16 * 4  # LayerNorm's ones and zeros are computed, not deferred
    assert all(g <= norm_params for g in grew), grew
    assert net.up.weight.placements == [R, S0] and net.down.weight.placements == [R, S1]
    with pytest.raises(RuntimeError, match="init_empty"):
        net.up.weight.to_torch()
    ids = dtorch.from_torch(torch.tensor([[1, 4, 9]]), device_mesh=mesh2)
    with pytest.raises(RuntimeError, match="init_empty"):
        net(ids).to_torch()  # what is computed from it has no value either
    state = torch_state()
    net.load_state_dict(state)
    ref = Net(mesh2)
    ref.load_state_dict(state)
    assert torch.equal(net(ids).to_torch(), ref(ids).to_torch())
    dtorch.save_checkpoint(ref, tmp_path)
    with dtorch.nn.init_empty():
        again = Net(mesh2)
    dtorch.load_checkpoint(again, tmp_path)
    for (k, p), q in zip(again.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(p.to_torch(), q.to_torch()), k


def test_inside_the_context_fills_draw_nothing_and_outside_they_give_values(mesh1):
    g = gen(9)
    with dtorch.nn.init_empty():
        lin = dtorch.nn.Linear(8, 6, device_mesh=mesh1)
        lin.reset_parameters()
        init.trunc_normal_(lin.weight, generator=g)
        t = dtorch.rand(5, device_mesh=mesh1, placements=[S0])
        z = dtorch.zeros(3, device_mesh=mesh1)  # computed values are still made
        init.ones_(z)  # and the init functions leave every tensor as it is
    assert torch.equal(g.get_state(), gen(9).get_state())
    assert torch.equal(z.to_torch(), torch.zeros(3))
    for v in (lin.weight, lin.bias, t):
        with pytest.raises(RuntimeError, match="no value"):
            v.to_torch()
    init.kaiming_uniform_(lin.weight, a=math.sqrt(5), generator=gen())
    lin.bias.zero_()
    ref = torch.nn.init.kaiming_uniform_(torch.empty(6, 8), a=math.sqrt(5), generator=gen())
    assert torch.equal(lin.weight.to_torch(), ref) and not lin.bias.to_torch().any()
    lin.reset_parameters()
    assert lin.weight.to_torch().abs().max() <= 1 / math.sqrt(8)


def test_a_view_of_a_tensor_without_a_value_takes_a_full_write(mesh1):
    with dtorch.nn.init_empty():
        w = dtorch.empty((4, 6), device_mesh=mesh1, placements=[S0])
    p = dtorch.nn.Parameter(w)  # an alias (detach) of a tensor with no value
    v = w.view(4, 2, 3)
    p.copy_(dtorch.ones((4, 6), device_mesh=mesh1))
    assert torch.equal(p.to_torch(), torch.ones(4, 6))
    with pytest.raises(RuntimeError, match="no value"):
        v.to_torch()  # (no storage was shared: it says so rather than read stale values)


def test_torchs_meta_device_defers_too(mesh1):
    with torch.device("meta"):
        lin = dtorch.nn.Linear(4, 3, device_mesh=mesh1)
    with pytest.raises(RuntimeError, match="no value"):
        lin.weight.to_torch()
    lin.reset_parameters()
    assert lin.weight.to_torch().abs().max() <= 0.5


def test_the_context_is_the_calling_threads(mesh1):
    made = {}

    def other():
        made["t"] = dtorch.rand(4, device_mesh=mesh1)

    with dtorch.nn.init_empty():
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        with dtorch.nn.init_empty():  # nests
            inner = dtorch.empty(2, device_mesh=mesh1)
        outer = dtorch.empty(2, device_mesh=mesh1)
    assert made["t"].to_torch().shape == (4,)
    for t in (inner, outer):
        with pytest.raises(RuntimeError, match="no value"):
            t.to_torch()
    assert dtorch.empty(2, device_mesh=mesh1).to_torch().shape == (2,)


def test_replayed_construction_loops_give_every_layer_torchs_values(mesh1):
    """Layers built in a loop repeat one window, which replays: the fills made inside the
    replayed windows (and the deferred ones) must be what a record-by-record run gives."""
    g, ref = gen(11), gen(11)
    layers = [dtorch.empty((16, 8), device_mesh=mesh1, placements=[S0]).uniform_(
        -1, 1, generator=g) for _ in range(12)]
    for k, t in enumerate(layers):
        assert torch.equal(t.to_torch(), torch.empty(16, 8).uniform_(-1, 1, generator=ref)), k
    with dtorch.nn.init_empty():
        empty = [dtorch.nn.Linear(8, 8, device_mesh=mesh1) for _ in range(12)]
    for k, lin in enumerate(empty):
        with pytest.raises(RuntimeError, match="no value"):
            lin.weight.to_torch()
        lin.weight.normal_(generator=gen(k))
        assert torch.equal(lin.weight.to_torch(), torch.empty(8, 8).normal_(generator=gen(k)))
