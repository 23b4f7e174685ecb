"""The one rule of which Partials a dtype can hold (``placement.check_partials``, run by
``spec.intern_spec`` on every new layout): every way of making a tensor meets it, before
anything is sent."""

import pytest
import torch

import dtorch
from dtorch import Partial, Replicate, Shard
from helpers import assert_close
from test_validation import assert_raises_at_call, assert_usable

R = Replicate()


INTEGERS = [torch.int32, torch.int64, torch.int8, torch.uint8, torch.bool]


@pytest.mark.parametrize("dtype", INTEGERS, ids=str)
def test_an_integer_average_is_refused_wherever_it_would_be_made(mesh1, dtype):
    """No collective of torch averages integers: an int32 Partial(avg) of 1073741825 would read
    back as a wrapped sum divided. Every way of laying a tensor out (factories, from_torch,
    DTorch's constructors, a redistribute, a local_map's result, an operator's result) goes
    through the one check, which names the dtype and the fix; float averages pass."""
    avg, t = Partial("avg"), torch.tensor([1073741825, 3], dtype=torch.int32).to(dtype)
    x = dtorch.from_torch(t, mesh1, [R])
    s = dtorch.from_torch(t, mesh1, [Shard(0)])
    name = str(dtype)[6:]
    calls = [
        lambda: dtorch.from_torch(t, mesh1, [avg]),
        lambda: dtorch.zeros(3, dtype=dtype, device_mesh=mesh1, placements=[avg]),
        lambda: dtorch.full((3,), 1, dtype=dtype, device_mesh=mesh1, placements=[avg]),
        lambda: dtorch.empty(3, dtype=dtype, device_mesh=mesh1, placements=[avg]),
        lambda: dtorch.zeros_like(x, placements=[avg]),
        lambda: dtorch.tensor(t.tolist(), dtype=dtype, device_mesh=mesh1, placements=[avg]),
        lambda: dtorch.Tensor(t, mesh1, [avg]),
        lambda: dtorch.Tensor(x, mesh1, [avg]),  # an alias of x's blocks, moved
        lambda: x.redistribute(placements=[avg]),
        lambda: s.redistribute(placements=[avg]),
        lambda: dtorch.local_map(torch.clone, [avg])(x),
    ]
    if dtype == torch.int64:
        calls += [lambda: dtorch.arange(3, device_mesh=mesh1, placements=[avg]),
                  lambda: dtorch.randint(0, 5, (3,), device_mesh=mesh1, placements=[avg]),
                  lambda: dtorch.LongTensor([1, 2], mesh1, [avg])]
    for call in calls:
        assert_raises_at_call(ValueError, call,
                              match=rf"Partial\(reduce_op='avg'\) cannot hold an? {name} "
                                    rf"tensor.*Partial\('sum'\) or a floating dtype")
    summed = dtorch.from_torch(t, mesh1, [Partial("sum")])  # the fix the message names
    assert summed.to_torch().tolist() == t.tolist()
    if dtype != torch.bool:
        average = dtorch.from_torch(t.double(), mesh1, [avg])  # ... or a floating dtype
        assert_close(average.to_torch(), t.double())
    assert_usable(mesh1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16,
                                   torch.complex64], ids=str)
def test_a_floating_average_is_made_and_read_back(mesh1, dtype):
    """The other side of the rule above: floating and complex Partial(avg) tensors are made by
    every path and read back as their value."""
    t = torch.tensor([1.5, -2.0, 4.0]).to(dtype)
    avg = Partial("avg")
    made = [dtorch.from_torch(t, mesh1, [avg]), dtorch.Tensor(t, mesh1, [avg]),
            dtorch.from_torch(t, mesh1, [R]).redistribute(placements=[avg]),
            dtorch.full((3,), 1.5, dtype=dtype, device_mesh=mesh1, placements=[avg])]
    for x, expected in zip(made, [t, t, t, torch.full((3,), 1.5, dtype=dtype)]):
        assert x.placements == [avg]
        assert_close(x.to_torch(), expected)
