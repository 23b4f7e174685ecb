"""Indexing against plain torch: ``x[index]``, ``x[index] = v``, the indexing functions and the
value-dependent ops, over meshes x placements x dtypes x uneven sizes.

A call raises ValueError at the call exactly where the docs say (an index touches a sharded dim,
a number written into a Partial, a Partial sorted) and otherwise gives torch's values; hypothesis
draws the indices. Whole dims keep their shards.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

import dtorch
from dtorch import Partial, Replicate, Shard
from helpers import (
    TORCH_RAISED,
    assert_close,
    assert_executed,
    assert_refused,
    check_like_torch,
    distribute,
    fixture_settings,
    layout_fixture,
    layout_id,
    lib,
    sample,
    torch_expected,
)

R, S0, S1, S2, P = Replicate(), Shard(0), Shard(1), Shard(2), Partial()
HYPOTHESIS = fixture_settings(25)


LAYOUTS = [("one", (R,)), ("mesh1", (S0,)), ("mesh1", (S2,)), ("mesh1", (P,)),
           ("mesh2", (S0, S2)), ("mesh2", (S2, S0)), ("mesh3", (S0, S2, R))]


layout = layout_fixture(LAYOUTS)


def touched(index, shape, picks: bool = True) -> set:
    """The dims an index touches (docs/ops.md: an int, a slice that is not the whole dim, an
    index tensor or list, a mask); the others pass whole. ``picks=False`` leaves out the dims
    an int or an index tensor, list or mask picks from."""
    items = index if isinstance(index, tuple) else (index,)
    used = sum(1 for item in items if item is not None and item is not Ellipsis)
    dims, d = set(), 0
    for item in items:
        if item is None:
            continue
        if item is Ellipsis:
            d += len(shape) - used
            continue
        whole = isinstance(item, slice) and item.indices(shape[d]) == (0, shape[d], 1)
        if not (whole or not picks and not isinstance(item, slice)):
            dims.add(d)
        d += 1
    return dims


def getitem_refused(placements, index, shape, dtype=torch.float32) -> bool:
    """docs/ops.md: a sharded dim that a slice touches is refused; one an int or an index
    tensor (list, mask) picks from is too in a bool tensor (else the device whose block holds
    an element selects it)."""
    return shards_any(placements, touched(index, shape, picks=dtype == torch.bool))


def shards_any(placements, dims) -> bool:
    return any(p.is_shard() and p.dim in dims for p in placements)


# -- __getitem__ ----------------------------------------------------------------------------------

SHAPE = (5, 4, 7)
WHOLE_DIM_INDICES = {  # the sharded dims (0 and 2 in LAYOUTS) pass whole: never refused
    "int": (slice(None), 1),
    "neg-int": (slice(None), -1),
    "slice-step": (slice(None), slice(None, None, 2)),
    "neg-slice": (slice(None), slice(-3, -1)),
    "none": (None, slice(None), 2, None),
    "ellipsis": (Ellipsis, slice(None)),
    "ellipsis-mid": (slice(None), Ellipsis, slice(None)),
    "list": (slice(None), [0, 2, 2]),
    "tensor-2d": (slice(None), torch.tensor([[0, 1], [3, 3]])),
    "int+ellipsis": (Ellipsis, 2, slice(None)),
    "mask-torch": (slice(None), torch.tensor([True, False, True, True])),
}
TOUCHING_INDICES = {  # these index a dim some layouts shard: refused there but for picks
    "first-int": 3,
    "first-slice": slice(1, 4),
    "adv-apart": ([0, 1], slice(None), [2, 3]),
    "adv-adjacent": (slice(None), [0, 1], [2, 3]),
    "neg-everything": (-1, -2, -3),
}


@pytest.mark.parametrize("name", WHOLE_DIM_INDICES)
def test_getitem_whole_dims_keep_shards(name, layout):
    mesh, placements, exact = layout
    t = sample(SHAPE)
    x = distribute(t, mesh, placements)
    index = WHOLE_DIM_INDICES[name]
    y = x[index]
    assert_close(y, t[index], exact)
    assert not any(p.is_replicate() for p, q in zip(y.placements, placements)
                   if not q.is_replicate())


@pytest.mark.parametrize("name", TOUCHING_INDICES)
def test_getitem_touching(name, layout):
    """Refused (ValueError naming the fix) exactly when a slice touches a sharded dim; the fix
    works as written."""
    mesh, placements, exact = layout
    t = sample(SHAPE)
    x = distribute(t, mesh, placements)
    index = TOUCHING_INDICES[name]
    refused = getitem_refused(placements, index, SHAPE)
    if check_like_torch(lambda v: v[index], [x], [t], exact, refused=refused, op="getitem"):
        return
    y = x.redistribute(placements=[R] * mesh.ndim)[index]
    assert_close(y, t[index], exact)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.float64], ids=str)
def test_getitem_dtypes(dtype, mesh2):
    t = sample(SHAPE, torch.int64) > 0 if dtype == torch.bool else sample(SHAPE, dtype)
    x = distribute(t, mesh2, [S0, S2])
    assert_close(x[:, 1:3, ..., None], t[:, 1:3, ..., None])


def test_getitem_errors(mesh1):
    t = sample(SHAPE)
    x = distribute(t, mesh1, [R])
    i16, f32 = torch.tensor([1], dtype=torch.int16), torch.tensor([1.0])
    for bad in (7, (0, 0, 0, 0), 1.5, (slice(None), slice(None, None, -1)),
                (i16,), (i16, slice(None, None, 0)), (f32, 9),  # the slice's, the int's error
                slice(1.5, -1, 0), slice(0, 1.5, 0), slice(1, 1.5, -1),  # types before step
                slice(-1, 1.5, 0), slice(-1, "a", 0)):  # torch's -1 quirk: the step's error
        assert torch_expected(lambda v: v[bad], [t], [x]) is TORCH_RAISED
    with pytest.raises(IndexError, match="mask"):
        x[torch.tensor([True, False])]


@pytest.mark.parametrize("index", [
    (..., ...), (..., 0, ...), (None, ..., ...), (..., None, ...), (0, 1, ..., ..., 2),
    (..., ..., 1), (..., ..., None), (..., ..., slice(1, None)),  # past the last dim: IndexError
    (..., ..., slice(None)), (..., ..., slice(0, None, 1)), (..., 0, ..., slice(None)),
    (0, ..., ..., slice(None), ...),  # full slices past the last dim: skipped
    (..., ..., 0, slice(None)), (..., ..., -1, slice(None), slice(None)),  # an int within it
    (..., ..., 0, 0), (None, ..., ..., 0),
    (..., ..., slice(None, None, 0)), (..., ..., 0, slice(None, None, 0)),  # the step's error
    (..., ..., slice(None, 1.5)),  # the slice's TypeError
], ids=str)
def test_several_ellipses_read_as_torch_reads_them(index, mesh1):
    """torch lets every ``...`` advance by the dims no item uses: after the first they are
    no-ops when nothing follows them or nothing is free, and an item after a second one is past
    the last dim (IndexError) unless it is a full slice, which torch skips."""
    t = sample(SHAPE)
    x = distribute(t, mesh1, [R])
    check_like_torch(lambda v: v[index], [x], [t], exact=True)


def index_items(shape):
    """Random torch-style indices for ``shape``: ints, slices, None, ..., lists."""
    def item(size):
        return st.one_of(
            st.integers(-size, size - 1),
            st.builds(slice, st.one_of(st.none(), st.integers(-size - 1, size + 1)),
                      st.one_of(st.none(), st.integers(-size - 1, size + 1)),
                      st.one_of(st.none(), st.integers(1, 3))),
            st.lists(st.integers(-size, size - 1), min_size=1, max_size=3),
        )
    return st.tuples(*[item(s) for s in shape]).flatmap(
        lambda items: st.tuples(st.integers(0, len(items)), st.integers(0, 2)).map(
            lambda cut: items[:cut[0]] + ((None,) if cut[1] == 1 else (Ellipsis,)
                                          if cut[1] == 2 else ()) + items[cut[0]:]))


def test_getitem_hypothesis(mesh1, mesh2):
    """Random indices over sharded and Partial layouts: refused exactly when a slice touches
    a sharded dim, else torch's values."""
    executed = []

    @HYPOTHESIS
    @given(data=st.data())
    def example(data):
        mesh, placements = data.draw(st.sampled_from([
            (mesh1, [S0]), (mesh1, [S1]), (mesh2, [S1, S0]), (mesh2, [P, S2]), (mesh1, [R]),
            (mesh1, [Partial("max")]), (mesh2, [P, Partial("avg")]), (mesh2, [R, P])]))
        t = sample(SHAPE)
        x = distribute(t, mesh, placements)
        index = data.draw(index_items(SHAPE))
        refused = getitem_refused(placements, index, SHAPE)
        if check_like_torch(lambda v: v[index], [x], [t], refused=refused, op="getitem"):
            executed.append(index)

    example()
    assert_executed({"getitem": len(executed)}, ["getitem"], 10)


@pytest.mark.parametrize("placements", [(S0,), (S0, S0), (S0, P), (P, S1), (S1, S0)], ids=str)
def test_getitem_int_on_sharded_dim_selects_from_its_block(placements, mesh1, mesh2):
    """Every int on a dim that some mesh dims shard (uneven: 5 rows on 3 or 4 devices, a
    device with no row at all): the device holding the element selects it, the result is
    Replicate on those mesh dims (a Partial elsewhere stays, to be reduced later), with torch's
    values bit for bit (the others add zeros)."""
    mesh = mesh1 if len(placements) == 1 else mesh2
    t = sample((5, 3, 4))
    x = distribute(t, mesh, placements)
    for index in [*range(-5, 5), (4, 1), (Ellipsis, 2, slice(None)), (0, None, -1)]:
        y = x[index]
        for p, q in zip(y.placements, placements):
            assert p == q if q.is_partial() else (p == R) == (q.dim in touched(index, t.shape))
        assert torch.equal(y.to_torch(), t[index]), index
    assert all(torch.equal(a.to_torch(), b) for a, b in zip(x, t))  # iteration, as torch's


def test_getitem_int_on_sharded_dim_refused_for_bools_and_slices(mesh1):
    """A sharded dim a bool tensor's int or index picks from (a bool sum is no selection), or
    that a slice touches, keeps the refusal naming the fix."""
    t = sample((5, 3))
    assert_refused(lambda v: v[2], distribute(t > 0, mesh1, [S0]), op="getitem")
    assert_refused(lambda v: v[[2, 0]], distribute(t > 0, mesh1, [S0]), op="getitem")
    assert_refused(lambda v: v[1:3], distribute(t, mesh1, [S0]), op="getitem")


PICKS = {  # index tensors (and ints beside them) on the dims (0 and 2) the layouts shard
    "rows": (torch.tensor([4, 0, 4, -1, 2]),),
    "rows-2d": (torch.tensor([[3, -5], [0, 4]]),),
    "clip-pooled": (torch.arange(5), torch.tensor([1, 3, 0, 3, 2])),  # x[arange(B), eos]
    "apart": (torch.tensor([0, 4, 2]), slice(None), torch.tensor([6, -7, 3])),  # to the front
    "adjacent": (slice(None), torch.tensor([0, 3]), torch.tensor([[6], [1]])),  # in place
    "int-beside": (1, slice(None), torch.tensor([6, 0, 6])),
    "broadcast": (torch.tensor([[1], [4]]), torch.tensor([2, 0, 1])),
}


@pytest.mark.parametrize("placements", [(S0,), (S2,), (S0, S2), (S2, S0), (S0, S0), (P, S0),
                                        (S0, P)], ids=str)
@pytest.mark.parametrize("name", PICKS)
def test_getitem_index_tensors_on_sharded_dims(name, placements, mesh1, mesh2):
    """Each device picks the elements its block holds (uneven: 5 rows and 7 columns on 3 or 4
    devices, a device with no row at all), zeros for the others, and the Partial sum is reduced
    to Replicate: torch's values bit for bit, a Partial elsewhere kept; the gradient lands in
    the owners' blocks, repeated picks summed, as torch's."""
    mesh = mesh1 if len(placements) == 1 else mesh2
    t = sample((5, 4, 7), torch.float64)
    index = PICKS[name]
    x = distribute(t, mesh, placements)
    y = x[index]
    assert [p.is_partial() for p in y.placements] == [q.is_partial() for q in placements]
    assert torch.equal(y.to_torch(), t[index])
    if any(p.is_partial() for p in placements):
        return
    w = dtorch.from_torch(t, device_mesh=mesh, placements=list(placements), requires_grad=True)
    u = sample(t[index].shape, torch.float64)
    (w[index] * dtorch.from_torch(u, device_mesh=mesh)).sum().backward()
    ref = t.clone().requires_grad_()
    (ref[index] * u).sum().backward()
    assert torch.equal(w.grad.to_torch(), ref.grad)


def test_getitem_int_on_sharded_dim_differentiates(mesh1):
    """The gradient of a selected row lands in the owner's block (zeros elsewhere), as torch's."""
    t = sample((5, 3))
    w = dtorch.from_torch(t, device_mesh=mesh1, placements=[S0], requires_grad=True)
    (w[3] * dtorch.arange(3.0, device_mesh=mesh1)).sum().backward()
    expected = torch.zeros(5, 3)
    expected[3] = torch.arange(3.0)
    assert torch.equal(w.grad.to_torch(), expected)


def test_getitem_dtorch_index_tensor(mesh2):
    t = sample((6, 5))
    idx = torch.tensor([[4, 0], [1, 1]])
    x = distribute(t, mesh2, [S1, R])
    assert_close(x[distribute(idx, mesh2, [R, R])], t[idx])
    # an index tensor of any layout is made Replicate first (on the devices: nothing waits)
    for placements in ([S0, R], [R, S1], [Partial(), S0]):
        assert_close(x[distribute(idx, mesh2, placements)], t[idx])


def test_getitem_mask_syncs(mesh1):
    """A dtorch bool mask is value-dependent: fetched, turned into indices, then indexed."""
    t = sample((5, 6))
    x = distribute(t, mesh1, [R])
    assert_close(x[x > 0], t[t > 0])
    xs = distribute(t, mesh1, [S0])
    assert_close(xs[:, x[0] > 0], t[:, t[0] > 0])  # the mask's dim is whole: S(0) stays
    assert xs[:, x[0] > 0].placements == [S0]


# -- __setitem__ ----------------------------------------------------------------------------------

SET_CASES = {
    "scalar-col": ((slice(None), 1), lambda shape: 3.0),
    "row-vector": ((Ellipsis, 2), lambda shape: sample(shape[:1] + shape[1:2], seed=1)),
    "broadcast": ((slice(None), slice(1, 3)), lambda shape: sample((1, 2, shape[2]), seed=1)),
    "list": ((slice(None), [0, 3]), lambda shape: -1.0),
    "first-dim": ((2,), lambda shape: 0.5),
    "view-shaped": ((slice(None), 0), lambda shape: sample((shape[0], shape[2]), seed=2)),
}


@pytest.mark.parametrize("name", SET_CASES)
def test_setitem(name, layout):
    mesh, placements, exact = layout
    index, make = SET_CASES[name]
    t = sample(SHAPE)
    value = make(SHAPE)

    def run(v, lib_value):
        v[index] = lib_value
        return v

    expected = run(t.clone(), value)
    view = t[index].shape
    values = [value] if not isinstance(value, torch.Tensor) else [
        (distribute(value, mesh, vp, seed=1), vp) for vp in ([R] * mesh.ndim, placements)
        if all(not p.is_shard() or p.dim < value.dim() for p in vp)]
    for v in values:
        x = distribute(t, mesh, placements)
        dv, vp = v if isinstance(v, tuple) else (v, None)
        if setitem_refused(placements, vp, index, view, value):
            assert_refused(run, x, dv, op="setitem")
            continue
        run(x, dv)
        assert x.placements == placements
        assert_close(x, expected, exact)


def setitem_refused(placements, value_placements, index, view, value) -> bool:
    """docs/ops.md, per mesh dim: a touched dim of ``x`` must not be sharded; a whole one may,
    the value then sharded alike (its matching dim at full size), Replicate (chunked locally) or
    broadcast; a Partial ``x`` takes only a value of the same Partial (a number would be written
    on every device); a Replicate ``x`` only a Replicate value."""
    places = view_places(index, SHAPE)
    for i, p in enumerate(placements):
        q = value_placements[i] if value_placements else None
        if p.is_partial() and q != p or q is not None and q.is_partial() and q != p:
            return True
        if p.is_replicate() and q is not None and q.is_shard():
            return True
        if p.is_shard():
            if p.dim not in places:
                return True
            if q is not None and q.is_shard():
                o = places[p.dim]
                vd = o - (len(view) - value.dim())
                if q.dim != vd or value.shape[vd] != view[o]:
                    return True
    return False


def view_places(index, shape) -> dict:
    """{dim of x passing whole: its dim in ``x[index]``} for indices with at most one index
    list (which then stays in its place) and no None, as SET_CASES has."""
    items = index if isinstance(index, tuple) else (index,)
    if Ellipsis in items:
        k = items.index(Ellipsis)
        items = items[:k] + (slice(None),) * (len(shape) - len(items) + 1) + items[k + 1:]
    items += (slice(None),) * (len(shape) - len(items))
    places, pos = {}, 0
    for d, item in enumerate(items):
        if isinstance(item, int):
            continue
        if isinstance(item, slice) and item.indices(shape[d]) == (0, shape[d], 1):
            places[d] = pos
        pos += 1
    return places


def test_setitem_partial(mesh1):
    t, v = sample((5, 4)), sample((5,), seed=1)
    x, dv = distribute(t, mesh1, [P]), distribute(v, mesh1, [P])
    x[:, 1] = dv
    t[:, 1] = v
    assert_close(x, t)

    def write(value):
        x[:, 1] = value

    assert_refused(write, 2.0, op="setitem")  # each device would write 2: the sum would be 6


def test_setitem_mask_and_dtype(mesh1):
    t = sample((5, 4), torch.int64)
    x = distribute(t, mesh1, [R])
    x[x < 0] = 0
    t[t < 0] = 0
    assert_close(x, t)
    x[:, 0] = 2.7  # cast to the tensor's dtype, as in torch
    t[:, 0] = 2.7
    assert_close(x, t)


# -- indexing functions ---------------------------------------------------------------------------

def _index(shape, high, seed=3):
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


FUNCTIONS = {
    # name: (fn(lib, input, index, src), input shape, index shape or (dim, high), src shape);
    # the digit or the op says the dim indexed along (index_put: dim 0)
    "index_select0": (lambda L, a, i, s: L.index_select(a, 0, i), (5, 7), ((4,), 5), None),
    "index_select1": (lambda L, a, i, s: L.index_select(a, 1, i), (5, 7), ((3,), 7), None),
    "gather0": (lambda L, a, i, s: L.gather(a, 0, i), (5, 7), ((3, 7), 5), None),
    "gather1": (lambda L, a, i, s: a.gather(1, i), (5, 7), ((5, 2), 7), None),
    "scatter0": (lambda L, a, i, s: L.scatter(a, 0, i, s), (5, 7), ((2, 7), 5), (2, 7)),
    "scatter_value1": (lambda L, a, i, s: L.scatter(a, 1, i, 2.5), (5, 7), ((5, 3), 7), None),
    "scatter_add1": (lambda L, a, i, s: a.scatter_add(1, i, s), (5, 7), ((5, 9), 7), (5, 9)),
    "index_add0": (lambda L, a, i, s: L.index_add(a, 0, i, s, alpha=2), (5, 7), ((6,), 5),
                   (6, 7)),
    "index_add1": (lambda L, a, i, s: a.index_add(1, i, s), (5, 7), ((3,), 7), (5, 3)),
    "index_put": (lambda L, a, i, s: L.index_put(a, (i,), s, True), (5, 7), ((4,), 5), (4, 7)),
}
# docs/ops.md: the indexed dim must be Replicate (index_put: every dim); a Partial input passes
# selection (with a Replicate index) and the linear writes (a Partial source), nothing else
PARTIAL_PASSES = {"index_select0", "index_select1", "gather0", "gather1", "scatter_add1",
                  "index_add0", "index_add1", "index_put"}
ONE_D = [("one", (R,)), ("mesh1", (S0,)), ("mesh1", (S1,)), ("mesh1", (R,)), ("mesh1", (P,)),
         ("mesh2", (S1, S0)), ("mesh3", (S0, S1, S0))]


@pytest.mark.parametrize("name", FUNCTIONS)
@pytest.mark.parametrize("lay", ONE_D, ids=layout_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64], ids=str)
def test_indexing_functions(name, lay, dtype, request):
    """Every operand in the same placements (shards past the end of an operand's dims
    mean Replicate for it), then all-Replicate operands after a refusal."""
    fn, shape, (ishape, high), sshape = FUNCTIONS[name]
    dim = 0 if name == "index_put" else int(name[-1])
    mesh, exact = request.getfixturevalue(lay[0]), lay[0] == "one"
    t, i = sample(shape, dtype), _index(ishape, high)
    s = sample(sshape, dtype, seed=1) if sshape else None

    def place(v, partial_ok=True):
        return [p if (p.is_shard() and p.dim < v.ndim) or (p.is_partial() and partial_ok)
                else R for p in lay[1]]

    ops = [distribute(t, mesh, place(t)), distribute(i, mesh, place(i, False)),
           distribute(s, mesh, place(s), seed=1) if s is not None else None]
    one_d_index = name.startswith(("index_select", "index_add", "index_put"))
    refused = (any(p.is_shard(dim) for p in lay[1])
               or P in lay[1] and name not in PARTIAL_PASSES
               # a 1-D index shards along dim: only over a Replicate input (none here)
               or one_d_index and any(p.is_shard(0) for p in lay[1])
               or name == "index_put" and any(p.is_shard() for p in lay[1]))
    if not check_like_torch(lambda a, b, c: fn(lib(a), a, b, c), ops, [t, i, s], exact,
                            refused=refused):
        rep = [o.redistribute(placements=[R] * mesh.ndim) if o is not None else None
               for o in ops]
        assert_close(fn(dtorch, *rep), fn(torch, t, i, s), exact)


def test_indexing_function_errors(mesh1):
    t = sample((5, 7))
    x = distribute(t, mesh1, [S0])
    with pytest.raises(ValueError, match=r"dtorch.index_select.*redistribute"):
        dtorch.index_select(x, 0, distribute(_index((3,), 5), mesh1, [R]))
    with pytest.raises(IndexError):  # torch's own check, at the call
        dtorch.index_select(x, 2, distribute(_index((3,), 5), mesh1, [R]))
    with pytest.raises(RuntimeError):  # gather's index must have the input's rank
        dtorch.gather(x, 1, distribute(_index((3,), 5), mesh1, [R]))


# -- sorting --------------------------------------------------------------------------------------

SORTS = {  # name: (fn, the dim sorted along): refused where that dim is sharded, or Partial
    "topk": (lambda v: v.topk(3, dim=1), 1),
    "topk-small-last": (lambda v: v.topk(2, largest=False), 2),
    "sort": (lambda v: v.sort(dim=0, descending=True, stable=True), 0),
    "sort-last": (lambda v: v.sort(), 2),
    "argsort": (lambda v: v.argsort(dim=1, stable=True), 1),
}


@pytest.mark.parametrize("name", SORTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64], ids=str)
def test_sorting(name, dtype, layout):
    mesh, placements, exact = layout
    fn, dim = SORTS[name]
    t = sample((6, 5, 7), dtype)
    x = distribute(t, mesh, placements)
    refused = any(p.is_partial() or p.is_shard(dim) for p in placements)
    if not check_like_torch(fn, [x], [t], exact, refused=refused, op=name.split("-")[0]):
        # the fix the error names: the sorted dim whole (and Partials reduced)
        whole = [R if p.is_partial() or p.is_shard(dim) else p for p in placements]
        out = fn(x.redistribute(placements=whole))
        assert_close(out, fn(t), exact)
        assert all(o.placements == whole for o in (out if isinstance(out, tuple) else [out]))


# -- value-dependent ------------------------------------------------------------------------------


def test_nonzero_unique(mesh2):
    t = sample((5, 6), torch.int64)
    x = distribute(t, mesh2, [S0, S1])
    assert_close(dtorch.nonzero(x), torch.nonzero(t))
    for a, b in zip(x.nonzero(as_tuple=True), t.nonzero(as_tuple=True)):
        assert_close(a, b)
    assert_close(dtorch.unique(x), torch.unique(t))
    for a, b in zip(x.unique(return_inverse=True, return_counts=True),
                    t.unique(return_inverse=True, return_counts=True)):
        assert_close(a, b)
    assert dtorch.unique(x).placements == [R, R]


def test_sharded_index_gathers_from_whole_input(mesh2):
    """An index sharded along ``dim`` with the input Replicate: each device selects its chunk
    of the index (uneven: 5 indices over 2)."""
    t, i = sample((4, 6)), _index((5,), 4)
    x = distribute(t, mesh2, [R, S1])
    y = dtorch.index_select(x, 0, distribute(i, mesh2, [S0, R]))
    assert y.placements == [S0, S1]
    assert_close(y, torch.index_select(t, 0, i))
    g = _index((5, 6), 4)
    z = dtorch.gather(x, 0, distribute(g, mesh2, [S0, S1]))
    assert z.placements == [S0, S1]
    assert_close(z, torch.gather(t, 0, g))
