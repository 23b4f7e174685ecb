"""Pipeline schedules for training (``dtorch.nn.ScheduleGPipe``, ``Schedule1F1B``): the
per-stage action lists and the order they are issued in (which is the order each stage's
devices run them), and the gradients, losses and training steps against torch's one-process
run of the same model on the whole batch."""

import itertools

import pytest
import torch

import dtorch
from dtorch import Replicate, Shard
from dtorch.nn.schedules import (actions_1f1b, actions_gpipe, actions_interleaved_1f1b,
                                 issue_order)

R, S0 = Replicate(), Shard(0)


def check_actions(acts, p, m, v, bound):
    """Every device's list covers each of its stages' F and B of every micro-batch, a B after
    its F, at most ``bound(d)`` micro-batches' activations in flight; the issue order keeps
    each list and issues every action after what it needs."""
    for d, device in enumerate(acts):
        stages = [d + c * p for c in range(v)]
        assert sorted(device) == sorted((s, k, i) for s in stages for k in "FB"
                                        for i in range(m))
        in_flight, peak = 0, 0
        for n, (s, kind, i) in enumerate(device):
            in_flight += 1 if kind == "F" else -1
            peak = max(peak, in_flight)
            assert kind == "F" or (s, "F", i) in device[:n]
        assert peak == bound(d), (d, peak)
    order = issue_order(acts)
    for d, device in enumerate(acts):
        assert [a for a in order if a in set(device)] == device
    seen, last = set(), p * v - 1
    for s, kind, i in order:
        if kind == "F" and s:
            assert (s - 1, "F", i) in seen
        if kind == "B":
            assert (s + 1, "B", i) in seen if s < last else (s, "F", i) in seen
        seen.add((s, kind, i))


@pytest.mark.parametrize("p, m", list(itertools.product(range(1, 5), (1, 2, 3, 4, 7, 8))))
def test_gpipe_and_1f1b_actions_and_their_order(p, m):
    check_actions(actions_gpipe(p, m), p, m, 1, lambda d: m)  # GPipe holds all m
    check_actions(actions_1f1b(p, m), p, m, 1, lambda d: min(p - d, m))  # 1F1B p - d


@pytest.mark.parametrize("p, v, groups", list(itertools.product((2, 3, 4), (2, 3), (1, 2, 3))))
def test_interleaved_actions_and_their_order(p, v, groups):
    m = p * groups
    # Megatron's warm-up: 2 (p - d - 1) + (v - 1) p forwards, then one in flight more
    check_actions(actions_interleaved_1f1b(p, m, v), p, m, v,
                  lambda d: min(m * v, 2 * (p - d - 1) + (v - 1) * p + 1))
    with pytest.raises(ValueError, match="groups"):
        actions_interleaved_1f1b(p, m + 1, v)


def test_1f1b_order_on_4_stages_is_the_textbook_one():
    acts = [[(k, i) for _, k, i in device] for device in actions_1f1b(4, 6)]
    assert acts[0] == [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("F", 4), ("B", 1),
                       ("F", 5), ("B", 2), ("B", 3), ("B", 4), ("B", 5)]
    assert acts[3] == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3),
                       ("B", 3), ("F", 4), ("B", 4), ("F", 5), ("B", 5)]
    # interleaved on 2 devices, 2 chunks, 4 micro-batches: device 0's forwards take micro-
    # batches 0, 1 through chunk 0, then through chunk 1 (stage 2), 4 of them before a backward
    device0 = actions_interleaved_1f1b(2, 4, 2)[0]
    assert device0[:6] == [(0, "F", 0), (0, "F", 1), (2, "F", 0), (2, "F", 1), (0, "F", 2),
                           (2, "B", 0)]


D = 6


def torch_stages():
    torch.manual_seed(0)
    return [torch.nn.Sequential(torch.nn.Linear(D, 8), torch.nn.Tanh()),
            torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()),
            torch.nn.Linear(8, 2)]


def dtorch_stages(meshes, ref):
    dims = [(D, 8), (8, 8), (8, 2)]
    acts = [dtorch.nn.Tanh(), dtorch.nn.GELU(), None]
    out = []
    for mesh, (i, o), act, r in zip(meshes, dims, acts, ref):
        lin = dtorch.nn.Linear(i, o, device_mesh=mesh)
        lin.load_state_dict((r[0] if act is not None else r).state_dict())
        out.append(dtorch.nn.Sequential(lin, act) if act is not None else lin)
    return out


def loss_fn(y, t):
    return ((y - t) ** 2).mean()


def microbatches(x, m, dp=1):
    """The micro-batches a schedule makes of ``x``: chunks; of a batch sharded on dp, chunk i
    of every device's block, joined (``split_microbatches`` cuts each block locally)."""
    blocks = x.chunk(dp)
    return [torch.cat([b.chunk(m)[i] for b in blocks]) for i in range(m)]


def data(seed, n=24):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, D, generator=g), torch.randn(n, 2, generator=g)


@pytest.fixture(scope="module")
def pp3():
    return dtorch.init_device_mesh("cpu", (3,), mesh_dim_names=["pp"])


@pytest.fixture(scope="module")
def dp2pp3():
    return dtorch.init_device_mesh("cpu", (2, 3), mesh_dim_names=["dp", "pp"])


@pytest.mark.parametrize("schedule", [dtorch.nn.ScheduleGPipe, dtorch.nn.Schedule1F1B])
@pytest.mark.parametrize("m", [1, 3, 4])
@pytest.mark.parametrize("layout", ["pp3", "dp2xpp3"])
def test_gradients_and_losses_equal_torchs(schedule, m, layout, pp3, dp2pp3):
    mesh = pp3 if layout == "pp3" else dp2pp3
    meshes = mesh.unbind("pp")
    ref = torch_stages()
    stages = dtorch_stages(meshes, ref)
    x, t = data(1)
    # torch: the mean of the micro-batches' losses, on the whole batch in one process
    dp = 2 if layout == "dp2xpp3" else 1
    chunks = list(zip(microbatches(x, m, dp), microbatches(t, m, dp)))
    want_losses = []
    for xi, ti in chunks:
        loss = loss_fn(ref[2](ref[1](ref[0](xi))), ti)
        (loss / m).backward()
        want_losses.append(loss.item())
    batch = [S0] if layout == "dp2xpp3" else [R]  # the stage meshes are the dp dim's
    dx = dtorch.from_torch(x, meshes[0], batch)
    dt = dtorch.from_torch(t, meshes[-1], batch)
    losses = []
    out = schedule(stages, m, loss_fn=loss_fn).step(dx, target=dt, losses=losses)
    torch.testing.assert_close(out.to_torch(), ref[2](ref[1](ref[0](x))), atol=1e-6, rtol=1e-5)
    assert out.device_mesh == meshes[-1]
    assert [v.item() for v in losses] == pytest.approx(want_losses, rel=1e-6, abs=1e-7)
    mine = [p for s in stages for p in s.parameters()]
    theirs = [p for s in ref for p in s.parameters()]
    for p, q in zip(mine, theirs):
        torch.testing.assert_close(p.grad.to_torch(), q.grad, atol=1e-6, rtol=1e-5)
        assert p.grad.placements == p.placements


def test_training_steps_equal_torchs(dp2pp3):
    meshes = dp2pp3.unbind("pp")
    ref = torch_stages()
    stages = dtorch_stages(meshes, ref)
    opt = dtorch.optim.AdamW([p for s in stages for p in s.parameters()], lr=0.05)
    ref_opt = torch.optim.AdamW([p for s in ref for p in s.parameters()], lr=0.05)
    schedule = dtorch.nn.Schedule1F1B(stages, 4, loss_fn=loss_fn)
    for step in range(4):
        x, t = data(10 + step)
        losses = []
        schedule.step(dtorch.from_torch(x, meshes[0], [S0]), target=dtorch.from_torch(
            t, meshes[-1], [S0]), losses=losses)
        opt.step()
        opt.zero_grad()
        want = []
        for xi, ti in zip(microbatches(x, 4, 2), microbatches(t, 4, 2)):
            loss = loss_fn(ref[2](ref[1](ref[0](xi))), ti)
            (loss / 4).backward()
            want.append(loss.item())
        ref_opt.step()
        ref_opt.zero_grad()
        assert [v.item() for v in losses] == pytest.approx(want, rel=1e-5, abs=1e-6), step
    for p, q in zip([p for s in stages for p in s.parameters()],
                    [p for s in ref for p in s.parameters()]):
        torch.testing.assert_close(p.to_torch(), q.detach(), atol=1e-5, rtol=1e-5)


def test_a_data_parallel_stage_reduces_its_gradients_once(dp2pp3):
    """Every micro-batch's backward but the last runs with the stage's sync off: one bucketed
    all-reduce per stage and step, not one per micro-batch."""
    meshes = dp2pp3.unbind("pp")
    stages = dtorch_stages(meshes, torch_stages())
    x, t = data(2, n=16)
    with dtorch.profiler.profile() as prof:
        dtorch.nn.Schedule1F1B(stages, 4, loss_fn=loss_fn).step(
            dtorch.from_torch(x, meshes[0], [S0]),
            target=dtorch.from_torch(t, meshes[-1], [S0]))
        dtorch.sync()
    for stage_mesh in meshes:
        device = stage_mesh.mesh.flatten().tolist()[0]
        names = [n for e in prof.kernels() if e["pid"] == device for n in e["name"].split("+")]
        assert names.count("all_reduce_coalesced") == 1, (device, names)


def test_forward_only_and_errors(pp3):
    meshes = pp3.unbind("pp")
    ref = torch_stages()
    stages = dtorch_stages(meshes, ref)
    x, t = data(3)
    with torch.no_grad():
        out = dtorch.nn.Schedule1F1B(stages, 3).step(dtorch.from_torch(x, meshes[0]))
    torch.testing.assert_close(out.to_torch(), ref[2](ref[1](ref[0](x))), atol=1e-6, rtol=1e-5)
    assert all(p.grad is None for s in stages for p in s.parameters())
    with pytest.raises(ValueError, match="n_microbatches"):
        dtorch.nn.ScheduleGPipe(stages, 0)
    with pytest.raises(ValueError, match="target"):
        dtorch.nn.ScheduleGPipe(stages, 2, loss_fn=loss_fn).step(dtorch.from_torch(x, meshes[0]))
    with pytest.raises(ValueError, match="does not split"):
        dtorch.nn.ScheduleGPipe(stages, 5, loss_fn=loss_fn).step(
            dtorch.from_torch(x[:3], meshes[0]), target=dtorch.from_torch(t[:3], meshes[-1]))


@pytest.mark.parametrize("m", [3, 6])
@pytest.mark.parametrize("layout", ["pp3", "dp2xpp3"])
def test_interleaved_gradients_equal_torchs(m, layout, pp3, dp2pp3):
    """6 virtual stages on 3 stage meshes (2 chunks a device), round-robin."""
    meshes = (pp3 if layout == "pp3" else dp2pp3).unbind("pp")
    torch.manual_seed(0)
    widths = [D, 8, 8, 8, 8, 8, 2]
    ref = [torch.nn.Sequential(torch.nn.Linear(a, b), torch.nn.Tanh())
           for a, b in zip(widths, widths[1:])]
    stages = []
    for k, r in enumerate(ref):
        lin = dtorch.nn.Linear(widths[k], widths[k + 1], device_mesh=meshes[k % 3])
        lin.load_state_dict(r[0].state_dict())
        stages.append(dtorch.nn.Sequential(lin, dtorch.nn.Tanh()))
    x, t = data(4)
    dp = 2 if layout == "dp2xpp3" else 1
    want = []
    for xi, ti in zip(microbatches(x, m, dp), microbatches(t, m, dp)):
        h = xi
        for r in ref:
            h = r(h)
        loss = loss_fn(h, ti)
        (loss / m).backward()
        want.append(loss.item())
    batch = [S0] if dp == 2 else [R]
    losses = []
    dtorch.nn.ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn).step(
        dtorch.from_torch(x, meshes[0], batch),
        target=dtorch.from_torch(t, meshes[0], batch), losses=losses)
    assert [v.item() for v in losses] == pytest.approx(want, rel=1e-6, abs=1e-7)
    for s, r in zip(stages, ref):
        for p, q in zip(s.parameters(), r.parameters()):
            torch.testing.assert_close(p.grad.to_torch(), q.grad, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="round-robin"):
        dtorch.nn.ScheduleInterleaved1F1B(stages[:3] + stages[4:5], m, loss_fn=loss_fn)
