"""Gradient accumulation without a reduction per micro-step: ``Module.no_sync()`` (DDP's) and
``set_requires_gradient_sync`` (FSDP2's), one mechanism (``autograd/grad_sync.py``).

Each case accumulates micro-batches of uneven sizes (7 and 5 rows on dp2: blocks of 4/3 and
3/2) and compares every ``.grad`` with torch's accumulation in one process, and counts the
gradient collectives each backward runs on device 0: no bucketed one while the sync is off, then as many as one
plain backward runs (the sum reduced once)."""

import threading

import pytest
import torch

import dtorch
import dtorch.nn.functional as F
from dtorch import Partial, Replicate, Shard
from dtorch.autograd import grad_sync

R, S0, S1 = Replicate(), Shard(0), Shard(1)
# the reductions a data-parallel gradient takes: bucketed on a 1-D mesh, a redistribute's step
# on a 2-D one (tp's all-gather and its reduce-scatter in the backward are not counted)
COLLECTIVES = ("all_reduce_coalesced", "reduce_scatter_coalesced", "step:all_reduce")
SIZES = (7, 5, 7)  # rows of the micro-batches


def g(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def collectives(fn) -> tuple:
    """How many reductions device 0 runs for ``fn()`` (a forward and backward: the loss's own
    all-reduce among them), and how many of them are gradient buckets' (``buckets.py``; ZeRO-3's
    bucketed all-gathers are not reductions)."""
    with dtorch.profiler.profile() as prof:
        fn()
        dtorch.sync()
    # (a chain's event names its kernels joined by "+")
    names = [n for e in prof.kernels() if e["pid"] == 0 for n in e["name"].split("+")]
    return sum(n in COLLECTIVES for n in names), sum(n in COLLECTIVES[:2] for n in names)


class MLP(dtorch.nn.Module):
    """Two layers: ``w1`` column-parallel on tp (when the mesh has one), ``w2`` whole."""

    def __init__(self, mesh, tp: bool, grad_placements=None, zero3=False):
        super().__init__()
        ws = g(6, 4, seed=1), g(3, 6, seed=2)
        rest = [R] * (mesh.ndim - 1)
        self.w1 = dtorch.nn.Parameter(dtorch.from_torch(
            ws[0], device_mesh=mesh, placements=[R, S0] if tp else [R, *rest]))
        self.w2 = dtorch.nn.Parameter(dtorch.from_torch(ws[1], device_mesh=mesh,
                                                        placements=[R, *rest]))
        if grad_placements:
            for p in self.parameters():
                p.grad_placements = [S1 if p is self.w1 and tp else S0, *p.placements[1:]]
        self.torch = [w.clone().requires_grad_() for w in ws]
        if zero3:  # the parameters Shard(0) on dp, gathered around the forward (FSDP2's)
            dtorch.nn.fully_shard(self)

    def forward(self, x):
        h = F.tanh(x @ self.w1.T)
        if h.device_mesh.ndim > 1:  # tp's columns joined (its backward keeps them apart)
            h = h.redistribute(placements=[h.placements[0], R])
        return (h @ self.w2.T).pow(2).mean()

    def torch_loss(self, x):
        return (torch.tanh(x @ self.torch[0].T) @ self.torch[1].T).pow(2).mean()


def batches(mesh):
    xs = [g(n, 4, seed=10 + k) for k, n in enumerate(SIZES)]
    rest = [R] * (mesh.ndim - 1)
    return xs, [dtorch.from_torch(x, device_mesh=mesh, placements=[S0, *rest]) for x in xs]


def assert_grads(model):
    for p, t in zip(model.parameters(), model.torch):
        torch.testing.assert_close(p.grad.to_torch(), t.grad, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def dp2():
    return dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["dp"])


@pytest.fixture(scope="module")
def grid():
    return dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "tp"])


@pytest.mark.parametrize("layout", ["dp2", "dp2xtp2", "dp2-zero2", "dp2-zero3"])
def test_no_sync_reduces_the_sum_once(layout, dp2, grid):
    mesh = grid if layout == "dp2xtp2" else dp2
    model = MLP(mesh, tp=layout == "dp2xtp2", grad_placements=layout == "dp2-zero2",
                zero3=layout == "dp2-zero3")
    xs, ds = batches(mesh)
    for x in xs:
        model.torch_loss(x).backward()
    for _ in range(2):  # one plain backward's count (the second: nothing of a first time)
        plain, plain_buckets = collectives(lambda: model(ds[0]).backward())
        for p in model.parameters():
            p.grad = None
    with model.no_sync():
        for d in ds[:-1]:  # the gradients' reductions gone (the loss's own stays)
            inside, buckets = collectives(lambda: model(d).backward())
            assert buckets == 0
            if mesh.ndim > 1:  # its gradients' reductions are redistributes' (3 of 4)
                assert inside <= plain - 2
        assert all(getattr(p, "_grad", None) is None for p in model.parameters())
    assert collectives(lambda: model(ds[-1]).backward())[1] == plain_buckets
    assert plain_buckets >= 1 or mesh.ndim > 1
    assert_grads(model)
    want = [R, S0] if layout == "dp2xtp2" else [R]
    assert model.w1.grad.placements == ([S0] if "zero" in layout else want)


def test_reading_grad_inside_reduces_the_sum_so_far(dp2):
    model = MLP(dp2, tp=False)
    xs, ds = batches(dp2)
    with model.no_sync():
        model(ds[0]).backward()
        model(ds[1]).backward()
        for x in xs[:2]:
            model.torch_loss(x).backward()
        assert_grads(model)  # reduced at the read: the whole gradient so far
        model(ds[2]).backward()
    model.torch_loss(xs[2]).backward()
    assert_grads(model)


def test_zero_grad_drops_what_is_held(dp2):
    model = MLP(dp2, tp=False)
    xs, ds = batches(dp2)
    opt = dtorch.optim.SGD(model.parameters(), lr=0.1)
    with model.no_sync():
        model(ds[0]).backward()
        opt.zero_grad()
        model(ds[1]).backward()
    model(ds[2]).backward()
    for x in xs[1:]:
        model.torch_loss(x).backward()
    assert_grads(model)


def test_held_gradients_of_leaves_a_syncing_backward_does_not_reach_land(dp2):
    """w2 alone is reached by the syncing backward; w1's held sum lands at its end too."""
    model = MLP(dp2, tp=False)
    xs, ds = batches(dp2)
    with model.no_sync():
        model(ds[0]).backward()
    (ds[1] @ model.w2[:, :4].T).sum().backward()
    model.torch_loss(xs[0]).backward()
    (xs[1] @ model.torch[1][:, :4].T).sum().backward()
    assert_grads(model)


def test_accumulated_adamw_steps_equal_torch(dp2):
    model = MLP(dp2, tp=False)
    ref = torch.optim.AdamW(model.torch, lr=0.01)
    opt = dtorch.optim.AdamW(model.parameters(), lr=0.01, zero_stage=1)
    xs, ds = batches(dp2)
    for _ in range(2):
        for k, (x, d) in enumerate(zip(xs, ds)):
            model.torch_loss(x).backward()
            if k < len(xs) - 1:
                with model.no_sync():
                    model(d).backward()
            else:
                model(d).backward()
        ref.step(), opt.step()
        ref.zero_grad(), opt.zero_grad()
    for p, t in zip(model.parameters(), model.torch):
        torch.testing.assert_close(p.to_torch(), t.detach(), atol=1e-6, rtol=1e-5)


def test_switches_nest_and_recover(dp2):
    model = MLP(dp2, tp=False)
    ids = [p._id for p in model.parameters()]
    with model.no_sync():
        with model.no_sync():
            pass
        assert all(i in grad_sync._off for i in ids)  # the outer context still holds it
    assert not any(i in grad_sync._off for i in ids)
    with pytest.raises(ValueError):
        with model.no_sync():
            raise ValueError("inside")
    assert not any(i in grad_sync._off for i in ids)
    model.set_requires_gradient_sync(False)
    model.set_requires_gradient_sync(False)  # a switch, not a count (FSDP2's)
    assert all(i in grad_sync._off for i in ids)
    model.set_requires_gradient_sync(True)
    assert not any(i in grad_sync._off for i in ids)
    model.set_requires_gradient_sync(True)  # already on: nothing to undo
    assert not any(i in grad_sync._off for i in ids)


def test_fsdp2_switch_accumulates_as_no_sync(dp2):
    model = MLP(dp2, tp=False)
    xs, ds = batches(dp2)
    model.set_requires_gradient_sync(False)
    model(ds[0]).backward()
    model.set_requires_gradient_sync(True)
    assert collectives(lambda: model(ds[1]).backward())[1] >= 1
    model.set_requires_gradient_sync(False)
    assert collectives(lambda: model(ds[1]).backward())[1] == 0
    model.set_requires_gradient_sync(True)
    model(ds[-1]).backward()
    for x in (*xs, xs[1]):
        model.torch_loss(x).backward()
    assert_grads(model)


def test_threads_accumulate_their_own_models(dp2):
    models = [MLP(dp2, tp=False) for _ in range(2)]
    xs, ds = batches(dp2)
    errors = []

    def train(model):
        try:
            for k, d in enumerate(ds):
                if k < len(ds) - 1:
                    with model.no_sync():
                        model(d).backward()
                else:
                    model(d).backward()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=train, args=(m,)) for m in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for model in models:
        for x in xs:
            model.torch_loss(x).backward()
        assert_grads(model)


def test_a_gradient_needing_no_reduction_lands_at_once(grid):
    """A leaf sharded on every mesh dim gets a sharded gradient, which needs no reduction: it
    lands in ``.grad`` inside ``no_sync`` as usual."""
    w = dtorch.from_torch(g(6, 4), device_mesh=grid, placements=[S0, S1]).requires_grad_()
    x = dtorch.from_torch(g(6, 4, seed=3), device_mesh=grid, placements=[S0, S1])
    with grad_sync.no_sync([w]):
        (x * w).sum().backward()
        assert getattr(w, "_grad", None) is not None and w.grad.placements == [S0, S1]
    torch.testing.assert_close(w.grad.to_torch(), g(6, 4, seed=3))
