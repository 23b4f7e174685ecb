"""Controller passes on hand-built batches: which kernels each pass leaves, and that each pass
is named in the controller's DEBUG log and the trace (no runtime of the session's)."""

import logging
import os
import pathlib
import re
import subprocess
import sys

import pytest

from dtorch import protocol as P
from dtorch.controller.logical_graph import LogicalGraph, Operator
from dtorch.controller.passes import (
    PASSES,
    Chain,
    assign_streams,
    eliminate_dead_code,
    fuse_chains,
    lower_redistribute,
    run_passes,
)
from dtorch.controller.streams import COMM_STREAM, compute_stream


pytestmark = pytest.mark.no_runtime  # (conftest syncs after the other tests)


def make_graph(n_devices=2):
    g = LogicalGraph()
    g.define([P.DEFINE_MESH, 1, "cpu", [n_devices], list(range(n_devices))])
    g.define([P.DEFINE_SPEC, 1, [4, 3], "float32", 1, ["S0"]])
    g.define([P.DEFINE_SPEC, 2, [4, 3], "float32", 1, ["R"]])
    g.define([P.DEFINE_CALL, 1, "mul", [1, 0], [1], b"", 0])  # S0 * scalar
    g.define([P.DEFINE_CALL, 2, "add_", [1, 1], [1], b"", P.INPLACE])
    g.define([P.DEFINE_CALL, 3, None, [1], [2], b"", 0, P.CallKind.REDISTRIBUTE])
    g.define([P.DEFINE_CALL, 4, "add", [2, 2], [2], b"", 0])
    return g


def op(g, call, out, *operands, graph=0):
    return Operator(g.calls[call], [P.OP, call, 0, graph, out, *operands])


def kinds(nodes):
    out = []
    for n in nodes:
        if isinstance(n, Operator):
            out.append(n.call.op)
        elif isinstance(n, Chain):
            out.append("chain(" + ",".join(m.call.op for m in n.members) + ")")
        elif type(n) is int:
            out.append(f"release {n}")
        else:
            out.append(f"tag {n[0]}")
    return out


def test_dead_chain_is_dropped_with_its_releases():
    g = make_graph()
    nodes = [op(g, 1, 11, 10, 2.0), op(g, 1, 12, 11, 3.0), 11, 12]
    assert eliminate_dead_code(g, nodes) == []


def test_read_results_and_in_place_ops_stay():
    g = make_graph()
    nodes = [op(g, 1, 11, 10, 2.0), [P.FETCH, 11, 1], 11, op(g, 2, 10, 10, 10)]
    assert kinds(eliminate_dead_code(g, nodes)) == ["mul", f"tag {P.FETCH}", "release 11", "add_"]


def test_redistribute_lowers_to_collective_on_the_comm_stream():
    g = make_graph()
    nodes = lower_redistribute(g, [op(g, 3, 11, 10)])
    # the step's call shape is defined to the hosts first
    assert kinds(nodes) == [f"tag {P.DEFINE_CALL}", "step:all_gather"]
    nodes = assign_streams(g, nodes)
    assert nodes[1].stream == COMM_STREAM and nodes[1].waits is None
    # a compute kernel reading the gathered value waits for the comm stream once
    g.define([P.DEFINE_CALL, 5, "mul", [2, 0], [2], b"", 0])
    a, b = op(g, 5, 12, 11, 2.0), op(g, 5, 13, 11, 3.0)
    assign_streams(g, [a, b])
    assert a.stream == compute_stream(0) and a.waits == [COMM_STREAM] and b.waits is None


def test_chains_fuse_and_drop_internal_releases():
    g = make_graph()
    nodes = [op(g, 1, 11, 10, 2.0), op(g, 1, 12, 11, 3.0), 11, op(g, 1, 13, 12, 4.0), 12, 99]
    nodes = fuse_chains(g, assign_streams(g, nodes))
    assert kinds(nodes) == ["chain(mul,mul,mul)", "release 99"]


def test_a_result_read_twice_or_fetched_breaks_the_chain():
    g = make_graph()
    nodes = [op(g, 1, 11, 10, 2.0), op(g, 1, 12, 11, 3.0), op(g, 1, 13, 11, 4.0), 11]
    assert kinds(fuse_chains(g, assign_streams(g, nodes))) == ["mul", "mul", "mul", "release 11"]
    nodes = [op(g, 1, 11, 10, 2.0), op(g, 1, 12, 11, 3.0), [P.FETCH, 11, 1, 1], 11]
    assert kinds(fuse_chains(g, nodes)) == ["mul", "mul", f"tag {P.FETCH}", "release 11"]


def test_in_place_ops_do_not_fuse():
    g = make_graph()
    nodes = [op(g, 1, 11, 10, 2.0), op(g, 2, 11, 11, 10), 11]
    assert kinds(fuse_chains(g, assign_streams(g, nodes))) == ["mul", "add_", "release 11"]


# -- assign_streams: ordering across graphs and streams -------------------------------------------
# Stream kinds: the compute streams of graphs 0 and 1 (A, B) and the communication stream. The
# calls below are stand-ins chosen by flags alone, which is all the pass reads: a collective
# read (COMM), an in-place collective (COMM | INPLACE, as torch's all_reduce on a tensor), a
# compute read, an in-place compute write, a factory and a view. A kernel's ``waits`` is the
# WAIT record the controller puts before it: ``[WAIT, *waits]``.

STREAMS = {"A": compute_stream(0), "B": compute_stream(1), "comm": COMM_STREAM}
READ, WRITE, MAKE, VIEW_OF = {"A": 11, "B": 11, "comm": 12}, {"A": 13, "B": 13, "comm": 14}, 15, 16


def stream_graph():
    g = make_graph()
    g.define([P.DEFINE_CALL, 11, "mul", [1, 0], [1], b"", 0])
    g.define([P.DEFINE_CALL, 12, "all_gather", [1], [1], b"", P.COMM, P.CallKind.STEP])
    g.define([P.DEFINE_CALL, 13, "mul_", [1, 0], [1], b"", P.INPLACE])
    g.define([P.DEFINE_CALL, 14, "all_reduce_", [1], [1], b"", P.COMM | P.INPLACE])
    g.define([P.DEFINE_CALL, 15, "ones", [], [1], b"", 0])
    g.define([P.DEFINE_CALL, 16, "view", [1], [1], b"", P.VIEW])
    return g


class Program:
    """Batches of accesses, each issued on a stream kind (A, B or comm); ``run`` passes the
    batch so far through assign_streams."""

    def __init__(self, g=None):
        self.g, self.nodes = g or stream_graph(), []

    def issue(self, kind, call, out, *operands) -> Operator:
        node = op(self.g, call, out, *operands, graph=1 if kind == "B" else 0)
        self.nodes.append(node)
        return node

    def read(self, kind, x, out):
        return self.issue(kind, READ[kind], out, x, *([2.0] if kind != "comm" else []))

    def write(self, kind, x):
        return self.issue(kind, WRITE[kind], x, x, *([2.0] if kind != "comm" else []))

    def make(self, kind, out):
        if kind == "comm":  # a collective's result, gathered from a tensor never seen before
            return self.issue(kind, READ[kind], out, 999)
        return self.issue(kind, MAKE, out)

    def view(self, kind, x, out):
        return self.issue(kind, VIEW_OF, out, x)

    def run(self) -> list:
        nodes, self.nodes = assign_streams(self.g, self.nodes), []
        return nodes


def expected_waits(first, second):
    return None if STREAMS[first] == STREAMS[second] else [STREAMS[first]]


ALIASES = {  # (what the first access touches, what the second touches)
    "same tensor": (10, 10),
    "view, then its base": (12, 10),  # 12 is a view of the view 11 of 10
    "base, then a view of a view": (10, 12),
}


@pytest.mark.parametrize("alias", list(ALIASES))
@pytest.mark.parametrize("hazard", ["RAW", "WAR", "WAW"])
@pytest.mark.parametrize("first,second", [(a, b) for a in STREAMS for b in STREAMS])
def test_each_hazard_waits_for_the_other_stream_once_and_never_on_one(first, second, hazard,
                                                                       alias):
    p = Program()
    p.make(first, 10)
    p.view(first, 10, 11)  # views run on a compute stream (graph A's when first is comm)
    p.view(first, 11, 12)
    p.read(first, 12, 40)  # the first access's stream has seen them made
    p.make(first, 30)
    p.read(second, 30, 31)  # the second's stream has waited past all that, without touching 10
    p.run()
    a, b = ALIASES[alias]
    one = p.read(first, a, 20) if hazard == "WAR" else p.write(first, a)
    two = p.read(second, b, 21) if hazard == "RAW" else p.write(second, b)
    p.run()
    assert one.waits is None
    assert two.stream == STREAMS[second] and two.waits == expected_waits(first, second)


@pytest.mark.parametrize("first,second", [(a, b) for a in STREAMS for b in STREAMS])
def test_a_result_is_read_after_it_is_made(first, second):
    p = Program()
    made = p.make(first, 10)
    reads = [p.read(second, 10, 20), p.read(second, 10, 21)]
    p.run()
    assert made.waits is None
    assert [r.waits for r in reads] == [expected_waits(first, second), None]  # then covered


def test_a_view_made_on_another_stream_orders_its_readers_and_fetches_after_its_making():
    p = Program()
    p.make("A", 10)
    made = p.view("B", 10, 11)
    read = p.read("comm", 11, 20)  # B waited for A, so one wait on B covers both
    p.nodes.append([P.FETCH, 11, 1])  # after the view's making, on B
    write = p.write("A", 10)  # after the view's read of 10, the comm read and the fetch
    p.nodes.append([P.FETCH, 11, 2])  # now after A's write, which waited for the rest
    nodes = p.run()
    fetches = [n for n in nodes if isinstance(n, P.HostFetch)]
    assert made.waits == [STREAMS["A"]] and read.waits == [STREAMS["B"]]
    assert write.waits == [STREAMS["B"], COMM_STREAM]
    assert [f.stream for f in fetches] == [STREAMS["B"], STREAMS["A"]]
    again = p.read("comm", 11, 21)  # A's wait for B and comm covers the view's making
    p.run()
    assert again.waits == [STREAMS["A"]]


def test_the_state_an_update_writes_in_place_is_ordered_as_its_parameter():
    """An optimizer update (``protocol.writes``: INPLACE, and operand 2 written too) on graph
    A: a comm-stream read of the state before it makes it wait (write after read), and a
    comm-stream read after it waits for it (read after write), as for operand 0."""
    g = stream_graph()
    g.define([P.DEFINE_CALL, 17, "sgd_update_", [1, 1, 1], [1], b"", P.INPLACE | P.writes(2)])
    p = Program(g)
    p.make("A", 10), p.make("A", 11), p.make("A", 12)  # parameter, gradient, state
    p.run()
    before = p.read("comm", 12, 20)
    update = p.issue("A", 17, 10, 10, 11, 12)
    after = p.read("comm", 12, 21)
    p.run()
    assert before.waits == [STREAMS["A"]]  # the state's making
    assert update.waits == [COMM_STREAM]  # write after the comm read of the state
    assert after.waits == [STREAMS["A"]]  # read after the update's write
    assert P.written(P.INPLACE | P.writes(2, 3)) == (2, 3) and P.written(P.INPLACE) == ()


def test_reads_on_two_streams_are_not_ordered_but_a_write_waits_for_both():
    p = Program()
    p.make("A", 10)
    reads = [p.read("B", 10, 20), p.read("comm", 10, 21), p.read("A", 10, 22)]
    write = p.write("A", 10)
    p.run()
    assert [r.waits for r in reads] == [[STREAMS["A"]], [STREAMS["A"]], None]
    assert write.waits == [STREAMS["B"], COMM_STREAM]


def test_waits_pass_on_what_the_other_stream_waited_for():
    p = Program()
    p.make("A", 10)
    gather = p.read("comm", 10, 11)  # comm waits for A
    first = p.read("B", 11, 12)  # B waits for comm, so for A too
    second = p.read("B", 10, 13)
    p.run()
    assert gather.waits == [STREAMS["A"]] and first.waits == [COMM_STREAM]
    assert second.waits is None


def test_a_wait_covers_only_the_devices_that_recorded_it():
    g = stream_graph()  # mesh 1 on devices 0, 1; mesh 2 on devices 2, 3
    g.define([P.DEFINE_MESH, 2, "cpu", [2], [2, 3]])
    g.define([P.DEFINE_SPEC, 3, [4, 3], "float32", 2, ["S0"]])
    g.define([P.DEFINE_CALL, 21, "ones", [], [3], b"", 0])
    g.define([P.DEFINE_CALL, 22, "mul", [3, 0], [3], b"", 0])
    p = Program(g)
    p.make("B", 10)
    p.issue("B", 21, 20)  # on mesh 2
    on_mesh1 = p.read("A", 10, 11)
    on_mesh2 = p.issue("A", 22, 21, 20, 2.0)  # A's wait on mesh 1 does not cover devices 2, 3
    p.run()
    assert on_mesh1.waits == [STREAMS["B"]] and on_mesh2.waits == [STREAMS["B"]]


def test_a_base_released_while_its_views_live_keeps_its_storage_ordered():
    g = stream_graph()
    g.define([P.DEFINE_CALL, 23, "split", [1], [1, 1], b"", P.VIEW])  # two views at once
    p = Program(g)
    p.make("A", 10)
    p.issue("A", 23, 11, 12, 10)
    p.nodes.append(10)  # the base goes; its views stay
    read = p.read("B", 11, 20)
    write = p.write("A", 12)  # writes the storage B read through the other view
    p.nodes += [11, 20]
    p.run()
    assert read.waits == [STREAMS["A"]] and write.waits == [STREAMS["B"]]
    assert set(g.streams.storages) == {10}
    p.nodes.append(12)
    p.run()
    assert g.streams.storages == {} and g.streams.roots == {}


def test_a_fetch_runs_on_the_last_writer_and_a_later_write_elsewhere_waits_for_it():
    p = Program()
    p.make("A", 10)
    p.view("A", 10, 11)
    p.write("B", 11)  # the last write, through the view
    p.read("A", 10, 20)  # A has now waited for all of B so far
    p.nodes.append([P.FETCH, 10, 7])
    write = p.write("A", 10)  # must not change what the fetch queued on B reads
    nodes = p.run()
    fetch = next(n for n in nodes if isinstance(n, P.HostFetch))
    assert fetch == P.HostFetch(P.FETCH, 10, 7, STREAMS["B"])
    assert write.waits == [STREAMS["B"]]


def test_redistribute_steps_and_their_temporaries_are_ordered_across_streams():
    g = stream_graph()
    g.define([P.DEFINE_MESH, 3, "cpu", [2, 2], [0, 1, 2, 3]])
    g.define([P.DEFINE_SPEC, 4, [4, 4], "float32", 3, ["S0", "R"]])
    g.define([P.DEFINE_SPEC, 5, [4, 4], "float32", 3, ["R", "S0"]])
    g.define([P.DEFINE_CALL, 24, "ones", [], [4], b"", 0])
    g.define([P.DEFINE_CALL, 25, None, [4], [5], b"", 0, P.CallKind.REDISTRIBUTE])
    g.define([P.DEFINE_CALL, 26, "mul_", [4, 0], [4], b"", P.INPLACE])
    g.define([P.DEFINE_CALL, 27, "mul", [5, 0], [5], b"", 0])
    p = Program(g)
    p.issue("B", 24, 10)
    p.issue("A", 25, 11, 10)  # all-gather on comm into a temporary, then chunk on A
    write = p.issue("B", 26, 10, 10, 0.0)  # must wait for the all-gather's read of 10
    read = p.issue("B", 27, 12, 11, 1.0)  # the chunk's result, made on A
    p.nodes = lower_redistribute(g, p.nodes)
    nodes = [n for n in p.run() if isinstance(n, Operator)]
    assert [(n.call.op, n.stream, n.waits) for n in nodes] == [
        ("ones", STREAMS["B"], None),
        ("step:all_gather", COMM_STREAM, [STREAMS["B"]]),
        ("step:chunk", STREAMS["A"], [COMM_STREAM]),
        ("mul_", STREAMS["B"], [COMM_STREAM]),
        ("mul", STREAMS["B"], [STREAMS["A"]]),
    ]
    assert write is nodes[3] and read is nodes[4]
    assert set(g.streams.storages) == {10, 11, 12}  # the temporary is gone


def test_a_chain_never_absorbs_a_kernel_that_waits_and_its_reads_order_later_writes():
    p = Program()
    p.make("B", 30)
    p.make("A", 10)
    p.nodes += [op(p.g, 1, 11, 10, 2.0), op(p.g, 1, 12, 11, 3.0), 11]
    p.nodes += [op(p.g, 4, 13, 12, 30), 12]  # reads B's 30: waits, so it starts a new task
    p.write("B", 10)  # the chain read 10 on A
    nodes = fuse_chains(p.g, p.run())
    assert kinds(nodes) == ["ones", "ones", "chain(mul,mul)", "add", "release 12", "mul_"]
    assert nodes[3].waits == [STREAMS["B"]] and nodes[5].waits == [STREAMS["A"]]


# -- every pass named, with the nodes it took and left --------------------------------------------


def every_pass_changes(g) -> list:
    """A redistribute (lowered to an all-gather: more nodes), dead code (fewer), a chain of two
    muls (one node), releases and a fetch."""
    return [op(g, 1, 11, 10, 2.0), op(g, 1, 12, 11, 3.0), 11, op(g, 3, 13, 12),
            op(g, 4, 14, 13, 13), op(g, 1, 15, 10, 5.0), 15, 12, 13, [P.FETCH, 14, 1]]


def each_pass(batch) -> list:
    """``name: nodes taken -> nodes left`` of each pass over ``batch(graph)``, run one by one."""
    g, lines = make_graph(), []
    nodes = batch(g)
    for run_pass in PASSES:
        taken, nodes = len(nodes), run_pass(g, nodes)
        lines.append(f"{run_pass.__name__}: {taken} -> {len(nodes)} nodes")
    return lines


def test_each_pass_is_named_with_its_node_counts_in_the_debug_log_and_the_trace(caplog):
    expected = each_pass(every_pass_changes)
    assert len({line.split(": ")[1] for line in expected}) == len(PASSES)  # each its own counts
    g, spans = make_graph(), []
    with caplog.at_level(logging.DEBUG, logger="dtorch.controller"):
        run_passes(g, every_pass_changes(g), spans)
    assert [r.getMessage() for r in caplog.records if r.name == "dtorch.controller"] == expected
    assert [name for name, *_ in spans] == expected
    assert all(device == stream == P.CONTROLLER and t0 <= t1
               for _, device, stream, t0, t1, _ in spans)


def test_dtorch_debug_prints_each_pass_of_the_controllers_batches():
    root = pathlib.Path(__file__).resolve().parent.parent
    code = ("import dtorch\nmesh = dtorch.DeviceMesh('cpu', [0, 1])\n"
            "print((dtorch.ones((4, 4), device_mesh=mesh) * 2).sum().item())\n")
    env = {**os.environ, "DTORCH_DEBUG": "1", "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env, cwd=root, check=False)
    assert proc.returncode == 0 and proc.stdout.split()[-1] == "32.0", proc.stderr[-3000:]
    for run_pass in PASSES:
        assert re.search(rf"^\[dtorch controller\] {run_pass.__name__}: \d+ -> \d+ nodes$",
                         proc.stderr, re.MULTILINE), (run_pass.__name__, proc.stderr[-3000:])
    assert re.search(r"^\[dtorch controller\] batch: \d+ records -> ", proc.stderr, re.MULTILINE)
