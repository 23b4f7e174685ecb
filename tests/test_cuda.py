"""What only a GPU can show: every factory's blocks on their GPU, NCCL collectives, kernels on
CUDA streams ordered by events, the memory figures against torch.cuda's, and CUDA graphs of a
hot program against its eager run. Each test is marked ``cuda`` (``cuda(n=2)``: two GPUs) and
skipped where torch sees fewer GPUs (``conftest.py``); ``benchmarks/gpu_check.py`` runs them."""

import pytest
import torch

import dtorch
from dtorch import Partial, Replicate, Shard
from helpers import runtime_with

R, S0 = Replicate(), Shard(0)

FACTORIES = {  # name -> fn(mesh, placements): a (6, 4) float tensor made by that factory
    "zeros": lambda m, p: dtorch.zeros(6, 4, device_mesh=m, placements=p),
    "ones": lambda m, p: dtorch.ones(6, 4, device_mesh=m, placements=p),
    "empty": lambda m, p: dtorch.empty(6, 4, device_mesh=m, placements=p).zero_(),
    "full": lambda m, p: dtorch.full((6, 4), 2.5, device_mesh=m, placements=p),
    "rand": lambda m, p: dtorch.rand(6, 4, device_mesh=m, placements=p),
    "randn": lambda m, p: dtorch.randn(6, 4, device_mesh=m, placements=p,
                                       generator=torch.Generator().manual_seed(0)),
    "arange": lambda m, p: dtorch.arange(24.0, device_mesh=m, placements=p).reshape(6, 4),
    "eye": lambda m, p: dtorch.eye(6, 4, device_mesh=m, placements=p),
    "linspace": lambda m, p: dtorch.linspace(0, 1, 24, device_mesh=m, placements=p).view(6, 4),
    "from_torch": lambda m, p: dtorch.from_torch(torch.rand(6, 4), m, p),
    "uniform_": lambda m, p: dtorch.empty(6, 4, device_mesh=m, placements=p).uniform_(),
    "normal_": lambda m, p: dtorch.empty(6, 4, device_mesh=m, placements=p).normal_(),
}


def on_device(t):
    """``t`` through a kernel that returns each block as it is (``torch.clone``): a host
    refuses a block that is not on its device (``dtorch.local_map``), so this read fails
    unless every block of ``t`` is on its GPU."""
    return dtorch.local_map(torch.clone, [list(t.placements)])(t)


@pytest.mark.cuda
@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_every_factory_makes_its_blocks_on_the_gpu(name):
    mesh = dtorch.DeviceMesh("cuda", [0])
    t = FACTORIES[name](mesh, [R])
    assert torch.equal(on_device(t).to_torch(), t.to_torch())


@pytest.mark.cuda(n=2)
@pytest.mark.parametrize("placements", [[S0], [R], [Partial()]], ids=["S0", "R", "P"])
@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_every_factory_on_two_gpus(name, placements):
    mesh = dtorch.DeviceMesh("cuda", [0, 1])
    t = FACTORIES[name](mesh, placements)
    assert torch.equal(on_device(t).to_torch(), t.to_torch())


@pytest.mark.cuda(n=2)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nccl_collectives_equal_torch(dtype):
    """Every redistribute a 2-GPU mesh lowers to a collective (all-reduce, all-gather,
    reduce-scatter, all-to-all) equals the value torch computes in one process; bfloat16 sums
    accumulate in float32 as torch's do."""
    mesh = dtorch.DeviceMesh("cuda", [0, 1])
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1)).to(dtype)
    tol = dict(atol=1e-2, rtol=1e-2) if dtype == torch.bfloat16 else {}
    for src, dst in (([S0], [R]), ([R], [S0]), ([S0], [Shard(1)]), ([Partial()], [R]),
                     ([Partial()], [S0])):
        t = dtorch.from_torch(x, mesh, src)
        torch.testing.assert_close(t.redistribute(placements=dst).to_torch(), x, **tol)


@pytest.mark.cuda
def test_a_hot_loop_on_cuda_graphs_equals_its_eager_run():
    """The same loop with CUDA graphs on (the default) and off: each iteration's value equal,
    read inside the replayed windows (every 8th step), not only the last."""
    def loop():
        mesh = dtorch.DeviceMesh("cuda", [0])
        x = dtorch.from_torch(torch.linspace(-1, 1, 4096), mesh)
        seen = []
        for k in range(400):
            x = (x * 1.0001 + 0.001).tanh()
            if k % 8 == 7:
                seen.append(x.to_torch())
        return seen

    with runtime_with(DTORCH_CUDA_GRAPHS="1", DTORCH_FUSION_AFTER="8",
                      DTORCH_FUSION_AFTER_S="0"):
        graphed = loop()
    with runtime_with(DTORCH_CUDA_GRAPHS="0", DTORCH_FUSION="0"):
        eager = loop()
    for a, b in zip(graphed, eager):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.cuda
def test_memory_figures_are_torch_cudas():
    """``get_memory_stats`` on a GPU counts what torch.cuda counts on the host: a 64 MiB tensor
    made and freed moves both by its size."""
    mesh = dtorch.DeviceMesh("cuda", [0])
    graph = dtorch.default_graph
    before = graph.get_memory_stats(mesh).find(0).memory_allocated
    t = dtorch.zeros(16 << 20, device_mesh=mesh)
    during = graph.get_memory_stats(mesh).find(0).memory_allocated
    assert during - before >= 64 << 20
    del t
    assert graph.get_memory_stats(mesh).find(0).memory_allocated <= before + (1 << 20)


@pytest.mark.cuda
def test_streams_order_a_collective_after_compute_and_a_free_after_its_last_use():
    """A value computed on the compute stream, moved by the communication stream and freed
    while queued work still reads it: every read gives the value (events order the streams;
    a cross-stream free waits for its readers)."""
    mesh = dtorch.DeviceMesh("cuda", [0])
    for k in range(20):
        x = dtorch.full((1 << 20,), float(k), device_mesh=mesh)
        y = (x * 2).redistribute(placements=[R])
        del x
        assert y.sum().item() == 2.0 * k * (1 << 20)
