"""Linear and Embedding layers against their torch twins, loaded with the same weights
(``load_state_dict(torch_module.state_dict())``): bit-identical on a one-device mesh, allclose on
TP=2, TP=4 and DP x TP meshes, with feature sizes that do not divide the tp size; the layouts
each layer gives its parameters and outputs; the errors that name the layer and the fix."""

from __future__ import annotations

import math

import pytest
import torch

import dtorch
from dtorch import Partial, Replicate, Shard
from helpers import assert_close

R, P = Replicate(), Partial()
nn = dtorch.nn
IN, OUT = 6, 10  # neither divides by 4


@pytest.fixture(scope="module")
def tp1():
    return dtorch.DeviceMesh("cpu", [0], mesh_dim_names=["tp"])


@pytest.fixture(scope="module")
def tp2():
    return dtorch.DeviceMesh("cpu", [0, 1], mesh_dim_names=["tp"])


@pytest.fixture(scope="module")
def tp4():
    return dtorch.DeviceMesh("cpu", [0, 1, 2, 3], mesh_dim_names=["tp"])


MESHES = ["tp1", "tp2", "tp4", "mesh2"]  # mesh2: 2x2 ["dp", "tp"] (conftest)


@pytest.fixture(params=MESHES)
def mesh(request):
    return request.getfixturevalue(request.param)


def exact(mesh) -> bool:
    return not mesh.is_distributed


def tp_index(mesh):
    return mesh.dim_name_index("tp")


def layout(mesh, x: torch.Tensor, on_tp) -> list:
    """The input's placements: the batch on "dp" (uneven), ``on_tp`` on "tp"."""
    out = []
    for name, size in zip(mesh.dim_names, mesh.shape):
        if name == "dp":
            out.append(Shard(0))
        else:
            out.append(R if size == 1 else on_tp)
    return out


def put(x: torch.Tensor, mesh, on_tp) -> dtorch.Tensor:
    return dtorch.from_torch(x, device_mesh=mesh, placements=layout(mesh, x, on_tp))


# -- Linear and its parallel variants ------------------------------------------------------------

LAST = Shard(-1)  # stands for Shard(ndim - 1) of the tensor at hand
# class: (weight on tp, bias on tp, input on tp, output on tp)
LINEARS = {
    nn.Linear: (R, R, R, R),
    nn.ReplicateParallelLinear: (R, R, R, R),
    nn.ColumnParallelLinear: (Shard(0), Shard(0), R, LAST),
    nn.ColumnParallelLinearWithReplicateOutput: (Shard(0), Shard(0), R, R),
    nn.ColumnParallelLinearWithReplicateInputOutput: (Shard(0), Shard(0), LAST, R),
    nn.RowParallelLinear: (Shard(1), P, LAST, P),
    nn.RowParallelLinearWithReplicateOutput: (Shard(1), P, LAST, R),
}


def concrete(p, ndim: int):
    return Shard(ndim - 1) if p == LAST else p


def expected_placements(mesh, p, ndim: int) -> list:
    """A tensor's placements: ``p`` on "tp" when it has more than one device, else ``R``;
    ``S(0)`` on "dp" for activations (``ndim``), ``R`` for parameters (``ndim`` None)."""
    out = []
    for name, size in zip(mesh.dim_names, mesh.shape):
        if name == "dp":
            out.append(R if ndim is None else Shard(0))
        else:
            out.append(R if size == 1 else concrete(p, ndim or 2))
    return out


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("cls", list(LINEARS), ids=lambda c: c.__name__)
def test_linear_like_torch(cls, bias, mesh):
    w_tp, b_tp, in_tp, out_tp = LINEARS[cls]
    torch.manual_seed(0)
    twin = torch.nn.Linear(IN, OUT, bias=bias)
    layer = cls(IN, OUT, bias=bias, device_mesh=mesh)
    assert layer.load_state_dict(twin.state_dict()) is not None
    assert layer.weight.placements == expected_placements(mesh, w_tp, None)
    if bias:
        assert layer.bias.placements == expected_placements(mesh, b_tp, None)
    else:
        assert layer.bias is None
    shape = (5, IN) if not bias else (5, 3, IN)  # an uneven batch; a 3-D input too
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    y = layer(put(x, mesh, concrete(in_tp, len(shape))))
    with torch.no_grad():
        expected = twin(x)
    assert y.placements == expected_placements(mesh, out_tp, len(shape))
    assert_close(y, expected, exact=exact(mesh))


def test_linear_parameters_hold_torch_values(tp4):
    """Each device holds its slice (uneven ones too); the row bias is held once (Partial)."""
    twin = torch.nn.Linear(IN, OUT)
    for cls in (nn.ColumnParallelLinear, nn.RowParallelLinear):
        layer = cls(IN, OUT, device_mesh=tp4)
        layer.load_state_dict(twin.state_dict())
        state = layer.state_dict()
        assert_close(state["weight"], twin.weight.detach(), exact=True)
        assert_close(state["bias"], twin.bias.detach(), exact=True)
        back = torch.nn.Linear(IN, OUT)
        back.load_state_dict({k: v.to_torch() for k, v in state.items()})
        assert torch.equal(back.weight, twin.weight) and torch.equal(back.bias, twin.bias)


class ReLU(nn.Module):
    def forward(self, x):
        return nn.functional.relu(x)


def test_torch_mlp_loads_into_its_tensor_parallel_twin(mesh):
    """Linear-ReLU-Linear from torch, loaded into Column -> ReLU -> Row with a replicated
    output: no communication between the layers, one all-reduce at the end."""
    torch.manual_seed(2)
    twin = torch.nn.Sequential(torch.nn.Linear(IN, OUT), torch.nn.ReLU(),
                               torch.nn.Linear(OUT, IN))
    model = nn.Sequential(nn.ColumnParallelLinear(IN, OUT, device_mesh=mesh), ReLU(),
                          nn.RowParallelLinearWithReplicateOutput(OUT, IN, device_mesh=mesh))
    model.load_state_dict(twin.state_dict())
    x = torch.randn(5, IN)
    y = model(put(x, mesh, R))
    with torch.no_grad():
        expected = twin(x)
    assert y.placements == expected_placements(mesh, R, 2)
    assert_close(y, expected, exact=exact(mesh))


def test_partial_output_then_replicate(tp4):
    """A RowParallelLinear's Partial output reduces to torch's value wherever it is read."""
    twin = torch.nn.Linear(OUT, IN)
    layer = nn.RowParallelLinear(OUT, IN, device_mesh=tp4)
    layer.load_state_dict(twin.state_dict())
    x = torch.randn(4, OUT)
    y = layer(put(x, tp4, Shard(1)))
    assert y.placements == [P]
    with torch.no_grad():
        assert_close(y.redistribute(placements=[R]), twin(x))


def test_plain_linear_on_a_tp_mesh_is_replicated(mesh2):
    """Unlike DTorch (an assert), a Linear without a shard type on a mesh with "tp" works."""
    twin = torch.nn.Linear(IN, OUT)
    layer = nn.Linear(IN, OUT, device_mesh=mesh2)
    assert layer.tp_dim is None and layer.weight.placements == [R, R]
    layer.load_state_dict(twin.state_dict())
    x = torch.randn(5, IN)
    y = layer(dtorch.from_torch(x, device_mesh=mesh2, placements=[Shard(0), R]))
    assert y.placements == [Shard(0), R]
    with torch.no_grad():
        assert_close(y, twin(x))


def test_default_mesh_comes_from_the_guard(tp2):
    with dtorch.default_graph.device_mesh_guard(tp2):
        layer = nn.ColumnParallelLinear(IN, OUT)
        emb = nn.VocabParallelEmbedding(7, 4)
    assert layer.weight.device_mesh == tp2 and layer.weight.placements == [Shard(0)]
    assert emb.weight.device_mesh == tp2 and emb.weight.placements == [Shard(0)]


def test_tp_dim_forms(tp2, mesh2):
    assert nn.ColumnParallelLinear(IN, OUT, device_mesh=mesh2, tp_dim=0).weight.placements == [
        Shard(0), R]
    assert nn.RowParallelLinear(IN, OUT, device_mesh=mesh2, tp_dim="dp").tp_dim == 0
    # a name the mesh lacks, a dim of one device, or None: no tensor parallelism
    assert nn.ColumnParallelLinear(IN, OUT, device_mesh=tp2, tp_dim="mp").tp_dim is None
    one = dtorch.DeviceMesh("cpu", [[0], [1]], mesh_dim_names=["dp", "tp"])
    assert nn.RowParallelLinear(IN, OUT, device_mesh=one).bias.placements == [R, R]
    assert nn.Linear(IN, OUT, device_mesh=tp2, tp_shard_type="row").weight.placements == [
        Shard(1)]
    with pytest.raises(ValueError, match="tp_shard_type"):
        nn.Linear(IN, OUT, device_mesh=tp2, tp_shard_type="column")
    with pytest.raises(IndexError):
        nn.ColumnParallelLinear(IN, OUT, device_mesh=tp2, tp_dim=3)
    with pytest.raises(TypeError):
        nn.ColumnParallelLinear(IN, OUT, device_mesh=tp2, tp_shard_type="row")


def test_input_placement_argument(tp2, mesh2):
    """``layer(x, input_placement=...)`` moves the input on the tp dim first (DTorch's hook
    argument), the other mesh dims kept."""
    twin = torch.nn.Linear(IN, OUT)
    layer = nn.ColumnParallelLinear(IN, OUT, device_mesh=tp2)
    layer.load_state_dict(twin.state_dict())
    x = torch.randn(3, IN)
    y = layer(put(x, tp2, Shard(1)), input_placement=R)
    with torch.no_grad():
        assert_close(y, twin(x))
    row = nn.RowParallelLinearWithReplicateOutput(IN, OUT, device_mesh=mesh2)
    row.load_state_dict(twin.state_dict())
    x = torch.randn(5, 3, IN)
    y = row(put(x, mesh2, R), input_placement=Shard(-1))  # R -> S(-1): a local chunk
    assert y.placements == [Shard(0), R]
    with torch.no_grad():
        assert_close(y, twin(x))


def test_reset_parameters_draws_like_torch(tp4):
    """torch's bounds (1 / sqrt(in_features)); every device draws its own block of one
    tensor; the row bias is held once (its value stays within the bound)."""
    bound = 1 / math.sqrt(IN)
    torch.manual_seed(0)  # (the draws follow torch's generator: not the earlier tests' state)
    for cls in (nn.ColumnParallelLinear, nn.RowParallelLinear, nn.Linear):
        layer = cls(IN, 40, device_mesh=tp4)
        w, b = layer.weight.to_torch(), layer.bias.to_torch()
        assert w.abs().max() <= bound and b.abs().max() <= bound
        assert w.std() > bound / 3 and b.std() > bound / 10
        # no block repeats another: that would repeat a block's 60 values, where 240 float32
        # draws share one by chance about once in 300 layers
        assert len(set(w.flatten().tolist())) >= w.numel() - 2
    emb = nn.VocabParallelEmbedding(13, 40, padding_idx=5, device_mesh=tp4)
    w = emb.weight.to_torch()
    assert torch.equal(w[5], torch.zeros(40)) and 0.7 < w.std() < 1.3
    assert len(set(w[torch.arange(13) != 5].flatten().tolist())) == 12 * 40


def test_dtype(tp2):
    layer = nn.RowParallelLinear(IN, OUT, dtype=torch.float64, device_mesh=tp2)
    assert layer.weight.dtype == torch.float64 and layer.bias.dtype == torch.float64
    x = dtorch.ones((2, IN), dtype=torch.float64, device_mesh=tp2, placements=[Shard(1)])
    assert layer(x).dtype == torch.float64


# -- errors: the layer, the placements, the fix -------------------------------------------------


class MLP(nn.Module):
    def __init__(self, mesh):
        super().__init__()
        self.up = nn.ColumnParallelLinearWithReplicateOutput(IN, OUT, device_mesh=mesh)
        self.down = nn.RowParallelLinear(OUT, IN, device_mesh=mesh)

    def forward(self, x):
        return self.down(self.up(x))  # up gathers its output: down wants it sharded


class Block(nn.Module):
    def __init__(self, mesh):
        super().__init__()
        self.mlp = MLP(mesh)

    def forward(self, x):
        return self.mlp(x)


def test_wrong_input_placement_names_the_layer_and_the_fix(mesh2):
    block = Block(mesh2)
    x = dtorch.randn((5, IN), device_mesh=mesh2, placements=[Shard(0), R])
    with pytest.raises(ValueError) as info:
        block(x)
    msg = str(info.value)
    assert "mlp.down (RowParallelLinear)" in msg, msg
    assert "[Shard(dim=0), Replicate()]" in msg and "mesh dim 1 ('tp')" in msg, msg
    assert "x = x.redistribute(placements=[Shard(dim=0), Shard(dim=1)])" in msg, msg
    h = block.mlp.up(x)  # the fix it names works
    assert block.mlp.down(h.redistribute(placements=[Shard(0), Shard(1)])).shape == (5, IN)


@pytest.mark.parametrize("cls", [nn.ColumnParallelLinear, nn.Embedding,
                                 nn.VocabParallelEmbedding], ids=lambda c: c.__name__)
def test_sharded_input_refused(cls, tp2):
    layer = cls(IN, OUT, device_mesh=tp2)
    x = dtorch.zeros((4, IN), dtype=torch.int64, device_mesh=tp2, placements=[Shard(1)])
    with pytest.raises(ValueError, match=rf"{cls.__name__}: input placements \[Shard\(dim=1\)\]"
                                         rf".*redistribute\(placements=\[Replicate\(\)\]\)"):
        layer(x)


def test_non_dtorch_input_and_other_mesh(tp2, tp4):
    layer = nn.ColumnParallelLinear(IN, OUT, device_mesh=tp2)
    with pytest.raises(TypeError, match="from_torch"):
        layer(torch.ones(2, IN))
    with pytest.raises(ValueError, match="redistribute\\(device_mesh="):
        layer(dtorch.ones((2, IN), device_mesh=tp4))


# -- Embedding, EmbeddingWithReplicateOutput, VocabParallelEmbedding ----------------------------

# class: (weight on tp, output on tp)
EMBEDDINGS = {
    nn.Embedding: (Shard(1), LAST),
    nn.EmbeddingWithReplicateOutput: (Shard(1), R),
    nn.VocabParallelEmbedding: (Shard(0), R),
}


@pytest.mark.parametrize("vocab", [11, 3])  # 3 rows over 4 devices: one holds none
@pytest.mark.parametrize("cls", list(EMBEDDINGS), ids=lambda c: c.__name__)
def test_embedding_like_torch(cls, vocab, mesh):
    w_tp, out_tp = EMBEDDINGS[cls]
    twin = torch.nn.Embedding(vocab, OUT, padding_idx=1)
    layer = cls(vocab, OUT, padding_idx=1, device_mesh=mesh)
    layer.load_state_dict(twin.state_dict())
    assert layer.weight.placements == expected_placements(mesh, w_tp, None)
    ids = torch.randint(0, vocab, (5, 3), generator=torch.Generator().manual_seed(3))
    ids[0, 0] = 1  # the padding row
    y = layer(put(ids, mesh, R))
    assert y.placements == expected_placements(mesh, out_tp, 3)
    with torch.no_grad():
        expected = twin(ids)
    # a vocabulary-parallel lookup sums one row with zeros: exact on every mesh
    assert_close(y, expected, exact=exact(mesh) or cls is nn.VocabParallelEmbedding)
    # the gradient reaches every looked-up row but the padding row, as torch's
    layer.weight.requires_grad_()
    layer(put(ids, mesh, R)).sum().backward()
    twin(ids).sum().backward()
    assert not twin.weight.grad[1].any()
    assert_close(layer.weight.grad, twin.weight.grad, exact=True)


def test_embedding_constructor_forms(tp2):
    table = torch.randn(7, 4)
    emb = nn.VocabParallelEmbedding.from_pretrained(table, device_mesh=tp2)
    assert emb.weight.placements == [Shard(0)] and not emb.weight.requires_grad
    assert_close(emb.weight, table, exact=True)
    ids = torch.tensor([[6, 0, 3]])
    assert_close(emb(dtorch.from_torch(ids, device_mesh=tp2)), torch.nn.functional.embedding(
        ids, table), exact=True)
    assert nn.Embedding(7, 4, padding_idx=-1, device_mesh=tp2).padding_idx == 6
    with pytest.raises(AssertionError, match="Padding_idx"):
        nn.Embedding(7, 4, padding_idx=7)
    with pytest.raises(TypeError, match="by keyword"):
        nn.Embedding(7, 4, "cpu")  # DTorch's order: device third
    with pytest.raises(NotImplementedError, match="max_norm"):
        nn.Embedding(7, 4, max_norm=1.0)


def test_vocab_parallel_embedding_op_rows(tp2):
    """The op's rows (docs/ops.md): indices sharded with the table whole, columns sharded with
    the indices whole, rows sharded -> a Partial sum; anything else names the redistribute."""
    F = dtorch.nn.functional
    table = torch.randn(5, 4)
    ids = torch.tensor([[4, 0], [2, 2], [1, 3]])
    expected = torch.nn.functional.embedding(ids, table)
    for ids_p, w_p, out_p in [(Shard(0), R, Shard(0)), (Shard(1), R, Shard(1)),
                              (R, Shard(1), Shard(2)), (R, Shard(0), P), (R, R, R)]:
        y = F.vocab_parallel_embedding(dtorch.from_torch(ids, tp2, [ids_p]),
                                       dtorch.from_torch(table, tp2, [w_p]))
        assert y.placements == [out_p]
        assert_close(y, expected, exact=True)
    for ids_p, w_p in [(Shard(0), Shard(0)), (R, P)]:
        with pytest.raises(ValueError, match=r"dtorch\.vocab_parallel_embedding.*redistribute\("):
            F.vocab_parallel_embedding(dtorch.from_torch(ids, tp2, [ids_p]),
                                       dtorch.from_torch(table, tp2, [w_p]))


def test_vocab_index_out_of_range_raises_at_read(tp2):
    F = dtorch.nn.functional
    table = dtorch.zeros((5, 4), device_mesh=tp2, placements=[Shard(0)])
    y = F.vocab_parallel_embedding(dtorch.tensor([1, 5], device_mesh=tp2), table)
    with pytest.raises(RuntimeError, match="vocab_parallel_embedding"):
        y.to_torch()
    dtorch.sync()
