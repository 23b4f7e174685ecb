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

import torch

from .client.dispatch import call_op
from .factories import from_torch
from .ops.indexing import ELLIPSIS, TENSOR
from .placement import Replicate
from .tensor import Tensor

_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def getitem(self: Tensor, index) -> Tensor:
    items, tensors = encode_index(self, index)
    return call_op("getitem", (self, *tensors), (items,))


def setitem(self: Tensor, index, value) -> None:
    """``self[index] = value``; a torch.Tensor value is sent Replicate first."""
    items, tensors = encode_index(self, index)
    if isinstance(value, torch.Tensor):
        value = _replicated(value, self)
    call_op("setitem", (self, value, *tensors), (items,))


def encode_index(x: Tensor, index) -> tuple:
    """(static items, index tensors) for ``x[index]`` (see ops/indexing.py for the items)."""
    index = index if isinstance(index, tuple) else (index,)
    index = [_as_index_tensor(it, x) for it in index]
    spans = [it.ndim if _is_mask(it) else 0 if it is None or it is Ellipsis else 1
             for it in index]
    items, tensors = [], []
    for k, it in enumerate(index):
        if it is None:
            items.append(None)
        elif it is Ellipsis:
            items.append(ELLIPSIS)
        elif isinstance(it, slice):
            items.append(("slice", _opt_int(it.start), _opt_int(it.stop), _opt_int(it.step)))
        elif _is_mask(it):
            nz = _mask_indices(it, x, _dim_at(index, spans, k, x.ndim))
            items += [TENSOR] * len(nz)
            tensors += nz
        elif isinstance(it, Tensor):
            items.append(TENSOR)
            tensors.append(it)
        else:
            items.append(int(it))
    return tuple(items), tensors


def _as_index_tensor(it, x: Tensor):
    """Lists and torch tensors become index tensors (a torch bool mask stays a torch tensor:
    its indices are found here, without a wait)."""
    if isinstance(it, bool):
        raise IndexError("dtorch does not support indexing with a Python bool")
    if isinstance(it, (list, tuple)):
        it = torch.tensor(it)
    if isinstance(it, torch.Tensor):
        if it.dtype == torch.bool:
            return it
        if it.dtype not in _INT_DTYPES:
            raise IndexError("tensors used as indices must be long, int, byte or bool tensors")
        return _replicated(it.long(), x)
    if isinstance(it, Tensor) and it.dtype not in (*_INT_DTYPES, torch.bool):
        raise IndexError("tensors used as indices must be long, int, byte or bool tensors")
    if not (it is None or it is Ellipsis or isinstance(it, (int, slice, Tensor))):
        if not hasattr(it, "__index__"):
            raise IndexError(f"only integers, slices (`:`), ellipsis (`...`), None and long or "
                             f"byte Variables are valid indices (got {type(it).__name__})")
    return it


def _is_mask(it) -> bool:
    return isinstance(it, (Tensor, torch.Tensor)) and it.dtype == torch.bool


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
    return [_replicated(t, x) for t in torch.nonzero(values, as_tuple=True)]


def _opt_int(v):
    return None if v is None else int(v)


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
