"""DTorch's Graph API (``dtorch.graph``): identity, waits and their futures, the default mesh and
dtype guards, the thread-local default graph, GraphOption, and memory figures
(``dtorch.memory_stats``), which on CPU devices are the bytes their tensors hold."""

from __future__ import annotations

import asyncio
import gc
import threading

import pytest
import torch

import dtorch
from dtorch import Shard
from dtorch.current import current_graph
from dtorch.future import TensorFuture
from dtorch.graph import Graph, GraphOption, VoidFutureCollect
from dtorch.memory_stats import MemoryStat, MemoryStats

MB = 2**20


# -- identity -------------------------------------------------------------------------------------


def test_default_graph_is_the_importing_threads():
    assert isinstance(dtorch.default_graph, Graph)
    assert Graph.default_graph() is dtorch.default_graph
    assert dtorch.default_graph.id == 0


def test_ids_equality_and_hash():
    a, b = Graph(), Graph()
    assert isinstance(a.id, int) and a.id != b.id
    assert a == a and a != b and not (a == "graph")
    assert {a, b, a} == {a, b}
    with pytest.raises(AttributeError):
        a.id = 7


def test_names_and_strings():
    g = Graph()
    assert g.get_name() == ""
    g.set_name("decoder")
    assert g.get_name() == "decoder"
    assert str(g) == f"dtorch.Graph with id: {g.id}"
    assert repr(g) == f"dtorch.Graph(id={g.id}, name='decoder')"
    with pytest.raises(TypeError):
        g.set_name(3)


def test_graph_option():
    opt = GraphOption()
    assert opt.per_device_per_process is None
    opt.per_device_per_process = True
    assert opt == GraphOption(per_device_per_process=True) != GraphOption()
    assert str(opt) == repr(opt) == "GraphOption(per_device_per_process=True)"
    with pytest.raises(TypeError):
        GraphOption(per_device_per_process="yes")
    with pytest.raises(TypeError):
        GraphOption(True)  # keyword only, as DTorch's
    assert Graph(GraphOption(per_device_per_process=True)).option.per_device_per_process is True
    with pytest.raises(TypeError):
        Graph("cpu")


@pytest.mark.parametrize("env, expected", [(None, False), ("1", True), ("true", True),
                                           ("0", False)])
def test_graph_option_default_comes_from_the_environment(monkeypatch, env, expected):
    if env is None:
        monkeypatch.delenv("DTORCH_PER_DEVICE_PER_PROCESS", raising=False)
    else:
        monkeypatch.setenv("DTORCH_PER_DEVICE_PER_PROCESS", env)
    assert Graph().option == GraphOption(per_device_per_process=expected)
    # an explicit choice wins; dtorch runs every device in a host process either way
    g = Graph(GraphOption(per_device_per_process=not expected))
    assert g.option.per_device_per_process is (not expected)
    with g:
        assert (dtorch.ones(3) * 2).tolist() == [2.0] * 3


# -- with graph: and the thread-local default -----------------------------------------------------


def test_with_graph_nests_and_restores_also_on_exceptions():
    a, b = Graph(), Graph()
    assert current_graph() is dtorch.default_graph
    with a:
        assert current_graph() is a
        with b:
            assert current_graph() is b
            y = dtorch.ones(4) + 1  # runs on b's compute streams
        assert current_graph() is a
        with pytest.raises(ZeroDivisionError), b:
            1 / 0
        assert current_graph() is a
    assert current_graph() is dtorch.default_graph
    assert y.tolist() == [2.0] * 4


def test_default_graph_is_thread_local():
    seen = {}

    def other():
        g = Graph.default_graph()
        seen["default"], seen["again"] = g, Graph.default_graph()
        with Graph() as h:
            seen["inside"] = current_graph() is h
        seen["after"] = current_graph() is g

    with Graph() as mine:
        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert current_graph() is mine  # the other thread's blocks are its own
    assert seen["default"] is seen["again"]
    assert seen["default"] is not dtorch.default_graph
    assert seen["default"] != dtorch.default_graph
    assert seen["inside"] and seen["after"]
    assert Graph.default_graph() is dtorch.default_graph


# -- waits ----------------------------------------------------------------------------------------


def test_sync_and_every_form_of_sync_future():
    g = Graph()
    with g:
        y = dtorch.ones(3) * 3
    g.sync()
    done = g.sync_future()
    assert isinstance(done, VoidFutureCollect)
    assert done.wait_for(60_000) is True
    assert done.wait() is None
    assert done.get() is None and done.get() is None  # any number of times
    assert done.is_ready()

    async def both():
        return await g.sync_future(), await dtorch.default_graph.sync_future()

    assert asyncio.run(both()) == (None, None)
    assert y.tolist() == [3.0] * 3


def test_sync_future_raises_a_kernel_error_each_get_and_only_there():
    w = dtorch.tensor([2]) ** -1  # integers to a negative power fail on the host
    done = dtorch.default_graph.sync_future()
    done.wait()  # waiting raises nothing
    with pytest.raises(RuntimeError, match="pow"):
        done.get()
    with pytest.raises(RuntimeError, match="pow"):
        done.get()
    dtorch.sync()  # the user has been told once: a later wait does not raise it again
    del w


def test_void_future_collect_of_pending_futures():
    a, b = TensorFuture(), TensorFuture()
    done = VoidFutureCollect((a, b))
    assert not done.is_ready() and done.wait_for(5) is False
    assert repr(done) == "VoidFutureCollect(pending)"
    a._finish(torch.ones(1))
    assert not done.is_ready() and done.wait_for(0) is False
    b._finish(error=ValueError("lost"))
    assert done.is_ready() and done.wait_for(0) is True
    with pytest.raises(ValueError, match="lost"):
        done.get()
    assert VoidFutureCollect().is_ready()


def test_awaiting_is_woken_by_the_completing_thread():
    f = TensorFuture()
    done = VoidFutureCollect((f,))

    async def main():
        task = asyncio.ensure_future(_await(done))
        for _ in range(3):
            await asyncio.sleep(0)
        assert not task.done()
        threading.Thread(target=f._finish).start()  # the receiver thread's part
        return await task

    assert asyncio.run(main()) is None


async def _await(x):
    return await x


def test_tensor_future_wait_for_get_twice_and_is_ready():
    fut = (dtorch.arange(6) * 2).to_torch_async()
    assert fut.wait_for(60_000) is True
    first, second = fut.get(), fut.get()
    assert torch.equal(first, torch.arange(6) * 2) and torch.equal(first, second)
    assert fut.is_ready()  # still, after get (DTorch's std::future is spent by then)
    assert torch.equal(asyncio.run(_await(fut)), first)
    pending = TensorFuture()
    assert pending.wait_for(1) is False and pending.wait_for(-5) is False


def test_tensor_future_raises_the_same_error_on_every_get():
    fut = (dtorch.tensor([1, 2]) // 0).to_torch_async()
    with pytest.raises(RuntimeError, match="floor_divide") as first:
        fut.get()
    with pytest.raises(RuntimeError, match="floor_divide") as second:
        fut.get()
    assert str(first.value) == str(second.value)


# -- default mesh and dtype -----------------------------------------------------------------------


def test_device_mesh_guard_nests_and_restores(mesh1):
    g = Graph()
    assert g.default_device_mesh == dtorch.DeviceMesh("cpu", [0])
    with g.device_mesh_guard(mesh1) as m:
        assert m is mesh1 and g.default_device_mesh is mesh1
        with g.device_mesh_guard("cpu:2"):
            assert g.default_device_mesh == dtorch.DeviceMesh("cpu", [2])
        assert g.default_device_mesh is mesh1
        with pytest.raises(KeyError), g.device_mesh_guard(torch.device("cpu")):
            assert g.default_device_mesh == dtorch.DeviceMesh("cpu", [0])
            raise KeyError("inside")
        assert g.default_device_mesh is mesh1
    assert g.default_device_mesh == dtorch.DeviceMesh("cpu", [0])
    with pytest.raises(TypeError):
        with g.device_mesh_guard(3):
            pass
    assert dtorch.default_graph.default_device_mesh == dtorch.DeviceMesh("cpu", [0])


def test_device_mesh_guard_none_keeps_the_default(mesh1):
    """None keeps the default in place, as a loader passing on an optional mesh needs (HF's
    ``from_pretrained`` path with no ``device_mesh``), and a mesh set inside still unwinds."""
    g = Graph()
    with g.device_mesh_guard(None) as m:
        assert m == g.default_device_mesh == dtorch.DeviceMesh("cpu", [0])
    with g.device_mesh_guard(mesh1):
        with g.device_mesh_guard(None) as m:
            assert m is mesh1 and g.default_device_mesh is mesh1
            with g.device_mesh_guard("cpu:2"):
                assert g.default_device_mesh == dtorch.DeviceMesh("cpu", [2])
            assert g.default_device_mesh is mesh1
        assert g.default_device_mesh is mesh1
    assert g.default_device_mesh == dtorch.DeviceMesh("cpu", [0])


def test_dtype_guard_nests_and_restores():
    g = Graph()
    assert g.default_dtype is torch.float32
    with g.dtype_guard(torch.float16) as d:
        assert d is torch.float16 and g.default_dtype is torch.float16
        with g.dtype_guard(None):
            assert g.default_dtype is torch.float32
        with pytest.raises(RuntimeError), g.dtype_guard(torch.bfloat16):
            assert g.default_dtype is torch.bfloat16
            raise RuntimeError("inside")
        assert g.default_dtype is torch.float16
    assert g.default_dtype is torch.float32
    with pytest.raises(TypeError):
        with g.dtype_guard("float64"):
            pass


def test_factories_take_the_default_graphs_guarded_mesh_and_dtype(mesh1):
    g = dtorch.default_graph
    with g.device_mesh_guard(mesh1), g.dtype_guard(torch.float64):
        x = dtorch.ones(6)
    assert x.device_mesh == mesh1 and x.dtype is torch.float64
    assert dtorch.ones(6).device_mesh == dtorch.DeviceMesh("cpu", [0])


def test_satisfy(mesh2):
    g = dtorch.default_graph
    assert g.satisfy(mesh2) and g.satisfy(dtorch.DeviceMesh("cpu", [1000])) and g.satisfy("cpu")
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert not g.satisfy(f"cuda:{n}")
    assert g.satisfy(torch.device("cuda", 0)) == (n > 0)
    if n:
        assert g.satisfy(dtorch.DeviceMesh("cuda", list(range(n))))


# -- memory ---------------------------------------------------------------------------------------


def test_memory_stat():
    s = MemoryStat(allocated=4_194_304, reserved=8_000_000, max_memory_allocated=5,
                   max_memory_reserved=12_345_678_901)
    assert str(s) == ("MemoryStat(allocated: 4.1943MB, reserved: 8MB, maxAllocated: 5e-06MB, "
                      "maxReserved: 12345.7MB)")
    assert (s.memory_allocated, s.memory_reserved, s.max_memory_allocated,
            s.max_memory_reserved) == (4_194_304, 8_000_000, 5, 12_345_678_901)
    assert MemoryStat(s) == s and eval(repr(s), {"MemoryStat": MemoryStat}) == s
    s.memory_allocated = 1
    assert s.memory_allocated == 1 and s != MemoryStat()
    assert str(MemoryStat()) == ("MemoryStat(allocated: 0MB, reserved: 0MB, maxAllocated: 0MB, "
                                 "maxReserved: 0MB)")
    with pytest.raises(TypeError):
        MemoryStat(allocated=1.5)


def test_memory_stats_mapping():
    stats = MemoryStats({3: MemoryStat(allocated=2_000_000), 1: MemoryStat()}, device_type="cuda")
    assert stats.size == len(stats) == 2 and list(stats) == [1, 3]
    assert stats.find(3).memory_allocated == 2_000_000 and stats[1] == MemoryStat()
    assert stats.find(0) is None and 0 not in stats
    with pytest.raises(KeyError):
        stats[0]
    assert [d for d, _ in stats.items()] == [1, 3]
    assert str(stats) == (
        "MemoryStats(\n"
        "\tcuda:1: MemoryStat(allocated: 0MB, reserved: 0MB, maxAllocated: 0MB, maxReserved: 0MB)\n"
        "\tcuda:3: MemoryStat(allocated: 2MB, reserved: 0MB, maxAllocated: 0MB, maxReserved: 0MB)\n"
        ")")
    assert str(MemoryStats()) == "MemoryStats(\n)"


def _held(stats, devices) -> list:
    return [stats.find(d).memory_allocated for d in devices]


def test_cpu_memory_figures_follow_the_tensors_devices_hold():
    mesh = dtorch.DeviceMesh("cpu", [4, 5])
    g = dtorch.default_graph
    gc.collect()  # other tests' tensors in reference cycles go first
    base = g.get_memory_stats(mesh)
    assert isinstance(base, MemoryStats) and base.size == 2 and list(base) == [4, 5]
    start = _held(base, [4, 5])
    big = dtorch.ones((2, MB), device_mesh=mesh, placements=[Shard(0)])  # 4 MB on each device
    view = big.reshape(-1)  # shares the storage: counted once
    held = g.get_memory_stats(mesh)
    assert _held(held, [4, 5]) == [s + 4 * MB for s in start]
    for d in (4, 5):
        stat = held.find(d)
        assert stat.memory_reserved == stat.memory_allocated  # a CPU device caches nothing
        assert stat.max_memory_allocated >= stat.memory_allocated
    del big, view
    dropped = g.get_memory_stats(mesh, reset_peak=True)
    assert _held(dropped, [4, 5]) == start
    for d in (4, 5):  # the peak stays until it is reset
        assert dropped.find(d).max_memory_allocated >= start[0] + 4 * MB
    after = g.get_memory_stats(mesh)
    for d, s in zip((4, 5), start):
        stat = after.find(d)
        assert stat.memory_allocated == s
        # reset: only the figures' own rows (a 1 x 4 int64 block) have been held since
        assert s <= stat.max_memory_allocated <= s + 1024
        assert stat.max_memory_reserved == stat.max_memory_allocated


def test_memory_figures_of_a_2d_mesh_and_the_default(mesh2):
    x = dtorch.zeros((4, 1024), device_mesh=mesh2, placements=[Shard(0), Shard(1)])
    stats = dtorch.default_graph.get_memory_stats(mesh2)
    assert list(stats) == [0, 1, 2, 3]
    assert all(stats.find(d).memory_allocated >= 2 * 512 * 4 for d in range(4))
    everywhere = dtorch.default_graph.get_memory_stats()  # every CPU device used so far
    assert {0, 1, 2, 3} <= set(everywhere) and everywhere.find(10_000) is None
    del x


def test_empty_cache_keeps_what_is_held():
    mesh = dtorch.DeviceMesh("cpu", [6])
    g = dtorch.default_graph
    x = dtorch.ones(MB, device_mesh=mesh)
    g.empty_cache()
    assert g.get_memory_stats(mesh).find(6).memory_allocated >= 4 * MB
    del x
    g.empty_cache()
    assert g.get_memory_stats(mesh).find(6).memory_allocated < 4 * MB
