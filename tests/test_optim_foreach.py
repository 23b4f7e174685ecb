"""The optimizers' update calls: one per parameter group and mesh (torch's ``foreach`` or
``fused`` implementation on each device's list of blocks), or one per parameter with
``foreach=False``; bit-identical to torch's same implementation on one device."""

import pytest
import torch

import dtorch
from dtorch import Replicate, Shard

R, S0, S1 = Replicate(), Shard(0), Shard(1)
SHAPES = [(5, 3), (7,), (4, 6), (2, 2, 3)]  # uneven under a 2-way Shard(0)

CASES = [
    ("Adam", dict(lr=0.05)),
    ("Adam", dict(lr=0.05, betas=(0.8, 0.99), weight_decay=0.1, maximize=True)),
    ("AdamW", dict(lr=0.05, weight_decay=0.1)),
    ("SGD", dict(lr=0.1)),
    ("SGD", dict(lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True)),
    ("SGD", dict(lr=0.1, momentum=0.5, dampening=0.3, maximize=True)),
]
IMPLEMENTATIONS = [dict(), dict(foreach=True), dict(foreach=False), dict(fused=True)]


def starts():
    g = torch.Generator().manual_seed(3)
    return [torch.randn(s, generator=g) for s in SHAPES]


def grads(step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g) for s in SHAPES]


def torch_run(name, kwargs, impl, steps=3):
    """torch's optimizer, as dtorch's ``impl`` (its default: foreach)."""
    ps = [p.clone().requires_grad_() for p in starts()]
    opt = getattr(torch.optim, name)(ps, **kwargs, **(impl or dict(foreach=True)))
    for step in range(steps):
        for p, g in zip(ps, grads(step)):
            p.grad = g
        opt.step()
    return ps, opt


def dtorch_run(name, kwargs, impl, placements, steps=3):
    ps = [dtorch.nn.Parameter(dtorch.from_torch(p, m, pl)) for p, (m, pl) in
          zip(starts(), placements)]
    opt = getattr(dtorch.optim, name)(ps, **kwargs, **impl)
    for step in range(steps):
        for p, g, (m, pl) in zip(ps, grads(step), placements):
            p.grad = dtorch.from_torch(g, m, pl)
        opt.step()
    return ps, opt


def update_calls(run) -> list:
    """The names of the update kernels device 0 ran during ``run()``."""
    with dtorch.profiler.profile() as prof:
        run()
        dtorch.sync()
    return [e["name"] for e in prof.kernels() if e["pid"] == 0 and e["name"].endswith("_update_")]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, ids=["default", "foreach", "single", "fused"])
@pytest.mark.parametrize("name,kwargs", CASES, ids=[f"{n}-{i}" for i, (n, _) in
                                                    enumerate(CASES)])
def test_one_device_is_bit_identical_to_torchs_implementation(name, kwargs, impl, one):
    """Parameters and state after three steps equal torch's with the same ``foreach`` /
    ``fused`` (dtorch's default is foreach) bit for bit: a list update that mixed up which
    gradient or moment goes with which parameter, or missed a write, differs."""
    expected, opt_t = torch_run(name, kwargs, impl)
    got, opt_d = dtorch_run(name, kwargs, impl, [(one, [R])] * len(SHAPES))
    for k, (p, q) in enumerate(zip(got, expected)):
        assert torch.equal(p.to_torch(), q.detach()), k
        for key, value in opt_t.state[q].items():
            mine = opt_d.state[p][key]
            mine = mine.to_torch() if isinstance(mine, dtorch.Tensor) else mine
            assert torch.equal(mine, value), (k, key)


@pytest.mark.parametrize("impl", [dict(), dict(fused=True)], ids=["foreach", "fused"])
@pytest.mark.parametrize("name,kwargs", [CASES[1], CASES[4]], ids=["Adam", "SGD"])
def test_sharded_parameters_on_two_meshes_follow_torch(name, kwargs, impl, mesh1, mesh2):
    """Shard/Replicate parameters (uneven shards) on a 3-device and a 2x2 mesh: one update
    call per mesh, values as torch's (elementwise: any layout updates in place)."""
    placements = [(mesh2, [S0, S1]), (mesh1, [S0]), (mesh1, [R]), (mesh2, [R, S1])]
    expected, _ = torch_run(name, kwargs, impl)
    got, opt = dtorch_run(name, kwargs, impl, placements)
    for k, (p, q) in enumerate(zip(got, expected)):
        torch.testing.assert_close(p.to_torch(), q.detach(), msg=str(k))
    for p, g in zip(got, grads(3)):
        p.grad = dtorch.from_torch(g, p.device_mesh, p.placements)
    calls = update_calls(opt.step)  # device 0 is on both meshes
    assert len(calls) == 2, calls


@pytest.mark.parametrize("impl,calls", [(dict(), 1), (dict(fused=True), 1),
                                        (dict(foreach=False), len(SHAPES))])
def test_one_update_call_per_group_and_mesh(impl, calls, one):
    """foreach and fused: one update call for the group's parameters on one mesh; foreach=False
    one per parameter, as torch's for-loop."""
    ps, opt = dtorch_run("AdamW", dict(lr=0.01), impl, [(one, [R])] * len(SHAPES), steps=1)
    for p, g in zip(ps, grads(1)):
        p.grad = dtorch.from_torch(g, one, [R])
    assert update_calls(opt.step) == ["adam_update_"] * calls


def test_zero_and_master_weights_update_as_one_call(mesh2):
    """ZeRO-1 updates each parameter's chunk on dp; bfloat16 parameters with master weights
    update their float32 copies: still one call for the group, values as torch's foreach."""
    placements = [(mesh2, [R, S0]), (mesh2, [R, R]), (mesh2, [R, S1]), (mesh2, [R, R])]
    expected, _ = torch_run("AdamW", dict(lr=0.05), dict())
    got, opt = dtorch_run("AdamW", dict(lr=0.05, zero_stage=1), dict(), placements)
    for k, (p, q) in enumerate(zip(got, expected)):
        torch.testing.assert_close(p.to_torch(), q.detach(), msg=str(k))
    assert opt.state[got[1]]["exp_avg"].placements == [S0, R]
    low = [dtorch.nn.Parameter(dtorch.from_torch(p.to(torch.bfloat16), m, pl))
           for p, (m, pl) in zip(starts(), placements)]
    opt = dtorch.optim.AdamW(low, lr=0.05, master_weights=True)
    for p, g in zip(low, grads(0)):
        p.grad = dtorch.from_torch(g.to(torch.bfloat16), mesh2, p.placements)
    assert update_calls(opt.step) == ["adam_update_"]
    ref = [p.to(torch.bfloat16).float().requires_grad_() for p in starts()]
    for p, g in zip(ref, grads(0)):
        p.grad = g.to(torch.bfloat16).float()
    torch.optim.AdamW(ref, lr=0.05, foreach=True).step()
    for p, q in zip(low, ref):
        assert torch.equal(opt.state[p]["master"].to_torch(), q.detach())
        assert torch.equal(p.to_torch(), q.detach().to(torch.bfloat16))


def test_refusals(one):
    p = dtorch.nn.Parameter(dtorch.zeros(3, device_mesh=one, placements=[R]))
    with pytest.raises(RuntimeError, match="`fused` and `foreach` cannot be `True` together"):
        dtorch.optim.Adam([p], foreach=True, fused=True)
    assert dtorch.optim.AdamW([p]).param_groups[0]["foreach"] is None  # torch's default


def test_a_group_of_many_parameters_is_one_call(one):
    """40 parameters: the call writes 120 operands, flags wider than msgpack's 64-bit ints
    (``protocol.wire_bits``); values as torch's foreach."""
    g = torch.Generator().manual_seed(9)
    starts = [torch.randn(3, generator=g) for _ in range(40)]
    ref = [p.clone().requires_grad_() for p in starts]
    ps = [dtorch.nn.Parameter(dtorch.from_torch(p, one, [R])) for p in starts]
    opt_t, opt_d = torch.optim.Adam(ref, lr=0.1, foreach=True), dtorch.optim.Adam(ps, lr=0.1)
    for step in range(2):
        for p, q in zip(ps, ref):
            q.grad = torch.randn(3, generator=g)
            p.grad = dtorch.from_torch(q.grad, one, [R])
        opt_t.step()
        assert update_calls(opt_d.step) == ["adam_update_"]
    assert all(torch.equal(p.to_torch(), q.detach()) for p, q in zip(ps, ref))


def test_a_state_dict_saved_without_foreach_loads(one):
    """Groups saved before ``foreach``/``fused`` existed (or by torch without them) keep the
    optimizer's own options; the step goes on as torch's."""
    ps, opt = dtorch_run("Adam", dict(lr=0.05), dict(), [(one, [R])] * len(SHAPES), steps=1)
    saved = opt.state_dict()
    for group in saved["param_groups"]:
        del group["foreach"], group["fused"]
    opt.load_state_dict(saved)
    for p, g in zip(ps, grads(1)):
        p.grad = dtorch.from_torch(g, one, [R])
    opt.step()
    expected, _ = torch_run("Adam", dict(lr=0.05), dict(), steps=2)
    assert all(torch.equal(p.to_torch(), q.detach()) for p, q in zip(ps, expected))
