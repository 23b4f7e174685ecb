"""``dtorch.nn.Parameter`` and ``dtorch.nn.Buffer``: dtorch tensors a Module registers as its
parameters and buffers (``named_parameters``, ``state_dict``, ``to``).

Like torch's, each is a new tensor that shares the given tensor's blocks (an alias: no copy).

>>> import dtorch
>>> p = dtorch.nn.Parameter(dtorch.zeros(3))
>>> isinstance(p, dtorch.Tensor), p.requires_grad
(True, True)
"""

from __future__ import annotations

import weakref

from ..tensor import Tensor


def _alias_as(cls, data: Tensor) -> Tensor:
    """A new tensor of class ``cls`` sharing ``data``'s blocks."""
    if not isinstance(data, Tensor):
        raise TypeError(f"dtorch.nn.{cls.__name__}: expects a dtorch.Tensor, got "
                        f"{type(data).__name__}; build one with dtorch.Tensor(t, "
                        f"device_mesh=..., placements=...)")
    alias = data.detach()
    alias.__class__ = cls
    return alias


class Parameter(Tensor):
    __slots__ = ()

    def __new__(cls, data: Tensor, requires_grad: bool = True):
        p = _alias_as(cls, data)
        p.requires_grad = requires_grad
        return p

    def __repr__(self) -> str:
        return "Parameter containing:\n" + super().__repr__()


class Buffer(Tensor):
    """A tensor a Module keeps in its state (``persistent=False``: not in ``state_dict``)."""

    __slots__ = ()

    def __new__(cls, data: Tensor, *, persistent: bool = True):
        b = _alias_as(cls, data)
        if not persistent:
            _TRANSIENT[id(b)] = b
        return b

    @property
    def persistent(self) -> bool:
        return _TRANSIENT.get(id(self)) is not self


# the buffers made with persistent=False, by id (no room in a slot; a tensor's == is elementwise,
# so it cannot key a WeakSet)
_TRANSIENT = weakref.WeakValueDictionary()
