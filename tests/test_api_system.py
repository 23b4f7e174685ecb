"""DTorch's system API: GlobalOption, dtorch.cuda.nvtx and MainNode.

NVTX ranges are operators: the client records each range, and every device runs its push, mark
and pop between the kernels issued around them (checked here by reading the hosts' record from a
``local_map`` kernel queued between them)."""

import os
import subprocess
import sys

import pytest
import torch

import dtorch
import dtorch.nn.functional as F
from dtorch import Shard, config
from dtorch.client import session
from dtorch.cluster import main_node
from dtorch.cluster.main_node import MainNode
from dtorch.cuda import nvtx, nvtx_kernels
from dtorch.global_option import GlobalOption


def host_events(x, name):
    """(A local_map kernel.) How many pushes, pops and marks named ``name`` this host process
    has run so far, on any of its devices."""
    kinds = [kind for message, kind, _, _ in nvtx_kernels.EVENTS if message == name]
    counts = [kinds.count("push"), kinds.count("pop"), kinds.count("mark")]
    return torch.tensor(counts, dtype=torch.int64, device=x.device)


def events_on_hosts(x, name) -> list:
    return dtorch.local_map(host_events, [Shard(0)])(x, name).tolist()


def named(*names) -> list:
    return [r for r in nvtx.recorded() if r.name in names]


# -- GlobalOption ---------------------------------------------------------------------------------


def test_timeouts_are_the_knobs_in_force():
    with config.Context(collective_timeout_s=7.0, heartbeat_timeout_s=2.5):
        assert GlobalOption.get_comm_timeout_second() == 7.0
        assert GlobalOption.get_grpc_timeout_second() == 2.5
    assert GlobalOption.get_comm_timeout_second() == config.collective_timeout_s
    with config.Context(collective_timeout_s=0.0), pytest.raises(ValueError, match="> 0"):
        GlobalOption.get_comm_timeout_second()


def test_dtorch_variables_set_the_knobs_where_dtorch_own_are_unset():
    theirs = {"DTORCH_COMM_TIMEOUT_SECOND": "42", "DTORCH_GRPC_TIMEOUT_SECOND": "1.5"}
    assert config.from_dtorch_names(theirs) == {"collective_timeout_s": 42.0,
                                                "heartbeat_timeout_s": 1.5}
    ours_too = {**theirs, "DTORCH_COLLECTIVE_TIMEOUT": "9", "DTORCH_HEARTBEAT_TIMEOUT": "4"}
    assert config.from_dtorch_names(ours_too) == {}
    assert config.from_dtorch_names({"DTORCH_COMM_TIMEOUT_SECOND": ""}) == {}
    for bad in ("0", "-1", "inf", "nan", "ten"):
        with pytest.raises(ValueError, match="DTORCH_COMM_TIMEOUT_SECOND"):
            config.from_dtorch_names({"DTORCH_COMM_TIMEOUT_SECOND": bad})


def test_dtorch_variables_are_read_at_import():
    """In a fresh interpreter (only dtorch.config and global_option: no runtime, no torch)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("DTORCH_COLLECTIVE_TIMEOUT", "DTORCH_HEARTBEAT_TIMEOUT")}
    code = ("import sys, types; p = types.ModuleType('dtorch'); "
            f"p.__path__ = [{os.path.dirname(dtorch.__file__)!r}]; sys.modules['dtorch'] = p; "
            "from dtorch.global_option import GlobalOption as G; "
            "print(G.get_comm_timeout_second(), G.get_grpc_timeout_second())")

    def run(**variables):
        return subprocess.run([sys.executable, "-c", code], env={**env, **variables},
                              capture_output=True, text=True, timeout=60)

    assert run(DTORCH_COMM_TIMEOUT_SECOND="42", DTORCH_GRPC_TIMEOUT_SECOND="5").stdout.split() \
        == ["42.0", "5.0"]
    failed = run(DTORCH_COMM_TIMEOUT_SECOND="0")
    assert failed.returncode != 0 and "DTORCH_COMM_TIMEOUT_SECOND='0'" in failed.stderr


def test_options_dtorch_reads_but_does_not_use(monkeypatch):
    for name in ("DTORCH_ZMQ_TIMEOUT_SECOND", "DTORCH_DTENSOR_IN_SAME_DEVICE",
                 "DTORCH_PER_DEVICE_PER_PROCESS", "DTORCH_VALIDATE_KERNEL_INPUT_OUTPUT",
                 "DTORCH_NUM_GPU_WHEN_ENABLE_DTENSOR_IN_SAME_DEVICE"):
        monkeypatch.delenv(name, raising=False)
    G = GlobalOption
    assert G.get_zmq_timeout_second() == 3.0
    assert not G.get_dtensor_in_same_device() and not G.get_per_device_per_process()
    assert not G.get_validate_kernel_input_output()
    assert G.get_num_gpu_when_enable_dtensor_in_same_device() == 8
    monkeypatch.setenv("DTORCH_ZMQ_TIMEOUT_SECOND", "5")
    monkeypatch.setenv("DTORCH_DTENSOR_IN_SAME_DEVICE", "true")
    monkeypatch.setenv("DTORCH_PER_DEVICE_PER_PROCESS", "1")
    monkeypatch.setenv("DTORCH_VALIDATE_KERNEL_INPUT_OUTPUT", "TRUE")
    monkeypatch.setenv("DTORCH_NUM_GPU_WHEN_ENABLE_DTENSOR_IN_SAME_DEVICE", "4")
    assert G.get_zmq_timeout_second() == 5.0
    assert G.get_dtensor_in_same_device() and G.get_per_device_per_process()
    assert G.get_validate_kernel_input_output()
    assert G.get_num_gpu_when_enable_dtensor_in_same_device() == 4
    for name, bad in (("DTORCH_ZMQ_TIMEOUT_SECOND", "0"), ("DTORCH_PER_DEVICE_PER_PROCESS", "2"),
                      ("DTORCH_NUM_GPU_WHEN_ENABLE_DTENSOR_IN_SAME_DEVICE", "0")):
        monkeypatch.setenv(name, bad)
        getter = {"DTORCH_ZMQ_TIMEOUT_SECOND": G.get_zmq_timeout_second,
                  "DTORCH_PER_DEVICE_PER_PROCESS": G.get_per_device_per_process}.get(
            name, G.get_num_gpu_when_enable_dtensor_in_same_device)
        with pytest.raises(ValueError, match=name):
            getter()


# -- dtorch.cuda.nvtx -----------------------------------------------------------------------------


def test_ranges_are_recorded_on_the_client_in_order():
    x = dtorch.ones(4)
    depth = nvtx.range_push("rec outer")
    y = x * 2
    with nvtx.range("rec inner {}", None, 1):
        nvtx.mark("rec mark")
        z = y + 1
    assert nvtx.range_pop() == depth == 0
    dtorch.sync()
    outer, inner, mark = named("rec outer", "rec inner 1", "rec mark")
    assert outer.start_ns < inner.start_ns <= mark.start_ns <= inner.end_ns < outer.end_ns
    assert mark.kind == "mark" and mark.end_ns == mark.start_ns and inner.kind == "range"
    assert {outer.graph, inner.graph, mark.graph} == {dtorch.default_graph.id}
    assert z.tolist() == [3.0] * 4


def test_hosts_run_ranges_between_the_ops_around_them():
    x = dtorch.ones(1)  # on the default mesh, where the ranges run too
    nvtx.range_push("host r")
    inside = events_on_hosts(x, "host r")
    nvtx.mark("host r")
    after_mark = events_on_hosts(x, "host r")
    nvtx.range_pop()
    after = events_on_hosts(x, "host r")
    assert (inside, after_mark, after) == ([1, 0, 0], [1, 0, 1], [1, 1, 1])


def test_ranges_run_on_every_device_of_the_graph_mesh(mesh1):
    x = dtorch.ones(3, device_mesh=mesh1, placements=[Shard(0)])
    devices = list(mesh1.devices)
    # each device's host process records the events of all its devices of the mesh
    machine = config.RuntimeFacts(config.cpu_hosts)
    shared = [sum(machine.host_index("cpu", e) == machine.host_index("cpu", d) for e in devices)
              for d in devices]
    with dtorch.default_graph.device_mesh_guard(mesh1):
        nvtx.range_push("mesh r")
    dtorch.sync()
    assert events_on_hosts(x, "mesh r") == [v for n in shared for v in (n, 0, 0)]
    nvtx.range_pop()  # where its push ran, whatever the default mesh is now
    dtorch.sync()
    assert events_on_hosts(x, "mesh r") == [v for n in shared for v in (n, n, 0)]


def test_range_pop_without_a_push_raises_at_the_call():
    g = dtorch.Graph()
    with pytest.raises(RuntimeError, match=f"no range is open on graph {g.id}"):
        nvtx.range_pop(g)
    assert (dtorch.ones(2) + 1).tolist() == [2.0, 2.0]  # the runtime is as it was


def test_range_on_another_graph_formats_and_closes_on_error():
    g = dtorch.Graph()
    with nvtx.range("graph r {a}", g, a=7):
        pass
    with nvtx.range("layer {}", 3):  # as torch.cuda.nvtx.range: 3 is a format argument
        pass
    with pytest.raises(ZeroDivisionError), nvtx.range("boom r"):
        1 / 0
    g.sync()
    (on_g,) = named("graph r 7")
    assert on_g.graph == g.id and named("layer 3") and named("boom r")
    with pytest.raises(RuntimeError, match="no range is open"):
        nvtx.range_pop()  # boom r was closed


def test_dtorch_functional_forms_and_argument_errors():
    F._nvtx_range_push(None, "raw r")
    F._nvtx_mark(dtorch.default_graph, "raw r")
    F._nvtx_range_pop(dtorch.default_graph)
    assert events_on_hosts(dtorch.ones(1), "raw r") == [1, 0, 1]  # the pop carries no name
    with pytest.raises(TypeError, match="must be a str"):
        F._nvtx_mark(None, 3)
    with pytest.raises(TypeError, match="must be a str"):
        nvtx.range_push(b"bytes")
    with pytest.raises(TypeError, match="dtorch.Graph"):
        nvtx.mark("m", graph="g")


class Net(torch.nn.Module):
    def __init__(self, fail=False):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
        self.act = torch.nn.ReLU()
        self.fail = fail

    def forward(self, x):
        for layer in self.layers:
            x = self.act(layer(x))
        if self.fail:
            raise ValueError("forward failed")
        return x


def test_module_register_nvtx_wraps_every_forward():
    net = Net()
    handles = nvtx.module_register_nvtx(net, tag="mod net")
    before = len(nvtx.recorded())
    net(torch.randn(3, 2))
    ranges = [r for r in nvtx.recorded()[before:]]
    names = [r.name for r in ranges]
    assert names == ["mod net", "layers.0", "act", "layers.1", "act"]
    root = ranges[0]
    assert all(root.start_ns < r.start_ns and r.end_ns < root.end_ns for r in ranges[1:])
    for h in handles:
        h.remove()
    count = len(nvtx.recorded())
    net(torch.randn(3, 2))
    assert len(nvtx.recorded()) == count


def test_module_register_nvtx_closes_ranges_when_forward_raises():
    net = Net(fail=True)
    nvtx.module_register_nvtx(net, tag="failing net")
    with pytest.raises(ValueError, match="forward failed"):
        net(torch.randn(1, 2))
    assert named("failing net")
    with pytest.raises(RuntimeError, match="no range is open"):
        nvtx.range_pop()


def test_cuda_module():
    assert dtorch.cuda.is_available() == torch.cuda.is_available()
    assert dtorch.cuda.nvtx is nvtx


# -- MainNode -------------------------------------------------------------------------------------


@pytest.fixture
def not_started(monkeypatch):
    """The runtime as before its start (the session's own is put back after the test)."""
    monkeypatch.setattr(main_node, "_address", None)
    monkeypatch.setattr(session, "_current", None)


def test_main_node_address_before_start(not_started, monkeypatch):
    monkeypatch.delenv("DTORCH_MAIN_NODE_ADDRESS", raising=False)
    assert MainNode.get_address() == f"{config.bind_host}:0"
    monkeypatch.setenv("DTORCH_MAIN_NODE_ADDRESS", "10.1.2.3:14000")
    assert MainNode.get_address() == "10.1.2.3:14000"
    MainNode.set_address("10.0.0.1:13000")
    assert MainNode.get_address() == "10.0.0.1:13000"  # set_address comes first
    for bad in ("localhost:13000", "10.0.0.1", "10.0.0.1:", "10.0.0.1:port", "10.0.0.1:70000",
                "10.0.0:13000", "[::1]:13000"):
        with pytest.raises(ValueError, match="IPv4:port"):
            MainNode.set_address(bad)
    with pytest.raises(TypeError):
        MainNode.set_address(13000)


def test_main_node_bad_address_in_environment(not_started, monkeypatch):
    monkeypatch.setenv("DTORCH_MAIN_NODE_ADDRESS", "main-node:13000")
    with pytest.raises(ValueError, match="DTORCH_MAIN_NODE_ADDRESS"):
        MainNode.get_address()


def test_main_node_address_is_fixed_once_the_runtime_runs(monkeypatch):
    monkeypatch.setattr(main_node, "_address", None)
    dtorch.sync()  # the runtime is running
    with pytest.raises(ValueError, match="^Cluster already start, node type: main$"):
        MainNode.set_address("10.0.0.1:13000")
    with pytest.raises(ValueError, match="IPv4:port"):  # a bad address is still named first
        MainNode.set_address("nowhere")


def test_main_node_cluster_is_this_machine():
    assert MainNode.num_node_in_cluster() == 1
    assert MainNode.wait_cluster_ready(1) is True
    assert MainNode.wait_cluster_ready(0, timeout_second=1) is True
    with pytest.raises(RuntimeError, match="set_address"):  # more machines need a main node
        MainNode.wait_cluster_ready(2)
    with pytest.raises(TypeError):
        MainNode.wait_cluster_ready("2")
