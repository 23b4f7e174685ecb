"""Generates the public functions and Tensor methods from the operator registry.

Each entry's signature (torch's) becomes a real Python function, so argument errors are Python's
own and a call costs no signature binding: ``add(input, other, *, alpha=1)`` becomes

    def add(input, other, *, alpha=1):
        return _dispatch(_op, (input, other), (alpha,), 3)
"""

from __future__ import annotations

import os

from .. import current
from ..ops.creation import size_arg
from ..ops.registry import REGISTRY, plug_dispatch
from . import session
from .dispatch import dispatch, redistribute
from .overrides import handler

_FILENAME = os.path.join(os.path.dirname(os.path.abspath(__file__)), "<generated>")


def _tuple(items) -> str:
    return "(" + ", ".join(items) + ("," if items else "") + ")"


def _tensors(items) -> tuple:
    """Tensor varargs given as one list or tuple (``einsum("ij->j", [x])``) or spread out."""
    return tuple(items[0]) if len(items) == 1 and isinstance(items[0], (list, tuple)) else items


def _keyword_size(positional: tuple, keyword, op: str, name: str) -> tuple:
    """Static varargs given by their keyword, as torch takes them (``x.reshape(shape=(2, -1))``,
    ``x.repeat(repeats=(2, 1))``): one sequence, and not beside positional ones."""
    if positional:
        raise TypeError(f"{op}() got multiple values for argument '{name}'")
    return size_arg((keyword,))


def _axis(dim, axis, default, op: str):
    """``axis=``, NumPy's name of ``dim``, which torch takes too (``torch.cat(ts, axis=0)``)."""
    if dim != default:
        raise TypeError(f"{op}() got multiple values for argument 'dim' (as 'axis')")
    return axis


_NO_KEYWORD = object()


def generate(op, dispatch_fn=dispatch):
    """The public function of ``op``; ``dispatch_fn`` (default: ``dispatch``) receives
    ``(op, operands, static)`` (dtorch.register_op routes its operators through a carrier).
    Static varargs (``*shape``) may also come as one keyword of their name (``shape=``), and a
    ``dim`` with a default as ``axis=``."""
    params, operands, static, star, axis = [], [], [], False, False
    for p in op.params:
        if p.varargs and p.kind == "static":
            given = f"{p.name}_positional"
            params += [f"*{given}", f"{p.name}=_NO"]
            static.append(f"(_size({given}) if {p.name} is _NO else "
                          f"_keyword_size({given}, {p.name}, {op.name!r}, {p.name!r}))")
            star = True
            continue
        if p.varargs:
            params.append("*" + p.name)
            star = True
        else:
            if p.keyword_only and not star:
                params.append("*")
                star = True
            params.append(p.name if p.default is None else f"{p.name}={p.default}")
        if p.kind == "tensor":
            operands.append(p.name)
        elif p.kind == "tensors":  # varargs ("*operands") may also come as one list, as in torch
            operands.append(f"*_tensors({p.name})" if p.varargs else "*" + p.name)
        elif p.name == "dim" and p.default is not None:
            static.append(f"({p.name} if axis is _NO else "
                          f"_axis({p.name}, axis, {p.default}, {op.name!r}))")
            axis = True
        else:
            static.append(p.name)
    if axis:
        params += ["axis=_NO"] if star else ["*", "axis=_NO"]
    # dispatch itself learns to skip this front's frame when it looks for the user's line
    depth = ", 3" if dispatch_fn is dispatch else ""
    call = f"_dispatch(_op, {_tuple(operands)}, {_tuple(static)}{depth})"
    src = (
        f"def {op.name}({', '.join(params)}):\n"
        f"    return {f'_result({call})' if op.result else call}\n"
    )
    namespace = {"_dispatch": dispatch_fn, "_op": op, "_size": size_arg, "_result": op.result,
                 "_tensors": _tensors, "_keyword_size": _keyword_size, "_NO": _NO_KEYWORD,
                 "_axis": _axis}
    exec(compile(src, _FILENAME, "exec"), namespace)
    fn = namespace[op.name]
    fn.__doc__ = op.doc or f"dtorch.{op.signature}: torch.{op.name} on distributed tensors."
    fn.__qualname__ = op.name
    return fn


def place(op, fn, module, functional, tensor_cls) -> None:
    """Puts ``fn``, the front of ``op``, where its entry asks: ``module`` (``dtorch``),
    ``functional`` (``dtorch.nn.functional``) and methods of ``tensor_cls``."""
    if op.function:
        setattr(module, op.name, fn)
    if op.functional:
        setattr(functional, op.name, fn)
    for method in op.methods:
        setattr(tensor_cls, method, fn)
    for alias in op.aliases:
        setattr(module, alias, fn)
        if op.methods:
            setattr(tensor_cls, alias, fn)


# the Tensor methods that talk to the runtime itself rather than issue an operator
RUNTIME_METHODS = {
    "to_torch_async": session.fetch,
    "redistribute": redistribute,
    "__del__": session.release,
}


_targets: tuple = ()  # (module, functional, tensor_cls) of ``install``


def place_late(op) -> None:
    """Places the front of an entry registered after ``install`` (``dtorch.register_op``)."""
    place(op, op.front, *_targets)


def install(module, functional, tensor_cls, methods=None) -> None:
    """Adds every registered operator's front (see ``place``): the entry's own where it has
    one, else the one generated from its signature; then the runtime's methods of Tensor, and
    ``methods`` (name -> function: those of the layers above the client, autograd's). This
    is the only place that adds to ``dtorch``, ``dtorch.nn.functional`` and ``Tensor``."""
    global _targets
    _targets = (module, functional, tensor_cls)
    plug_dispatch(dispatch)
    current.plug_session(session.current, session.running)
    for op in REGISTRY.values():
        place(op, op.front or generate(op), module, functional, tensor_cls)
    for name, fn in {**RUNTIME_METHODS, **(methods or {})}.items():
        setattr(tensor_cls, name, fn)
    tensor_cls.__torch_function__ = handler(module, functional, tensor_cls)  # torch's on ours
