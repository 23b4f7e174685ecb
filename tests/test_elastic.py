"""Elastic training (``dtorch.elastic``): a host SIGKILLed at a random point of a step costs that
step, and the run goes on to the same losses as an uninterrupted one.

The programs run in subprocesses of their own (``elastic_program.py``): each first trains
without a kill (the reference), then again with kills, in the same interpreter. The losses of a
recovered run equal the reference's to 1e-5: every step sees the same global batch, re-split
over the new data-parallel size, so the only difference is the order of the gradient sums over
3 devices instead of 4 (float32 rounding, about 1e-7 of a loss of 3.6; the 1e-5 the issue asks
leaves room for Adam's normalised steps). Without the recovery the run fails at the kill, and a
recovery from a stale or wrong snapshot (a step behind, a step ahead, the optimizer's moments
lost) moves the losses by 1e-3 or more.

The rules that pick the new mesh are data (``policy.py``) and are checked without a runtime; the
snapshot and restore across layouts are checked in this test session's runtime, bit for bit.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

import dtorch
from dtorch import Replicate, Shard
from dtorch.elastic.policy import Layout, Unrecoverable, fit, grow, remesh
from dtorch.elastic import snapshot as snapshots
from processes import TESTS_DIR, alive, run_client

RECOVERY_S = 10.0  # the promise on this machine
TOLERANCE = 1e-5


def run_program(plans: list, hosts: int, timeout: float = 420) -> list:
    code = (f"import sys, json; sys.path.insert(0, {TESTS_DIR!r}); import elastic_program as e; "
            f"print('RESULT ' + json.dumps([e.main(p) for p in json.loads(sys.argv[1])]))")
    results = run_client(code, timeout=timeout, args=[json.dumps(plans)],
                         env={"DTORCH_CPU_HOSTS": str(hosts)})
    for r in results:  # no process of any runtime the program started outlives it
        assert not [p for p in r["pids"] if alive(p)], r["pids"]
    return results


def check_recovered(reference: dict, run: dict, kills: int, shape: list) -> None:
    """The run lost ``kills`` hosts, recovered each time within RECOVERY_S, ends on a mesh of
    ``shape`` and its losses equal the reference's."""
    assert run["error"] is None, run["error"]
    assert len(run["killed"]) == kills, run["killed"]
    lost = [e for e in run["events"] if e["kind"] == "lost"]
    recovered = [e for e in run["events"] if e["kind"] == "recovered"]
    assert len(lost) == kills and recovered, run["events"]
    for e in recovered:
        assert e["seconds"] <= RECOVERY_S, e
        assert e["restored"] is not None and e["restored"] <= e["step"], e
    assert recovered[-1]["mesh_shape"] == shape, recovered[-1]
    # a loss names the killed host's device, and comes in the step the kill landed in
    assert {d for e in lost for d in e["lost_devices"]} == {k["device"] for k in run["killed"]}
    for kill, e in zip(run["killed"], lost):
        assert e["step"] + 1 >= kill["step"], (kill, e)
    assert len(run["losses"]) == len(reference["losses"])
    diffs = [abs(a - b) for a, b in zip(reference["losses"], run["losses"])]
    assert max(diffs) <= TOLERANCE, diffs


def test_dp4_zero0_loses_a_host_then_two_in_a_row_then_one_during_recovery():
    """dp4, ZeRO-0: a host killed during step 4 (dp shrinks to 3; the 20 steps after it equal
    the reference); a spare keeping dp at 4; two losses in successive steps; a loss while the
    first is being recovered (the spare taken by the first, dp shrinking for the second)."""
    ref, shrunk, spared, twice, during = run_program([
        dict(mesh=[4], steps=24),
        dict(mesh=[4], steps=24, kills=[[4, 2]], seed=1),
        dict(mesh=[4], steps=10, kills=[[4, 1]], spares=[4], seed=2),
        dict(mesh=[4], steps=10, kills=[[4, 1], [5, 3]], seed=3),
        dict(mesh=[4], steps=10, kills=[[4, 1]], kill_in_recovery=2, spares=[4], seed=4),
    ], hosts=5)
    check_recovered(ref, shrunk, 1, [3])
    short = dict(ref, losses=ref["losses"][:10])
    check_recovered(short, spared, 1, [4])
    assert spared["events"][-1]["devices"] == [0, 4, 2, 3]  # the spare in the lost one's place
    check_recovered(short, twice, 2, [2])
    assert during["killed"][1]["recovering"], during["killed"]
    check_recovered(short, during, 2, [3])
    assert during["events"][-1]["devices"] == [0, 4, 3]


@pytest.mark.parametrize("zero", [2, 3])
def test_zero_sharded_state_comes_back_from_the_snapshot(zero):
    """ZeRO-2 (optimizer state and gradients sharded on dp) and ZeRO-3 (parameters too): the
    lost host's shard existed only there, and comes back from the snapshot's files."""
    ref, run = run_program([dict(mesh=[4], steps=24, zero=zero),
                            dict(mesh=[4], steps=24, zero=zero, kills=[[4, 1]], seed=zero)],
                           hosts=4)  # the 20 steps after the loss
    check_recovered(ref, run, 1, [3])


def test_a_batch_three_devices_cannot_share_evenly_goes_to_dp2_with_a_spare():
    """A global batch of 16 rows on dp4: after a loss dp is 2, not 3 (each step's batch stays
    whole and evenly split), and the device left over replaces the next loss."""
    ref, run = run_program([dict(mesh=[4], steps=10, zero=2, batch=16),
                            dict(mesh=[4], steps=10, zero=2, batch=16, kills=[[3, 2], [6, 0]],
                                 seed=8)], hosts=4)
    check_recovered(ref, run, 2, [2])
    first, second = [e for e in run["events"] if e["kind"] == "recovered"]
    assert first["devices"] == [0, 1] and second["devices"] == [3, 1], run["events"]


def test_a_step_with_dropout_re_runs_with_the_same_masks():
    """Dropout on dp4, a host lost in step 4 and a spare in its place: the snapshot keeps the
    random states, so the re-run steps draw the masks they drew and every loss is the
    reference's. (Where dp shrinks, the blocks and so the masks change: there a run is an
    uninterrupted one's in distribution only.)"""
    ref, run = run_program([dict(mesh=[4], steps=8, dropout=True),
                            dict(mesh=[4], steps=8, dropout=True, spares=[4], kills=[[4, 1]],
                                 every=2, seed=9)], hosts=5)
    check_recovered(ref, run, 1, [4])


def test_dp_tp_a_lost_tp_member():
    """dp2 x tp2: a lost tp member's place taken by a spare (the mesh keeps its shape), or its
    whole tp group dropped (dp shrinks to 1); on dp1 x tp2 with no spare nothing can recover:
    the error names why, and the last completed step's state reads back from the snapshot."""
    names = ["dp", "tp"]
    ref, spared, shrunk, ref12, stuck = run_program([
        dict(mesh=[2, 2], names=names, steps=10),
        dict(mesh=[2, 2], names=names, steps=10, kills=[[4, 3]], spares=[4], seed=5,
             trace=True),
        dict(mesh=[2, 2], names=names, steps=10, kills=[[4, 0]], seed=6),
        dict(mesh=[1, 2], names=names, steps=6, probe_after=[2, 3]),
        dict(mesh=[1, 2], names=names, steps=6, kills=[[4, 1]], read_snapshot=True,
             keep_snapshot=True, seed=7),
    ], hosts=5)
    check_recovered(ref, spared, 1, [2, 2])
    assert spared["events"][-1]["devices"] == [0, 1, 2, 4]
    # the trace recorded across the loss: the loss (a mark), the recovery (a span as long as
    # it took), and the new runtime's kernels, the spare's among them
    (lost, zero), (recovered, took) = spared["trace"]["spans"]
    assert lost.startswith("dtorch.elastic: lost at step") and "host 3 pid" in lost
    assert zero == 0 and recovered.startswith("dtorch.elastic: recovered at step")
    assert took == pytest.approx(spared["events"][-1]["seconds"] * 1e6, rel=1e-3)
    assert spared["trace"]["devices"] == [0, 1, 2, 4]
    check_recovered(ref, shrunk, 1, [1, 2])
    assert shrunk["events"][-1]["devices"] == [2, 3]
    error = stuck["error"]
    assert error is not None and len(stuck["losses"]) == 3, stuck
    assert "no spare device is left" in error["message"]
    # the last committed snapshot: step 3's, or step 2's when the kill in step 4 came while
    # step 3's was being written (every device writes a share of it): the reference's logits
    # after that step
    assert "host 1 pid" in error["message"] and error["step"] in (2, 3)
    assert error["logits"] == pytest.approx(ref12["probe"][str(error["step"])], abs=TOLERANCE)
    assert stuck["losses"] == pytest.approx(ref12["losses"][:3], abs=TOLERANCE)


# -- the rules, without a runtime ---------------------------------------------------------------
def test_remesh_spares_first_then_dp_shrinks_whole_slices():
    dp_tp = Layout([[0, 1], [2, 3]], (4, 5))
    assert remesh(dp_tp, [2], 0, True) == Layout([[0, 1], [4, 3]], (5,))
    # (in the mesh's order: the spares go to the lost devices from the first coordinate)
    assert remesh(dp_tp, [2, 1], 0, True) == Layout([[0, 4], [5, 3]], ())
    assert remesh(Layout([[0, 1], [2, 3]], ()), [3], 0, True) == Layout([[0, 1]], ())
    assert remesh(Layout([[0, 1], [2, 3]], ()), [1], 1, True) == Layout([[0], [2]], ())
    assert remesh(Layout([0, 1, 2, 3], ()), [1, 3], 0, True) == Layout([0, 2], ())
    # a lost spare leaves the pool; a device the mesh does not use changes nothing
    assert remesh(Layout([0, 1], (2, 3)), [2, 7], 0, True) == Layout([0, 1], (3,))
    with pytest.raises(Unrecoverable, match="shrink=False"):
        remesh(Layout([0, 1], ()), [1], 0, False)
    with pytest.raises(Unrecoverable, match="no data-parallel dim"):
        remesh(Layout([0, 1], ()), [1], None, True)
    with pytest.raises(Unrecoverable, match="last one"):
        remesh(Layout([[0, 1]], ()), [0], 0, True)


def test_grow_adds_whole_slices_up_to_the_start_size():
    assert grow(Layout([[0, 1]], ()), 2, 0, [0, 1, 5, 6, 7]) == Layout([[0, 1], [5, 6]], ())
    assert grow(Layout([[0, 1]], ()), 2, 0, [0, 1, 5]) == Layout([[0, 1]], ())  # half a slice
    assert grow(Layout([0, 2], ()), 4, 0, [0, 1, 2, 3]) == Layout([0, 2, 1, 3], ())
    # devices that joined first, then the spares; only to sizes that divide the batch's rows
    assert grow(Layout([0, 2], (9,)), 4, 0, [0, 2, 9, 8]) == Layout([0, 2, 8, 9], ())
    assert grow(Layout([0, 2], (9,)), 4, 0, [0, 2, 9, 8, 7]) == Layout([0, 2, 8, 7], (9,))
    assert grow(Layout([0, 2], ()), 4, 0, [0, 1, 2], rows=16) == Layout([0, 2], ())  # not 3
    assert grow(Layout([0, 2], ()), 4, 0, [0, 1, 2, 3], rows=12) == Layout([0, 2, 1, 3], ())
    assert grow(Layout([0, 2], ()), 4, 0, [0, 1, 2, 3], rows=6) == Layout([0, 2, 1], ())


def test_dp_shrinks_to_a_size_that_divides_the_batch_and_keeps_the_rest_as_spares():
    assert fit(Layout([0, 1, 2], ()), 0, 16) == Layout([0, 1], (2,))
    assert fit(Layout([0, 1, 2], ()), 0, 12) == Layout([0, 1, 2], ())
    assert fit(Layout([0, 1, 2], (7,)), 0, 5) == Layout([0], (7, 2, 1))  # last slice first
    assert fit(Layout([[0, 1], [2, 3], [4, 5]], ()), 0, 4) == Layout([[0, 1], [2, 3]], (4, 5))
    assert fit(Layout([[0, 1, 2], [3, 4, 5]], ()), 1, 4) == Layout([[0, 1], [3, 4]], (2, 5))
    assert fit(Layout([[0, 1], [2, 3]], ()), None, 3) == Layout([[0, 1], [2, 3]], ())
    assert fit(Layout([0, 1, 2], ()), 0, None) == Layout([0, 1, 2], ())
    # a loss after it takes a spare the fit left: dp stays
    assert remesh(fit(Layout([0, 1, 2], ()), 0, 16), [0], 0, True) == Layout([2, 1], ())


# -- snapshots, in this session's runtime -------------------------------------------------------
class Net(dtorch.nn.Module):
    def __init__(self, mesh, tp: bool):
        super().__init__()
        col = [Shard(0) if tp else Replicate()] + [Replicate()] * (mesh.ndim - 1)
        self.w = dtorch.nn.Parameter(dtorch.randn(6, 5, device_mesh=mesh, placements=col))
        self.b = dtorch.nn.Parameter(dtorch.zeros(6, device_mesh=mesh,
                                                  placements=[Replicate()] * mesh.ndim))
        self.register_buffer("seen", torch.zeros(2))  # a torch buffer: the client's

    def forward(self, x):
        return x @ self.w.t() + self.b


def make(mesh, zero: int, tp: bool = False):
    net = Net(mesh, tp)
    opt = dtorch.optim.AdamW(net.parameters(), lr=0.1, zero_stage=zero)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    return {"net": net, "opt": opt, "sched": sched}


def train(state, steps: int, mesh) -> None:
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        x = dtorch.from_torch(torch.randn(4, 5, generator=g), mesh, [Replicate()] * mesh.ndim)
        state["net"](x).square().mean().backward()
        state["opt"].step()
        state["opt"].zero_grad()
        state["sched"].step()
        state["net"].seen += 1


@pytest.mark.parametrize("zero", [0, 2])
def test_a_snapshot_restores_on_another_layout_bit_for_bit(tmp_path, zero):
    """Taken on dp2 (ZeRO as given), restored on one device and on a tp2 x dp1 mesh: the
    parameters, the optimizer's moments and step counts, the scheduler and the client's buffer
    are those of the snapshot's call, not of the steps after it; and the restored state trains
    on as the original does."""
    dp2 = dtorch.DeviceMesh("cpu", [0, 1], mesh_dim_names=["dp"])
    state = make(dp2, zero)
    train(state, 2, dp2)
    shot = snapshots.take(state, 2, str(tmp_path))
    expect = {k: v.to_torch() for k, v in state["net"].state_dict().items()
              if isinstance(v, dtorch.Tensor)}
    moments = {k: v.to_torch() for k, v in state["opt"].state[state["net"].w].items()
               if isinstance(v, dtorch.Tensor)}
    train(state, 1, dp2)  # after the call: not in the snapshot
    shot.future.result()
    for mesh, tp in [(dtorch.DeviceMesh("cpu", [0], mesh_dim_names=["dp"]), False),
                     (dtorch.DeviceMesh("cpu", [[1], [0]], mesh_dim_names=["tp", "dp"]), True)]:
        fresh = make(mesh, zero, tp)
        snapshots.restore(fresh, shot, str(tmp_path))
        for k, v in expect.items():
            assert torch.equal(fresh["net"].state_dict()[k].to_torch(), v), k
        got = fresh["opt"].state[fresh["net"].w]
        for k, v in moments.items():
            assert torch.equal(got[k].to_torch(), v), k
            assert list(got[k].placements) == fresh["opt"].update_layout(fresh["net"].w)
        assert float(got["step"]) == 2.0
        assert fresh["sched"].last_epoch == 2 and fresh["opt"].param_groups[0]["lr"] == 0.025
        assert fresh["net"].seen.tolist() == [2.0, 2.0]
    # trains on as the original did from the snapshot: one more step each
    again = make(dp2, zero)
    snapshots.restore(again, shot, str(tmp_path))
    train(again, 1, dp2)
    torch.testing.assert_close(again["net"].w.to_torch(), state["net"].w.to_torch(),
                               rtol=0, atol=0)


def test_state_with_dtorch_tensors_outside_a_module_or_optimizer_is_refused(tmp_path):
    class Holder:
        def state_dict(self):
            return {"t": dtorch.zeros(2)}

    with pytest.raises(TypeError, match="holds dtorch tensors"):
        snapshots.take({"h": Holder()}, 0, str(tmp_path))
    with pytest.raises(TypeError, match="is a int"):
        snapshots.take({"n": 3}, 0, str(tmp_path))


def test_an_error_in_the_step_is_the_programs_and_the_run_goes_on():
    """Not a loss: a ValueError in the step reaches the program, nothing is recovered, and the
    next step runs on the same mesh."""
    def build(mesh):
        net = dtorch.nn.Linear(3, 1, device_mesh=mesh)
        return {"net": net, "opt": dtorch.optim.SGD(net.parameters(), lr=0.1)}

    def step(state, x):
        loss = state["net"](x).square().mean()
        loss.backward()
        state["opt"].step()
        state["opt"].zero_grad()
        return loss

    def bad(state, x):
        return state["net"](x.reshape(3, 7))

    with dtorch.elastic.Elastic(build, (2,), ["dp"]) as run:
        step_one = run.step(step, torch.ones(6, 3))
        with pytest.raises(RuntimeError, match="shape"):
            run.step(bad, torch.ones(6, 3))
        assert run.steps == 1 and not run.events
        assert run.step(step, torch.ones(6, 3)) < step_one
        assert run.steps == 2


def test_elastic_arguments_are_checked():
    with pytest.raises(ValueError, match="differ in length"):
        dtorch.elastic.Elastic(dict, (2, 2), ["dp"])
    with pytest.raises(ValueError, match="do not fill"):
        dtorch.elastic.Elastic(dict, (2,), ["dp"], devices=[0, 1, 2])
    with pytest.raises(ValueError, match="snapshot_every"):
        dtorch.elastic.Elastic(dict, (2,), ["dp"], snapshot_every=0)
    with pytest.raises(TypeError, match="dict of named state"):
        dtorch.elastic.Elastic(lambda mesh: [mesh], (2,), ["dp"])
