"""Expert parallelism: ``dtorch.nn.MoE`` (and ``moe_experts`` under it) against a dense torch
reference in HF Mixtral's layout, on the same weights and tokens."""

import pytest
import torch
import torch.nn.functional as TF

import dtorch
from dtorch import Replicate, Shard

R, S0 = Replicate(), Shard(0)


class Expert(torch.nn.Module):
    def __init__(self, d, f):
        super().__init__()
        self.w1 = torch.nn.Linear(d, f, bias=False)
        self.w2 = torch.nn.Linear(f, d, bias=False)
        self.w3 = torch.nn.Linear(d, f, bias=False)

    def forward(self, x):
        return self.w2(TF.silu(self.w1(x)) * self.w3(x))


class DenseMoE(torch.nn.Module):
    """Mixtral's sparse MoE block, dense: every token through its top-k experts."""

    def __init__(self, d, f, n_experts, k, renormalize=True):
        super().__init__()
        self.gate = torch.nn.Linear(d, n_experts, bias=False)
        self.experts = torch.nn.ModuleList(Expert(d, f) for _ in range(n_experts))
        self.k, self.renormalize = k, renormalize

    def route(self, x):
        probs = TF.softmax(self.gate(x), dim=-1, dtype=torch.float)
        w, idx = probs.topk(self.k, dim=-1)
        if self.renormalize:
            w = w / w.sum(dim=-1, keepdim=True)
        return w.to(x.dtype), idx

    def forward(self, x):
        w, idx = self.route(x)
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for j in range(self.k):
                out[t] += w[t, j] * self.experts[int(idx[t, j])](x[t])
        return out


D, F = 8, 12


def make(mesh, n_experts, k, *, seed=0, renormalize=True, d=D, f=F, **kw):
    torch.manual_seed(seed)
    ref = DenseMoE(d, f, n_experts, k, renormalize)
    moe = dtorch.nn.MoE(d, f, n_experts, k, renormalize=renormalize, device_mesh=mesh, **kw)
    moe.load_state_dict(ref.state_dict())
    return ref, moe


def run(ref, moe, x, placements):
    """The output, and the gradients of the input, the gate and the experts (the backward
    sends the rows' gradients back along the same all-to-alls), against the dense torch's."""
    mesh = moe.w1.device_mesh
    inputs = dtorch.from_torch(x, device_mesh=mesh, placements=placements).requires_grad_()
    y = moe(inputs)
    x = x.clone().requires_grad_()
    ref.zero_grad()
    want = ref(x)
    got = y.to_torch()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(7))
    want.backward(grad)
    y.backward(dtorch.from_torch(grad, device_mesh=mesh, placements=y.placements))
    torch.testing.assert_close(inputs.grad.to_torch(), x.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(moe.gate.weight.grad.to_torch(), ref.gate.weight.grad,
                               rtol=1e-5, atol=1e-5)
    for name in ("w1", "w2", "w3"):
        want_grad = torch.stack([torch.zeros_like(w) if w.grad is None else w.grad for w in (
            getattr(e, name).weight for e in ref.experts)])
        torch.testing.assert_close(getattr(moe, name).grad.to_torch(), want_grad, rtol=1e-5,
                                   atol=1e-5)
    return y.detach()


@pytest.fixture(scope="module")
def ep2():
    return dtorch.DeviceMesh("cpu", [0, 1], mesh_dim_names=["ep"])


@pytest.fixture(scope="module")
def ep4():
    return dtorch.DeviceMesh("cpu", [0, 1, 2, 3], mesh_dim_names=["ep"])


@pytest.fixture(scope="module")
def ep_tp():
    return dtorch.DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=["ep", "tp"])


@pytest.fixture(scope="module")
def dp_ep():
    return dtorch.DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=["dp", "ep"])


@pytest.mark.parametrize("k", [1, 2])
def test_ep2_matches_dense(ep2, k):
    ref, moe = make(ep2, 4, k)
    y = run(ref, moe, torch.randn(10, D), [S0])
    assert y.placements == [S0] and moe.w1.placements == [S0]


@pytest.mark.parametrize("k", [1, 2])
def test_ep4_two_experts_per_device(ep4, k):
    ref, moe = make(ep4, 8, k, seed=1)
    x = torch.randn(16, D)
    _, idx = ref.route(x)
    assert len(set(idx.flatten().tolist())) > 4  # several devices' experts, several per device
    run(ref, moe, x, [S0])


@pytest.mark.parametrize("tokens", [7, 3])
def test_tokens_that_do_not_divide_the_mesh(ep4, tokens):
    """7 tokens: blocks of 2, 2, 2, 1; 3 tokens: the last device has none to send."""
    ref, moe = make(ep4, 8, 2, seed=2)
    run(ref, moe, torch.randn(tokens, D), [S0])


@pytest.mark.parametrize("k", [1, 2])
def test_unbalanced_all_tokens_to_one_device(ep4, k):
    """The router sends every token to experts 6 (and 7): device 3 receives everything, the
    others nothing."""
    ref, moe = make(ep4, 8, k, seed=3)
    with torch.no_grad():
        ref.gate.weight.mul_(0.01)
        ref.gate.weight[6, 0] = 100.0
        ref.gate.weight[7, 0] = 50.0
    moe.load_state_dict(ref.state_dict())
    x = torch.randn(9, D)
    x[:, 0] = 1.0
    _, idx = ref.route(x)
    assert idx[:, 0].eq(6).all() and (k == 1 or idx[:, 1].eq(7).all())
    run(ref, moe, x, [S0])


def test_issues_without_a_sync(ep4, monkeypatch):
    """The data-dependent exchange stays on the hosts: the client never fetches or syncs while
    it issues the layer."""
    from dtorch.client.session import Session

    ref, moe = make(ep4, 8, 2, seed=14)
    x = torch.randn(12, D)
    xd = dtorch.from_torch(x, device_mesh=ep4, placements=[S0])

    def refuse(*args, **kwargs):
        raise AssertionError("the MoE layer waited for a value")

    with monkeypatch.context() as m:
        m.setattr(Session, "fetch", refuse)
        m.setattr(Session, "sync_async", refuse)
        y = moe(moe(xd))
    with torch.no_grad():
        want = ref(ref(x))
    torch.testing.assert_close(y.to_torch(), want, rtol=1e-5, atol=1e-5)


def test_no_renormalisation(ep2):
    ref, moe = make(ep2, 4, 2, seed=4, renormalize=False)
    w, _ = ref.route(torch.randn(6, D))
    assert not torch.allclose(w.sum(-1), torch.ones(6))  # the option changes the weights
    run(ref, moe, torch.randn(6, D), [S0])


def test_ep_times_tp(ep_tp):
    """Experts S(0) on ep, their hidden f sharded on tp (w1, w3 S(1); w2 S(2)); the Partial
    over tp is all-reduced."""
    ref, moe = make(ep_tp, 4, 2, seed=5)
    assert moe.w1.placements == [S0, Shard(1)] and moe.w2.placements == [S0, Shard(2)]
    y = run(ref, moe, torch.randn(11, D), [S0, R])
    assert y.placements == [S0, R]


def test_ep_times_tp_rows_travel_as_column_blocks(ep_tp):
    """Dispatched over ep, each tp rank sends only its block of the hidden columns (7 = 4 + 3:
    uneven) and the layer's result is S(1) on tp before the module gathers it."""
    ref, moe = make(ep_tp, 4, 2, seed=18, d=7, f=6)
    x = torch.randn(9, 7)
    idx = ref.route(x)[1]
    xd = dtorch.from_torch(x, device_mesh=ep_tp, placements=[S0, R])
    w, i, _ = moe.route(xd)
    y = dtorch.nn.functional.moe_experts(xd, i, w, moe.w1, moe.w3, moe.w2)
    assert y.placements == [S0, Shard(1)]
    torch.testing.assert_close(i.to_torch(), idx)
    with torch.no_grad():
        torch.testing.assert_close(y.to_torch(), ref(x), rtol=1e-5, atol=1e-5)
    run(ref, moe, x, [S0, R])


def test_ep_times_tp_unbalanced(ep_tp):
    """Every token to expert 3 (ep rank 1): the tp ranks of ep rank 0 receive no rows."""
    ref, moe = make(ep_tp, 4, 1, seed=19)
    with torch.no_grad():
        ref.gate.weight.mul_(0.01)
        ref.gate.weight[3, 0] = 100.0
    moe.load_state_dict(ref.state_dict())
    x = torch.randn(6, D)
    x[:, 0] = 1.0
    assert ref.route(x)[1].eq(3).all()
    run(ref, moe, x, [S0, R])


def test_dp_times_ep(dp_ep):
    """Tokens S(0) on dp and on ep; the experts replicated over dp."""
    ref, moe = make(dp_ep, 4, 2, seed=6)
    assert moe.w1.placements == [R, S0]
    y = run(ref, moe, torch.randn(13, D), [S0, S0])
    assert y.placements == [S0, S0]


def test_dp_ep_tp():
    """All three on 8 devices: tokens S(0) on dp and ep, R on tp; experts S(0) on ep, f on tp."""
    mesh = dtorch.DeviceMesh("cpu", torch.arange(8).view(2, 2, 2).tolist(),
                             mesh_dim_names=["dp", "ep", "tp"])
    ref, moe = make(mesh, 4, 2, seed=16)
    assert moe.w1.placements == [R, S0, Shard(1)]
    y = run(ref, moe, torch.randn(15, D), [S0, S0, R])
    assert y.placements == [S0, S0, R]


def test_replicated_tokens_need_no_dispatch(ep4):
    """Tokens R on ep: each device computes its experts' share, summed by an all-reduce."""
    ref, moe = make(ep4, 8, 2, seed=7)
    y = run(ref, moe, torch.randn(5, D), [R])
    assert y.placements == [R]


def test_batch_seq_input(ep2):
    ref, moe = make(ep2, 4, 2, seed=8)
    x = torch.randn(2, 3, D)
    y = moe(dtorch.from_torch(x, device_mesh=ep2, placements=[S0]))
    assert y.shape == (2, 3, D)
    with torch.no_grad():
        want = ref(x.reshape(-1, D)).reshape(2, 3, D)
    torch.testing.assert_close(y.to_torch(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tp", [False, True])
def test_bfloat16_experts_with_given_routing(ep2, ep_tp, tp):
    """``moe_experts`` on its own, bfloat16 tokens and experts (the exchange carries them as
    they are), float32 gate weights, fixed routing; against float32 torch."""
    mesh = ep_tp if tp else ep2
    torch.manual_seed(17)
    E, T = 4, 9
    w1, w3, w2 = torch.randn(E, F, D), torch.randn(E, F, D), torch.randn(E, D, F)
    x = torch.randn(T, D)
    idx = torch.randint(0, E, (T, 2))
    g = torch.rand(T, 2)
    want = torch.zeros(T, D)
    for t in range(T):
        for j in range(2):
            e = int(idx[t, j])
            want[t] += g[t, j] * (w2[e] @ (TF.silu(w1[e] @ x[t]) * (w3[e] @ x[t])))

    def put(t, on_tp=R):
        return dtorch.from_torch(t, device_mesh=mesh, placements=[S0, on_tp] if tp else [S0])

    bf = torch.bfloat16
    y = dtorch.nn.functional.moe_experts(put(x.to(bf)), put(idx), put(g), put(w1.to(bf), Shard(1)),
                                         put(w3.to(bf), Shard(1)), put(w2.to(bf), Shard(2)))
    assert y.dtype == bf and y.placements == ([S0, Shard(1)] if tp else [S0])
    torch.testing.assert_close(y.to_torch().float(), want, rtol=0.05, atol=0.3)


def test_state_dict_round_trip(ep2):
    ref, moe = make(ep2, 4, 2, seed=9)
    sd = moe.state_dict()
    assert sorted(sd) == ["gate.weight", "w1", "w2", "w3"]
    torch.testing.assert_close(sd["w2"].to_torch()[3], ref.experts[3].w2.weight.detach())
    _, other = make(ep2, 4, 2, seed=10)
    other.load_state_dict(sd)
    x = torch.randn(4, D)
    a = moe(dtorch.from_torch(x, device_mesh=ep2, placements=[S0])).to_torch()
    b = other(dtorch.from_torch(x, device_mesh=ep2, placements=[S0])).to_torch()
    torch.testing.assert_close(a, b)
    bad = ref.state_dict()
    del bad["experts.2.w3.weight"]
    with pytest.raises(RuntimeError, match="w3 of experts \\[2\\]"):
        other.load_state_dict(bad)


# -- refusals ---------------------------------------------------------------------------------


def test_experts_not_divisible_by_ep(ep4):
    with pytest.raises(ValueError, match="num_experts=6 does not divide over the 4 devices"):
        dtorch.nn.MoE(D, F, 6, 2, device_mesh=ep4)
    with pytest.raises(ValueError, match="top_k=5 exceeds num_experts=4"):
        dtorch.nn.MoE(D, F, 4, 5, device_mesh=ep4)
    w = dtorch.from_torch(torch.zeros(6, F, D), device_mesh=ep4, placements=[S0])
    w2 = dtorch.from_torch(torch.zeros(6, D, F), device_mesh=ep4, placements=[S0])
    x = dtorch.from_torch(torch.zeros(4, D), device_mesh=ep4, placements=[S0])
    idx = dtorch.from_torch(torch.zeros(4, 1, dtype=torch.long), device_mesh=ep4,
                            placements=[S0])
    g = dtorch.from_torch(torch.ones(4, 1), device_mesh=ep4, placements=[S0])
    with pytest.raises(ValueError, match="6 experts do not divide over the 4 devices"):
        dtorch.nn.functional.moe_experts(x, idx, g, w, w, w2)
    _check_usable(ep4)


def test_wrong_input(ep_tp):
    _, moe = make(ep_tp, 4, 2, seed=11)
    with pytest.raises(ValueError, match=r"expects \[tokens, 8\] or \[batch, seq, 8\]"):
        moe(dtorch.from_torch(torch.zeros(4, D + 1), device_mesh=ep_tp, placements=[S0, R]))
    with pytest.raises(ValueError, match=r"expects \[tokens, 8\]"):
        moe(dtorch.from_torch(torch.zeros(D), device_mesh=ep_tp, placements=[R, R]))
    with pytest.raises(ValueError, match="Replicate on the tp dim"):
        moe(dtorch.from_torch(torch.zeros(4, D), device_mesh=ep_tp, placements=[S0, Shard(1)]))
    with pytest.raises(TypeError, match="expects a dtorch.Tensor"):
        moe(torch.zeros(4, D))
    x = dtorch.from_torch(torch.zeros(4, D), device_mesh=ep_tp, placements=[S0, R])
    idx = dtorch.from_torch(torch.zeros(4, 2, dtype=torch.long), device_mesh=ep_tp,
                            placements=[S0, R])
    g = dtorch.from_torch(torch.ones(4, 2), device_mesh=ep_tp, placements=[S0, R])
    f = dtorch.nn.functional.moe_experts
    with pytest.raises(ValueError, match=r"w2 must be \[experts, hidden, ffn\]"):
        f(x, idx, g, moe.w1, moe.w3, moe.w1)
    with pytest.raises(ValueError, match=r"weights must have the indices' shape"):
        f(x, idx, g[:, :1], moe.w1, moe.w3, moe.w2)
    with pytest.raises(ValueError, match=r"tokens \(input, indices, weights\) are"):
        f(x, idx.redistribute(placements=[R, R]), g, moe.w1, moe.w3, moe.w2)
    with pytest.raises(ValueError, match=r"expected \(R, R, R\)"):  # tokens sharded over tp
        f(x.redistribute(placements=[S0, S0]), idx.redistribute(placements=[S0, S0]),
          g.redistribute(placements=[S0, S0]), moe.w1, moe.w3, moe.w2)
    _check_usable(ep_tp)


def test_expert_index_out_of_range_fails_at_read(ep2):
    """A bad expert id fails on its device after the exchange (the peers never hang), and the
    runtime goes on."""
    _, moe = make(ep2, 4, 2, seed=12)
    x = dtorch.from_torch(torch.randn(4, D), device_mesh=ep2, placements=[S0])
    idx = dtorch.from_torch(torch.tensor([[0], [1], [2], [9]]), device_mesh=ep2,
                            placements=[S0])
    g = dtorch.from_torch(torch.ones(4, 1), device_mesh=ep2, placements=[S0])
    y = dtorch.nn.functional.moe_experts(x, idx, g, moe.w1, moe.w3, moe.w2)
    with pytest.raises(Exception, match="expert index 9 is out of range"):
        y.to_torch()
    _check_usable(ep2)


def test_input_failed_on_one_device(ep2):
    """Tokens that failed upstream on device 1 only: device 1 still takes part in the exchange
    (its peers would wait forever otherwise), every device's result is poisoned, the error is
    the upstream one, and the runtime goes on."""
    _, moe = make(ep2, 4, 2, seed=15)
    table = dtorch.from_torch(torch.randn(5, D), device_mesh=ep2, placements=[R])
    ids = dtorch.from_torch(torch.tensor([0, 1, 2, 7]), device_mesh=ep2, placements=[S0])
    y = moe(dtorch.nn.functional.embedding(ids, table))  # row 7 is out of range on device 1
    with pytest.raises(Exception, match="index out of range"):
        y.to_torch()
    _check_usable(ep2)


def test_input_failed_on_one_device_under_tp(ep_tp):
    """Device (ep 1, tp 0) fails upstream and routes its stand-in zeros differently from its tp
    peer: the column gathers over tp still meet (padded to the larger count), all results are
    poisoned, and the runtime goes on."""
    _, moe = make(ep_tp, 4, 2, seed=20)
    table = dtorch.from_torch(torch.randn(5, D), device_mesh=ep_tp, placements=[R, R])
    # Partial on tp: tp 0 holds the ids, tp 1 zeros; taken as R, they differ per tp rank
    ids = dtorch.from_torch(torch.tensor([0, 1, 2, 3, 7, 1]), device_mesh=ep_tp,
                            placements=[S0, dtorch.Partial()])
    ids = dtorch.local_map(torch.clone, [S0, R])(ids)  # id 7 is out of range on tp 0 only
    y = moe(dtorch.nn.functional.embedding(ids, table))
    with pytest.raises(Exception, match="index out of range"):
        y.to_torch()
    _check_usable(ep_tp)


def _check_usable(mesh):
    ref, moe = make(mesh, 4, 2, seed=13)
    placements = [S0] + [R] * (mesh.ndim - 1)
    run(ref, moe, torch.randn(6, D), placements)
