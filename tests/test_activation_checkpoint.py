"""Activation checkpointing (``dtorch.nn.checkpoint``, ``autograd/checkpoint.py``): gradients
equal the uncheckpointed run's (bit for bit on one device, dropout included, which the
recompute must draw again), and torch's where the values are torch's; parameters, ZeRO-3 layers,
regions in a row, a retained graph, and the errors torch gives."""

import functools

import pytest
import torch
from torch.utils.checkpoint import create_selective_checkpoint_contexts
from transformers import LlamaConfig

import dtorch
from dtorch import Replicate, Shard
from dtorch.autograd import checkpoint as checkpointing
from dtorch.models.llama import LlamaForCausalLM

F = dtorch.nn.functional
R, S0 = Replicate(), Shard(0)


class Block(dtorch.nn.Module):
    """Column- then row-parallel on tp (when the mesh has one), dropout between, a residual."""

    def __init__(self, mesh, p=0.3, dtype=torch.float32):
        super().__init__()
        tp = mesh.ndim > 1
        self.up = dtorch.nn.Linear(8, 16, device_mesh=mesh, dtype=dtype,
                                   tp_shard_type="col" if tp else None)
        self.down = dtorch.nn.Linear(16, 8, device_mesh=mesh, dtype=dtype,
                                     tp_shard_type="row" if tp else None)
        self.p = p

    def forward(self, x):
        h = F.dropout(F.gelu(self.up(x)), self.p, training=self.p > 0)
        o = self.down(h)
        return x + o.redistribute(placements=[o.placements[0], *[R] * (o.device_mesh.ndim - 1)])


def run(blocks, mesh, x0, checkpointed, seed=5, **kwargs):
    """The loss, the parameters' gradients and the input's, after one backward."""
    for b in blocks:
        for p in b.parameters():
            p.grad = None
    dtorch.manual_seed(seed)
    x = dtorch.from_torch(x0, mesh, [S0, *[R] * (mesh.ndim - 1)]).requires_grad_()
    h = x
    for b in blocks:
        h = dtorch.nn.checkpoint(b, h, **kwargs) if checkpointed else b(h)
    loss = (h * h).sum()
    loss.backward()
    return (loss.item(), [p.grad.to_torch() for b in blocks for p in b.parameters()],
            x.grad.to_torch())


def make(mesh, n=3, **kwargs):
    torch.manual_seed(0)
    return [Block(mesh, **kwargs) for _ in range(n)], torch.randn(6, 8, generator=torch.Generator(
    ).manual_seed(2), dtype=kwargs.get("dtype", torch.float32))


def test_one_device_is_bit_identical_dropout_included(one):
    blocks, x0 = make(one)
    plain, again = run(blocks, one, x0, False), run(blocks, one, x0, True)
    assert plain[0] == again[0]
    for a, b in zip(plain[1] + [plain[2]], again[1] + [again[2]]):
        assert torch.equal(a, b)


def test_the_recompute_draws_the_forwards_dropout(one):
    """Without the seed stream set back, the recomputed masks differ: the gradients too. (So
    the test above would catch a recompute that draws afresh.)"""
    blocks, x0 = make(one)
    plain = run(blocks, one, x0, False)
    fresh = run(blocks, one, x0, True, preserve_rng_state=False)
    assert plain[0] == fresh[0]  # the forward is the same
    assert not all(torch.equal(a, b) for a, b in zip(plain[1], fresh[1]))


@pytest.mark.parametrize("layout", ["dp2xtp2", "dp3"])
def test_distributed_equals_uncheckpointed(layout, mesh1, mesh2):
    mesh = mesh2 if layout == "dp2xtp2" else mesh1
    blocks, x0 = make(mesh, dtype=torch.float64)
    plain, again = run(blocks, mesh, x0, False), run(blocks, mesh, x0, True)
    assert plain[0] == pytest.approx(again[0], rel=1e-14)
    for a, b in zip(plain[1] + [plain[2]], again[1] + [again[2]]):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)  # float64: reduction order


def test_equals_torch_without_dropout(mesh2):
    blocks, x0 = make(mesh2, p=0.0)
    refs = []
    for b in blocks:
        up, down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)
        for mine, theirs in ((b.up, up), (b.down, down)):
            theirs.load_state_dict({k: v.to_torch() for k, v in mine.state_dict().items()})
        refs.append((up, down))
    x = x0.clone().requires_grad_()
    h = x
    for up, down in refs:
        h = torch.utils.checkpoint.checkpoint(
            lambda t, up=up, down=down: t + down(torch.nn.functional.gelu(up(t))), h,
            use_reentrant=False)
    (h * h).sum().backward()
    loss, grads, xgrad = run(blocks, mesh2, x0, True)
    want = [p.grad for up, down in refs for p in (*up.parameters(), *down.parameters())]
    for a, b in zip(grads + [xgrad], want + [x.grad]):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)


def test_parameters_get_gradients_when_no_input_requires_grad(one):
    block = Block(one, p=0.0)
    x = dtorch.from_torch(torch.randn(4, 8), one)
    dtorch.nn.checkpoint(block, x).sum().backward()
    got = [p.grad.to_torch() for p in block.parameters()]
    for p in block.parameters():
        p.grad = None
    block(x).sum().backward()
    for a, p in zip(got, block.parameters()):
        assert torch.equal(a, p.grad.to_torch())


@pytest.mark.parametrize("selective", [False, True], ids=["whole", "selective"])
def test_zero3_layers_gather_again_in_the_recompute(selective):
    """A ZeRO-3 layer's recompute gathers its shards again; a selective one's kept products
    take their weights' gradients through the gathered weights, reduce-scattered back."""
    kwargs = {"context_fn": functools.partial(
        create_selective_checkpoint_contexts, [torch.ops.aten.addmm.default])} if selective else {}
    mesh = dtorch.init_device_mesh("cpu", (3,), mesh_dim_names=["dp"])
    blocks, x0 = make(mesh, p=0.0)
    plain = run(blocks, mesh, x0, False)
    torch.manual_seed(0)
    sharded = [Block(mesh, p=0.0) for _ in range(3)]
    for s, b in zip(sharded, blocks):
        s.load_state_dict({k: v.to_torch() for k, v in b.state_dict().items()})
        dtorch.nn.fully_shard(s)
    again = run(sharded, mesh, x0, True, **kwargs)
    assert all(p.placements == [S0] for s in sharded for p in s.parameters())
    assert again[0] == pytest.approx(plain[0], rel=1e-6)
    for a, b in zip(plain[1] + [plain[2]], again[1] + [again[2]]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_a_retained_graph_recomputes_again(one):
    block = Block(one, p=0.0)
    x = dtorch.from_torch(torch.randn(4, 8), one).requires_grad_()
    y = dtorch.nn.checkpoint(block, x).sum()
    y.backward(retain_graph=True)
    first = x.grad.to_torch().clone()
    y.backward()
    torch.testing.assert_close(x.grad.to_torch(), 2 * first)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y.backward()


def test_errors_are_torchs(one):
    block = Block(one, p=0.0)
    x = dtorch.from_torch(torch.randn(4, 8), one).requires_grad_()
    with pytest.raises(RuntimeError, match="not compatible with .grad"):
        dtorch.autograd.grad(dtorch.nn.checkpoint(block, x).sum(), x)
    calls = []

    def changing(t):  # a different shape the second time: the recompute must say so
        calls.append(1)
        return t[: 4 - len(calls) + 1] * 2

    with pytest.raises(RuntimeError, match="recomputed outputs"):
        dtorch.nn.checkpoint(changing, x).sum().backward()
    with torch.no_grad():  # no grad mode: just the call
        assert not dtorch.nn.checkpoint(block, x).requires_grad
    plain = dtorch.from_torch(torch.randn(4, 8), one)
    with pytest.warns(UserWarning, match="None of the inputs"):
        dtorch.nn.checkpoint(lambda t: t * 2, plain)


def llama_training_equals_plain(mesh, checkpointing_kwargs, exact: bool) -> None:
    """3 AdamW steps of the Llama with HF's switch on (``gradient_checkpointing_kwargs``)
    equal the same steps without it: bit for bit (``exact``: one device) or within 1e-5."""
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=32)
    ids = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(3))
    runs = []
    for checkpointed in (False, True):
        model = LlamaForCausalLM(config, device_mesh=mesh).train()
        model.load_state_dict({k: torch.randn(v.shape, generator=torch.Generator().manual_seed(
            i)) * 0.1 for i, (k, v) in enumerate(model.state_dict().items())})
        if checkpointed:
            model.gradient_checkpointing_enable(checkpointing_kwargs)
            assert model.is_gradient_checkpointing
        opt = dtorch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for _ in range(3):
            logits = model(ids)
            labels = dtorch.from_torch(ids[:, 1:].flatten(), device_mesh=logits.device_mesh)
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        runs.append((losses, [p.to_torch() for p in model.parameters()]))
    (plain, plain_w), (again, again_w) = runs
    if exact:
        assert plain == again and all(torch.equal(a, b) for a, b in zip(plain_w, again_w))
    else:
        assert again == pytest.approx(plain, rel=1e-5)
        for a, b in zip(plain_w, again_w):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", ["one", "dp2xtp2"])
def test_llama_training_with_gradient_checkpointing(layout, one, mesh2, monkeypatch):
    recomputed = []
    real = checkpointing._recompute
    monkeypatch.setattr(checkpointing, "_recompute",
                        lambda *a: recomputed.append(a[0]) or real(*a))
    llama_training_equals_plain(one if layout == "one" else mesh2, None, layout == "one")
    assert len(recomputed) == 3 * 2  # each layer, each step


def test_the_region_records_nothing_but_its_node(one):
    """What saves the memory: the forward inside the region is not on the tape (the hosts keep
    no graph of its kernels); its output hangs on one node that reads the inputs alone."""
    from dtorch.autograd import tape

    block = Block(one, p=0.0)
    x = dtorch.from_torch(torch.randn(4, 8), one).requires_grad_()
    h = x * 2  # a recorded call before the region
    out = dtorch.nn.checkpoint(block, h)
    assert type(out._node.op) is tape.Recomputed
    assert [o._id for o in out._node.operands] == [h._id]
    plain = block(h)
    assert type(plain._node.op) is not tape.Recomputed  # (without it: the block's own calls)
