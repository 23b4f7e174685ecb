"""Ordering across graphs and streams, end to end: every program here runs on plain torch and on
dtorch with its accesses split over two graphs' compute streams and the communication stream,
and must give torch's values.

Each program first makes one stream busy (``busy``: a chain of matmuls, about 0.2 s on one CPU
thread) and then issues an access there that conflicts with one issued next on another, idle
stream. Without the wait between them the idle stream's access runs first, so each test fails
whenever the ordering is missing (they all failed before ``assign_streams`` ordered accesses by
storage; see test_passes.py for the exact waits)."""

import contextlib

import pytest
import torch

import dtorch
from dtorch import Replicate, Shard
from helpers import assert_close

BUSY_N, BUSY_STEPS = 512, 12


def busy(mesh):
    """Queues about 0.2 s of matmuls on the current graph's compute stream of ``mesh``'s
    devices. The result must stay alive until the check: released unread, the chain would be
    dropped as dead code."""
    a = dtorch.ones((BUSY_N, BUSY_N), device_mesh=mesh,
                    placements=[Replicate()] * len(mesh.shape)) / BUSY_N
    s = a
    for _ in range(BUSY_STEPS):
        s = s @ a
    return s


class Torch:
    """Plays the part of the runtime in a program run on torch: graphs are no-ops, nothing is
    slow."""

    a = b = contextlib.nullcontext()

    @staticmethod
    def busy():
        return None


class Dtorch:
    def __init__(self, mesh):
        self.a, self.b, self.mesh = dtorch.Graph(), dtorch.Graph(), mesh
        self.kept = []

    def busy(self):
        self.kept.append(busy(self.mesh))


def read_then_write_elsewhere(x, rt):
    with rt.b:
        rt.busy()
        y = x * 2
    with rt.a:
        x.add_(100)  # after B's read
    return y, x


def write_through_a_view_then_read_elsewhere(x, rt):
    with rt.a:
        rt.busy()
        x[1:3].mul_(10)
    with rt.b:
        y = x + 0  # after A's write through the view
    return y, x


def read_then_write_through_a_view_elsewhere(x, rt):
    with rt.b:
        rt.busy()
        y = x * 2
    with rt.a:
        x[0:2].add_(100)  # after B's read of the base
    return y, x


def write_then_write_through_an_older_view_elsewhere(x, rt):
    v = x.view(16)
    with rt.b:
        rt.busy()
        x.mul_(2)
    with rt.a:
        v.add_(1)  # after B's write of the base
    return (x,)


PROGRAMS = [
    read_then_write_elsewhere,
    write_through_a_view_then_read_elsewhere,
    read_then_write_through_a_view_elsewhere,
    write_then_write_through_an_older_view_elsewhere,
]


@pytest.mark.parametrize("program", PROGRAMS, ids=lambda p: p.__name__)
def test_conflicting_accesses_in_two_graphs_run_in_program_order(program, one):
    t = torch.arange(16.0).reshape(4, 4)
    expected = program(t.clone(), Torch)
    rt = Dtorch(one)
    actual = program(dtorch.from_torch(t, one, [Replicate()]), rt)
    for a, e in zip(actual, expected):
        assert_close(a, e, exact=True)


@pytest.mark.parametrize("drop_base", [False, True], ids=["base kept", "base released"])
def test_in_place_write_in_another_graph_waits_for_a_collective_reading_it(mesh1, drop_base):
    t = torch.randn(5, 6)
    x = dtorch.from_torch(t, mesh1, [Shard(1)])
    v = x.t()  # a view: Shard(0)
    ga, gb = dtorch.Graph(), dtorch.Graph()
    with gb:  # the comm stream waits for B's busy work, so the gather of v runs late
        _late = busy(mesh1).redistribute(placements=[Shard(0)]).redistribute(
            placements=[Replicate()])
    gathered = v.redistribute(placements=[Replicate()])
    if drop_base:
        del x  # the view keeps the storage, and its ordering
    with ga:
        v.mul_(0)  # after the all-gather read it
    assert_close(gathered, t.t())
    assert_close(v, torch.zeros(6, 5))


def test_a_fetch_sees_a_write_made_in_another_graph_through_a_view(one):
    t = torch.arange(12.0).reshape(3, 4)
    x = dtorch.from_torch(t, one, [Replicate()])
    ga = dtorch.Graph()
    with ga:
        _kept = busy(one)  # alive to the end: dropped unread, it would be dead code
        x[1].add_(1)
    expected = t.clone()
    expected[1] += 1
    assert_close(x, expected, exact=True)  # the fetch of x runs after A's write


def test_a_fetch_does_not_see_a_write_issued_after_it_in_another_graph(one):
    t = torch.arange(12.0).reshape(3, 4)
    x = dtorch.from_torch(t, one, [Replicate()])
    ga, gb = dtorch.Graph(), dtorch.Graph()
    with gb:
        y = x * 1
    with ga:
        z = y + 0  # A has waited for B up to y
    with gb:
        _kept = busy(one)  # alive to the end: dropped unread, it would be dead code
    fetched = y.to_torch_async()  # queued on B, behind the busy work
    with ga:
        y.add_(100)  # must wait for the fetch
    torch.testing.assert_close(fetched.get(), t, rtol=0, atol=0)
    assert_close(y, t + 100, exact=True)
    assert_close(z, t, exact=True)
