"""Indexing: ``x[index]``, ``x[index] = v``, and torch's indexing functions.

A dim that an index touches (an int, a slice that is not the whole dim, an index tensor) must be
Replicate: a shard's block of a slice of an uneven split is generally not an ``array_split``
chunk of the result, so the rule refuses rather than give wrong values. A dim that passes whole
(``:``, ``...``, the dims after the index) keeps its shard at its new position, since each
device then indexes its own block exactly as torch indexes the whole. Selection copies elements
and never combines them, so every Partial passes ``x[index]``; index tensors are Replicate.

The index travels as static data: ints, ``None``, ``"..."``, ``("slice", start, stop, step)``
and ``"T"`` for each index tensor, which are operands. Bool masks are value-dependent and turned
into integer indices on the client before they get here (``dtorch/indexing.py``).
"""

from __future__ import annotations

import torch

from ..placement import Replicate, Shard
from .registry import INPLACE, VIEW, OpDef, register
from .rules import ALL_PARTIALS, LINEAR_PARTIALS, Placed, expand

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


def getitem_rule(call) -> Placed:
    spec, *idx = call.tensors
    dims = passthrough_dims(call.static["index"], spec.shape, [len(s.shape) for s in idx])
    rest = (R,) * len(idx)
    rows = [((Shard(o),), (Shard(d),) + rest) for d, o in dims.items()]
    rows += [((p,), (p,) + rest) for p in ALL_PARTIALS]
    return expand(call, rows)


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


register(OpDef("getitem", "getitem(input: Tensor, indices: TensorList, index)", _getitem,
               getitem_rule, meta=getitem_meta, function=False, flags=VIEW))
register(OpDef("setitem", "setitem(input: Tensor, value: Tensor, indices: TensorList, index)",
               _setitem, setitem_rule, meta=setitem_meta, function=False, flags=INPLACE))


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
