"""Indexing: ``x[index]``, ``x[index] = v``, and torch's indexing functions.

A dim that a slice (not the whole dim) touches must be Replicate: a shard's block of a slice
of an uneven split is generally not an ``array_split`` chunk of the result, so the rule refuses
rather than give wrong values. An int or an index tensor may index a sharded dim: the device
whose block holds an element selects it (``ops/select_sharded.py``); setitem's still must be
Replicate there. A dim that passes whole
(``:``, ``...``, the dims after the index) keeps its shard at its new position, since each
device then indexes its own block exactly as torch indexes the whole. Selection copies elements
and never combines them, so every Partial passes ``x[index]``; index tensors are Replicate.

The index travels as static data: ints, ``None``, ``"..."``, ``("slice", start, stop, step)``
and ``"T"`` for each index tensor, which are operands. Bool masks are value-dependent and turned
into integer indices on the client, by the fronts (``getitem``, ``setitem``), before the call.

Ints, slices (any step, negative bounds), ``None``, ``...`` and integer tensors (dtorch or
torch tensors, or lists: advanced indexing, broadcast as torch does) index without waiting; a
dtorch index tensor of any layout or mesh is made Replicate on the input's mesh first
(``x[arange, ids.argmax(-1)]`` with ``ids`` sharded).
Value-dependent results sync: a result's shape must be known on the client before the call
returns, so a dtorch bool mask (``x[mask]``, ``x[mask] = v``), ``nonzero`` and ``unique`` first
fetch the values they depend on (like ``to_torch()``), compute on the client, and send the
result back Replicate on the input's mesh. A torch bool mask needs no wait.

>>> import dtorch
>>> mesh = dtorch.DeviceMesh("cpu", [0, 1])
>>> x = dtorch.arange(12, device_mesh=mesh).reshape(3, 4).redistribute(mesh, [dtorch.Shard(0)])
>>> x[:, 1:3].to_torch()
tensor([[ 1,  2],
        [ 5,  6],
        [ 9, 10]])
"""

from __future__ import annotations

import operator

import torch

from ..placement import Replicate, Shard
from ..tensor import Tensor
from .creation import from_torch
from .registry import INPLACE, VIEW, OpDef, issue, register
from .rules import ALL_PARTIALS, LINEAR_PARTIALS, Placed, expand
from .segments import cut_slice
from .select_sharded import pick, picked_dims, picking_rows, reduce_picked

R = Replicate()
TENSOR, ELLIPSIS = "T", "..."


def decode_index(items, tensors) -> tuple:
    """The Python index the static ``items`` stand for, with ``tensors`` in the "T" slots."""
    it = iter(tensors)
    out = []
    for item in items:
        if item == TENSOR:
            out.append(next(it))
        elif item == ELLIPSIS:
            out.append(Ellipsis)
        elif isinstance(item, tuple):
            out.append(slice(*item[1:]))
        else:
            out.append(item)
    return tuple(out)


def _is_full(item, size: int) -> bool:
    return isinstance(item, tuple) and slice(*item[1:]).indices(size) == (0, size, 1)


def passthrough_dims(items, shape, index_ndims) -> dict:
    """{input dim: result dim} of the dims an index leaves whole, by torch's rule: ints select
    (the dim goes), slices and None keep their place, and the index tensors' broadcast dims
    replace the indexed dims where those are adjacent, else go first."""
    used = sum(1 for it in items if it is not None and it != ELLIPSIS)
    fill = (("slice", None, None, None),) * (len(shape) - used)
    if ELLIPSIS in items:
        k = items.index(ELLIPSIS)
        items = tuple(items[:k]) + fill + tuple(items[k + 1:])
    else:
        items = tuple(items) + fill
    view, d = [], 0  # per dim of the sliced view: the input dim it passes whole, -1, or "T"
    for item in items:
        if item is None:
            view.append(-1)
            continue
        if item == TENSOR:
            view.append(TENSOR)
        elif not isinstance(item, int):
            view.append(d if _is_full(item, shape[d]) else -1)
        d += 1
    adv = [k for k, v in enumerate(view) if v == TENSOR]
    if not adv:
        return {v: k for k, v in enumerate(view) if v != -1}
    b = max(index_ndims)
    if adv == list(range(adv[0], adv[-1] + 1)):
        return {v: k if k < adv[0] else k - len(adv) + b
                for k, v in enumerate(view) if v not in (-1, TENSOR)}
    rest = [v for v in view if v != TENSOR]
    return {v: b + k for k, v in enumerate(rest) if v != -1}


def _getitem(input, *indices, index):
    return input[decode_index(index, indices)]


def meta_indices(indices) -> list:
    """Index tensors for indexing a meta tensor: torch reads a 0-dim one as an int (``item()``,
    which a meta tensor cannot do); any int gives the shape, so a CPU 0 stands in."""
    return [torch.zeros((), dtype=torch.long) if i.dim() == 0 else i for i in indices]


def getitem_meta(input, *indices, index):
    """The kernel on meta tensors, with torch's IndexError for index tensors that do not
    broadcast (the meta kernel raises a RuntimeError)."""
    try:
        torch.broadcast_shapes(*[i.shape for i in indices])
    except RuntimeError:
        shapes = ", ".join(str(list(i.shape)) for i in indices)
        raise IndexError(f"shape mismatch: indexing tensors could not be broadcast together "
                         f"with shapes {shapes}") from None
    return _getitem(input, *meta_indices(indices), index=index)


def _getitem_kernel(ctx, input, *indices, index):
    picked = picked_dims(ctx.in_specs[0], index)
    if picked:
        return pick(ctx, input, indices, index, picked, lambda x, t, i: _getitem(x, *t, index=i))
    return _getitem(input, *indices, index=index)


def getitem_rule(call) -> Placed:
    spec, *idx = call.tensors
    dims = passthrough_dims(call.static["index"], spec.shape, [len(s.shape) for s in idx])
    picked = picked_dims(spec, call.static["index"])
    rest = (R,) * len(idx)
    rows = [((Shard(o),), (Shard(d),) + rest) for d, o in dims.items()]
    rows += [((p,), (p,) + rest) for p in ALL_PARTIALS] + picking_rows(picked, len(idx))
    return reduce_picked(expand(call, rows), spec, picked)


def _setitem(input, value, *indices, index):
    input[decode_index(index, indices)] = value
    return input


def setitem_meta(input, value, *indices, index):
    return _setitem(input, value, *meta_indices(indices), index=index)


def setitem_rule(call) -> Placed:
    """A whole dim may be sharded: the value's matching dim is then sharded alike (a Replicate
    value is chunked locally), or it broadcasts there. Writing P into P keeps P (each device
    writes its contribution; max/min/avg alike), but a Python number would be written n times."""
    spec, value = call.inputs[:2]
    idx = call.tensors[1 + (not isinstance(value, type)):]
    items = call.static["index"]
    meta = torch.empty(spec.shape, device="meta")
    view = meta[decode_index(items, meta_indices(
        [torch.empty(s.shape, dtype=torch.long, device="meta") for s in idx]))].shape
    rest = (R,) * len(idx)
    rows = []
    for d, o in passthrough_dims(items, spec.shape, [len(s.shape) for s in idx]).items():
        if isinstance(value, type):
            rows.append(((Shard(d),), (Shard(d),) + rest))
            continue
        vd = o - (len(view) - len(value.shape))
        v = Shard(vd) if vd >= 0 and value.shape[vd] == view[o] else R
        rows.append(((Shard(d),), (Shard(d), v) + rest))
    if not isinstance(value, type):
        rows += [((p,), (p, p) + rest) for p in ALL_PARTIALS]
    return expand(call, rows, auto_chunk=True)


# -- fronts: ``x[index]`` and ``x[index] = value`` -------------------------------------------------

# torch's index tensors: long and int ones index, bool and byte ones are masks (byte: deprecated)
_INT_DTYPES = (torch.int64, torch.int32)
_MASK_DTYPES = (torch.bool, torch.uint8)


def getitem(self: Tensor, index) -> Tensor:
    segments = cut_slice(self, index)  # whole segments of a sub-split dim: a local cut
    if segments is not None:
        return segments
    items, tensors = index_operands(self, index)
    return issue("getitem", (self, *tensors), (items,))


def setitem(self: Tensor, index, value) -> None:
    """``self[index] = value``; a torch.Tensor value is sent Replicate first."""
    if not isinstance(value, (Tensor, torch.Tensor, bool, int, float, complex)) and not hasattr(
            type(value), "__index__"):
        # as torch, and before the index: Python numbers, their subclasses (NumPy float64)
        # and ints (NumPy int8) are values; a NumPy float32 or bool is refused
        raise TypeError(f"can't assign a {_type_name(value)} to a dtorch.Tensor")
    items, tensors = index_operands(self, index, (value,))
    if isinstance(value, torch.Tensor):
        value = _replicated(value, self)
    issue("setitem", (self, value, *tensors), (items,))


def index_operands(x: Tensor, index, value=()) -> tuple:
    """(static items, index tensors) for ``x[index]`` (``x[index] = value[0]``): checked as
    torch checks them, then the index tensors the client holds are sent Replicate, and dtorch
    index tensors of another layout are made Replicate on ``x``'s mesh (an all-gather, or a
    copy from their mesh: the values stay on the devices, so nothing waits)."""
    items, tensors, known = encode_index(x, index)
    _check_bounds(x, items, tensors, known, value)
    return items, [_replicated(t.long(), x) if isinstance(t, torch.Tensor) else _on_mesh_of(t, x)
                   for t in tensors]


def _on_mesh_of(index: Tensor, x: Tensor) -> Tensor:
    mesh = x.device_mesh
    return index.redistribute(mesh, [R] * mesh.ndim)


def encode_index(x: Tensor, index) -> tuple:
    """(static items, index tensors, known) for ``x[index]`` (see ops/indexing.py for the
    items). Index tensors are dtorch tensors, or torch ones whose values the client holds;
    ``known``: (torch index tensor, the dim it indexes)."""
    index = index if isinstance(index, tuple) else (index,)
    # torch counts the dims an index uses before it looks at the items' types (None, ``...``
    # and a bool use none)
    used = sum(map(_span, index))
    if used > x.ndim:
        raise IndexError(f"too many indices for tensor of dimension {x.ndim}")
    index = _as_indices(x, _one_ellipsis(index, x.ndim - used, x.ndim))
    spans = list(map(_span, index))
    items, tensors, known = [], [], []
    for k, it in enumerate(index):
        if it is None:
            items.append(None)
        elif it is Ellipsis:
            items.append(ELLIPSIS)
        elif isinstance(it, slice):
            items.append(("slice", it.start, it.stop, it.step))
        elif _is_mask(it):
            nz = _mask_indices(it, x, _dim_at(index, spans, k, x.ndim))
            items += [TENSOR] * len(nz)
            tensors += nz
        elif isinstance(it, (Tensor, torch.Tensor)):
            if isinstance(it, torch.Tensor):
                known.append((it, _dim_at(index, spans, k, x.ndim)))
            items.append(TENSOR)
            tensors.append(it)
        else:
            items.append(operator.index(it))
    return tuple(items), tensors, known


def _span(it) -> int:
    """The input dims an index item uses, as torch counts them before it looks at the items'
    types (None, ``...`` and a bool use none)."""
    if _is_mask(it):
        return it.ndim
    return 0 if it is None or it is Ellipsis or isinstance(it, bool) else 1


def _one_ellipsis(index: tuple, free: int, ndim: int) -> tuple:
    """The index as torch reads one with several ``...``: each stands for the ``free`` dims no
    item uses (a full slice ``:`` counts as used), so items may run past the result's last dim.
    torch walks the items with a position in its result: a slice or None moves it on, an int
    removes the dim there; at or past the end it skips a full slice (and moves on) and refuses
    anything else (IndexError), once it has read every slice (a zero step is its ValueError
    first). The result is that walk as an index without ``...``."""
    if sum(it is Ellipsis for it in index) < 2:
        return index
    for it in index:
        if isinstance(it, slice):
            _as_index(it)
    out, at, dims = [], 0, ndim  # the position, and the result's dims so far
    for it in index:
        for item in [slice(None)] * free if it is Ellipsis else [it]:
            if at > dims or at == dims and item is not None:
                if _full_slice(item):
                    at += 1
                    continue
                raise IndexError(f"an index with more than one ellipsis places {item!r} past "
                                 f"the tensor's last dim (use one ellipsis)")
            out.append(item)
            if item is None:
                at, dims = at + 1, dims + 1
            elif isinstance(item, (slice, list, tuple, Tensor, torch.Tensor)):
                at += _span(item)
            else:  # an int
                dims -= 1
    return tuple(out)


def _full_slice(it) -> bool:
    """``:`` (also ``0:``, ``::1``): an item torch's indexing skips."""
    return (isinstance(it, slice) and it.start in (None, 0) and it.stop is None
            and it.step in (None, 1))


def _as_indices(x: Tensor, index) -> list:
    """Each item ``_as_index``, in order; as torch applies the items one by one, an int out of
    bounds or a bad slice raises before a later item's error (``x[4, :1.5]``). Index tensors
    are taken last, after every item has been applied, so their dtype is checked then, as
    torch's advanced indexing does (``x[t16, ::0]`` is torch's slice error)."""
    out, dim = [], 0
    for it in index:
        item = _as_index(it)
        if it is Ellipsis:
            dim = None  # where later items land depends on the items after them
        elif dim is not None and item is not None:
            if not isinstance(item, (slice, Tensor, torch.Tensor)):
                size = x.shape[dim]
                if not -size <= operator.index(item) < size:
                    raise IndexError(f"index {operator.index(item)} is out of bounds for "
                                     f"dimension {dim} with size {size}")
            dim += item.ndim if _is_mask(item) else 1
        out.append(item)
    if any(isinstance(item, (Tensor, torch.Tensor)) and
           item.dtype not in (*_INT_DTYPES, *_MASK_DTYPES) for item in out):
        raise IndexError("tensors used as indices must be long, int, byte or bool tensors")
    return out


def _as_index(it):
    """An index item as torch would take it, or torch's error: lists become torch tensors,
    and the rest ints, slices, None or ``...`` (index tensors' dtypes: ``_as_indices``)."""
    if isinstance(it, bool):
        raise IndexError("dtorch does not support indexing with a Python bool")
    if isinstance(it, (list, tuple)):
        it = torch.tensor(it)
    if isinstance(it, (Tensor, torch.Tensor)):
        return it
    if isinstance(it, slice):  # checked here, in the index's order, as torch does
        return _as_slice(it)
    if it is None or it is Ellipsis or hasattr(type(it), "__index__"):
        return it
    error = TypeError if isinstance(it, str) else IndexError  # as torch: a str is no sequence
    raise error(f"only integers, slices (`:`), ellipsis (`...`), None and long or byte "
                f"Variables are valid indices (got {_type_name(it)})")


def _type_name(value) -> str:
    """A type as torch names it in errors: ``numpy.float32``, ``str``."""
    t = type(value)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__name__}"


def _check_bounds(x: Tensor, items, tensors, known, value=()) -> None:
    """torch's IndexError for ``known`` index values out of range, at the call (a dtorch index
    tensor's values are only on the devices: there the kernel raises it, at the next read).
    torch checks them last, and only when the result has elements, so the call's metadata
    rule runs first here, as ``bind`` will run it."""
    if not known:
        return
    meta = torch.empty(x.shape, dtype=x.dtype, device="meta")
    indices = [torch.empty(t.shape, dtype=torch.long, device="meta") for t in tensors]
    view = getitem_meta(meta, *indices, index=items)
    if value:  # the value's checks (dtypes, shapes) come before the bounds too
        v = value[0]
        if isinstance(v, (Tensor, torch.Tensor)):
            v = torch.empty(v.shape, dtype=v.dtype, device="meta")
        setitem_meta(meta, v, *indices, index=items)
    if not view.numel():
        return
    for index, dim in known:
        size = x.shape[dim]
        bad = index[(index >= size) | (index < -size)]
        if bad.numel():
            raise IndexError(f"index {bad.flatten()[0].item()} is out of bounds for dimension "
                             f"{dim} with size {size}")


def _is_mask(it) -> bool:
    return isinstance(it, (Tensor, torch.Tensor)) and it.dtype in _MASK_DTYPES


def _dim_at(index, spans, k: int, ndim: int) -> int:
    """The input dim item ``k`` of the index starts at."""
    if any(it is Ellipsis for it in index[:k]):
        return ndim - sum(spans[k:])
    return sum(spans[:k])


def _mask_indices(mask, x: Tensor, dim: int) -> list:
    """A bool mask as integer indices; a dtorch mask is fetched first (a sync)."""
    got, want = list(mask.shape), list(x.shape[dim:dim + mask.ndim])
    if got != want:
        raise IndexError(f"The shape of the mask {got} at index 0 does not match the shape of "
                         f"the indexed tensor {list(x.shape)} at index {dim}")
    values = mask.to_torch() if isinstance(mask, Tensor) else mask
    return list(torch.nonzero(values, as_tuple=True))


def _as_slice(it: slice) -> slice:
    """A slice's bounds as ints, or torch's error. torch reads the step first and, when it is
    zero, notes the ValueError and reads on: a start or stop that is no integer replaces it with
    a TypeError, and a start or stop of -1 raises it at once (CPython's test for a failed read,
    -1 with an error pending), as ``x[-1:1.5:0]`` does."""
    step = _slice_int(it.step)
    bounds = []
    for v in (it.start, it.stop):
        bounds.append(_slice_int(v))
        if step == 0 and bounds[-1] == -1:
            break
    if step is not None and step <= 0:
        raise ValueError("slice step cannot be zero" if step == 0 else
                         "step must be greater than zero")
    return slice(*bounds, step)


def _slice_int(v):
    if v is None:
        return None
    if not hasattr(type(v), "__index__"):
        raise TypeError("slice indices must be integers or None or have an __index__ method")
    return operator.index(v)


def _replicated(t: torch.Tensor, like: Tensor) -> Tensor:
    mesh = like.device_mesh
    return from_torch(t, mesh, [Replicate()] * mesh.ndim)


register(OpDef("getitem", "getitem(input: Tensor, indices: TensorList, index)", _getitem_kernel,
               getitem_rule, meta=getitem_meta, function=False, flags=VIEW, uses_context=True,
               methods=("__getitem__",), front=getitem))
register(OpDef("setitem", "setitem(input: Tensor, value: Tensor, indices: TensorList, index)",
               _setitem, setitem_rule, meta=setitem_meta, function=False, flags=INPLACE,
               methods=("__setitem__",), front=setitem))


# -- value-dependent ops (sync) -------------------------------------------------------------------


def nonzero(input: Tensor, *, as_tuple: bool = False):
    """``torch.nonzero``. Its shape depends on the values: this fetches ``input`` (a sync) and
    returns the indices Replicate on ``input``'s mesh.

    >>> import dtorch
    >>> dtorch.nonzero(dtorch.tensor([0, 3, 0, 5])).to_torch().flatten()
    tensor([1, 3])
    """
    result = torch.nonzero(input.to_torch(), as_tuple=as_tuple)
    if as_tuple:
        return tuple(_replicated(t, input) for t in result)
    return _replicated(result, input)


def unique(input: Tensor, sorted: bool = True, return_inverse: bool = False,
           return_counts: bool = False, dim=None):
    """``torch.unique``. Value-dependent like ``nonzero``: fetches ``input`` (a sync) and returns
    Replicate results on its mesh.

    >>> import dtorch
    >>> dtorch.unique(dtorch.tensor([3, 1, 3])).to_torch()
    tensor([1, 3])
    """
    result = torch.unique(input.to_torch(), sorted=sorted, return_inverse=return_inverse,
                          return_counts=return_counts, dim=dim)
    if isinstance(result, tuple):
        return tuple(_replicated(t, input) for t in result)
    return _replicated(result, input)


register(OpDef("nonzero", "nonzero(input: Tensor, *, as_tuple=False)", None, None,
               methods=("nonzero",), front=nonzero))
register(OpDef("unique", "unique(input: Tensor, sorted=True, return_inverse=False, "
                         "return_counts=False, dim=None)", None, None, methods=("unique",),
               front=unique))


# -- torch's indexing functions -------------------------------------------------------------------
# ``dim`` is the dim indexed along; it must be Replicate in the indexed tensor, other dims may be
# sharded alike in every operand of the same size there.


def _dim(call) -> int:
    return call.static["dim"] % max(len(call.tensors[0].shape), 1)


def _aligned(specs, d) -> tuple:
    """Shard(d) in every operand, or None when their sizes differ along d (blocks would not
    line up)."""
    sizes = {s.shape[d] if d < len(s.shape) else None for s in specs}
    return (Shard(d),) * len(specs) if len(sizes) == 1 and None not in sizes else None


def index_select_rule(call) -> Placed:
    """Other dims shard; a sharded index gives a sharded result along ``dim`` (each device
    selects its chunk of the index from the whole input); selection passes every Partial."""
    (spec, _), dim = call.tensors, _dim(call)
    rows = [((Shard(d),), (Shard(d), R)) for d in range(len(spec.shape)) if d != dim]
    rows.append(((Shard(dim),), (R, Shard(0))))
    rows += [((p,), (p, R)) for p in ALL_PARTIALS]
    return expand(call, rows)


def gather_rule(call) -> Placed:
    """out[i][j] = input[index[i][j]][j] (dim 0): other dims shard in both where their sizes
    agree; an index sharded along ``dim`` gathers its rows from the whole input."""
    (spec, index), dim = call.tensors, _dim(call)
    rows = [((Shard(d),), ins) for d in range(len(spec.shape))
            if d != dim and (ins := _aligned((spec, index), d))]
    rows.append(((Shard(dim),), (R, Shard(dim))))
    rows += [((p,), (p, R)) for p in ALL_PARTIALS]
    return expand(call, rows)


def scatter_rule(linear: bool):
    """Other dims shard in input, index and src alike where their sizes agree. scatter_add is
    linear in (input, src) together: sum_i f(a_i, s_i) = f(sum a_i, sum s_i); scatter is not
    taken as such (which of several writes to one place wins is up to the device)."""

    def rule(call) -> Placed:
        specs, dim = call.tensors, _dim(call)
        rows = [((Shard(d),), ins) for d in range(len(specs[0].shape))
                if d != dim and (ins := _aligned(specs, d))]
        if linear:
            rows += [((p,), (p, R, p)) for p in LINEAR_PARTIALS]
        return expand(call, rows)

    return rule


def index_add_rule(call) -> Placed:
    """Other dims shard in input and source alike (the index is 1-D, along ``dim``); linear in
    (input, source) together, like scatter_add."""
    (spec, _, source), dim = call.tensors, _dim(call)
    rows = [((Shard(d),), (Shard(d), R, Shard(d))) for d in range(len(spec.shape))
            if d != dim and _aligned((spec, source), d)]
    rows += [((p,), (p, R, p)) for p in LINEAR_PARTIALS]
    return expand(call, rows)


# kernels get tensor operands positionally and static args by name: put ``dim`` back in place
for _name, _linear in (("scatter", False), ("scatter_add", True)):
    register(OpDef(_name, f"{_name}(input: Tensor, dim, index: Tensor, src: Tensor)",
                   lambda input, index, src, dim, _fn=getattr(torch, _name): _fn(input, dim,
                                                                                  index, src),
                   scatter_rule(_linear), methods=(_name,)))
register(OpDef("index_add", "index_add(input: Tensor, dim, index: Tensor, source: Tensor, *, "
               "alpha=1)",
               lambda input, index, source, dim, alpha=1: torch.index_add(input, dim, index,
                                                                          source, alpha=alpha),
               index_add_rule, methods=("index_add",)))
register(OpDef("index_select", "index_select(input: Tensor, dim, index: Tensor)",
               lambda input, index, dim: torch.index_select(input, dim, index),
               index_select_rule, methods=("index_select",)))
register(OpDef("gather", "gather(input: Tensor, dim, index: Tensor, *, sparse_grad=False)",
               lambda input, index, dim, sparse_grad=False: torch.gather(input, dim, index,
                                                                         sparse_grad=sparse_grad),
               gather_rule, methods=("gather",)))


def _index_put(input, *operands, accumulate=False):
    return torch.index_put(input, operands[:-1], operands[-1], accumulate)


def index_put_rule(call) -> Placed:
    """Replicate, except that accumulating is linear in (input, values) together."""
    n = len(call.tensors)
    rows = []
    if call.static.get("accumulate"):
        rows = [((p,), (p,) + (R,) * (n - 2) + (p,)) for p in LINEAR_PARTIALS]
    return expand(call, rows)


register(OpDef("index_put", "index_put(input: Tensor, indices: TensorList, values: Tensor, "
               "accumulate=False)", _index_put, index_put_rule, methods=("index_put",)))


# -- sorting --------------------------------------------------------------------------------------


def along_dim_rule(call) -> Placed:
    """Sorting and top-k work along ``dim``, which must be whole (Replicate); every other dim
    may be sharded: each device sorts its own rows. Values move, so no Partial passes."""
    (spec,) = call.tensors
    dim = call.static.get("dim", -1) % max(len(spec.shape), 1)
    n_out = len(call.outs)
    rows = [((Shard(d),) * n_out, (Shard(d),)) for d in range(len(spec.shape)) if d != dim]
    return expand(call, rows)


def _argsort(input, dim=-1, descending=False, *, stable=False):
    return torch.argsort(input, dim=dim, descending=descending, stable=stable)


register(OpDef("topk", "topk(input: Tensor, k, dim=-1, largest=True, sorted=True)",
               lambda input, k, dim=-1, largest=True, sorted=True: tuple(
                   torch.topk(input, k, dim, largest, sorted)),
               along_dim_rule, methods=("topk",), result=torch.return_types.topk))
register(OpDef("sort", "sort(input: Tensor, dim=-1, descending=False, *, stable=False)",
               lambda input, dim=-1, descending=False, stable=False: tuple(
                   torch.sort(input, dim=dim, descending=descending, stable=stable)),
               along_dim_rule, methods=("sort",), result=torch.return_types.sort))
register(OpDef("argsort", "argsort(input: Tensor, dim=-1, descending=False, *, stable=False)",
               _argsort, along_dim_rule, methods=("argsort",)))
