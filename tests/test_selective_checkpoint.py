"""Selective activation checkpointing (``autograd/selective.py``): with torch's
``create_selective_checkpoint_contexts`` as ``context_fn``, the products the policy keeps are
not run again in the backward, and the gradients are the uncheckpointed run's: bit for bit on
one device (dropout included), within float64's reduction-order error on meshes (uneven rows
too). The policy sees what torch's sees; a policy that keeps what dtorch cannot keeps nothing
and says so; a recompute that differs raises."""

import functools
import warnings

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import dtorch
from dtorch.autograd import selective
from test_activation_checkpoint import Block, llama_training_equals_plain, make, run

F = dtorch.nn.functional
MM, ADDMM = torch.ops.aten.mm.default, torch.ops.aten.addmm.default
# torch shows a linear with a bias (Block's) as addmm, one without (the Llama's) as mm
KEEP_PRODUCTS = functools.partial(create_selective_checkpoint_contexts, [MM, ADDMM])


def forward_kernels(blocks, mesh, x0, context_fn):
    """The names of the forward kernels (fused chains split) the backward's recompute ran."""
    for b in blocks:
        b.zero_grad()
    x = dtorch.from_torch(x0, mesh).requires_grad_()
    h = x
    for b in blocks:
        h = dtorch.nn.checkpoint(b, h, context_fn=context_fn)
    loss = (h * h).sum()
    dtorch.sync()
    with dtorch.profiler.profile() as prof:
        loss.backward()
        dtorch.sync()
    return [part for e in prof.kernels() if "(backward)" not in e["name"]
            for part in e["name"].split("+")]


def test_one_device_is_bit_identical_and_runs_no_product_again(one):
    blocks, x0 = make(one)
    plain = run(blocks, one, x0, False)
    selective = run(blocks, one, x0, True, context_fn=KEEP_PRODUCTS)
    assert plain[0] == selective[0]
    for a, b in zip(plain[1] + [plain[2]], selective[1] + [selective[2]]):
        assert torch.equal(a, b)
    # the whole recompute runs the linears again, the selective one none of them (its
    # gradients come from matmuls of the formula) but still the dropout and gelu between
    assert forward_kernels(blocks, one, x0, None).count("linear") == 2 * len(blocks)
    again = forward_kernels(blocks, one, x0, KEEP_PRODUCTS)
    assert "linear" not in again and "gelu" in again and "dropout" in again


@pytest.mark.parametrize("layout", ["dp2xtp2", "dp3-uneven"])
def test_distributed_equals_uncheckpointed(layout, mesh1, mesh2):
    mesh = mesh2 if layout == "dp2xtp2" else mesh1
    blocks, x0 = make(mesh, dtype=torch.float64)
    if layout == "dp3-uneven":  # 7 rows on 3 devices: blocks of 3, 3, 1
        x0 = torch.randn(7, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    plain = run(blocks, mesh, x0, False)
    selective = run(blocks, mesh, x0, True, context_fn=KEEP_PRODUCTS)
    assert plain[0] == pytest.approx(selective[0], rel=1e-14)
    for a, b in zip(plain[1] + [plain[2]], selective[1] + [selective[2]]):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)  # float64: reduction order


def test_the_policy_sees_what_torchs_sees(one):
    """A torchtitan-style policy: every other product kept, counted per call. It is called in
    the forward only, with torch's context (``op_output`` the result) and the aten op torch's
    dispatch names for a linear with a bias (``addmm``); the products it does not keep run
    again."""
    seen = []

    def every_other_mm(ctx, op, *args, **kwargs):
        seen.append((op, ctx.is_recompute, type(ctx.op_output)))
        keep = op is ADDMM and sum(o is ADDMM for o, _, _ in seen) % 2 == 1
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    blocks, x0 = make(one, p=0.0)
    policy = functools.partial(create_selective_checkpoint_contexts, every_other_mm)
    plain = run(blocks, one, x0, False)
    seen.clear()
    selective = run(blocks, one, x0, True, context_fn=policy)
    for a, b in zip(plain[1] + [plain[2]], selective[1] + [selective[2]]):
        assert torch.equal(a, b)
    assert [op for op, _, _ in seen].count(ADDMM) == 2 * len(blocks)  # the forward's only
    assert torch.ops.aten.gelu.default in [op for op, _, _ in seen]
    assert all(not again and kind is dtorch.Tensor for _, again, kind in seen)
    # each block's first linear (up) kept, its second (down) run again
    assert forward_kernels(blocks, one, x0, policy).count("linear") == len(blocks)


def test_keeping_what_has_no_formula_warns_and_recomputes(one):
    blocks, x0 = make(one, p=0.0)
    plain = run(blocks, one, x0, False)
    keep_gelu = functools.partial(create_selective_checkpoint_contexts,
                                  [torch.ops.aten.gelu.default, MM, ADDMM])
    with pytest.warns(UserWarning, match="keeps gelu's output, which dtorch recomputes"):
        selective = run(blocks, one, x0, True, context_fn=keep_gelu)
    for a, b in zip(plain[1] + [plain[2]], selective[1] + [selective[2]]):
        assert torch.equal(a, b)


def test_other_contexts_are_entered_around_forward_and_recompute(one):
    entered = []

    class Marker:
        def __init__(self, name):
            self.name = name

        def __enter__(self):
            entered.append((self.name, torch.is_grad_enabled()))

        def __exit__(self, *exc):
            entered.append(("exit " + self.name, None))

    block = Block(one, p=0.0)
    x = dtorch.from_torch(torch.randn(4, 8), one).requires_grad_()
    y = dtorch.nn.checkpoint(block, x, context_fn=lambda: (Marker("forward"),
                                                           Marker("recompute")))
    assert entered == [("forward", False), ("exit forward", None)]
    y.sum().backward()
    assert entered[2:] == [("recompute", True), ("exit recompute", None)]


def test_a_recompute_that_differs_raises(one):
    a = dtorch.from_torch(torch.randn(16, 8), one).requires_grad_()
    x = dtorch.from_torch(torch.randn(4, 8), one).requires_grad_()
    calls = []

    def changing(t):  # the same shapes, but the kept call is another op the second time
        calls.append(1)
        return F.linear(t, a).tanh() if len(calls) == 1 else (t @ a.t()).tanh()

    y = dtorch.nn.checkpoint(changing, x, context_fn=KEEP_PRODUCTS).sum()
    with pytest.raises(RuntimeError, match="forward kept linear's"):
        y.backward()
    calls.clear()

    def fewer(t):
        calls.append(1)
        return F.linear(t.tanh(), a) if len(calls) == 1 else F.linear(t, a)

    y = dtorch.nn.checkpoint(fewer, x, context_fn=KEEP_PRODUCTS).sum()
    with pytest.raises(RuntimeError, match="fewer than the forward"):
        y.backward()
    # and the runtime goes on: the same region, computing the same, gives torch's gradient
    x.grad = None
    dtorch.nn.checkpoint(lambda t: F.linear(t, a).tanh(), x, context_fn=KEEP_PRODUCTS).sum().backward()
    xt, at = x.to_torch().requires_grad_(), a.to_torch()
    torch.nn.functional.linear(xt, at).tanh().sum().backward()
    assert torch.equal(x.grad.to_torch(), xt.grad)


def test_a_retained_graph_recomputes_again(one):
    block = Block(one, p=0.0)
    x = dtorch.from_torch(torch.randn(4, 8), one).requires_grad_()
    y = dtorch.nn.checkpoint(block, x, context_fn=KEEP_PRODUCTS).sum()
    y.backward(retain_graph=True)
    first = x.grad.to_torch().clone()
    y.backward()  # the kept outputs were taken: everything is run again
    torch.testing.assert_close(x.grad.to_torch(), 2 * first)


@pytest.mark.parametrize("layout", ["one", "dp2xtp2"])
def test_llama_training_with_selective_checkpointing(layout, one, mesh2, monkeypatch):
    """HF's switch with HF's ``gradient_checkpointing_kwargs``: torchtitan's policy (keep the
    products) over 3 AdamW steps equals the run without checkpointing, and each recompute
    takes the layer's 7 projections from the forward."""
    taken = []
    real = selective.Region._substitute
    monkeypatch.setattr(selective.Region, "_substitute",
                        lambda self, b, *a: taken.append(b.op.name) or real(self, b, *a))
    torchtitans = functools.partial(create_selective_checkpoint_contexts, [MM])  # no biases
    with warnings.catch_warnings():  # every product it keeps has a formula
        warnings.filterwarnings("error", message="dtorch.nn.checkpoint")
        llama_training_equals_plain(one if layout == "one" else mesh2,
                                    {"use_reentrant": False, "context_fn": torchtitans},
                                    layout == "one")
    assert taken == ["linear"] * 7 * 2 * 3  # 2 layers, 3 steps


def test_another_threads_calls_stay_out_of_the_region(one):
    """The region is the calling thread's: operators another thread issues while it is open
    (here, from inside the checkpointed function's forward only) are neither counted nor kept,
    so the recompute, which issues no such call, still finds its kept products where the
    forward left them (were they counted, the product would be call 3, not 0)."""
    import threading

    a = dtorch.from_torch(torch.randn(16, 8), one).requires_grad_()
    other = dtorch.from_torch(torch.randn(16, 8), one)
    seen = []

    def elsewhere():  # a product the policy would keep, were it in the region
        seen.append(F.linear(other, other).sum().item())

    def f(t):
        if not seen:
            worker = threading.Thread(target=elsewhere)
            worker.start()
            worker.join()
        return F.linear(t, a).tanh()

    x = dtorch.from_torch(torch.randn(4, 8), one).requires_grad_()
    dtorch.nn.checkpoint(f, x, context_fn=KEEP_PRODUCTS).sum().backward()
    xt, at = x.to_torch().requires_grad_(), a.to_torch().requires_grad_()
    torch.nn.functional.linear(xt, at).tanh().sum().backward()
    assert torch.equal(x.grad.to_torch(), xt.grad) and torch.equal(a.grad.to_torch(), at.grad)
    ot = other.to_torch()
    assert seen == [torch.nn.functional.linear(ot, ot).sum().item()]


@pytest.mark.parametrize("product", ["matmul-3d-2d", "matmul-batched", "mm", "bmm"])
def test_every_product_with_a_formula_is_bit_identical(product, one, monkeypatch):
    """Each kept product's VJP in dtorch's operators gives the bits torch's backward of the
    kernel gives (one device); the policy sees the aten op torch's dispatch shows (a batched
    matmul is a bmm), and each is kept."""
    taken, asked = [], []
    real = selective.Region._substitute
    monkeypatch.setattr(selective.Region, "_substitute",
                        lambda self, b, *a: taken.append(b.op.name) or real(self, b, *a))
    keep = functools.partial(create_selective_checkpoint_contexts, lambda ctx, op, *args: (
        asked.append(op) or CheckpointPolicy.MUST_SAVE if op in (MM, torch.ops.aten.bmm.default)
        else CheckpointPolicy.PREFER_RECOMPUTE))
    g = torch.Generator().manual_seed(1)
    shapes = {"matmul-3d-2d": ((3, 4, 8), (8, 5)), "matmul-batched": ((3, 4, 8), (3, 8, 5)),
              "mm": ((4, 8), (8, 5)), "bmm": ((3, 4, 8), (3, 8, 5))}[product]
    fn = {"mm": dtorch.mm, "bmm": dtorch.bmm}.get(product, dtorch.matmul)
    a0, b0 = (torch.randn(s, generator=g) for s in shapes)
    grads = []
    for context_fn in (None, keep):
        a, b = (dtorch.from_torch(t, one).requires_grad_() for t in (a0, b0))
        y = fn(a.tanh(), b).sigmoid() if context_fn is None else dtorch.nn.checkpoint(
            lambda u, v: fn(u.tanh(), v).sigmoid(), a, b, context_fn=context_fn)
        (y * y).sum().backward()
        grads.append([a.grad.to_torch(), b.grad.to_torch()])
    assert all(torch.equal(p, q) for p, q in zip(*grads))
    batched = product in ("matmul-batched", "bmm")
    assert (torch.ops.aten.bmm.default if batched else MM) in asked
    assert taken == [{"matmul-3d-2d": "matmul", "matmul-batched": "matmul"}.get(product, product)]


def test_a_kept_linear_on_batched_rows_with_a_bias_is_bit_identical(one, monkeypatch):
    """A linear on a batch of sequences with a bias (the bias's gradient sums over every row,
    the weight's over the flattened rows), kept as torch shows it (``addmm``): the input's,
    weight's and bias's gradients bit for bit."""
    taken = []
    real = selective.Region._substitute
    monkeypatch.setattr(selective.Region, "_substitute",
                        lambda self, b, *a: taken.append(b.op.name) or real(self, b, *a))
    g = torch.Generator().manual_seed(2)
    x0, w0, b0 = (torch.randn(s, generator=g) for s in ((3, 4, 8), (5, 8), (5,)))
    keep = functools.partial(create_selective_checkpoint_contexts, [ADDMM])
    grads = []
    for context_fn in (None, keep):
        x, w, b = (dtorch.from_torch(t, one).requires_grad_() for t in (x0, w0, b0))
        y = F.linear(x.tanh(), w, b).sigmoid() if context_fn is None else dtorch.nn.checkpoint(
            lambda u: F.linear(u.tanh(), w, b).sigmoid(), x, context_fn=context_fn)
        (y * y).sum().backward()
        grads.append([t.grad.to_torch() for t in (x, w, b)])
    assert all(torch.equal(p, q) for p, q in zip(*grads))
    assert taken == ["linear"]


def test_a_region_holds_its_kept_products_and_nothing_else(one):
    """What a selective region keeps between forward and backward, in the device's own
    figures: exactly the outputs of the products the policy keeps, beside what a whole
    checkpoint holds (its output; the input was there before)."""
    import gc

    torch.manual_seed(0)
    up, down = (dtorch.nn.Linear(32, 256, device_mesh=one),
                dtorch.nn.Linear(256, 32, device_mesh=one))

    def f(t):
        return down(F.gelu(up(t)))

    x = dtorch.from_torch(torch.randn(64, 32), one).requires_grad_()
    keep_up = functools.partial(create_selective_checkpoint_contexts, lambda ctx, op, *args: (
        CheckpointPolicy.MUST_SAVE if op is ADDMM and args[1] is up.weight
        else CheckpointPolicy.PREFER_RECOMPUTE))

    def held(run) -> int:
        gc.collect()
        before = dtorch.default_graph.get_memory_stats(one).find(0).memory_allocated
        y = run()
        after = dtorch.default_graph.get_memory_stats(one).find(0).memory_allocated
        y.sum().backward()  # (the kept output is taken, and freed, by the recompute)
        return after - before

    whole = held(lambda: dtorch.nn.checkpoint(f, x))
    selective = held(lambda: dtorch.nn.checkpoint(f, x, context_fn=keep_up))
    assert whole == 64 * 32 * 4  # the output
    assert selective - whole == 64 * 256 * 4  # up's output, float32
