"""torch.max(input, other) / torch.min(input, other): the elementwise forms of the reductions'
names (dtorch/ops/reduction.py ``with_elementwise``), against torch; the reductions keep theirs."""

import pytest
import torch

import dtorch
from dtorch import Partial, Replicate, Shard
from helpers import assert_close, assert_refused, distribute

R, S0, S1 = Replicate(), Shard(0), Shard(1)


def sample(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


CALLS = {  # name: fn(lib, a, b), a and b (5, 4)
    "max": lambda L, a, b: L.max(a, b),
    "min": lambda L, a, b: L.min(a, b),
    "max other=": lambda L, a, b: L.max(a, other=b),
    "method": lambda L, a, b: a.min(b),
    "method other=": lambda L, a, b: a.max(other=b),
}


@pytest.mark.parametrize("placements", [[R], [S0], [S1]], ids=str)
@pytest.mark.parametrize("name", CALLS)
def test_elementwise_forms(name, placements, mesh1):
    a, b = sample(5, 4), sample(5, 4, seed=1)
    got = CALLS[name](dtorch, distribute(a, mesh1, placements), distribute(b, mesh1, placements))
    assert_close(got, CALLS[name](torch, a, b))
    assert got.placements == placements


def test_partial_max_and_reductions_stay(mesh1):
    """max(x, y) passes a Partial(max) (min a Partial(min)); the other Partials are refused."""
    a, b = sample(5, 4), sample(5, 4, seed=1)
    for name, passes in (("max", Partial("max")), ("min", Partial("min"))):
        fn = getattr(dtorch, name)
        got = fn(distribute(a, mesh1, [passes]), distribute(b, mesh1, [R]))
        assert got.placements == [passes]
        assert_close(got, getattr(torch, name)(a, b))
        for other in (Partial(), Partial("avg"), Partial("min" if name == "max" else "max")):
            assert_refused(fn, distribute(a, mesh1, [other]), distribute(b, mesh1, [R]))
    y = distribute(a, mesh1, [S0])
    assert_close(dtorch.max(y), a.max())
    values, indices = dtorch.min(y, 1)
    assert_close(values, a.min(1).values)
    assert_close(indices, a.min(1).indices)
    assert_close(y.max(dim=1, keepdim=True).values, a.max(dim=1, keepdim=True).values)


@pytest.mark.parametrize("call", [lambda L, a: L.max(a, 0.5), lambda L, a: L.max(a, a, True),
                                  lambda L, a: a.min(other=2), lambda L, a: L.max(a, 1, other=a)])
def test_torch_errors(call, mesh1):
    a = sample(5, 4)
    with pytest.raises(TypeError):
        call(torch, a)
    with pytest.raises(TypeError):
        call(dtorch, distribute(a, mesh1, [R]))
