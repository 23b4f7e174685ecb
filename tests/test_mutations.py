"""Mutation check of the placement tables: plant one wrong rule at a time and show that the value
checks catch it.

Each mutation lets an operator accept a layout its table refuses (a wrong row: the result keeps
the first operand's placements, as a careless row would say) or changes a reduction's entry.
The check runs that call on genuine contributions (``helpers.distribute``) and compares with
torch: unmutated the call is refused, mutated it runs and its value is wrong. With the old
inputs (``from_torch``: a Partial's value on device 0, zeros or copies elsewhere) ten of the
fifteen Partial mutations below would pass the value check: relu of zeros is zero, a product
with zeros is zero, and the max of copies is the copy.
"""

from __future__ import annotations

import pytest
import torch

import dtorch
import dtorch.nn.functional as F
from dtorch import Partial, Replicate, Shard
from dtorch.client import session
from dtorch.ops import reduction
from dtorch.ops.registry import REGISTRY
from dtorch.ops.rules import Placed
from helpers import assert_close, assert_refused, distribute, sample

R, S0, S1, P, PMAX = Replicate(), Shard(0), Shard(1), Partial(), Partial("max")


def let_through(name: str, wrong):
    """A mutation: ``name``'s rule also takes the calls where ``wrong(placements of each tensor
    operand, call)`` holds, its results keeping the first operand's placements."""

    def plant(monkeypatch):
        op = REGISTRY[name]
        original = op.placement

        def mutated(call):
            try:
                return original(call)
            except ValueError:
                if not wrong([s.placements for s in call.tensors], call):
                    raise
                return Placed((call.tensors[0].placements,) * len(call.outs))

        monkeypatch.setattr(op, "placement", mutated)

    return plant


def reduces_as(name: str, made, passes=()):
    """A mutation of a reduction's entry: a sharded reduced dim makes Partial(``made``), the
    Partials ``passes`` pass through."""

    def plant(monkeypatch):
        monkeypatch.setitem(reduction.REDUCTIONS, name, (made, passes))

    return plant


def has(placement):
    return lambda pls, call: any(placement in p for p in pls)


def any_shard(pls, call) -> bool:
    return any(p.is_shard() for p in pls[0])


# name: (mutation, mesh fixture, fn on torch and dtorch operands alike, operands (torch value,
# placements))
A, B = sample((5, 7)), sample((5, 7), seed=1)
MUTATIONS = {
    # elementwise
    "relu passes P": (let_through("relu", has(P)), "mesh1", lambda x: x.relu(), [(A, [P])]),
    "exp passes P": (let_through("exp", has(P)), "mesh1", lambda x: x.exp(), [(A, [P])]),
    "abs passes P(max)": (let_through("abs", has(PMAX)), "mesh1", lambda x: x.abs(),
                          [(A, [PMAX])]),
    "P + scalar": (let_through("add", lambda pls, call: call.has_scalar), "mesh1",
                   lambda x: x + 1, [(A, [P])]),
    "P * P": (let_through("mul", lambda pls, call: pls == [(P,), (P,)]), "mesh1",
              lambda x, y: x * y, [(A, [P]), (B, [P])]),
    "maximum passes P(sum)": (let_through("maximum", has(P)), "mesh1",
                              lambda x, y: torch.maximum(x, y) if isinstance(x, torch.Tensor)
                              else dtorch.maximum(x, y), [(A, [P]), (B, [R])]),
    "long passes P": (let_through("long", has(P)), "mesh1", lambda x: x.long(), [(A * 4, [P])]),
    "gt passes P on a 2-D mesh": (let_through("gt", has(P)), "mesh2", lambda x: x > 0,
                                  [(A, [S0, P])]),
    # reductions
    "amax passes P": (reduces_as("amax", "max", ("max", "sum")), "mesh1",
                      lambda x: x.amax(dim=1), [(A, [P])]),
    "sum passes P(max)": (reduces_as("sum", "sum", ("sum", "avg", "max")), "mesh1",
                          lambda x: x.sum(dim=0), [(A, [PMAX])]),
    "prod of shards as a sum": (reduces_as("prod", "sum"), "mesh1", lambda x: x.prod(dim=0),
                                [(A, [S0])]),
    "argmax of shards as a max": (reduces_as("argmax", "max"), "mesh1",
                                  lambda x: x.argmax(dim=1), [(A, [S1])]),
    "std passes P": (reduces_as("std", None, ("sum",)), "mesh1", lambda x: x.std(dim=1),
                     [(A, [P])]),
    # linear algebra
    "P @ P": (let_through("matmul", lambda pls, call: pls == [(P,), (P,)]), "mesh1",
              lambda x, y: x @ y, [(A, [P]), (B.t(), [P])]),
    "einsum of P times P": (let_through("einsum", lambda pls, call: pls == [(P,), (P,)]),
                            "mesh1", lambda x, y: (dtorch if isinstance(x, dtorch.Tensor)
                                                   else torch).einsum("ij,ij->i", x, y),
                            [(A, [P]), (B, [P])]),
    "linear adds a P(avg) bias to a P product": (
        let_through("linear", lambda pls, call: pls[-1] == (Partial("avg"),)), "mesh1",
        lambda x, w, b: (F if isinstance(x, dtorch.Tensor) else torch.nn.functional).linear(
            x, w, b), [(A, [P]), (sample((3, 7), seed=2), [R]),
                       (sample((3,), seed=3), [Partial("avg")])]),
    # shape
    "flip of a sharded dim": (let_through("flip", any_shard), "mesh1", lambda x: x.flip(0),
                              [(A, [S0])]),
    "roll of a sharded dim": (let_through("roll", any_shard), "mesh1",
                              lambda x: x.roll(2, 1), [(A, [S1])]),
    # (cat along its shard is right now: a sub-split Shard) a plain Shard read as a sub-split
    "sub-split + plain shard": (let_through("add", any_shard), "mesh1", lambda x, y: x + y,
                                [(A, [Shard(0, (3, 2))]), (B, [S0])]),
    # indexing
    "slice of a sharded dim": (let_through("getitem", any_shard), "mesh1",
                               lambda x: x[:, 1:6], [(A, [S1])]),
    "sort along a sharded dim": (let_through("sort", any_shard), "mesh1",
                                 lambda x: x.sort(dim=0).values, [(A, [S0])]),
    "number written into P": (let_through("setitem", lambda pls, call: call.has_scalar),
                              "mesh1", lambda x: _set(x.clone(), 2.0), [(A, [P])]),
    "gather along a sharded dim": (let_through("gather", any_shard), "mesh1",
                                   lambda x, i: x.gather(1, i),
                                   [(A, [S1]), (torch.randint(0, 2, (5, 7)), [S1])]),
}


def _set(x, value):
    x[:, 1] = value
    return x


@pytest.fixture
def fresh_rules():
    """The session's bound-call cache holds each call shape's rule result: cleared before and
    after, so a planted rule is consulted and leaves nothing behind."""
    dtorch.sync()  # starts the runtime if no test did
    session._current.bound.clear()
    yield
    session._current.bound.clear()


@pytest.mark.parametrize("name", MUTATIONS)
def test_planted_wrong_rule_is_caught(name, fresh_rules, monkeypatch, request):
    plant, mesh_name, fn, operands = MUTATIONS[name]
    mesh = request.getfixturevalue(mesh_name)
    ts = [t for t, _ in operands]
    xs = [distribute(t, mesh, pl, seed=k) for k, (t, pl) in enumerate(operands)]
    assert_refused(fn, *xs)  # the table refuses it (what the suite's tables declare)
    plant(monkeypatch)
    session._current.bound.clear()
    out = fn(*xs)  # the wrong row takes it now ...
    with pytest.raises(AssertionError):  # ... and the value check catches it
        assert_close(out, fn(*ts))

