"""DTorch's Tensor API on dtorch, written with DTorch's names and argument forms: the
``dtorch.Tensor`` constructor from each kind of data, typed classes, factories' ``device=`` and
``graph=`` and the graph's guards, ``redistribute_by_dict``, ``copy_`` between layouts, and the
Tensor members of DTorch's §1.6."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import dtorch
from dtorch.distributed_spec import DeviceMesh, Partial, Replicate, Shard, init_device_mesh
from dtorch.tensor import tensors_redistribute_by_dict
from helpers import assert_close, distribute, sample

R, S0, S1 = Replicate(), Shard(0), Shard(1)
MESH = init_device_mesh("cpu", (2, 3), ("dp", "tp"))


# -- construction ---------------------------------------------------------------------------------


DATA = [
    ("torch", lambda: torch.arange(12.).reshape(3, 4), torch.arange(12.).reshape(3, 4)),
    ("torch-int", lambda: torch.arange(6).reshape(2, 3), torch.arange(6).reshape(2, 3)),
    ("numpy", lambda: np.arange(6, dtype=np.float64).reshape(2, 3),
     torch.arange(6, dtype=torch.float64).reshape(2, 3)),
    ("lists", lambda: [[1.5, 2.0], [3.0, 4.0]], torch.tensor([[1.5, 2.0], [3.0, 4.0]])),
    ("ints", lambda: [1, 2, 3], torch.tensor([1, 2, 3])),
    ("bools", lambda: [True, False], torch.tensor([True, False])),
    ("number", lambda: 2.5, torch.tensor(2.5)),
]


@pytest.mark.parametrize("name,make,expected", DATA, ids=[d[0] for d in DATA])
def test_tensor_from_each_kind_of_data(name, make, expected):
    local = dtorch.Tensor(make())  # DTorch's "local" tensor: the default graph's mesh
    assert local.device_mesh == dtorch.default_graph.default_device_mesh
    assert local.placements == [R]
    assert_close(local, expected, exact=True)
    assert_close(dtorch.tensor(make()), expected, exact=True)
    if expected.dim():
        placements = [S0, R] if expected.shape[0] >= 2 else [R, R]
        laid = dtorch.Tensor(make(), MESH, placements)
        assert (laid.device_mesh, laid.placements) == (MESH, placements)
        assert_close(laid, expected, exact=True)


def test_tensor_from_a_dtorch_tensor_is_an_alias_or_a_move():
    t = sample((6, 4))
    x = dtorch.Tensor(t, MESH, [S0, S1])
    alias = dtorch.Tensor(x)
    assert alias is not x and alias.placements == x.placements
    assert_close(alias, t, exact=True)
    moved = dtorch.Tensor(x, MESH, [R, S0])
    assert moved.placements == [R, S0]
    assert_close(moved, t, exact=True)
    x.mul_(2)  # the alias shares the blocks, as torch.Tensor(t) shares t's storage
    assert_close(alias, t * 2, exact=True)


def test_from_numpy_and_tensor_dtype():
    a = np.arange(5, dtype=np.int32)
    assert_close(dtorch.from_numpy(a), torch.from_numpy(a), exact=True)
    assert dtorch.tensor([1, 2], dtype=torch.float16).dtype == torch.float16
    assert dtorch.Tensor(torch.ones(2), dtype=torch.float64).dtype == torch.float64


def test_tensor_of_a_partial_value_is_the_value():
    t = sample((4, 3))
    x = dtorch.Tensor(t, MESH, [Partial(), S1])
    assert_close(x, t, exact=True)


# -- typed classes --------------------------------------------------------------------------------


@pytest.mark.parametrize("name,dtype", [
    ("FloatTensor", torch.float32), ("DoubleTensor", torch.float64), ("HalfTensor", torch.float16),
    ("BFloat16Tensor", torch.bfloat16), ("ByteTensor", torch.uint8), ("CharTensor", torch.int8),
    ("ShortTensor", torch.int16), ("IntTensor", torch.int32), ("LongTensor", torch.int64),
    ("BoolTensor", torch.bool)])
def test_typed_classes_check_the_dtype(name, dtype):
    cls = getattr(dtorch, name)
    assert dtorch.get_data_type_tensor(dtype) is cls
    x = cls([1, 0, 1])
    assert x.dtype == dtype and isinstance(x, dtorch.Tensor) and isinstance(x, cls)
    other = dtorch.zeros(2, dtype=torch.float32 if dtype != torch.float32 else torch.int64)
    assert not isinstance(other, cls)
    assert not isinstance(torch.zeros(2, dtype=dtype), cls)  # a torch tensor is not one
    assert issubclass(cls, dtorch.Tensor) and not issubclass(dtorch.Tensor, cls)


# -- factories: device=, graph=, and the graph's defaults -------------------------------------------


def test_factories_take_device_and_graph():
    x = dtorch.zeros(2, 3, device="cpu:4")
    assert x.device_mesh == DeviceMesh("cpu", [4])
    y = dtorch.ones(4, device=MESH, placements=[S0, R])
    assert y.device_mesh == MESH and y.placements == [S0, R]
    z = dtorch.full((2,), 7, device=torch.device("cpu", 2))
    assert z.device_mesh == DeviceMesh("cpu", [2]) and z.dtype == torch.int64
    with pytest.raises(ValueError, match="device or device_mesh"):
        dtorch.zeros(2, device="cpu", device_mesh=MESH)
    g = dtorch.Graph()
    w = dtorch.arange(6, graph=g)
    g.sync()
    assert_close(w, torch.arange(6), exact=True)
    gen = torch.Generator().manual_seed(3)
    r = dtorch.rand(3, 4, generator=gen, device=MESH, placements=[S1, S0], graph=g)
    assert_close(r, torch.rand(3, 4, generator=torch.Generator().manual_seed(3)), exact=True)


def test_guards_set_the_factories_defaults_and_restore():
    graph = dtorch.default_graph
    before = graph.default_device_mesh
    with graph.device_mesh_guard(MESH):
        with graph.dtype_guard(torch.float64):
            assert dtorch.zeros(3).dtype == torch.float64
            assert dtorch.full((2,), 1.0).dtype == torch.float64
            assert dtorch.arange(3).dtype == torch.int64  # not a float factory
            assert dtorch.arange(0.5, 2).dtype == torch.float64
            assert dtorch.tensor([1.5]).dtype == torch.float64
            assert dtorch.tensor([1]).dtype == torch.int64
            assert dtorch.randn(2).dtype == torch.float64
        assert dtorch.zeros(3).dtype == torch.float32
        x = dtorch.ones(2, 3, placements=[S1, R])
        assert x.device_mesh == MESH
        assert_close(x, torch.ones(2, 3), exact=True)
        with pytest.raises(ZeroDivisionError):
            with graph.device_mesh_guard("cpu:5"):
                assert dtorch.zeros(1).device_mesh == DeviceMesh("cpu", [5])
                1 / 0
        assert dtorch.zeros(1).device_mesh == MESH
    assert graph.default_device_mesh == before
    assert dtorch.zeros(1).device_mesh == before


def test_like_factories_take_device():
    x = dtorch.ones(4, 3, device_mesh=MESH, placements=[S0, S1])
    assert dtorch.zeros_like(x).placements == [S0, S1]
    y = dtorch.zeros_like(x, device="cpu:1")
    assert y.device_mesh == DeviceMesh("cpu", [1]) and y.placements == [R]
    assert_close(dtorch.full_like(x, 3.0), torch.full((4, 3), 3.0), exact=True)


# -- Tensor members -------------------------------------------------------------------------------


def test_redistribute_by_dict_forms():
    t = sample((6, 4))
    x = dtorch.Tensor(t, MESH, [R, R])
    y = x.redistribute_by_dict(MESH, {"dp": S0, "pp": S1}, default_placement_mode="replicate")
    assert y.placements == [S0, R]  # "pp" is not a dim of this mesh: ignored
    assert_close(y, t, exact=True)
    z = y.redistribute_by_dict(placements_dict={1: S1}, default_placement_mode="keep")
    assert z.placements == [S0, S1]
    assert_close(z, t, exact=True)
    with pytest.raises(KeyError, match="tp"):
        x.redistribute_by_dict(MESH, {"dp": S0})  # "raise_error" is the default
    assert y.redistribute_by_dict(MESH, {}).placements == [S0, R]  # an empty dict keeps them
    one_row = dtorch.Tensor(torch.ones(1, 4), MESH)
    assert one_row.redistribute_by_dict(MESH, {"dp": S0, "tp": S1}).placements == [R, S1]
    kept = one_row.redistribute_by_dict(MESH, {"dp": S0, "tp": S1},
                                        convert_shard_size_one_to_replicate=False)
    assert kept.placements == [S0, S1]
    assert_close(kept, torch.ones(1, 4), exact=True)
    moved = tensors_redistribute_by_dict({"a": x, "n": 3}, MESH, {"dp": S0, "tp": R})
    assert moved["a"].placements == [S0, R] and moved["n"] == 3
    pair = tensors_redistribute_by_dict((x, x), MESH, {"tp": S1}, default_placement_mode="keep")
    assert [p.placements for p in pair] == [[R, S1], [R, S1]]


def test_redistribute_like_check_placement_and_metadata():
    t = sample((6, 4))
    x = dtorch.Tensor(t, MESH, [S0, S1])
    y = dtorch.Tensor(t, MESH).redistribute_like(x)
    assert y.placements == [S0, S1]
    assert x.check_placement(0, S0) and not x.check_placement(1, R)
    one = dtorch.Tensor(t, DeviceMesh("cpu", [[0, 1, 2]]), [R, S0])
    assert one.check_placement(0, S1)  # a mesh dim of one device holds every placement
    assert not one.check_placement(0, S1, skip_when_dim_size_equal_one=False)
    assert x.data is x and x.is_contiguous()
    x.set_name("weights")
    assert x.get_name() == "weights" and y.get_name() == ""


def test_copy_between_layouts_and_meshes():
    t = sample((6, 4))
    for src_mesh, src in ((MESH, [S1, S0]), (MESH, [Partial(), R]),
                          (DeviceMesh("cpu", [5, 4]), [S0])):
        dst = dtorch.zeros(6, 4, device_mesh=MESH, placements=[S0, S1])
        out = dst.copy_(distribute(t, src_mesh, src))
        assert out is dst and dst.placements == [S0, S1]
        assert_close(dst, t)
    half = dtorch.zeros(6, 4, dtype=torch.float16, device_mesh=MESH, placements=[R, S1])
    half.copy_(dtorch.Tensor(t, MESH, [S0, R]))
    assert_close(half, t.half(), exact=True)


def test_iteration_and_to_a_mesh_by_device():
    t = sample((3, 4))
    x = dtorch.Tensor(t, MESH, [R, S1])
    rows = list(x)
    assert len(rows) == 3 and all(r.placements == [R, S0] for r in rows)
    for r, e in zip(rows, t):
        assert_close(r, e, exact=True)
    with pytest.raises(TypeError, match="0-d"):
        iter(dtorch.tensor(1.0))
    other = init_device_mesh("cpu", (2, 3))
    assert x.to(device=other).device_mesh == other  # DTorch's device= takes a mesh
    assert x.to(other).placements == [R, S1]
    assert x.to("cpu") is x


def test_view_placements_relabels_the_blocks():
    """DTorch's ``x.view(placements)``: no data moves; the blocks are read under the new
    placements (so Replicate relabelled Partial sums every device's copy)."""
    t = sample((4, 6))
    x = dtorch.Tensor(t, MESH, [R, S1])
    summed = x.view([Partial(), S1])
    assert summed.placements == [Partial(), S1]
    assert_close(summed, t * 2, exact=True)  # two devices along "dp" each hold the value
    averaged = x.view((Partial("avg"), S1))
    assert_close(averaged, t, exact=True)
    whole = dtorch.Tensor(t, MESH)
    assert_close(whole.view(2, 12), t.view(2, 12), exact=True)  # torch's view still works
    assert_close(whole.view(-1), t.view(-1), exact=True)
    assert_close(whole.view((3, 8)), t.view((3, 8)), exact=True)
    with pytest.raises(ValueError, match="redistribute"):
        x.view([S0, S1])  # dp-sharded rows would be 2 of 4, the blocks hold all 4


def test_data_setter_aliases_the_new_value_as_torch():
    """``p.data = v``: the same tensor object (a Parameter stays one, requires_grad and all) now
    aliases ``v``'s blocks in ``v``'s layout, as torch's; ``v`` is unchanged, and a write
    through either shows in both."""
    p = dtorch.nn.Parameter(dtorch.Tensor(sample((4, 6)), MESH, [R, R]))
    t = sample((4, 6), seed=1)
    v = dtorch.Tensor(t, MESH, [S0, S1])
    p.data = v
    assert isinstance(p, dtorch.nn.Parameter) and p.requires_grad and p.is_leaf
    assert p.placements == [S0, S1]
    assert_close(p, t, exact=True)
    with torch.no_grad():
        v.mul_(2)
    assert_close(p, t * 2, exact=True)
    with pytest.raises(TypeError, match="dtorch.Tensor"):
        p.data = t
