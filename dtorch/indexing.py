"""``x[index]`` and ``x[index] = value``, and the value-dependent ops ``nonzero`` and ``unique``:
fronts over the entries of ``ops/indexing.py``.

Ints, slices (any step, negative bounds), ``None``, ``...`` and integer tensors (dtorch or
torch tensors, or lists: advanced indexing, broadcast as torch does) index without waiting.
A dim an index touches must be Replicate (the call raises ``ValueError`` naming the
``redistribute()`` otherwise); whole dims keep their shards.

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

from .client.dispatch import call_op
from .factories import from_torch
from .ops.indexing import ELLIPSIS, TENSOR, getitem_meta, setitem_meta
from .placement import Replicate
from .tensor import Tensor

# torch's index tensors: long and int ones index, bool and byte ones are masks (byte: deprecated)
_INT_DTYPES = (torch.int64, torch.int32)
_MASK_DTYPES = (torch.bool, torch.uint8)


def getitem(self: Tensor, index) -> Tensor:
    items, tensors = index_operands(self, index)
    return call_op("getitem", (self, *tensors), (items,))


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
    call_op("setitem", (self, value, *tensors), (items,))


def index_operands(x: Tensor, index, value=()) -> tuple:
    """(static items, index tensors) for ``x[index]`` (``x[index] = value[0]``): checked as
    torch checks them, then the index tensors the client holds are sent Replicate."""
    items, tensors, known = encode_index(x, index)
    _check_bounds(x, items, tensors, known, value)
    return items, [_replicated(t.long(), x) if isinstance(t, torch.Tensor) else t
                   for t in tensors]


def encode_index(x: Tensor, index) -> tuple:
    """(static items, index tensors, known) for ``x[index]`` (see ops/indexing.py for the
    items). Index tensors are dtorch tensors, or torch ones whose values the client holds;
    ``known``: (torch index tensor, the dim it indexes)."""
    index = index if isinstance(index, tuple) else (index,)
    # torch counts the dims an index uses before it looks at the items' types (None, ``...``
    # and a bool use none)
    used = sum(it.ndim if _is_mask(it) else 0 if it is None or it is Ellipsis
               or isinstance(it, bool) else 1 for it in index)
    if used > x.ndim:
        raise IndexError(f"too many indices for tensor of dimension {x.ndim}")
    index = [_as_index(it) for it in index]
    spans = [it.ndim if _is_mask(it) else 0 if it is None or it is Ellipsis else 1
             for it in index]
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


def _as_index(it):
    """An index item as torch would take it, or torch's error: lists become torch tensors,
    index tensors must be integer or bool ones, and the rest ints, slices, None or ``...``."""
    if isinstance(it, bool):
        raise IndexError("dtorch does not support indexing with a Python bool")
    if isinstance(it, (list, tuple)):
        it = torch.tensor(it)
    if isinstance(it, (Tensor, torch.Tensor)):
        if it.dtype not in (*_INT_DTYPES, *_MASK_DTYPES):
            raise IndexError("tensors used as indices must be long, int, byte or bool tensors")
        return it
    if isinstance(it, slice):  # checked here, in the index's order, as torch does
        start, stop, step = (_slice_int(v) for v in (it.start, it.stop, it.step))
        if step is not None and step <= 0:
            raise ValueError("slice step cannot be zero" if step == 0 else
                             "step must be greater than zero")
        return slice(start, stop, step)
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


def _slice_int(v):
    if v is None:
        return None
    if not hasattr(type(v), "__index__"):
        raise TypeError("slice indices must be integers or None or have an __index__ method")
    return operator.index(v)


def _replicated(t: torch.Tensor, like: Tensor) -> Tensor:
    mesh = like.device_mesh
    return from_torch(t, mesh, [Replicate()] * mesh.ndim)


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
