"""DTorch's DeviceMesh and Placement API (docs: DTORCH_API.md sections 1.3, 1.4 and 1.6's
redistribute_by_dict), written with DTorch's names and import path. Pure metadata: no runtime."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import dtorch.distributed_spec as ds
from dtorch.distributed_spec import (
    DeviceMesh,
    Partial,
    Placement,
    Replicate,
    Shard,
    assign_layers_to_stages,
    get_default_device_mesh,
    get_placements_from_dict,
    init_device_mesh,
)

R, P, S0, S1 = Replicate(), Partial(), Shard(0), Shard(1)
NAMES = ["dp", "tp", "pp"]


pytestmark = pytest.mark.no_runtime  # (conftest syncs after the other tests)


@pytest.fixture
def mesh3():
    return init_device_mesh("cpu", (2, 2, 2), NAMES)


def ids_of(meshes) -> list:
    return [m.mesh.tolist() for m in meshes]


# -- the import path -------------------------------------------------------------------------------


def test_distributed_spec_exports_dtorchs_names():
    assert sorted(ds.__all__) == sorted([
        "DeviceMesh", "Placement", "Shard", "Replicate", "Partial", "init_device_mesh",
        "get_default_device_mesh", "assign_layers_to_stages", "get_placements_from_dict"])
    import dtorch

    assert ds.DeviceMesh is dtorch.DeviceMesh and ds.Shard is dtorch.Shard


# -- constructor forms -----------------------------------------------------------------------------


@pytest.mark.parametrize("device, devices", [
    ("cpu", (0,)), ("cpu:3", (3,)), (torch.device("cpu"), (0,)), (torch.device("cpu", 2), (2,)),
])
def test_a_device_alone_is_a_one_device_mesh(device, devices):
    mesh = DeviceMesh(device)
    assert mesh.shape == (1,) and mesh.devices == devices and mesh.device_type == "cpu"
    assert not mesh.is_distributed and mesh.dim_names == []


def test_device_type_is_torchs_str_and_equals_dtorchs_device():
    """torch's DeviceMesh has a str, DTorch's a torch.device; programs compare with either."""
    kind = DeviceMesh("cpu", [0, 1]).device_type
    assert isinstance(kind, str) and kind == "cpu" and "cpu" == kind
    assert kind == torch.device("cpu") and torch.device("cpu") == kind
    assert kind != torch.device("cpu", 1) and kind != torch.device("cuda") and kind != "cuda"
    assert DeviceMesh("cuda").device_type == torch.device("cuda")
    assert {kind: 1}["cpu"] == 1 and torch.device(kind) == torch.device("cpu")
    assert repr(kind) == "'cpu'" and str(kind) == "cpu"


def test_a_cuda_device_names_one_gpu():
    """Whether or not the machine has GPU 1: making a mesh does not ask."""
    assert DeviceMesh(torch.device("cuda:1")).devices == (1,)
    assert DeviceMesh("cuda").devices == (0,) and DeviceMesh("cuda").device_type == "cuda"


def test_a_mesh_copies_a_mesh():
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=["dp", "tp"])
    copy = DeviceMesh(mesh)
    assert copy == mesh and copy is not mesh and hash(copy) == hash(mesh)
    assert copy.dim_names == ["dp", "tp"] and copy.mesh.tolist() == [[0, 1], [2, 3]]
    with pytest.raises(TypeError, match="copies a mesh"):
        DeviceMesh(mesh, [0, 1])


@pytest.mark.parametrize("ids", [
    [[0, 1], [2, 3]],
    torch.tensor([[0, 1], [2, 3]]),
    torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
], ids=["list", "int64-tensor", "int32-tensor"])
def test_ids_and_names_build_an_nd_mesh(ids):
    by_keyword = DeviceMesh("cpu", ids, mesh_dim_names=["dp", "tp"])
    assert by_keyword == DeviceMesh("cpu", ids, ["dp", "tp"])  # DTorch passes names third
    assert by_keyword.mesh.dtype == torch.int64 and by_keyword.mesh.device.type == "cpu"
    assert by_keyword.mesh.tolist() == [[0, 1], [2, 3]] and by_keyword.shape == (2, 2)


@pytest.mark.parametrize("args, error, match", [
    (("cpu", [0, 0]), ValueError, "distinct"),
    (("cpu", []), ValueError, "at least one device"),
    (("cpu", [[0, 1], [2, 3]], ["dp"]), ValueError, "Invalid dim_names"),
    (("cpu", [[0, 1], [2, 3]], ["dp", "dp"]), ValueError, "Invalid dim_names"),
    (("cpu", [0, 1], [1]), TypeError, "must be strings"),
    (("tpu",), ValueError, "device_type must be one of"),
    (("meta",), ValueError, "device_type must be one of"),
    ((5,), TypeError, "str or torch.device"),
    (("cpu:1", [0, 1]), ValueError, "either in the device"),
], ids=["duplicate", "empty", "names-too-few", "names-repeated", "names-not-str", "tpu", "meta",
        "int-device", "index-and-ids"])
def test_bad_meshes_say_what_to_fix(args, error, match):
    with pytest.raises(error, match=match):
        DeviceMesh(*args)


# -- members ---------------------------------------------------------------------------------------


def test_members(mesh3):
    assert mesh3.is_distributed and mesh3.device_type == "cpu"
    assert mesh3.ndim == 3 and mesh3.shape == (2, 2, 2) and mesh3.size() == 8
    assert mesh3.dim_names == NAMES and mesh3.mesh_dim_names == tuple(NAMES)
    assert mesh3.has_dim_name("tp") and not mesh3.has_dim_name("cp")
    assert [mesh3.dim_name_index(n) for n in NAMES] == [0, 1, 2]
    assert mesh3.dim_name_index("cp") is None and mesh3.dim_name_index("cp", -1) == -1


def test_the_id_tensor_is_a_copy(mesh3):
    ids = mesh3.mesh
    ids[0, 0, 0] = 7
    assert mesh3.mesh[0, 0, 0] == 0 and mesh3 == init_device_mesh("cpu", (2, 2, 2), NAMES)


def test_is_distributed_counts_devices_not_dims():
    assert not init_device_mesh("cpu", (1, 1, 1)).is_distributed
    assert init_device_mesh("cpu", 2).is_distributed


def test_an_unnamed_mesh_has_no_names():
    mesh = DeviceMesh("cpu", [0, 1])
    assert mesh.dim_names == [] and mesh.mesh_dim_names is None
    assert not mesh.has_dim_name("tp") and mesh.dim_name_index("tp") is None


def test_check_all_dim_names_in_set(mesh3):
    assert mesh3.check_all_dim_names_in_set({"dp", "tp", "pp", "cp"}) is None
    with pytest.raises(ValueError, match=r"\['pp'\].*not in"):
        mesh3.check_all_dim_names_in_set(["dp", "tp"])
    with pytest.raises(ValueError, match="DeviceMesh is distributed but dim_names is empty"):
        DeviceMesh("cpu", [0, 1]).check_all_dim_names_in_set({"dp"})
    assert DeviceMesh("cpu").check_all_dim_names_in_set(set()) is None  # one device: no names


def test_first_device_and_to_device():
    assert DeviceMesh("cpu").first_device() == torch.device("cpu")  # CPU id 0: plain "cpu"
    assert DeviceMesh("cpu:2").to_device() == torch.device("cpu", 2)
    assert DeviceMesh("cpu", [3, 1]).first_device() == torch.device("cpu", 3)
    with pytest.raises(ValueError, match="first_device"):
        DeviceMesh("cpu", [3, 1]).to_device()


def test_get_coordinate():
    mesh = DeviceMesh("cpu", [[3, 1], [0, 2]])
    assert [mesh.get_coordinate(d) for d in (3, 1, 0, 2)] == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert mesh.get_coordinate(5) is None  # as torch: a device outside the mesh has none
    with pytest.raises(ValueError, match="no current device"):
        mesh.get_coordinate()
    assert DeviceMesh("cpu:4").get_coordinate() == [0]


def test_equal_meshes_hash_alike(mesh3):
    same = DeviceMesh("cpu", torch.arange(8).view(2, 2, 2), mesh_dim_names=NAMES)
    assert same == mesh3 and len({same, mesh3}) == 1 and {mesh3: 1}[same] == 1
    assert init_device_mesh("cpu", (2, 2, 2)) != mesh3  # names are part of a mesh
    assert DeviceMesh("cpu", [1, 0]) != DeviceMesh("cpu", [0, 1]) and mesh3 != "cpu"


def test_repr_is_dtorchs():
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=["dp", "tp"])
    assert repr(mesh) == ("DeviceMesh('cpu', dim_name: ['dp', 'tp'], shape: (2, 2), "
                          "data: [[0, 1], [2, 3]])")
    assert repr(DeviceMesh("cpu", [2, 5])) == ("DeviceMesh('cpu', dim_name: [], shape: (2,), "
                                               "data: [2, 5])")


# -- unbind ----------------------------------------------------------------------------------------

IDS = torch.arange(8).view(2, 2, 2)
UNBIND = [  # (id, dims, expected sub-mesh ids, expected names): torch.unbind, highest dim first
    ("name", "pp", IDS.unbind(2), ["dp", "tp"]),
    ("first-name", "dp", IDS.unbind(0), ["tp", "pp"]),
    ("int", 1, IDS.unbind(1), ["dp", "pp"]),
    ("negative-int", -1, IDS.unbind(2), ["dp", "tp"]),
    ("several", ["dp", "pp"], [t for a in IDS.unbind(2) for t in a.unbind(0)], ["tp"]),
    ("several-any-order", [2, 0], [t for a in IDS.unbind(2) for t in a.unbind(0)], ["tp"]),
    ("unknown-ignored", ("pp", "cp"), IDS.unbind(2), ["dp", "tp"]),
    ("repeated", ["pp", 2, -1], IDS.unbind(2), ["dp", "tp"]),
    ("all", [0, 1, 2], [t for a in IDS.unbind(2) for b in a.unbind(1) for t in b.unbind(0)], []),
]


@pytest.mark.parametrize("dims, expected, names", [r[1:] for r in UNBIND],
                         ids=[r[0] for r in UNBIND])
def test_unbind_matches_torch_unbind(mesh3, dims, expected, names):
    subs = mesh3.unbind(dims)
    assert ids_of(subs) == [t.reshape(-1).tolist() if t.ndim == 0 else t.tolist() for t in expected]
    assert all(m.dim_names == names and m.device_type == "cpu" for m in subs)


def test_unbind_of_the_docs_example(mesh3):
    assert ids_of(mesh3.unbind("pp")) == [[[0, 2], [4, 6]], [[1, 3], [5, 7]]]


@pytest.mark.parametrize("dims", ["cp", ["cp", "ep"], []])
def test_unbind_of_no_known_dim_is_the_mesh(mesh3, dims):
    assert mesh3.unbind(dims)[0] is mesh3 and len(mesh3.unbind(dims)) == 1


def test_unbind_of_an_unnamed_mesh():
    mesh = DeviceMesh("cpu", [[3, 1], [0, 2]])
    assert ids_of(mesh.unbind(1)) == [[3, 0], [1, 2]] and mesh.unbind(1)[0].dim_names == []
    assert mesh.unbind("tp") == [mesh]
    with pytest.raises(IndexError):
        mesh.unbind(2)


# -- init_device_mesh, get_default_device_mesh, assign_layers_to_stages ----------------------------


@pytest.mark.parametrize("shape, expected", [
    (4, (4,)), ((2, 3), (2, 3)), ([2, None, 2], (2, 2)), ((), (1,)), ((None,), (1,)),
])
def test_init_device_mesh_numbers_row_major(shape, expected):
    mesh = init_device_mesh("cpu", shape)
    assert mesh.shape == expected
    assert mesh.mesh.tolist() == torch.arange(mesh.size()).view(expected).tolist()


def test_init_device_mesh_takes_names_either_way():
    torch_form = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    assert torch_form == init_device_mesh("cpu", (2, 2), ["dp", "tp"])  # DTorch's form
    assert torch_form.dim_names == ["dp", "tp"]
    with pytest.raises(ValueError, match="Invalid dim_names"):
        init_device_mesh("cpu", (2, None), ["dp", "tp"])  # None entries are dropped first


def test_get_default_device_mesh():
    mesh = DeviceMesh("cpu", [0, 1])
    assert get_default_device_mesh(device="cpu:3") == DeviceMesh("cpu:3")
    assert get_default_device_mesh(device_mesh=mesh) is mesh
    assert get_default_device_mesh() == DeviceMesh("cpu")  # the default graph's mesh
    graph = SimpleNamespace(default_device_mesh=mesh)
    assert get_default_device_mesh(graph=graph) is mesh
    with pytest.raises(ValueError, match="give one of them"):
        get_default_device_mesh(device="cpu", device_mesh=mesh)


@pytest.mark.parametrize("layers, stages, expected", [
    (4, 2, [0, 0, 1, 1]), (5, 2, [0, 0, 0, 1, 1]), (3, 3, [0, 1, 2]), (1, 2, [0]), (0, 2, []),
    (7, 3, [0, 0, 0, 1, 1, 2, 2]),
])
def test_assign_layers_to_stages(layers, stages, expected):
    assert assign_layers_to_stages(layers, stages) == expected


@pytest.mark.parametrize("stages", [0, -1])
def test_assign_layers_to_stages_needs_a_stage(stages):
    with pytest.raises(ValueError, match="num_stages > 0"):
        assign_layers_to_stages(4, stages)


# -- placements ------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("R", Replicate()), ("P", Partial()), ("S0", Shard(0)), ("S1", Shard(1)), ("S-1", Shard(-1)),
    ("S12", Shard(12)),
])
def test_placement_strings(text, expected):
    p = Placement(text)
    assert p == expected and type(p) is type(expected) and isinstance(p, Placement)
    assert hash(p) == hash(expected)


@pytest.mark.parametrize("text", ["", "r", "S", "Sx", "S1.5", "PS", "Psum", "S 1", "R "])
def test_other_placement_strings_raise(text):
    with pytest.raises(ValueError, match="placement strings are"):
        Placement(text)


def test_placement_wants_a_string():
    with pytest.raises(TypeError, match="takes a str"):
        Placement(0)
    assert type(Placement()) is Placement  # the bare base, which ops refuse as a placement


PREDICATES = [  # (placement, is_replicate, is_partial, is_shard)
    (R, True, False, False), (P, False, True, False), (Partial("max"), False, True, False),
    (S1, False, False, True), (Placement("S-1"), False, False, True),
]


@pytest.mark.parametrize("p, replicate, partial, shard", PREDICATES, ids=lambda v: repr(v))
def test_placement_predicates(p, replicate, partial, shard):
    assert (p.is_replicate(), p.is_partial(), p.is_shard()) == (replicate, partial, shard)
    assert not p.has_sub_split_coordinates() and p.get_sub_split_coordinates() is None


def test_shard_index():
    assert Shard(2).get_shard_index() == 2 and Placement("S-1").get_shard_index() == -1
    for p in (R, P):
        with pytest.raises(ValueError, match="is_shard"):
            p.get_shard_index()


def test_placements_are_hashable_classes():
    assert isinstance(Shard(0), Shard) and isinstance(Replicate(), Placement)
    assert len({Shard(0), Placement("S0"), R, Placement("R"), P, Partial("max")}) == 4


# -- get_placements_from_dict ----------------------------------------------------------------------

MESH2 = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=["dp", "tp"])
UNNAMED = DeviceMesh("cpu", [[0, 1], [2, 3]])
ORIGINAL = [P, S1]
FROM_DICT = [  # (id, mesh, dict, mode, expected)
    ("all-names", MESH2, {"dp": S0, "tp": S1}, "raise_error", [S0, S1]),
    ("extra-names-ignored", MESH2, {"dp": R, "tp": S0, "pp": S1}, "raise_error", [R, S0]),
    ("replicate", MESH2, {"tp": S0}, "replicate", [R, S0]),
    ("keep", MESH2, {"tp": S0}, "keep", [P, S0]),
    ("keep-empty", MESH2, {}, "keep", ORIGINAL),
    ("replicate-empty", MESH2, {}, "replicate", [R, R]),
    ("indices", UNNAMED, {1: S0, 0: P}, "raise_error", [P, S0]),
    ("extra-indices-ignored", UNNAMED, {0: S0, 5: S1}, "replicate", [S0, R]),
    ("indices-on-named", MESH2, {1: S0}, "keep", [P, S0]),
    ("one-device", DeviceMesh("cpu", [[0]], ["dp", "tp"]), {"tp": S0}, "raise_error", [R, R]),
]


@pytest.mark.parametrize("mesh, placements_dict, mode, expected", [r[1:] for r in FROM_DICT],
                         ids=[r[0] for r in FROM_DICT])
def test_get_placements_from_dict(mesh, placements_dict, mode, expected):
    assert get_placements_from_dict(mesh, placements_dict, ORIGINAL, mode) == expected
    assert get_placements_from_dict(mesh, placements_dict, original_placements=ORIGINAL,
                                    default_placement_mode=mode) == expected


@pytest.mark.parametrize("placements_dict, match", [
    ({"dp": S0}, r"Dimension name key: tp not in placements_dict.*dim_names: \['dp', 'tp'\]"),
    ({"dp": S0, "pp": S1}, "Dimension name key: tp"),
    ({}, "Dimension name key: dp"),
    (None, "Dimension name key: dp"),
    ({0: S0}, "Index key: 1 not in placements_dict.*ndim: 2"),
])
def test_a_missing_dim_raises_key_error(placements_dict, match):
    with pytest.raises(KeyError, match=match):
        get_placements_from_dict(MESH2, placements_dict)


@pytest.mark.parametrize("call, error, match", [
    (lambda: get_placements_from_dict(UNNAMED, {"tp": S0}), ValueError,
     "Key of placements_dict is dim_name but device_mesh not have dim_name"),
    (lambda: get_placements_from_dict(MESH2, {"tp": S0, 0: R}), TypeError, "all mesh dim names"),
    (lambda: get_placements_from_dict(MESH2, [S0, R]), TypeError, "must be a dict"),
    (lambda: get_placements_from_dict(MESH2, {"tp": "S0"}), TypeError, "Placement"),
    (lambda: get_placements_from_dict(MESH2, {"tp": S0}, None, "keep"), ValueError,
     "original_placements"),
    (lambda: get_placements_from_dict(MESH2, {"tp": S0}, [R], "keep"), ValueError,
     "one placement per mesh dim"),
    (lambda: get_placements_from_dict(MESH2, {"tp": S0}, None, "shard"), ValueError,
     "default_placement_mode must be one of"),
], ids=["names-on-unnamed", "mixed-keys", "not-a-dict", "not-a-placement", "keep-without-original",
        "keep-wrong-length", "bad-mode"])
def test_bad_placement_dicts_raise(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_a_shard_of_a_size_one_dim_becomes_replicate():
    d = {"dp": S0, "tp": Shard(-1)}
    assert get_placements_from_dict(MESH2, d, shape=(1, 4)) == [R, Shard(-1)]
    assert get_placements_from_dict(MESH2, d, shape=(4, 1)) == [S0, R]
    assert get_placements_from_dict(MESH2, d, shape=(1, 1),
                                    convert_shard_size_one_to_replicate=False) == [S0, Shard(-1)]
    assert get_placements_from_dict(MESH2, d) == [S0, Shard(-1)]  # no shape: nothing to check
