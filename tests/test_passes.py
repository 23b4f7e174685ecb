"""Controller passes on hand-built batches: which kernels each pass leaves (no runtime)."""

import pytest

from dtorch import protocol as P
from dtorch.controller.graph import LogicalGraph, Operator
from dtorch.controller.passes import (
    COMM_STREAM,
    Chain,
    StreamState,
    assign_streams,
    compute_stream,
    eliminate_dead_code,
    fuse_chains,
    lower_redistribute,
)


@pytest.fixture(autouse=True)
def _no_pending_errors():
    """Overrides conftest's: these tests start no runtime."""
    yield


def make_graph(n_devices=2):
    g = LogicalGraph()
    g.streams = StreamState()
    g.define([P.DEFINE_MESH, 1, "cpu", [n_devices], list(range(n_devices))])
    g.define([P.DEFINE_SPEC, 1, [4, 3], "float32", 1, ["S0"]])
    g.define([P.DEFINE_SPEC, 2, [4, 3], "float32", 1, ["R"]])
    g.define([P.DEFINE_CALL, 1, "mul", [1, 0], [1], b"", 0])  # S0 * scalar
    g.define([P.DEFINE_CALL, 2, "add_", [1, 1], [1], b"", P.INPLACE])
    g.define([P.DEFINE_CALL, 3, "redistribute", [1], [2], b"", 0])
    g.define([P.DEFINE_CALL, 4, "add", [2, 2], [2], b"", 0])
    return g


def op(g, call, out, *operands):
    return Operator(g.calls[call], [P.OP, call, 0, 0, out, *operands])


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
    assert kinds(nodes) == [f"tag {P.DEFINE_CALL}", P.STEP_PREFIX + "all_gather"]
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
