"""Pipeline parallelism: stage hops are point-to-point moves, micro-batches pipeline, and the
profiler's timeline shows it.

- a hop between meshes of one shape equals torch for every kind of placement (uneven shards,
  Partial, 2-D stage meshes of a (pp, dp, tp) mesh, a rotated mesh whose pairs form a cycle);
- it uses nothing but send/recv: the planner lowers it to one ``move`` step, the kernel (run
  here in threads against a recording process group) calls only ``send`` and ``recv``, and a
  traced hop runs no other step;
- ``dtorch.nn.pipeline`` equals the unpipelined stages and torch, also for a batch sharded on a
  "dp" dim, which it splits without a gather (the trace shows no collective but the hops);
- a failure before a hop poisons what the hop delivers, and the runtime stays usable;
- ``dtorch.profiler`` writes a valid trace of exactly the work issued inside it, and for 8
  micro-batches stage 1 computes while stage 0 still does.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch

import dtorch
from dtorch import DeviceMesh, Partial, Replicate, Shard
from dtorch.controller.passes import plan_steps
from dtorch.runtime import collectives
from dtorch.runtime.context import KernelContext
from dtorch.spec import MeshInfo, intern_spec
from helpers import assert_close, distribute

R, S0, S1, P = Replicate(), Shard(0), Shard(1), Partial()


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def pp():
    """Two stages of one device each: devices 0 and 1 run in different hosts."""
    return dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["pp"]).unbind("pp")


@pytest.fixture(scope="module")
def pp_dp():
    """Two stages of two devices each ("dp"): [0, 1] and [2, 3]."""
    return dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["pp", "dp"]).unbind("pp")


# -- the hop equals torch --------------------------------------------------------------------------


@pytest.mark.parametrize("placements", [[R], [S0], [S1], [P], [Partial("max")]], ids=str)
def test_hop_between_stage_meshes(pp_dp, placements):
    t = rand(5, 3, seed=1)  # 5 rows over 2 devices: uneven shards
    x = distribute(t, pp_dp[0], placements)
    y = x.redistribute(device_mesh=pp_dp[1], placements=placements)
    assert y.device_mesh == pp_dp[1] and y.placements == placements
    assert_close(y, t)
    back = y.redistribute(device_mesh=pp_dp[0], placements=placements)
    assert_close(back, t)


@pytest.mark.parametrize("placements", [[S0, S1], [R, S0], [P, S1], [S1, S1], [S0, P]], ids=str)
def test_hop_between_2d_stage_meshes(placements):
    stages = dtorch.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=["pp", "dp", "tp"]).unbind(
        "pp")
    assert stages[0].shape == (2, 2)
    t = rand(5, 7, seed=2)
    x = distribute(t, stages[0], placements)
    y = x.redistribute(device_mesh=stages[1], placements=placements)
    assert y.placements == placements
    assert_close(y, t)
    # and on to another layout there
    assert_close(y.redistribute(placements=[R, R]), t)


def test_hop_on_a_rotated_mesh():
    # device k sends to k + 1 and receives from k - 1: the pairs form a cycle, which must
    # neither deadlock in the transfers nor in making the pair groups
    src, dst = DeviceMesh("cpu", [0, 1, 2]), DeviceMesh("cpu", [1, 2, 0])
    t = rand(7, 2, seed=3)
    for placements in ([S0], [R], [P]):
        y = distribute(t, src, placements).redistribute(device_mesh=dst, placements=placements)
        assert_close(y, t)


def test_hop_of_integers_and_empty_blocks(pp_dp):
    t = torch.arange(3 * 4, dtype=torch.int64).reshape(3, 4)
    assert_close(distribute(t, pp_dp[0], [S0]).redistribute(pp_dp[1], [S0]), t)
    e = torch.zeros(1, 4)  # the second device's block is empty
    assert_close(distribute(e, pp_dp[0], [S0]).redistribute(pp_dp[1], [S0]), e)


# -- the hop is point-to-point ---------------------------------------------------------------------


def test_a_hop_is_planned_as_one_move_step():
    a, b = MeshInfo("cpu", (2, 2), [0, 1, 2, 3]), MeshInfo("cpu", (2, 2), [4, 5, 6, 7])
    for placements in ([S0, S1], [P, R], [R, R]):
        src = intern_spec((5, 6), "float32", a, placements)
        dst = intern_spec((5, 6), "float32", b, placements)
        assert [kind for kind, _, _ in plan_steps(src, dst)] == ["move"]


class RecordingGroup:
    """A two-member process group in this process: send and recv meet through a shared
    mailbox; every call is recorded, and any collective fails the test."""

    def __init__(self, world, members, me):
        self.world, self.members, self.me = world, members, me

    def send(self, tensors, dst_rank, tag):
        dst = self.members[dst_rank]
        self.world.calls.append(("send", self.me, dst))
        self.world.box(self.me, dst, tag).put(tensors[0].clone())
        return Done()

    def recv(self, tensors, src_rank, tag):
        src = self.members[src_rank]
        self.world.calls.append(("recv", src, self.me))
        return Receive(self.world.box(src, self.me, tag), tensors[0])

    def __getattr__(self, name):  # broadcast, allgather, ...: a move must not use them
        raise AssertionError(f"a move between same-shape meshes called {name}")


class Done:
    def wait(self):
        return True


class Receive:
    def __init__(self, box, into):
        self.box, self.into = box, into

    def wait(self):
        self.into.copy_(self.box.get(timeout=10))
        return True


class World:
    def __init__(self):
        import queue

        self.calls, self.boxes, self.lock, self.queue = [], {}, threading.Lock(), queue.Queue

    def box(self, src, dst, tag):
        with self.lock:
            return self.boxes.setdefault((src, dst, tag), self.queue())


class FakeDevice:
    def __init__(self, world, index):
        self.world, self.index, self.torch_device = world, index, torch.device("cpu")
        self.groups = []

    def group(self, members):
        assert len(members) == 2 and list(members) == sorted(members)
        self.groups.append(members)
        return RecordingGroup(self.world, members, self.index)

    cpu_group = group  # a CPU device's gloo groups serve both


@pytest.mark.parametrize("dst_devices", [[4, 5, 6, 7], [1, 2, 3, 0], [2, 3, 4, 5]],
                         ids=["disjoint", "rotated", "shifted"])
@pytest.mark.parametrize("placements", [[S0, S1], [S1, R], [P, S0]], ids=str)
def test_the_hop_kernel_only_sends_and_receives(dst_devices, placements):
    """Every device of both meshes runs ``collectives.hop`` at once (threads), as the hosts
    do; each must get its block, and only through send/recv on pair groups. The failure each
    sender reports (here the second one's) reaches its own receiver only."""
    src_mesh = MeshInfo("cpu", (2, 2), [0, 1, 2, 3])
    dst_mesh = MeshInfo("cpu", (2, 2), dst_devices)
    src = intern_spec((5, 3), "float32", src_mesh, placements)
    dst = intern_spec((5, 3), "float32", dst_mesh, placements)
    world = World()
    blocks = {d: torch.randn(src.local_region(c)[0]) for d, c in
              zip(src_mesh.devices, [(0, 0), (0, 1), (1, 0), (1, 1)])}
    failures = {src_mesh.devices[1]: 42}
    results, errors = {}, []

    def run(d):
        try:
            ctx = KernelContext(FakeDevice(world, d), [src], [dst])
            results[d] = collectives.hop(ctx, blocks.get(d), failures.get(d, 0))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(d,))
               for d in sorted(set(src_mesh.devices) | set(dst_mesh.devices))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    for k, d in enumerate(dst_devices):  # device k of the target holds device k's block
        assert torch.equal(results[d][0], blocks[src_mesh.devices[k]])
        assert results[d][1] == (42 if k == 1 else 0)
    for d in set(src_mesh.devices) - set(dst_devices):
        assert results[d] == ((), 0)
    kinds = {kind for kind, _, _ in world.calls}
    moved = {(a, b) for kind, a, b in world.calls if a != b}
    assert kinds <= {"send", "recv"}
    assert moved == {(s, t) for s, t in zip(src_mesh.devices, dst_devices) if s != t}


# -- pipeline() ------------------------------------------------------------------------------------


class Stage(dtorch.nn.Module):
    def __init__(self, width, n_layers, mesh):
        super().__init__()
        self.layers = dtorch.nn.ModuleList(
            [dtorch.nn.Linear(width, width, device_mesh=mesh) for _ in range(n_layers)])

    def forward(self, h):
        for layer in self.layers:
            h = dtorch.nn.functional.relu(layer(h))
        return h


def torch_stages(stages):
    """The torch twin of each stage (same weights)."""
    out = []
    for s in stages:
        layers = []
        for layer in s.layers:
            t = torch.nn.Linear(layer.in_features, layer.out_features)
            t.load_state_dict({k: v.to_torch() for k, v in layer.state_dict().items()})
            layers += [t, torch.nn.ReLU()]
        out.append(torch.nn.Sequential(*layers))
    return out


@pytest.mark.parametrize("microbatches", [1, 3, 4])
def test_pipeline_equals_the_stages_and_torch(pp, microbatches):
    stages = [Stage(6, 2, pp[0]), Stage(6, 2, pp[1])]
    t = rand(8, 6, seed=4)
    x = dtorch.from_torch(t, device_mesh=pp[0])
    y = dtorch.nn.pipeline(stages, x, microbatches=microbatches)
    assert y.device_mesh == pp[1] and y.shape == (8, 6)
    plain = stages[1](stages[0](x).redistribute(device_mesh=pp[1], placements=[R]))
    assert_close(y, plain.to_torch())
    t0, t1 = torch_stages(stages)
    with torch.no_grad():
        assert_close(y, t1(t0(t)))


def test_the_plain_loop_pipelines_too(pp):
    """What ``pipeline`` does, written out: the same values."""
    stages = [Stage(6, 1, pp[0]), Stage(6, 1, pp[1])]
    t = rand(8, 6, seed=5)
    x = dtorch.from_torch(t, device_mesh=pp[0])
    outs = []
    for mb in x.chunk(4, 0):
        h = stages[0](mb)
        h = h.redistribute(device_mesh=pp[1], placements=h.placements)
        outs.append(stages[1](h))
    assert_close(dtorch.cat(outs, 0), dtorch.nn.pipeline(stages, x, microbatches=4).to_torch())


def test_stages_given_as_callables_with_meshes(pp):
    t = rand(6, 4, seed=6)
    x = dtorch.from_torch(t, device_mesh=pp[0])
    y = dtorch.nn.pipeline([(lambda h: h * 2, pp[0]), (lambda h: h + 1, pp[1])], x,
                           microbatches=3)
    assert y.device_mesh == pp[1]
    assert_close(y, t * 2 + 1)
    with pytest.raises(ValueError, match="cannot tell the mesh"):
        dtorch.nn.pipeline([lambda h: h], x, microbatches=2)


@pytest.mark.parametrize("microbatches", [2, 3])
def test_a_dp_sharded_batch_is_split_without_a_gather(pp_dp, microbatches):
    stages = [Stage(4, 1, pp_dp[0]), Stage(4, 1, pp_dp[1])]
    t = rand(12, 4, seed=7)
    x = dtorch.from_torch(t, device_mesh=pp_dp[0], placements=[S0])
    x.sum().item()  # x is there before the trace starts
    with dtorch.profiler.trace() as prof:
        y = dtorch.nn.pipeline(stages, x, microbatches=microbatches)
        value = y.to_torch()
    assert y.placements == [S0] and y.device_mesh == pp_dp[1]
    t0, t1 = torch_stages(stages)
    with torch.no_grad():
        assert_close(value, t1(t0(t)))
    steps = {e["name"] for e in prof.kernels() if e["name"].startswith("step:")}
    assert steps == {"step:move"}, steps  # no all-gather, no all-to-all: only the hops


# -- failures --------------------------------------------------------------------------------------


def test_a_failure_before_a_hop_poisons_its_delivery(pp_dp):
    a = dtorch.from_torch(torch.tensor([4, 6, 8, 3]), device_mesh=pp_dp[0], placements=[S0])
    b = dtorch.from_torch(torch.tensor([2, 2, 1, 0]), device_mesh=pp_dp[0], placements=[S0])
    q = a // b  # only the second device's block fails
    moved = q.redistribute(device_mesh=pp_dp[1], placements=[S0])
    independent = a.redistribute(device_mesh=pp_dp[1], placements=[S0])
    with pytest.raises(RuntimeError, match="floor_divide"):
        dtorch.sync()
    with pytest.raises(RuntimeError, match="floor_divide"):
        moved.to_torch()
    assert torch.equal(independent.to_torch(), torch.tensor([4, 6, 8, 3]))
    assert torch.equal((independent + 1).to_torch(), torch.tensor([5, 7, 9, 4]))


# -- the profiler ----------------------------------------------------------------------------------


def test_a_trace_holds_exactly_the_work_issued_inside_it(pp, tmp_path):
    x = dtorch.from_torch(rand(4, 4), device_mesh=pp[0])
    before = x * 3.0  # issued before the trace: not in it, even if it runs after the start
    path = tmp_path / "trace.json"
    with dtorch.profiler.trace(str(path)) as prof:
        inside = (before + 1.0).redistribute(device_mesh=pp[1], placements=[R]).sum()
    after = inside * 2.0  # after the stop: not in it
    after.item()
    doc = json.loads(path.read_text())
    assert doc["traceEvents"] == prof.events
    kernels = prof.kernels()
    assert {(e["pid"], e["name"]) for e in kernels} == {
        (0, "add"), (0, "step:move"), (1, "step:move"), (1, "sum")}
    for e in kernels:
        assert e["dur"] >= 0 and e["ts"] >= 0 and e["tid"] in (0, 1)
        assert e["cat"] == ("comm" if e["tid"] == 0 else "compute")
    names = {(e["pid"], e["name"]) for e in prof.events if e["ph"] == "M"}
    assert {(0, "process_name"), (1, "process_name"), (0, "thread_name")} <= names
    assert dtorch.profiler.stop() == []  # nothing recorded once stopped


def test_the_timeline_shows_stages_overlapping(pp, tmp_path):
    """Eight micro-batches: stage 1 starts computing before stage 0 has finished (the hop of
    micro-batch 0 needs only its own stage-0 work, and seven more follow it there)."""
    # each micro-batch computes for tens of ms per stage (1 GFLOP), so that stage 0's last one
    # ends well after the first hop arrives, even when a busy machine makes a hop wait a
    # scheduler slice or two (with 64 x 512 micro-batches, a few ms each, it once missed by
    # 0.15 ms in a full run)
    stages = [Stage(1024, 4, pp[0]), Stage(1024, 4, pp[1])]
    x = dtorch.rand((8 * 128, 1024), device_mesh=pp[0])
    dtorch.nn.pipeline(stages, x, microbatches=8).sum().item()  # warm: groups, caches
    path = tmp_path / "pp.json"
    with dtorch.profiler.trace(str(path)):
        dtorch.nn.pipeline(stages, x, microbatches=8).sum().item()
    events = json.loads(path.read_text())["traceEvents"]
    compute = {d: sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                         if e["ph"] == "X" and e["pid"] == d and e["tid"] != 0)
               for d in (0, 1)}
    assert len(compute[0]) >= 8 and len(compute[1]) >= 8
    assert compute[1][0][0] < compute[0][-1][1]  # stage 1 began before stage 0 was done
