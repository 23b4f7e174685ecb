"""torch's own functions, ``torch.nn.functional`` and ``torch.nn`` modules on dtorch tensors
(``client/overrides.py``: the override protocol), against torch on the same values, on a
sharded batch and a tensor-parallel layout."""

import pytest
import torch
import torch.nn.functional as TF

import dtorch
from dtorch import Replicate, Shard

R, S0 = Replicate(), Shard(0)


def g(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(params=["S0", "R"])
def layout(request, mesh1):
    return mesh1, [S0] if request.param == "S0" else [R]


def put(t, layout):
    mesh, placements = layout
    return dtorch.from_torch(t, mesh, placements)


CALLS = {  # name -> fn(lib's x): the same call on torch's and dtorch's tensors
    "torch.add": lambda x: torch.add(x, x, alpha=2),
    "torch.mul scalar": lambda x: torch.mul(x, 3.0),
    "torch.exp": torch.exp,
    "torch.tanh": torch.tanh,
    "torch.where": lambda x: torch.where(x > 0, x, -x),
    "torch.cat": lambda x: torch.cat([x, x * 2], dim=1),
    "torch.softmax": lambda x: torch.softmax(x, dim=-1),
    "torch.matmul (a torch weight)": lambda x: torch.matmul(x, g(5, 3, seed=1)),
    "torch.sum dim": lambda x: torch.sum(x, dim=1),
    "F.relu": TF.relu,
    "F.gelu tanh": lambda x: TF.gelu(x, approximate="tanh"),
    "F.silu": TF.silu,
    "F.linear (torch weights)": lambda x: TF.linear(x, g(3, 5, seed=2), g(3, seed=3)),
    "F.layer_norm": lambda x: TF.layer_norm(x, (5,), g(5, seed=4), g(5, seed=5)),
    "F.dropout eval": lambda x: TF.dropout(x, 0.5, training=False),
    "torch.Tensor + dtorch": lambda x: torch.ones(7, 5) + x,
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_torch_functions_run_dtorchs_operators(name, layout):
    x = g(7, 5, seed=9)  # 7 rows on 3 devices: uneven blocks
    want = CALLS[name](x)
    got = CALLS[name](put(x, layout))
    assert isinstance(got, dtorch.Tensor)
    torch.testing.assert_close(got.to_torch(), want, atol=1e-6, rtol=1e-5)


def test_torch_modules_run_unmodified(layout):
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.GELU(), torch.nn.LayerNorm(8),
                              torch.nn.Linear(8, 2), torch.nn.Softmax(dim=-1))
    x = g(7, 5, seed=1)
    got = mlp(put(x, layout))
    assert got.placements == layout[1]
    torch.testing.assert_close(got.to_torch(), mlp(x), atol=1e-6, rtol=1e-5)
    emb = torch.nn.Embedding(10, 4)
    ids = torch.tensor([[1, 5, 9], [0, 2, 2]])
    torch.testing.assert_close(emb(dtorch.from_torch(ids, layout[0])).to_torch(), emb(ids))


def test_gradients_flow_through_torchs_functions(mesh2):
    w0, x0 = g(5, 3, seed=1), g(8, 5, seed=2)
    w = dtorch.from_torch(w0, mesh2, [R, Shard(1)]).requires_grad_()
    x = dtorch.from_torch(x0, mesh2, [S0, R])
    TF.silu(torch.matmul(x, w)).pow(2).mean().backward()
    ref = w0.clone().requires_grad_()
    TF.silu(torch.matmul(x0, ref)).pow(2).mean().backward()
    torch.testing.assert_close(w.grad.to_torch(), ref.grad, atol=1e-6, rtol=1e-5)


def test_what_dtorch_lacks_raises_naming_torchs_function(mesh1):
    x = dtorch.from_torch(g(4, 4), mesh1, [S0])
    with pytest.raises(NotImplementedError, match="fft"):
        torch.fft.fft(x)
    with pytest.raises(NotImplementedError, match="kthvalue"):
        torch.kthvalue(x, 2)
    assert torch.equal(torch.neg(x).to_torch(), -g(4, 4))  # the runtime goes on


def test_placement_errors_are_dtorchs(mesh2):
    x = dtorch.from_torch(g(4, 6), mesh2, [S0, Shard(1)])
    with pytest.raises(ValueError, match="redistribute"):
        torch.softmax(x, dim=1)  # a sharded softmax dim: dtorch's error, naming the fix


def test_torchs_init_functions_run_on_dtorch_tensors(mesh1):
    """They read the shape and call the tensor's in-place methods, which run as they are."""
    t = dtorch.empty((7, 5), device_mesh=mesh1, placements=[S0])
    torch.nn.init.kaiming_normal_(t, generator=torch.Generator().manual_seed(2))
    want = torch.nn.init.kaiming_normal_(torch.empty(7, 5),
                                         generator=torch.Generator().manual_seed(2))
    assert torch.equal(t.to_torch(), want)
    with dtorch.nn.init_empty():  # nothing drawn inside
        torch.nn.init.uniform_(t)
    assert torch.equal(t.to_torch(), want)


def test_cat_keeps_torchs_legacy_rule_for_empty_1d_tensors(mesh1):
    """torch's cat skips a 1-D tensor with no elements (HF's DynamicCache starts from one)."""
    x0 = g(4, 6)
    x = dtorch.from_torch(x0, mesh1, [S0])
    got = torch.cat([torch.tensor([]), x], dim=-1)
    assert got.placements == [S0]
    assert torch.equal(got.to_torch(), torch.cat([torch.tensor([]), x0], dim=-1))


@pytest.mark.parametrize("placements", [[S0], [R]], ids=["S0", "R"])
def test_isin_and_torch_tensor_operands_equal_torch(placements, mesh1):
    x0 = torch.tensor([[1, 5, 0], [3, 0, 2], [7, 0, 9], [4, 4, 1]])
    x = dtorch.from_torch(x0, mesh1, placements)
    for test in (0, torch.tensor([3, 7, 1])):
        for invert in (False, True):
            got = torch.isin(x, test, invert=invert)
            assert got.placements == placements
            assert torch.equal(got.to_torch(), torch.isin(x0, test, invert=invert))
    ones = torch.ones(4, 3, dtype=torch.long)  # a torch tensor with dims, as an operand
    assert torch.equal((x + ones).to_torch(), x0 + ones)
    assert torch.equal((x * torch.tensor([1, 2, 3])).to_torch(), x0 * torch.tensor([1, 2, 3]))


def test_new_tensor_methods_take_the_tensors_dtype_and_mesh(mesh1):
    x = dtorch.from_torch(g(4, 3).double(), mesh1, [S0])
    for made, want in ((x.new_ones(2, 3), torch.ones(2, 3)), (x.new_zeros((5,)), torch.zeros(5)),
                       (x.new_full((2,), 7), torch.full((2,), 7.0)),
                       (x.new_tensor([1, 2]), torch.tensor([1.0, 2.0]))):
        assert made.dtype == torch.float64 and made.device_mesh == mesh1
        assert made.placements == [R] and torch.equal(made.to_torch(), want.double())
    assert x.new_empty(3, dtype=torch.int32).dtype == torch.int32
    assert x.new_ones(2, requires_grad=True).requires_grad
