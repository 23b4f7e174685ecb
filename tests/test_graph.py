"""dtorch.Graph: each graph runs on compute streams of its own; values cross graphs and streams
with the waits the controller adds, and in-place writes wait for collectives reading them."""

import asyncio
import threading

import pytest
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


# -- which graph a tensor belongs to, and where operators on it run -------------------------------


def streams_of(prof, *names) -> dict:
    """{operator name: the streams its kernels ran on}, a fused kernel counting for each of its
    operators (``mul+sum``) and a backward as ``name (backward)``: a graph's compute stream is
    its id + 1."""
    found: dict = {}
    for e in prof.kernels():
        for name in e["name"].removeprefix("step:").split("+"):
            if name in names:
                found.setdefault(name, set()).add(e["tid"])
    return found


def test_factories_make_their_tensors_on_graph_or_the_current_graph(mesh2):
    g, h = dtorch.Graph(), dtorch.Graph()
    t = torch.randn(4, 3)
    assert dtorch.ones(2).graph == dtorch.default_graph
    assert dtorch.Tensor(t).graph == dtorch.default_graph
    assert dtorch.Tensor(t, graph=g).graph == g
    assert dtorch.tensor([1.5], graph=g).graph == g
    assert dtorch.from_torch(t, mesh2, [Shard(0), Replicate()], graph=g).graph == g
    assert dtorch.randn(3, graph=g).graph == g
    with g:
        made = [dtorch.zeros(3), dtorch.arange(4), dtorch.full((2,), 1.0), dtorch.rand(2),
                dtorch.from_torch(t), dtorch.eye(2)]
        assert all(m.graph == g for m in made)
        assert dtorch.zeros(3, graph=h).graph == h  # graph= wins over the block
    x = dtorch.from_torch(t, mesh2, [Replicate(), Shard(1)], graph=g)
    likes = [dtorch.zeros_like(x), dtorch.ones_like(x), dtorch.full_like(x, 2.0),
             dtorch.rand_like(x), dtorch.randint_like(x, 5)]
    assert all(m.graph == g for m in likes)  # the input's graph, as DTorch
    assert dtorch.zeros_like(x, graph=h).graph == h
    alias = dtorch.tensor(x, graph=h)  # an alias of x's blocks, on h from now on
    assert alias.graph == h and dtorch.tensor(x).graph == g
    assert torch.equal(alias.to_torch(), t) and torch.equal((alias * 2).to_torch(), t * 2)


def test_graph_must_be_a_graph_at_the_users_line():
    with pytest.raises(TypeError, match=r"dtorch\.zeros: graph must be a dtorch\.Graph, got str"):
        dtorch.zeros(3, graph="g")
    with pytest.raises(TypeError, match="graph must be a dtorch.Graph"):
        dtorch.ones(3, device_mesh=dtorch.DeviceMesh("cpu", [0]), graph=1)


def test_operators_run_on_their_operands_graph_not_the_with_block(mesh1):
    g, h = dtorch.Graph(), dtorch.Graph()
    t = torch.randn(5, 4)
    x = dtorch.from_torch(t, mesh1, [Shard(0)], graph=g)
    with dtorch.profiler.profile() as prof:
        with h:
            y = x.exp()  # x is g's: runs on g, whatever block it is issued in
            z = (y * 2).sum(0)
            r = x.redistribute(placements=[Replicate()])
            written = x.mul_(3.0)  # in place, on x's graph too
        assert_close(z, (t.exp() * 2).sum(0))
        assert_close(r, t)
        assert_close(x, t * 3)
    assert written is x and x.graph == g
    assert y.graph == g and z.graph == g and r.graph == g
    on_g = {g.id + 1}
    assert streams_of(prof, "exp", "mul", "sum", "mul_") == {"exp": on_g, "mul": on_g,
                                                            "sum": on_g, "mul_": on_g}


def test_operands_on_several_graphs(mesh2):
    """The innermost ``with graph:`` when it is one of the operands' graphs, else the first
    tensor operand's graph; values as torch's either way."""
    g, h, k = dtorch.Graph(), dtorch.Graph(), dtorch.Graph()
    a_t, b_t = torch.randn(6, 4), torch.randn(6, 4)
    a = dtorch.from_torch(a_t, mesh2, [Shard(0), Replicate()], graph=g)
    b = dtorch.from_torch(b_t, mesh2, [Replicate(), Shard(1)], graph=h)
    with dtorch.profiler.profile() as prof:
        ab, ba = a + b, b - a  # outside any block: the first operand's
        with h:
            in_h = a * b  # h is among them
            with k:
                in_k = a.maximum(b)  # k is not: the first operand's
        w = dtorch.where(a > 0, b, a)  # several graphs, three operands: the first tensor's
    assert (ab.graph, ba.graph, in_h.graph, in_k.graph) == (g, h, h, g)
    assert w.graph == a.graph == g
    assert streams_of(prof, "add", "sub", "mul", "maximum") == {
        "add": {g.id + 1}, "sub": {h.id + 1}, "mul": {h.id + 1}, "maximum": {g.id + 1}}
    assert_close(ab, a_t + b_t)
    assert_close(ba, b_t - a_t)
    assert_close(in_h, a_t * b_t)
    assert_close(in_k, torch.maximum(a_t, b_t))
    assert_close(w, torch.where(a_t > 0, b_t, a_t))


def test_two_graphs_writing_and_reading_one_tensor_in_turn(mesh1):
    """In-place writes of two graphs to one tensor, each read by the other graph: every access
    waits for the conflicting ones of the other stream (a race would show as a wrong value)."""
    g, h = dtorch.Graph(), dtorch.Graph()
    t = torch.randn(256, 256)
    x = dtorch.from_torch(t, mesh1, [Shard(0)], graph=g)
    y = dtorch.zeros(256, 256, device_mesh=mesh1, placements=[Shard(0)], graph=h)
    ref_x, ref_y = t.clone(), torch.zeros(256, 256)
    reads = []
    for step in range(6):
        x.mul_(0.5).add_(1.0)  # on g (x's)
        with h:
            # x @ x.T: both g's, so on g; y.add_ of it: y is h's, in h's block: on h
            y.add_(x @ x.T.redistribute(placements=[Replicate()]) * 1e-3)
            x.sub_(y.tanh())  # x's write, in h's block: on h, after g's writes and reads
        reads.append((x * y).sum())  # x first: on g, after h's writes
        ref_x.mul_(0.5).add_(1.0)
        ref_y.add_(ref_x @ ref_x.T * 1e-3)
        ref_x.sub_(ref_y.tanh())
        reads[-1] = (reads[-1], (ref_x * ref_y).sum())
    assert x.graph == g and y.graph == h
    for got, want in reads:
        assert_close(got, want)
    assert_close(x, ref_x)
    assert_close(y, ref_y)


def test_one_graphs_sync_waits_for_every_graph(mesh1):
    """``sync`` waits for the work of every graph, as DTorch's: it raises a failure of another
    graph's operator, with that operator's line."""
    g, h = dtorch.Graph(), dtorch.Graph()
    bad = dtorch.tensor([2], graph=h) ** -1  # integers to a negative power fail on the host
    with pytest.raises(RuntimeError, match=r"pow.*test_graph\.py"):
        g.sync()
    assert bad.graph == h
    dtorch.sync()


def test_a_mesh_mismatch_across_graphs_raises_at_the_users_line(mesh1, mesh2):
    g = dtorch.Graph()
    a = dtorch.ones(4, device_mesh=mesh1, graph=g)
    b = dtorch.ones(4, 1, device_mesh=mesh2)
    with pytest.raises(ValueError, match="different meshes"):
        a + b


def test_backward_runs_on_the_forwards_graph(mesh2):
    """Parameters on the default graph, the input and the forward on another: the VJPs run
    where their forward ran, and the gradients equal torch's."""
    g = dtorch.Graph()
    w_t, x_t = torch.randn(4, 3), torch.randn(6, 4)
    w = dtorch.from_torch(w_t, mesh2, [Replicate(), Shard(1)]).requires_grad_()
    x = dtorch.from_torch(x_t, mesh2, [Shard(0), Replicate()], graph=g)
    with dtorch.profiler.profile() as prof:
        loss = (x @ w).tanh().sum()  # x first: on g
        with dtorch.Graph():
            loss.backward()  # the block does not move the VJPs
        assert_close(w.grad, torch.func.grad(lambda w: (x_t @ w).tanh().sum())(w_t))
    assert loss.graph == g and w.graph == dtorch.default_graph
    backward = streams_of(prof, "matmul (backward)", "tanh (backward)", "sum (backward)")
    assert backward and set().union(*backward.values()) == {g.id + 1}


def test_parameters_belong_to_the_graph_they_were_made_on():
    g = dtorch.Graph()
    with g:
        layer = dtorch.nn.Linear(3, 2)
    assert layer.weight.graph == g and layer.bias.graph == g
    p = dtorch.nn.Parameter(dtorch.zeros(3))
    assert p.graph == dtorch.default_graph
    x = dtorch.randn(5, 3)  # the default graph's; the parameters are g's
    y = layer(x)
    assert y.graph == dtorch.default_graph  # linear(x, weight): x is the first operand
    ref = torch.nn.functional.linear(x.to_torch(), layer.weight.to_torch(), layer.bias.to_torch())
    assert_close(y, ref)


def test_threads_on_graphs_of_their_own_with_shared_tensors(mesh2):
    """Two threads, each in ``with`` a graph of its own, read the same shared weights (the
    importing thread's) and one shared tensor they both update in turn under a lock."""
    w_t = torch.randn(8, 8) / 3
    w = dtorch.from_torch(w_t, mesh2, [Replicate(), Replicate()])
    shared = dtorch.zeros(8, device_mesh=mesh2)
    graphs, out, lock = [dtorch.Graph(), dtorch.Graph()], {}, threading.Lock()
    inputs = [torch.randn(4, 8) for _ in graphs]

    def work(k):
        with graphs[k]:
            x = dtorch.from_torch(inputs[k], mesh2, [Shard(0), Replicate()])
            for _ in range(20):
                x = (x @ w).tanh()
                with lock:
                    # on shared's graph, the importing thread's
                    shared.add_(x.sum(0).redistribute(placements=[Replicate(), Replicate()]))
            out[k] = x

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    total = torch.zeros(8)
    for k, g in enumerate(graphs):
        ref = inputs[k]
        for _ in range(20):
            ref = (ref @ w_t).tanh()
            total += ref.sum(0)
        assert out[k].graph == g
        assert_close(out[k], ref)
    assert shared.graph == dtorch.default_graph
    assert_close(shared, total)
