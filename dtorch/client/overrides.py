"""torch's override protocol on dtorch tensors: ``torch.add(x, y)``,
``torch.nn.functional.relu(x)`` and ``torch.nn.Linear(6, 3)(x)`` on a dtorch tensor run
dtorch's operators (``Tensor.__torch_function__``, which ``frontend.install`` puts there).

torch calls ``__torch_function__`` of a "tensor-like" argument (any object with one) for its
functions, ``torch.nn.functional``'s and ``torch.Tensor``'s methods. The handler finds dtorch's
operator of the same name in the same place: ``torch.nn.functional.X`` -> ``dtorch.nn.functional
.X``, ``torch.X`` -> ``dtorch.X``, ``torch.Tensor.X`` (an operator or method of a torch tensor
meeting a dtorch one: ``torch_t + x``) -> ``dtorch.Tensor.X``; so the placement rules, errors and
autograd are dtorch's. ``torch.nn.init``'s functions run as they are (they call the tensor's
own in-place methods: ``dtorch.nn.init``). ``torch.cat`` keeps torch's legacy rule that a
1-D tensor with no elements takes no part. A torch tensor among the arguments (a torch module's weight, a constant)
is made a dtorch tensor first, Replicate on the mesh of the first dtorch tensor argument: correct
for any layout, but a copy to every device at each call, and a constant (no gradient reaches
a torch parameter: lay the module out once instead, ``load_state_dict`` into dtorch modules). What dtorch lacks raises ``NotImplementedError`` naming
torch's function; nothing falls back to one device.
"""

from __future__ import annotations

import torch

from ..tensor import Tensor


def handler(module, functional, tensor_cls):
    """``Tensor.__torch_function__`` for the namespaces ``frontend.install`` fills: ``dtorch``,
    ``dtorch.nn.functional`` and ``Tensor``."""

    def torch_function(cls, func, types, args=(), kwargs=None):
        return run(module, functional, tensor_cls, func, args, kwargs or {})

    return classmethod(torch_function)


def run(module, functional, tensor_cls, func, args, kwargs):
    """``func`` (torch's) on arguments among which are dtorch tensors, run as dtorch's operator
    of that name (see the module doc)."""
    first = args[0] if args and isinstance(args[0], Tensor) else next(
        (a for a in _leaves((args, kwargs)) if isinstance(a, Tensor)), None)
    if first is None:  # (torch asked us without one of ours: nothing to do)
        return NotImplemented
    try:
        ours = _OURS[func]
    except KeyError:
        ours = _OURS[func] = _ours(module, functional, tensor_cls, func)
    except TypeError:  # (an unhashable callable)
        ours = _ours(module, functional, tensor_cls, func)
    if ours is None and getattr(func, "__module__", None) == "torch.nn.init":
        # torch's init functions read a shape and call the tensor's own in-place methods,
        # which dtorch tensors have: they run as they are (``dtorch.nn.init``), unintercepted
        with torch._C.DisableTorchFunction():
            return func(*args, **kwargs)
    if ours is None:
        where = getattr(func, "__qualname__", None) or repr(func)
        raise NotImplementedError(
            f"dtorch has no operator for torch's {getattr(func, '__module__', 'torch')}."
            f"{where} on dtorch tensors; use dtorch's operators (docs/ops.md), "
            f"dtorch.local_map, or read the value with .to_torch()")
    if _plain(args) and (not kwargs or _plain(kwargs.values())):
        return ours(*args, **kwargs)
    mesh = first.device_mesh
    if func in _JOINS and args and isinstance(args[0], (list, tuple)):
        # torch's legacy rule: a 1-D torch tensor with no elements takes no part in a cat
        # (HF's DynamicCache starts each layer's keys from one)
        args = ([t for t in args[0] if not (isinstance(t, torch.Tensor) and t.dim() == 1
                                             and t.numel() == 0)], *args[1:])
    return ours(*_converted(args, mesh), **_converted(kwargs, mesh))


_JOINS = (torch.cat, torch.concat, torch.concatenate)
_OURS: dict = {}  # torch's function -> dtorch's of the same name and place (None: none)


def _ours(module, functional, tensor_cls, func):
    """dtorch's operator for torch's ``func``: the same name in the same place."""
    name = getattr(func, "__name__", None)
    if name is None:
        return None
    if getattr(torch.nn.functional, name, None) is func:
        return getattr(functional, name, None)
    if getattr(torch, name, None) is func or getattr(torch.linalg, name, None) is func:
        return getattr(module, name, None)
    if getattr(torch.Tensor, name, None) is func:
        return getattr(tensor_cls, name, None)
    return None


def _leaves(value):
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from _leaves(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v)
    else:
        yield value


def _plain(values) -> bool:
    """Whether ``values`` hold no torch tensor to convert, in lists and tuples too (torch.cat's
    tensors): the usual call, passed on as it is."""
    for v in values:
        if isinstance(v, torch.Tensor) or isinstance(v, dict) or isinstance(
                v, (list, tuple)) and not _plain(v):
            return False
    return True


def _converted(value, mesh):
    """``value`` with every torch tensor in it made a Replicate dtorch tensor on ``mesh``."""
    if isinstance(value, torch.Tensor):
        from ..ops.creation import from_torch

        return from_torch(value.detach(), device_mesh=mesh)
    if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        return (tuple if isinstance(value, tuple) else list)(_converted(v, mesh) for v in value)
    if isinstance(value, dict):
        return {k: _converted(v, mesh) for k, v in value.items()}
    return value
