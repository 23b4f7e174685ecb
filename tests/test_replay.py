"""Replay of repeated runs (controller/replay.py).

Without a runtime: a replayed window's host records are exactly what the passes make of it, and
a window that does not qualify is lowered by the passes. With the runtime: loops run with replay
are bit-identical to torch eager and to the same program with replay off, and an error inside a
replayed stretch names its line.
"""

import copy
import inspect
import os
import re
import time

import pytest
import torch

import dtorch
from dtorch import config, protocol as P
from dtorch.controller import replay
from dtorch.controller.logical_graph import LogicalGraph
from dtorch.controller.main import Controller
from dtorch.client import session
from dtorch.controller.replay import Replayer, periodic, windows
from helpers import runtime_with
from replay_lowering import run_passes


def make_graph():
    g = LogicalGraph()
    g.define([P.DEFINE_MESH, 1, "cpu", [2], [0, 1]])
    g.define([P.DEFINE_SPEC, 1, [4, 3], "float32", 1, ["S0"]])
    g.define([P.DEFINE_SPEC, 2, [4, 3], "float32", 1, ["R"]])
    g.define([P.DEFINE_CALL, 1, "mul", [1, 0], [1], b"", 0])  # S0 * scalar
    g.define([P.DEFINE_CALL, 2, "add_", [1, 1], [1], b"", P.INPLACE])
    g.define([P.DEFINE_CALL, 3, None, [1], [2], b"", 0, P.CallKind.REDISTRIBUTE])
    g.define([P.DEFINE_CALL, 4, "add", [1, 1], [1], b"", 0])
    g.define([P.DEFINE_CALL, 5, "transpose", [1], [1], b"", P.VIEW])
    g.define([P.DEFINE_CALL, 6, "mul", [2, 0], [2], b"", 0])  # R * scalar
    return g


class Ids:
    def __init__(self, first=100):
        self.next = first

    def __call__(self):
        self.next += 1
        return self.next


def op(call, site, out, *operands):
    return [P.OP, call, site, 0, out, *operands]


def lower_both(batches, monkeypatch, window=8, hold=False):
    """Each batch through a Replayer, and through one that never replays (every window goes
    through the passes): both outputs (host records), and how many windows were replayed.
    ``hold``: as the controller runs them (a batch's tail waits for the next; the last is let
    go at the end)."""
    monkeypatch.setattr(replay, "MIN_WINDOW", window)
    monkeypatch.setattr(config, "replay", True)
    outputs, hits = [], 0
    for replays in (True, False):
        g = make_graph()
        r = Replayer(g, run_passes(g), Controller.encode)
        if not replays:
            r.advance = lambda *args: False
        out = []
        for batch in copy.deepcopy(batches):
            r.run(batch, out, hold)
            hits += r.replayed if replays else 0
        r.run([], out)
        outputs.append(out)
    return outputs[0], outputs[1], hits


def run_symbolically(g, records) -> dict:
    """What the hosts would hold after ``records``: each live id's value as an expression
    (call, result index, operands' expressions, stream), a Replay expanded by its program's
    definition."""
    env, programs = {}, {}

    def value(t):
        return env.get(t, ("outside", t))

    def kernel(rec):
        call = g.calls[rec[P.OP_CALL]]
        n = len(call.outputs)
        operands = tuple(value(o) if spec else ("scalar", o)
                         for o, spec in zip(P.op_operands(rec, n), call.inputs))
        for k, t in enumerate(P.op_outs(rec, n)):
            env[t] = (call.id, k, operands, rec[P.OP_STREAM])

    for rec in records:
        if type(rec) is int:
            env.pop(rec, None)
        elif P.is_definition(rec):  # a redistribute step's call shape
            g.define(list(rec))
        elif rec[0] == P.KERNEL:
            kernel(rec)
        elif rec[0] == P.CHAIN:  # the links between its kernels get no blob
            members = P.items(rec)
            for m in members:
                kernel(m)
            for m in members[:-1]:
                env.pop(m[P.OP_OUTS])
        elif rec[0] == P.DEFINE_PROGRAM:
            programs[rec[1]] = P.DefineProgram(*rec)
        elif rec[0] == P.REPLAY:
            d = programs[rec[1]]
            outside = rec[2:2 + d.n_outside]
            made = rec[2 + d.n_outside:2 + d.n_outside + d.n_made]
            scalars = rec[2 + d.n_outside + d.n_made:]

            def tensor(ref, made=made, outside=outside):
                return made[ref] if ref >= 0 else outside[-1 - ref]

            for call_id, site, stream, outs, operands in d.steps:
                call = g.calls[call_id]
                values = [tensor(r) if spec else scalars[r]
                          for r, spec in zip(operands, call.inputs)]
                kernel([P.KERNEL, call_id, site, stream, *map(tensor, outs), *values])
            alive = set(d.survivors)
            for t in [outside[j] for j in d.released] + [
                    t for k, t in enumerate(made) if k not in alive]:
                env.pop(t, None)
    return env


def assert_same(replayed, lowered):
    assert run_symbolically(make_graph(), replayed) == run_symbolically(make_graph(), lowered)


def tensor_tensor_loop(ids, n, x, b):
    """``x = x + b`` n times: an operator and the release of the x before it."""
    out = []
    for _ in range(n):
        y = ids()
        out += [op(4, 7, y, x, b), x]
        x = y
    return out, x


def scalar_chain_loop(ids, n, x):
    """``x = x * 0.5; x = x * 2.0`` n times."""
    out = []
    for k in range(n):
        y, z = ids(), ids()
        out += [op(1, 8, y, x, 0.5 + k), x, op(1, 9, z, y, 2.0), y]
        x = z
    return out, x


def test_period_and_windows():
    keys = [5, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1]  # other work, then a period of 3
    assert periodic(keys) == (1, 14, 3)
    assert periodic([1, 2, 3, 4, 5, 6, 7, 8]) is None
    # two releases in a row repeat with period 1, briefly: the period of 6 is the one that holds
    keys = [9, 9] + [1, 2, -1, 3, -1, -1] * 8
    assert periodic(keys, min_length=24) == (2, len(keys), 6)


def test_windows_of_a_loop_have_one_shape_wherever_the_batch_cuts_it(monkeypatch):
    """A loop's windows start at the cut the fewest tensors cross (replay.phase), so batches
    that cut the loop anywhere replay one program, not one per phase; and its temporaries'
    lives stay inside a window."""
    monkeypatch.setattr(replay, "MIN_WINDOW", 8)
    g = make_graph()
    shapes = set()
    for offset in range(4):
        ids = Ids()
        body, _ = scalar_chain_loop(ids, 30, 1)
        batch = [op(4, 5, ids(), 1, 2)] + body[offset:]  # other work, then the loop from anywhere
        for start, end, is_window in windows(batch, g.calls):
            if is_window:
                key, outside, made, _ = replay.shape_of(g.calls, batch[start:end])
                shapes.add((key, len(outside)))
    assert len(shapes) == 1
    (_, n_outside), = shapes
    assert n_outside == 1  # one tensor crosses a cut: the chain's x


def test_windows_cover_the_batch_in_order(monkeypatch):
    monkeypatch.setattr(replay, "MIN_WINDOW", 4)
    ids = Ids()
    batch, _ = tensor_tensor_loop(ids, 20, 1, 2)
    batch = [[P.SYNC, 1], *batch, [P.FETCH, 3, 9]]
    cuts = windows(batch, make_graph().calls)
    # the sync, then the loop up to the period's phase (replay.phase), lowered as usual
    assert cuts[0][0] == 0 and not cuts[0][2] and 1 <= cuts[0][1] < 1 + 4
    assert cuts[-1][1] == len(batch)
    assert all(a[1] == b[0] for a, b in zip(cuts, cuts[1:]))
    assert sum(w for _, _, w in cuts) >= 3 and all(e - s == 4 for s, e, w in cuts if w)


def test_replayed_windows_equal_the_passes(monkeypatch):
    ids = Ids()
    first, x = tensor_tensor_loop(ids, 50, 1, 2)
    second, x = tensor_tensor_loop(ids, 37, x, 2)  # a batch cut elsewhere in the period
    third, _ = scalar_chain_loop(ids, 40, x)
    replayed, lowered, hits = lower_both([first, second, third], monkeypatch)
    assert_same(replayed, lowered)
    assert hits >= 20
    assert sum(type(r) is not int and r[0] == P.REPLAY for r in replayed) == hits


def test_a_batch_that_ends_inside_a_loop_holds_its_tail_for_the_next(monkeypatch):
    """With ``hold`` the records after a batch's last window wait for the next batch, where they
    begin a window: more windows replay, and the hosts get the same work; a tail with anything
    but operators and releases (a sync) is not held."""
    ids = Ids()
    batches, x = [], 1
    for n in (50, 37, 45, 29):  # each batch cut elsewhere in the period
        batch, x = tensor_tensor_loop(ids, n, x, 2)
        batches.append(batch)
    replayed, lowered, hits = lower_both(batches, monkeypatch, hold=True)
    assert_same(replayed, lowered)
    assert hits > lower_both(batches, monkeypatch)[2]
    g = make_graph()
    r = Replayer(g, run_passes(g), Controller.encode)
    r.run(copy.deepcopy(batches[0]), [], hold=True)
    assert r.held
    r.run(copy.deepcopy(batches[1]) + [[P.SYNC, 1]], [], hold=True)
    assert not r.held


def test_dead_code_inside_windows_is_dropped_as_the_passes_drop_it(monkeypatch):
    ids = Ids()
    batch, x = [], 1
    for _ in range(40):
        y, dead = ids(), ids()
        batch += [op(4, 7, y, x, 2), op(1, 8, dead, y, 3.0), dead, x]  # ``dead`` is never read
        x = y
    replayed, lowered, hits = lower_both([batch], monkeypatch)
    assert_same(replayed, lowered)
    assert hits
    programs = [P.DefineProgram(*r) for r in replayed if type(r) is not int and
                r[0] == P.DEFINE_PROGRAM]
    assert programs and all(step[0] == 4 for d in programs for step in d.steps)  # no mul


def test_in_place_loops_replay(monkeypatch):
    batch = []
    for _ in range(40):
        batch += [op(2, 5, 1, 1, 2)]  # acc.add_(b)
    replayed, lowered, hits = lower_both([batch, copy.deepcopy(batch)], monkeypatch)
    assert_same(replayed, lowered)
    assert hits


def test_views_made_and_dropped_in_a_window_replay(monkeypatch):
    ids = Ids()
    batch, x = [], 1
    for _ in range(40):
        v, y = ids(), ids()
        batch += [op(5, 3, v, x), op(4, 7, y, v, 2), v, x]
        x = y
    replayed, lowered, hits = lower_both([batch], monkeypatch)
    assert_same(replayed, lowered)
    assert hits


def test_a_view_that_outlives_its_window_is_not_replayed(monkeypatch):
    """Its storage is its base's, which the stream state would have to follow."""
    ids = Ids()
    batch, x = [], 1
    for _ in range(40):
        v, y = ids(), ids()
        batch += [op(5, 3, v, x), op(4, 7, y, x, 2), x]  # v is never released
        x = y
    replayed, lowered, hits = lower_both([batch, copy.deepcopy(batch)], monkeypatch)
    assert replayed == lowered and hits == 0


def test_an_input_written_on_another_stream_replays_once_waited_for(monkeypatch):
    """A loop reading a gathered value (written on the communication stream): the first window
    waits for the collective and is lowered by the passes; the windows after it replay, since
    the compute stream has waited already. The collective after the loop still waits for the
    loop's compute stream."""
    ids = Ids()
    gathered = ids()
    batch, acc = [op(3, 1, gathered, 1)], 2
    for _ in range(40):
        y = ids()
        batch += [op(6, 7, y, gathered, 2.0), acc]
        acc = y
    batch += [op(3, 2, ids(), 1)]  # redistribute again
    loop, last = tensor_tensor_loop(ids, 40, 3, 2)
    replayed, lowered, hits = lower_both([batch], monkeypatch)
    assert_same(replayed, lowered)
    assert hits
    replayed, lowered, hits = lower_both([batch, loop + [op(3, 2, ids(), last)]], monkeypatch)
    assert_same(replayed, lowered)
    assert [P.WAIT, 1] in replayed  # the last redistribute waits for the compute stream


def test_an_input_written_in_place_after_another_streams_read_is_not_replayed(monkeypatch):
    """``acc.add_(b)`` where the communication stream has read ``acc`` since its last write: the
    write must wait for that read, so the window goes through the passes."""
    batch = [op(2, 5, 1, 1, 2) for _ in range(40)] + [op(3, 1, 50, 1)]  # then all-gather acc
    second = [op(2, 5, 1, 1, 2) for _ in range(40)]
    replayed, lowered, hits = lower_both([batch, second], monkeypatch)
    assert_same(replayed, lowered)
    after_gather = replayed[replayed.index(next(r for r in replayed if type(r) is not int and
                                                r[0] == P.KERNEL and r[1] < 0)) + 1:]
    assert after_gather[0] == [P.WAIT, 0]  # the first add_ after it waits for the gather
    assert not any(type(r) is not int and r[0] == P.REPLAY for r in after_gather[:2])


def test_a_window_after_a_graph_switch_is_not_replayed_from_the_other_graph(monkeypatch):
    """The same loop under two dtorch.Graphs, the second batch's operators on the other graph:
    each graph's windows run on its own compute stream (a program is keyed by its graph)."""
    ids = Ids()
    first, x = tensor_tensor_loop(ids, 40, 1, 2)
    second, _ = tensor_tensor_loop(ids, 40, x, 2)
    for rec in second:  # issued on graph 1
        if type(rec) is not int and rec[0] == P.OP:
            rec[P.OP_STREAM] = 1
    replayed, lowered, hits = lower_both([first, second], monkeypatch)
    assert_same(replayed, lowered)  # (expressions carry their kernels' streams)
    assert hits


# -- with the runtime ------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def replaying():
    """This module's runtime replays, whatever mode the suite runs in (a runtime of its own
    only when the suite runs with DTORCH_REPLAY=0)."""
    saved, config.replay = config.replay, True
    if os.environ.get("DTORCH_REPLAY", "1") != "0":
        yield
    else:
        with runtime_with(DTORCH_REPLAY="1"):
            yield
    config.replay = saved


@pytest.fixture
def replay_off():
    """A runtime whose controller never replays."""
    saved = config.replay
    config.replay = False
    with runtime_with(DTORCH_REPLAY="0"):
        yield
    config.replay = saved


def loops(mesh, lib):
    """Loops of each kind a replay must get right, returning their results (dtorch or torch)."""
    if lib is torch:
        ones, arange = torch.ones, torch.arange
    else:
        def ones(*shape):
            return dtorch.ones(*shape, device_mesh=mesh)

        def arange(n):
            return dtorch.arange(float(n), device_mesh=mesh)
    b = arange(8)
    a = ones(8)
    for _ in range(3000):
        a = a * 0.999 + b  # tensor-scalar and tensor-tensor, a chain
    acc = ones(8)
    for k in range(2000):
        acc.add_(b, alpha=1.0 / (k + 1))  # in place, its scalar new each time
    x = ones(4, 8)
    for _ in range(1500):
        x = (x.t() * 1.001).t() + 0.5  # views inside the loop
    m = ones(8)
    for _ in range(1500):
        m = torch.maximum(m, b - 3.0) if lib is torch else dtorch.maximum(m, b - 3.0)
        dead = m * 2  # noqa: F841 - never read: dead code in every window
    return [a, acc, x, m]


def replayed_windows(prof) -> int:
    """Windows the controller replayed while ``prof`` recorded (its passes' spans say)."""
    found = [re.search(r"(\d+) windows replayed", e["name"]) for e in prof.events
             if e.get("ph") == "X"]
    return sum(int(m[1]) for m in found if m)


def test_loops_equal_torch_with_replay(one):
    with dtorch.profiler.profile() as prof:
        got = [t.to_torch() for t in loops(one, dtorch)]
    assert replayed_windows(prof) >= 20
    expected = loops(None, torch)
    for g, e in zip(got, expected):
        assert torch.equal(g, e)


@pytest.fixture
def runtime_of_its_own():
    """A runtime for one test: a client flusher told to wait a minute for a batch's company
    sleeps on after the test, and would hold back later tests' batches as long."""
    with runtime_with(DTORCH_REPLAY="1"):
        yield


def test_a_held_tail_runs_without_a_next_batch(one, monkeypatch, runtime_of_its_own):
    """The tail a batch holds for the next one (``Replayer.run``) is lowered alone once no batch
    has come for ``HOLD_MS``: the devices run it before the program's next call."""
    monkeypatch.setattr(config, "flush_delay_s", 60.0)  # the batches: 4096 records, then ours
    # and no flow-control mark among them: one falls after every max_inflight_ops / 4 records
    # a session has sent, and a mark sent after our last batch would take the tail along
    # before the controller could let it go alone
    monkeypatch.setattr(config, "max_inflight_ops", 10**9)
    a, b = dtorch.ones(8, device_mesh=one), dtorch.arange(8.0, device_mesh=one)
    with dtorch.profiler.profile() as prof:
        for _ in range(3000):
            a = a * 0.999 + b
        c = a - 1.0  # not the loop's: the last batch ends with a tail after its last window
        session.current().flush()
        time.sleep(0.5)  # no call: the controller alone has to let the tail go
        dtorch.sync()
    passes = [e for e in prof.events if e.get("ph") == "X" and e["name"].startswith("passes")]
    # (a slow machine may let a tail go between two of the loop's batches too: the controller
    # lets it go whenever it wakes without a batch, and batches may come more than HOLD_MS apart)
    alone = [e for e in passes if e["name"].startswith("passes: 0 records")]
    assert alone, [e["name"] for e in passes]
    assert alone[-1]["ts"] + 300_000 < passes[-1]["ts"]  # long before the sync's batch (in us)
    t = torch.ones(8)
    for _ in range(3000):
        t = t * 0.999 + torch.arange(8.0)
    assert torch.equal(c.to_torch(), t - 1.0)


def test_loops_equal_with_replay_off(replay_off):
    one = dtorch.DeviceMesh("cpu", [0])
    expected = loops(None, torch)
    with dtorch.profiler.profile() as prof:
        got = [t.to_torch() for t in loops(one, dtorch)]
    assert replayed_windows(prof) == 0
    for g, e in zip(got, expected):
        assert torch.equal(g, e)


def test_loops_on_a_sharded_mesh(mesh1):
    """Replay on 3 devices, Shard(0) of an uneven size: the windows run on every device."""
    x = dtorch.ones(10, device_mesh=mesh1, placements=[dtorch.Shard(0)])
    b = dtorch.arange(10.0, device_mesh=mesh1, placements=[dtorch.Shard(0)])
    tx, tb = torch.ones(10), torch.arange(10.0)
    with dtorch.profiler.profile() as prof:
        for _ in range(3000):
            x = x * 0.5 + b
            tx = tx * 0.5 + tb
        got = x.to_torch()
    assert replayed_windows(prof) >= 5
    assert torch.equal(got, tx)


def test_an_error_inside_replayed_windows_names_its_line(one):
    zero = dtorch.zeros(4, dtype=torch.int64, device_mesh=one)
    x = dtorch.ones(4, dtype=torch.int64, device_mesh=one)
    acc = dtorch.zeros(4, dtype=torch.int64, device_mesh=one)
    for _ in range(2000):
        acc = acc + x
    line = inspect.currentframe().f_lineno + 3
    # enough windows for the host to run them as generated code (program.STRAIGHT_AFTER)
    for _ in range(5000):
        acc = acc + x // zero  # fails on the host, every time
    with pytest.raises(RuntimeError, match="floor_divide") as info:
        acc.to_torch()
    assert f"test_replay.py:{line}" in str(info.value)
    dtorch.sync()
    assert torch.equal((x * 3).to_torch(), torch.full((4,), 3))  # the runtime goes on


# -- random loop bodies -------------------------------------------------------------------------------
# Each op maps the loop's state (x, y) to a new state with values kept bounded. ``lib`` is torch
# or dtorch, for the few functions that are not Tensor methods.
BODY_OPS = [
    lambda lib, x, y: (x.sin(), y),
    lambda lib, x, y: (x * 0.5 + y * 0.25, y),
    lambda lib, x, y: (x, (y + 1.0).tanh()),
    lambda lib, x, y: (lib.maximum(x, y) - 0.1, y),
    lambda lib, x, y: (lib.where(x > y, x, y * 0.5), y),
    lambda lib, x, y: (x.clamp(-1.5, 1.5), y.sigmoid()),
    lambda lib, x, y: (x.abs().sqrt(), y),
    lambda lib, x, y: (x - x.mean(dim=0, keepdim=True), y),  # a reduction
    lambda lib, x, y: (x, y + x.sum(dim=1, keepdim=True) * 0.01),
    lambda lib, x, y: (x.max(dim=0, keepdim=True).values * 0.5 + x * 0.5, y),  # 2 results
    lambda lib, x, y: (x.mul_(0.9), y),  # in place
    lambda lib, x, y: (x.add_(y, alpha=0.1), y),
    lambda lib, x, y: (x, y.t().contiguous().t() * 0.99),  # views
    lambda lib, x, y: ((x + y).cos(), y - 0.01),
]


def run_body(lib, x, y, body, n):
    for _ in range(n):
        for k in body:
            x, y = BODY_OPS[k](lib, x, y)
    return x, y


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("layout", ["one", "sharded"])
def test_random_loop_bodies_equal_torch(seed, layout, one, mesh1):
    g = torch.Generator().manual_seed(seed)
    body = torch.randint(len(BODY_OPS), (int(torch.randint(2, 7, (1,), generator=g)),),
                         generator=g).tolist()
    x0, y0 = torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g)
    expected = run_body(torch, x0.clone(), y0.clone(), body, 300)
    mesh, placements = (one, [dtorch.Replicate()]) if layout == "one" else \
        (mesh1, [dtorch.Shard(1)])
    x = dtorch.from_torch(x0, device_mesh=mesh, placements=placements)
    y = dtorch.from_torch(y0, device_mesh=mesh, placements=placements)
    with dtorch.profiler.profile() as prof:
        got = [t.to_torch() for t in run_body(dtorch, x, y, body, 300)]
    for g_, e in zip(got, expected):
        if layout == "one":
            assert torch.equal(g_, e), body
        else:
            torch.testing.assert_close(g_, e, atol=1e-5, rtol=1e-5)
    if layout == "one":
        assert replayed_windows(prof) > 0, body


def test_a_kernel_that_fails_in_hot_windows_spares_what_does_not_depend_on_it(one):
    """Windows replayed often enough to run as generated code (``program.STRAIGHT_AFTER``),
    where one kernel raises every time: its results carry the error, named at its line, and
    the loop's other work goes on right."""
    zero = dtorch.zeros(4, dtype=torch.int64, device_mesh=one)
    x = dtorch.ones(4, dtype=torch.int64, device_mesh=one)
    acc, kept = dtorch.zeros(4, dtype=torch.int64, device_mesh=one), []
    with dtorch.profiler.profile() as prof:
        for _ in range(3000):
            acc = acc + x
            kept.append(x // zero + 1); line = inspect.currentframe().f_lineno  # // fails
            acc = acc * 1
        with pytest.raises(RuntimeError, match="floor_divide") as info:  # told at the next wait
            dtorch.sync()
        assert "more kernel errors" not in str(info.value)  # the add carried it on, quietly
    assert replayed_windows(prof) > 32
    assert torch.equal(acc.to_torch(), torch.full((4,), 3000))
    for t in (kept[0], kept[-1]):
        with pytest.raises(RuntimeError, match="floor_divide") as info:
            t.to_torch()
        assert f"test_replay.py:{line}" in str(info.value)
    dtorch.sync()


def test_a_failed_input_poisons_the_replayed_windows_quietly(one):
    """An input that failed before the loop: every window reading it carries that failure on,
    and the client hears of it once, at the line that failed."""
    zero = dtorch.zeros(4, dtype=torch.int64, device_mesh=one)
    bad = dtorch.ones(4, dtype=torch.int64, device_mesh=one) // zero; line = inspect.currentframe().f_lineno
    acc = dtorch.zeros(4, dtype=torch.int64, device_mesh=one)
    with dtorch.profiler.profile() as prof:
        for _ in range(5000):  # (windows enough to run as generated code: STRAIGHT_AFTER)
            acc = acc + bad
        with pytest.raises(RuntimeError, match="floor_divide") as info:
            acc.to_torch()
    assert f"test_replay.py:{line}" in str(info.value)
    assert replayed_windows(prof) > 0
    with pytest.raises(RuntimeError, match="floor_divide"):
        (acc + 1).to_torch()
    dtorch.sync()


def test_a_tensor_of_an_earlier_runtime_read_in_replayed_windows(one):
    """A host that lacks a replay's outside input expands the replay into its records, which
    report the missing operand as usual (and the runtime goes on)."""
    stale = dtorch.ones(4, device_mesh=one)
    stale.to_torch()
    dtorch.shutdown()
    one = dtorch.DeviceMesh("cpu", [0])
    acc = dtorch.zeros(4, device_mesh=one)
    with dtorch.profiler.profile() as prof:
        for _ in range(2000):
            acc = acc + stale
        with pytest.raises(RuntimeError, match="not on this runtime"):
            acc.to_torch()
    assert replayed_windows(prof) > 0
    dtorch.sync()
    assert torch.equal((dtorch.ones(4, device_mesh=one) * 2).to_torch(), torch.full((4,), 2.0))
