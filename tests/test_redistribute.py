"""redistribute() on the runtime, against plain torch: every transition on 1-D (3 devices), 2-D
(2x2) and 3-D (2x2x2) meshes, even and uneven shapes, empty shards, every Partial reduce op,
genuine Partial inputs (each device a different contribution), and moves between meshes."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, strategies as st

import dtorch
from dtorch import DeviceMesh, Partial, Replicate, Shard
from helpers import assert_close, distribute, fixture_settings

R = Replicate()
S0, S1, S2 = Shard(0), Shard(1), Shard(2)
P = Partial()
PMAX, PMIN, PAVG = Partial("max"), Partial("min"), Partial("avg")


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def check_all(x, t, targets, mesh=None) -> None:
    """Issues every redistribute first (so they pipeline), then checks each value and layout."""
    outs = [x.redistribute(device_mesh=mesh, placements=list(dst)) for dst in targets]
    for dst, y in zip(targets, outs):
        assert y.placements == list(dst), (x.placements, dst)
        assert_close(y, t)


# -- one mesh: every placement pair ---------------------------------------------------------------

ONE_D = [R, S0, S1, P, PMAX, PAVG]


@pytest.mark.parametrize("shape", [(6, 3), (5, 7), (1, 2)], ids=str)
@pytest.mark.parametrize("src", ONE_D, ids=str)
def test_1d_every_pair(mesh1, shape, src):
    t = rand(*shape)
    x = distribute(t, mesh1, [src])
    check_all(x, t, [[dst] for dst in ONE_D + [PMIN] if dst != src])


TWO_D = [
    # (source, targets): single-dim transitions on each mesh dim, then nested ones
    ([S0, R], [[R, R], [S1, R], [P, R], [S0, S1], [S0, S0], [R, S0], [S1, S0]]),
    ([R, S1], [[R, R], [R, S0], [R, P], [S1, S1], [S0, S1], [S1, S0]]),
    ([S0, S0], [[R, R], [S0, R], [R, S0], [S0, S1], [S1, S1], [S1, S0], [P, P], [S0, P]]),
    ([S1, S0], [[S0, S1], [R, R], [S0, S0], [P, S0], [S1, P]]),
    ([P, R], [[R, R], [S0, R], [S1, R], [S0, S0], [P, S1], [PMAX, R]]),
    ([P, P], [[R, R], [S0, S1], [S1, S1], [R, P], [P, R], [S0, S0]]),
    ([R, PMAX], [[R, R], [R, S1], [S0, S1], [PMAX, R], [P, PMAX]]),
    ([PAVG, S0], [[R, R], [S1, S0], [R, S0], [S0, S0]]),
    ([PMIN, R], [[R, R], [S0, S1], [R, PMIN]]),
]


@pytest.mark.parametrize("shape", [(4, 6), (5, 7)], ids=str)
@pytest.mark.parametrize("src,targets", TWO_D, ids=lambda v: "".join(map(str, v)))
def test_2d(mesh2, shape, src, targets):
    t = rand(*shape, seed=1)
    check_all(distribute(t, mesh2, src), t, targets)


PERMUTED = DeviceMesh("cpu", [[3, 1], [0, 2]])  # devices out of order along both mesh dims
MESH_2X3 = DeviceMesh("cpu", [[0, 1, 2], [3, 4, 5]])  # uneven: 5 rows over 3, 7 over 2


@pytest.mark.parametrize("mesh", [PERMUTED, MESH_2X3], ids=["permuted", "2x3"])
@pytest.mark.parametrize("src,targets", TWO_D, ids=lambda v: "".join(map(str, v)))
def test_2d_permuted_and_2x3(mesh, src, targets):
    t = rand(5, 7, seed=15)
    check_all(distribute(t, mesh, src), t, targets)


THREE_D = [
    ([S0, S1, S2], [[R, R, R], [S2, S1, S0], [S0, S0, S0], [P, S1, P]]),
    ([S0, S0, S0], [[R, R, R], [S0, S0, R], [R, S0, S0], [S1, S1, S1], [S2, S0, S1]]),
    ([P, S0, P], [[R, R, R], [S0, S0, S0], [S2, R, S1], [P, P, P]]),
    ([R, R, R], [[S1, S1, S1], [P, S2, PMAX], [S0, R, S0]]),
]


@pytest.mark.parametrize("shape", [(4, 2, 4), (3, 1, 4)], ids=str)
@pytest.mark.parametrize("src,targets", THREE_D, ids=lambda v: "".join(map(str, v)))
def test_3d(mesh3, shape, src, targets):
    t = rand(*shape, seed=2)
    check_all(distribute(t, mesh3, src), t, targets)


def test_unchanged_placements_return_the_same_tensor(mesh2):
    x = distribute(rand(5, 7), mesh2, [S0, P])
    assert x.redistribute(placements=[S0, P]) is x
    assert x.redistribute(device_mesh=mesh2, placements=[Shard(-2), Partial("sum")]) is x
    same_mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=["dp", "tp"])
    assert x.redistribute(device_mesh=same_mesh, placements=[S0, P]) is x
    r = distribute(rand(3), mesh2, [R, R])
    assert r.redistribute() is r


def test_bad_placements_raise_at_the_call(mesh2):
    x = distribute(rand(5, 7), mesh2, [S0, R])
    with pytest.raises(ValueError, match="placements"):
        x.redistribute(placements=[R])
    with pytest.raises(IndexError):
        x.redistribute(placements=[R, S2])
    with pytest.raises(TypeError):
        x.redistribute(placements=[R, "S(0)"])
    with pytest.raises(TypeError):
        x.redistribute(device_mesh=[0, 1], placements=[R])


# -- genuine Partials: every device holds a different contribution --------------------------------

# per output placement: the placements of a (n, k) and b (k, m) whose product has it
MATMUL_OPERANDS = {R: (R, R), S0: (S0, R), S1: (R, S1), P: (S1, S0)}


def partial_product(mesh, placements, n=5, k=7, m=6, seed=3):
    """a @ b laid out as ``placements``, its Partial sums made by contracting sharded k."""
    a, b = rand(n, k, seed=seed), rand(k, m, seed=seed + 1)
    pa, pb = zip(*(MATMUL_OPERANDS[p] for p in placements))
    y = distribute(a, mesh, list(pa)) @ distribute(b, mesh, list(pb))
    assert y.placements == list(placements)
    return y, a @ b


@pytest.mark.parametrize("src,targets", [
    ([P], [[R], [S0], [S1], [PMAX], [PAVG]]),
    ([P, P], [[R, R], [S0, S1], [S1, S0], [S0, S0], [R, P], [P, S1], [PMIN, PMIN]]),
    ([P, S0], [[R, R], [S0, S0], [S1, S0], [S0, R], [R, S1]]),
    ([S1, P], [[R, R], [S1, S1], [S1, S0], [P, P]]),
], ids=lambda v: "".join(map(str, v)))
def test_genuine_partial_sum(mesh1, mesh2, src, targets):
    y, expected = partial_product(mesh1 if len(src) == 1 else mesh2, src)
    check_all(y, expected, targets)


def test_genuine_partial_sum_plus_factory_partial(mesh2):
    """A product's Partial plus distribute's and from_torch's (the value on coordinate 0, zeros
    elsewhere): still the sum."""
    y, expected = partial_product(mesh2, [P, P])
    extra, more = rand(5, 6, seed=9), rand(5, 6, seed=10)
    z = y + distribute(extra, mesh2, [P, P]) + dtorch.from_torch(more, mesh2, [P, P])
    check_all(z, expected + extra + more, [[R, R], [S1, S0]])


@pytest.mark.parametrize("op", ["sum", "max", "min"])
@pytest.mark.parametrize("shape", [(5, 7), (2, 3)], ids=str)
def test_shard_to_partial_pads_with_the_identity(mesh1, op, shape):
    """S -> P(op) leaves the identity of op around each chunk; negative values make a wrong
    identity (zero for max) visible."""
    t = rand(*shape, seed=4) - 5
    x = distribute(t, mesh1, [S0]).redistribute(placements=[Partial(op)])
    assert x.placements == [Partial(op)]
    check_all(x, t, [[R], [S0], [S1], [Partial(op)]])


@pytest.mark.parametrize("op", ["sum", "max", "min", "avg"])
def test_partial_round_trips(mesh2, op):
    t = rand(5, 7, seed=5) - 5
    p = Partial(op)
    x = distribute(t, mesh2, [R, R])
    for placements in ([p, R], [R, p], [p, p], [S1, p], [p, S0]):
        y = x.redistribute(placements=placements)
        assert y.placements == placements
        assert_close(y, t)
        assert_close(y.redistribute(placements=[R, R]), t)
        assert_close(y.redistribute(placements=[S0, S1]), t)


def test_partial_avg_reduce_scatter(mesh1):
    """P(avg) -> S reduces with a sum, then divides by the group size."""
    t = rand(5, 7, seed=6)
    check_all(distribute(t, mesh1, [PAVG]), t, [[S0], [S1]])


# -- edge cases: a mesh dim larger than the tensor dim, empty shards and tensors ------------------


@pytest.mark.parametrize("shape", [(1,), (2,), (1, 1), (0, 3)], ids=str)
def test_empty_shards_1d(mesh1, shape):
    t = rand(*shape, seed=7)
    for src in [R, S0, P, S1 if len(shape) > 1 else R]:
        x = distribute(t, mesh1, [src])
        check_all(x, t, [[dst] for dst in [R, S0, P, PMAX] if dst != src])


def test_empty_shards_3d(mesh3):
    t = rand(1, 2, seed=8)
    for src in ([S0, S1, S0], [S1, S0, S1], [P, S0, S0], [R, R, R]):
        x = distribute(t, mesh3, src)
        check_all(x, t, [dst for dst in ([R, R, R], [S0, S0, S0], [S1, S1, S1], [S0, P, S1])
                         if dst != src])


def test_integer_tensor(mesh2):
    t = torch.arange(35, dtype=torch.int64).reshape(5, 7)
    check_all(distribute(t, mesh2, [S0, S1]), t, [[R, R], [S1, S0], [P, R], [PMAX, S0]])


# -- between meshes -------------------------------------------------------------------------------

MESH_PAIR = DeviceMesh("cpu", [0, 1])
MESH_OTHER = DeviceMesh("cpu", [2, 3])
MESH_SWAPPED = DeviceMesh("cpu", [1, 0])
MESH_SHIFTED = DeviceMesh("cpu", [1, 2])  # device 1 both sends and receives
MESH_ONE = DeviceMesh("cpu", [0])
MESH_FLAT4 = DeviceMesh("cpu", [0, 1, 2, 3])


@pytest.mark.parametrize("dst_mesh", [MESH_OTHER, MESH_SWAPPED, MESH_SHIFTED],
                         ids=["other", "swapped", "shifted"])
@pytest.mark.parametrize("src", [R, S0, S1, P, PMAX], ids=str)
def test_same_shape_mesh(dst_mesh, src):
    t = rand(5, 3, seed=10)
    x = distribute(t, MESH_PAIR, [src])
    check_all(x, t, [[src], [R], [S0], [S1], [P]], mesh=dst_mesh)
    # and back: device c of each mesh holds the same block
    back = x.redistribute(device_mesh=dst_mesh, placements=[src]).redistribute(MESH_PAIR, [src])
    assert back.device_mesh == MESH_PAIR
    assert_close(back, t)


def test_empty_tensor_between_meshes():
    t = rand(0, 3)
    x = distribute(t, MESH_PAIR, [S1])
    check_all(x, t, [[S0], [R]], mesh=MESH_SWAPPED)
    check_all(x, t, [[S1], [P]], mesh=MESH_FLAT4)


@pytest.mark.parametrize("mesh", [PERMUTED, MESH_2X3], ids=["permuted", "2x3"])
def test_genuine_partial_on_permuted_and_2x3(mesh):
    y, expected = partial_product(mesh, [P, S1])
    check_all(y, expected, [[R, R], [S0, S1], [S1, P]])


def test_genuine_partial_between_meshes():
    y, expected = partial_product(MESH_PAIR, [P])
    check_all(y, expected, [[P], [R], [S1]], mesh=MESH_SWAPPED)
    check_all(y, expected, [[R], [S0]], mesh=MESH_OTHER)


@pytest.mark.parametrize("placements", [[R, R], [S0, S1], [P, S0], [S1, S1]], ids=str)
def test_one_device_to_four_and_back(mesh2, placements):
    t = rand(5, 7, seed=11)
    for src in ([R], [S0], [P]):
        x = distribute(t, MESH_ONE, src)
        y = x.redistribute(device_mesh=mesh2, placements=placements)
        assert y.device_mesh == mesh2 and y.placements == placements
        assert_close(y, t)
        back = y.redistribute(device_mesh=MESH_ONE, placements=src)
        # a Shard on a mesh dim of one device is read back as Replicate
        assert back.device_mesh == MESH_ONE and back.placements == ([R] if src == [S0] else src)
        assert_close(back, t, exact=src != [P])


def test_2x2_to_flat_and_back(mesh2):
    t = rand(5, 7, seed=12)
    x = distribute(t, mesh2, [S0, S1])
    check_all(x, t, [[R], [S0], [S1], [P]], mesh=MESH_FLAT4)
    y, expected = partial_product(mesh2, [P, S1])
    check_all(y, expected, [[S1], [R]], mesh=MESH_FLAT4)
    z = distribute(t, MESH_FLAT4, [S1])
    check_all(z, t, [[S0, S1], [P, P], [R, R]], mesh=mesh2)


def test_to_3d_mesh_and_back(mesh1, mesh3):
    t = rand(3, 1, 4, seed=13)
    x = distribute(t, mesh1, [S2])
    y = x.redistribute(mesh3, [S0, S1, S2])
    assert_close(y, t)
    check_all(y, t, [[S0], [P], [R]], mesh=mesh1)


# -- any pair, any mesh: hypothesis ---------------------------------------------------------------

SHAPES = [(5, 7), (4, 2), (3, 1, 4), (1, 3), (2, 2, 3)]


def placements(mesh_ndim, tensor_ndim):
    one = st.one_of(
        st.just(R),
        st.builds(Shard, st.integers(0, tensor_ndim - 1)),
        st.builds(Partial, st.sampled_from(["sum", "sum", "max", "min", "avg"])),
    )
    return st.lists(one, min_size=mesh_ndim, max_size=mesh_ndim)


@st.composite
def cases(draw):
    mesh_index = draw(st.integers(0, 2))
    shape = draw(st.sampled_from(SHAPES))
    src = draw(placements(mesh_index + 1, len(shape)))
    dst = draw(placements(mesh_index + 1, len(shape)))
    return mesh_index, shape, src, dst


def genuine(mesh, src, t_shape, seed):
    """A Partial product's sums where the layout allows one (2-D, sum only), else
    ``distribute``'s genuine contributions."""
    if len(t_shape) == 2 and all(p in MATMUL_OPERANDS for p in src):
        return partial_product(mesh, src, n=t_shape[0], m=t_shape[1], seed=seed)
    t = rand(*t_shape, seed=seed)
    return distribute(t, mesh, src, seed=seed), t


@fixture_settings(40)
@given(cases(), st.integers(0, 1000))
def test_any_pair(mesh1, mesh2, mesh3, case, seed):
    mesh_index, shape, src, dst = case
    mesh = (mesh1, mesh2, mesh3)[mesh_index]
    x, t = genuine(mesh, src, shape, seed)
    y = x.redistribute(placements=dst)
    assert y.placements == dst
    assert_close(y, t)


def test_every_pair_on_2d_for_a_small_uneven_tensor(mesh2):
    """Exhaustively: every placement pair of a 2-D mesh for a (3, 5) tensor."""
    t = rand(3, 5, seed=14)
    choices = [R, S0, S1, P, PMAX]
    for src in itertools.product(choices, repeat=2):
        x = distribute(t, mesh2, list(src))
        check_all(x, t, [list(d) for d in itertools.product(choices, repeat=2) if d != src])
