"""dtorch.profiler: the timeline (devices' kernels, the client's batches, the controller's passes,
nvtx ranges, call sites), the overlap of a collective with independent compute, and the DOT
picture of a batch's graph (``controller/dot.py``, also drawn here without a runtime)."""

import inspect
import json
import os
import re

import pytest
import torch

import dtorch
from dtorch import Partial, Replicate, Shard
from dtorch.controller.dot import to_dot
from dtorch.controller.passes import PASSES
from dtorch.cuda import nvtx
from processes import run_client
from test_passes import make_graph, op


def test_dot_of_a_batch_after_the_passes():
    """Without a runtime: a mul chain on the compute stream, a redistribute lowered to an
    all-gather on the communication stream (waiting for the compute stream), releases."""
    g = make_graph()
    nodes = [op(g, 1, 11, 10, 2.0), op(g, 1, 12, 11, 3.0), 11, op(g, 3, 13, 12),
             op(g, 4, 14, 13, 13), 12, 13, [dtorch.protocol.FETCH, 14, 1]]
    for run_pass in PASSES:
        nodes = run_pass(g, nodes)
    dot = to_dot(nodes, "batch-1")
    assert dot.startswith('digraph "batch-1" {') and dot.rstrip().endswith("}")
    assert dot.count("{") == dot.count("}")
    clusters = re.findall(r'subgraph "cluster_stream(\d+)" \{ label="([^"]+)"', dot)
    assert {label for _, label in clusters} == {"communication stream",
                                                "compute stream (graph 0)"}
    assert 'subgraph "cluster_chain' in dot  # the two muls: one host task
    assert re.search(r'label="step:all_gather\\n-> t\d+"', dot)
    assert re.search(r'-> k\d+_0 \[style=dashed, color=red, label="wait"\]', dot)
    assert 't10 [shape=ellipse, label="t10"]' in dot  # made by an earlier batch
    assert 'label="release t12"' in dot and 'label="fetch"' in dot
    for src, dst in re.findall(r"^  (\w+) -> (\w+)", dot, re.M):  # every edge names nodes
        assert re.search(rf"^\s+{src} \[", dot, re.M), src
        assert re.search(rf"^\s+{dst} \[", dot, re.M), dst


def test_graph_writes_each_batch_issued_inside(tmp_path):
    mesh = dtorch.DeviceMesh("cpu", [0, 1])
    x = dtorch.ones((4, 4), device_mesh=mesh, placements=[Shard(0)])
    with dtorch.profiler.graph(str(tmp_path)) as files:
        y = (x * 2 + 1).redistribute(placements=[Replicate()]).sum()
        assert y.item() == 48
    assert files and all(f.endswith(".dot") for f in files)
    dots = "".join(open(f).read() for f in files)
    assert "mul" in dots and "step:all_gather" in dots and "sum" in dots
    with dtorch.profiler.graph(str(tmp_path)) as more:
        pass
    assert not set(more) & set(files)  # later blocks add files of their own


def test_profile_has_every_process_and_the_call_sites(tmp_path):
    """Kernels per device and stream, each naming the user's line; the client's issue and
    flush spans and its nvtx ranges; the controller's passes per batch; one clock."""
    mesh = dtorch.DeviceMesh("cpu", [0, 1])
    x = dtorch.ones((64, 64), device_mesh=mesh, placements=[Shard(0)])
    with dtorch.profiler.profile() as prof:
        with nvtx.range("step"):
            line = f"test_profiler.py:{inspect.currentframe().f_lineno + 1}"
            y = (x * 2).sum()  # the line the kernels name
        y.item()
    kernels = prof.kernels()
    assert {e["pid"] for e in kernels} == {0, 1}
    assert any(e["args"]["site"].endswith(line) for e in kernels)
    spans = [e for e in prof.events if e["ph"] == "X"]
    client = [e for e in spans if e["cat"] == "client"]
    assert any(e["name"].startswith("issue ") for e in client)
    assert any(e["name"].startswith("flush ") for e in client)
    assert any(e["name"] == "nvtx: step" for e in client)
    assert any(e["cat"] == "controller" and e["name"].startswith("passes: ") for e in spans)
    for run_pass in PASSES:  # and each pass, with the nodes it took and left
        assert any(e["cat"] == "controller" and re.fullmatch(
            rf"{run_pass.__name__}: \d+ -> \d+ nodes", e["name"]) for e in spans), run_pass
    names = {e["args"]["name"] for e in prof.events if e["name"] == "process_name"}
    assert any(n.startswith("client") for n in names)
    assert any(n.startswith("controller") for n in names)
    issue = min(e["ts"] for e in client)
    assert issue <= min(e["ts"] for e in kernels)  # issued before it ran: clocks agree
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    doc = json.loads(path.read_text())
    assert doc["traceEvents"] == prof.events
    for e in doc["traceEvents"]:
        assert e["ph"] in ("M", "X") and isinstance(e["pid"], int) and isinstance(e["tid"], int)
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] >= 0


def test_a_collective_overlaps_independent_compute():
    """``bench_overlap.py``'s program: an all-reduce and an independent matmul on each device
    run at the same time, on the communication and the compute stream."""
    dtorch.sync()
    mesh = dtorch.DeviceMesh("cpu", [0, 1])
    grad = dtorch.ones((1 << 20,), device_mesh=mesh, placements=[Partial()])
    a = dtorch.randn((512, 512), device_mesh=mesh)
    (a @ a).sum().item()  # warm
    with dtorch.profiler.profile() as prof:
        reduced = grad.redistribute(placements=[Replicate()])
        product = a @ a
        for _ in range(3):
            product = product @ a
        dtorch.sync()
    for d in (0, 1):
        comm = [(e["ts"], e["ts"] + e["dur"]) for e in prof.kernels()
                if e["pid"] == d and e["tid"] == 0]
        compute = [(e["ts"], e["ts"] + e["dur"]) for e in prof.kernels()
                   if e["pid"] == d and e["tid"] != 0]
        assert comm and compute
        assert any(c0 < k1 and k0 < c1 for c0, c1 in comm for k0, k1 in compute), d
    torch.testing.assert_close(reduced.to_torch(), torch.ones(1 << 20))
    del product



THREADS = """
import json
import dtorch

mesh = dtorch.DeviceMesh("cpu", [0, 1])
with dtorch.profiler.profile() as prof:
    dtorch.ones(4, device_mesh=mesh).sum().item()
threads = {e["pid"]: e["args"]["torch_threads"] for e in prof.events
           if e["name"] == "process_name" and "torch_threads" in e["args"]}
print("RESULT " + json.dumps(threads))
"""


def test_cpu_hosts_take_omp_num_threads_as_torch_does():
    """A host's torch threads: an equal share of the cores, or ``OMP_NUM_THREADS`` where the
    user set it (fewer than one host's share of two cores or more, so the test tells the two
    apart)."""
    if os.cpu_count() < 2:
        pytest.skip("one core: every choice is one thread")
    plain = {"DTORCH_CPU_HOSTS": "1", "OMP_NUM_THREADS": None}
    share = run_client(THREADS, timeout=120, env=plain)
    assert share == {"0": os.cpu_count(), "1": os.cpu_count()}
    chosen = run_client(THREADS, timeout=120, env={**plain, "OMP_NUM_THREADS": "1"})
    assert chosen == {"0": 1, "1": 1}
