"""dtorch.Tensor: a symbol for a distributed tensor.

A Tensor holds only metadata (an interned TensorSpec: global shape, dtype, mesh, placements) and
an integer id; its value lives on the hosts. Operators return at once; reading a value
(``to_torch``, ``item``, ``print``) is the only wait. Operator methods (``x.sum()``, ``x + y``)
are generated from the operator registry by ``client/frontend.py``.

>>> import dtorch
>>> mesh = dtorch.DeviceMesh("cpu", [0, 1])
>>> x = dtorch.ones((4, 2), device_mesh=mesh, placements=[dtorch.Shard(0)])
>>> (x * 3).sum().item()
24.0
"""

from __future__ import annotations

import torch

from .client import session as _session
from .placement import Partial, Replicate, Shard, placements_str

DTYPES = {str(d)[6:]: d for d in vars(torch).values() if isinstance(d, torch.dtype)}


class Tensor:
    __slots__ = ("_id", "_spec", "__weakref__")
    # NumPy's operators defer to ours (``np.float32(2) + x`` calls ``x.__radd__``), as for torch
    __array_ufunc__ = None

    # -- metadata -------------------------------------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._spec.shape)

    def size(self, dim: int | None = None):
        return torch.Size(self._spec.shape) if dim is None else self._spec.shape[dim]

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self._spec.dtype]

    @property
    def device_mesh(self):
        return self._spec.mesh

    @property
    def placements(self) -> list:
        return list(self._spec.placements)

    @property
    def ndim(self) -> int:
        return len(self._spec.shape)

    def dim(self) -> int:
        return len(self._spec.shape)

    def numel(self) -> int:
        n = 1
        for s in self._spec.shape:
            n *= s
        return n

    @property
    def device(self) -> torch.device:
        return torch.device(self._spec.mesh.device_type)

    @property
    def is_dtensor(self) -> bool:
        return True

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def __len__(self) -> int:
        if not self._spec.shape:
            raise TypeError("len() of a 0-d tensor")
        return self._spec.shape[0]

    # -- layout ---------------------------------------------------------------------------------
    def redistribute(self, device_mesh=None, placements=None) -> Tensor:
        """The same value laid out on ``device_mesh`` (default: this tensor's) with
        ``placements`` (default: all Replicate). Unchanged layout returns ``self``.

        >>> import dtorch
        >>> mesh = dtorch.DeviceMesh("cpu", [0, 1])
        >>> x = dtorch.arange(6, device_mesh=mesh, placements=[dtorch.Shard(0)])
        >>> x.redistribute(placements=[dtorch.Replicate()]).placements
        [Replicate()]
        """
        from .client.dispatch import redistribute

        return redistribute(self, device_mesh, placements)

    # -- values (the only waits) ----------------------------------------------------------------
    def to_torch_async(self):
        """A TensorFuture of the full logical value (shards joined, partials reduced)."""
        return _session.current().fetch(self)

    def to_torch(self) -> torch.Tensor:
        """The full logical value as a torch.Tensor on the CPU."""
        return self.to_torch_async().get()

    def numpy(self):
        return self.to_torch().numpy()

    def tolist(self):
        return self.to_torch().tolist()

    def item(self):
        if self.numel() != 1:
            raise RuntimeError(
                f"a Tensor with {self.numel()} elements cannot be converted to Scalar"
            )
        return self.to_torch().item()

    def __bool__(self) -> bool:
        return bool(self.item())

    def __float__(self) -> float:
        return float(self.item())

    def __int__(self) -> int:
        return int(self.item())

    def __index__(self) -> int:
        return int(self.item())

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        try:
            value = repr(self.to_torch())
        except Exception as e:  # a poisoned tensor still prints its metadata
            value = f"<error: {e}>"
        return (
            f"dtorch.Tensor({value}, shape={list(self._spec.shape)}, dtype={self.dtype}, "
            f"device_mesh={self._spec.mesh!r}, placements={self.placements})"
        )

    def __str__(self) -> str:
        return self.__repr__()

    def __format__(self, spec: str) -> str:
        if self.numel() == 1 and spec:
            return format(self.item(), spec)
        return str(self)

    def __del__(self):
        _session.release(self._id)

    def __reduce__(self):
        raise TypeError("a dtorch.Tensor is a handle to remote memory; use to_torch() to save it")

    def __iter__(self):
        raise TypeError("iterating a dtorch.Tensor element by element is not supported yet")

    def _short(self) -> str:
        return f"Tensor#{self._id}{list(self._spec.shape)}{placements_str(self._spec.placements)}"


__all__ = ["Tensor", "DTYPES", "Shard", "Replicate", "Partial"]
