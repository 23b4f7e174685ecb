"""dtorch.Graph: each graph runs on compute streams of its own; values cross graphs and streams
with the waits the controller adds, and in-place writes wait for collectives reading them."""

import asyncio

import torch

import dtorch
from dtorch import Partial, Replicate, Shard
from helpers import assert_close


def test_default_graph_and_sync():
    assert isinstance(dtorch.default_graph, dtorch.Graph)
    x = dtorch.ones(3) * 2
    dtorch.default_graph.sync()
    assert x.tolist() == [2.0, 2.0, 2.0]


def test_two_graphs_and_values_crossing_them(mesh2):
    g1, g2 = dtorch.Graph(), dtorch.Graph()
    t = torch.randn(6, 4)
    with g1:
        a = dtorch.from_torch(t, mesh2, [Shard(0), Replicate()]) * 3
    with g2:
        b = dtorch.from_torch(t, mesh2, [Shard(0), Replicate()]) + 1
        c = a + b  # reads g1's result on g2's stream: waits for it
    d = c.redistribute(placements=[Replicate(), Replicate()])  # the comm stream waits for g2
    g1.sync()
    assert_close(d, t * 3 + t + 1)


def test_in_place_write_waits_for_a_collective_reading_it(mesh1):
    t = torch.randn(6, 5)
    x = dtorch.from_torch(t, mesh1, [Shard(0)])
    gathered = x.redistribute(placements=[Replicate()])  # the comm stream reads x
    x.mul_(0)  # compute stream: must not overwrite x before the all-gather has read it
    assert_close(gathered, t)
    assert_close(x, torch.zeros_like(t))


def test_partial_reduction_and_futures_across_graphs(mesh1):
    t = torch.randn(4, 3)
    p = dtorch.from_torch(t, mesh1, [Partial()])
    with dtorch.Graph():
        q = p * 2  # linear: stays Partial
    futures = [q.to_torch_async(), q.redistribute(placements=[Shard(1)]).to_torch_async()]

    async def gather():
        return await asyncio.gather(*futures)

    for value in asyncio.run(gather()):
        torch.testing.assert_close(value, t * 2)
    assert all(f.is_ready() for f in futures)
