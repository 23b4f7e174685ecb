"""Conversions: detach, the full writes (copy_ into a tensor's own layout, fill_, zero_), the
comparisons that answer one bool (equal, allclose), and their fronts, which add what needs more
than a signature: moving a copy's source across meshes, and reading the bool.

A full write writes every element of its tensor and reads none (``protocol.OVERWRITES``), so
it runs on a tensor whose value failed and makes it usable again; a write of part of one (an
indexing assignment) leaves it failed.

>>> import dtorch, torch
>>> mesh = dtorch.DeviceMesh("cpu", [0, 1])
>>> x = dtorch.ones(4, 3, device_mesh=mesh, placements=[dtorch.Shard(0)])
>>> y = dtorch.zeros(4, 3, device_mesh=mesh)
>>> dtorch.equal(y.copy_(x), x), dtorch.allclose(x, y)
(True, True)
"""

from __future__ import annotations

import torch

from ..mesh import DeviceMesh
from ..placement import Partial, Replicate, Shard
from ..tensor import Tensor
from .creation import PY_DTYPES, check_dtype, from_torch
from .elementwise import cast_rule
from .registry import INPLACE, OVERWRITES, VIEW, OpDef, issue, register
from .rules import Placed, expand, pointwise_rows

R = Replicate()
# Each block answers 1 (it agrees) or 0; the tensors agree when every block does: the minimum.
AGREE = Partial("min")


def same_layout(call) -> Placed:
    return Placed((call.tensors[0].placements,))


# detach shares its input's blocks: any layout passes unchanged
register(OpDef("detach", "detach(input: Tensor)", torch.detach, same_layout,
               methods=("detach",), flags=VIEW))


# -- copy_ ----------------------------------------------------------------------------------------


def source_placements(dst, src) -> tuple:
    """The layout ``src`` takes to be copied into ``dst`` block by block: ``dst``'s shards where
    the dims line up (where ``src`` broadcasts, Replicate), and Replicate on ``dst``'s Partial
    mesh dims (each device then keeps its share of the value, as a factory does: a sum of
    partial copies would not survive the cast to ``dst``'s dtype)."""
    off = len(dst.shape) - len(src.shape)
    out = []
    for p in dst.placements:
        e = p.dim - off if isinstance(p, Shard) else -1
        out.append(Shard(e) if e >= 0 and src.shape[e] == dst.shape[p.dim] else R)
    return tuple(out)


def copy_rule(call) -> Placed:
    """The destination keeps its layout; the source is redistributed to match it first (the
    one automatic redistribution of a conversion, documented in docs/ops.md)."""
    dst, src = call.tensors
    target = source_placements(dst, src)
    return Placed((dst.placements,), (None, None if target == src.placements else target))


def _copy(ctx, input, src, non_blocking=False):
    return input.copy_(ctx.partition(src), non_blocking=non_blocking)


def check_tensor(name: str, value, param: str = "other") -> None:
    """torch's TypeError for a non-tensor where a function takes a tensor."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{name}(): argument '{param}' must be Tensor, not {type(value).__name__}")


def copy_(input: Tensor, src: Tensor, non_blocking: bool = False) -> Tensor:
    """Copies ``src`` (broadcast and cast as torch does) into ``input``, which keeps its layout.
    ``src`` is redistributed to ``input``'s layout first, from any placements or mesh: loading a
    state_dict needs no manual sharding. A torch tensor of ``input``'s shape goes straight to
    the devices, each receiving its block (torch's ``load_state_dict`` copies so into the
    parameters of a module ``nn.parallelize`` laid out)."""
    if isinstance(src, torch.Tensor):
        same = tuple(src.shape) == tuple(input.shape)
        src = from_torch(src.detach(), input.device_mesh,
                         source_placements(input._spec, input._spec) if same else None)
    check_tensor("copy_", src, "src")
    if src.device_mesh != input.device_mesh:
        src = src.redistribute(input.device_mesh, source_placements(input._spec, src._spec))
    return issue("copy_", (input, src), (non_blocking,))


register(OpDef("copy_", "copy_(input: Tensor, src: Tensor, non_blocking=False)", _copy,
               copy_rule, meta=torch.Tensor.copy_, function=False, flags=INPLACE | OVERWRITES,
               uses_context=True, methods=("copy_",), front=copy_))


# -- fill_, zero_ ---------------------------------------------------------------------------------


def fill_rule(call) -> Placed:
    """The tensor keeps its layout; a value given as a (0-dim) tensor is made Replicate first.
    Every device fills its block (on a Partial sum mesh dim, as factories: coordinate 0 the
    value, the others zeros)."""
    dst, *value = call.tensors
    whole = (R,) * len(call.mesh.shape)
    return Placed((dst.placements,), (None, *(None if v.placements == whole else whole
                                              for v in value)))


def _fill(ctx, input, value):
    return input.fill_(value) if ctx.holds_value() else input.zero_()


def _zero(ctx, input):
    return input.zero_()


register(OpDef("fill_", "fill_(input: Tensor, value: Tensor)", _fill, fill_rule,
               meta=torch.Tensor.fill_, function=False, flags=INPLACE | OVERWRITES,
               uses_context=True, methods=("fill_",)))
register(OpDef("zero_", "zero_(input: Tensor)", _zero, same_layout, meta=torch.Tensor.zero_,
               function=False, flags=INPLACE | OVERWRITES, uses_context=True,
               methods=("zero_",)))


# -- equal, allclose ------------------------------------------------------------------------------


def agree_rule(call) -> Placed:
    """Blocks are compared where they line up, as in a binary elementwise op (a Replicate
    operand is chunked locally to the other's shards); a sharded mesh dim then holds one answer
    per block, reduced by their minimum. A Partial operand must be reduced first (the parts of
    equal tensors need not be equal)."""
    shape = torch.broadcast_shapes(*(s.shape for s in call.tensors))
    rows = pointwise_rows(call._replace(outs=[(tuple(shape), None)]))
    return expand(call, [((AGREE,), ins) for _, ins in rows], auto_chunk=True)


def _answer(input, ok: torch.Tensor) -> torch.Tensor:
    return ok.to(device=input.device, dtype=torch.int64)


def _equal(input, other):
    return _answer(input, torch.tensor(torch.equal(input, other)))


def _allclose(input, other, rtol=1e-05, atol=1e-08, equal_nan=False):
    return _answer(input, torch.isclose(input, other, rtol, atol, equal_nan).all())


def _answer_meta(input, other, **tolerances):
    if tolerances:  # allclose: torch's own checks of dtypes and shapes
        torch.isclose(input, other, **tolerances)
    return torch.empty((), dtype=torch.int64, device="meta")


def equal(input: Tensor, other: Tensor) -> bool:
    """True when both have the same shape and elements, as ``torch.equal``. It reads the
    answer, so it waits for the tensors' values (a sync point)."""
    check_tensor("equal", other)
    if tuple(input.shape) != tuple(other.shape):  # False, not an error, as torch
        return False
    return bool(issue("equal", (input, other), ()).item())


def allclose(input: Tensor, other: Tensor, rtol=1e-05, atol=1e-08, equal_nan=False) -> bool:
    """``torch.allclose`` (``other`` broadcasts). It reads the answer: a sync point."""
    check_tensor("allclose", other)
    return bool(issue("allclose", (input, other), (rtol, atol, equal_nan)).item())


register(OpDef("equal", "equal(input: Tensor, other: Tensor)", _equal, agree_rule,
               meta=_answer_meta, methods=("equal",), front=equal))
register(OpDef("allclose",
               "allclose(input: Tensor, other: Tensor, rtol=1e-05, atol=1e-08, equal_nan=False)",
               _allclose, agree_rule, meta=_answer_meta, methods=("allclose",), front=allclose))


# -- to -------------------------------------------------------------------------------------------


def _on_mesh(x: Tensor, mesh) -> Tensor:
    """``x`` on ``mesh`` with its placements (the meshes must have as many dims)."""
    if mesh == x.device_mesh:
        return x
    if len(mesh.shape) != len(x.device_mesh.shape):
        raise ValueError(
            f"dtorch.to: a {len(x.device_mesh.shape)}-D layout ({x.placements}) does not fit "
            f"a {len(mesh.shape)}-D mesh; say which placements to take, e.g. "
            f"x = x.redistribute(device_mesh=mesh, placements=[...])"
        )
    return x.redistribute(mesh, x.placements)


def _check_device(x: Tensor, device) -> None:
    if torch.device(device).type != x.device_mesh.device_type:
        raise NotImplementedError(
            f"dtorch.to: moving a tensor from {x.device_mesh.device_type} to {device} is not "
            f"supported yet; use x.to(device_mesh) for a mesh of that device type"
        )


def to_arguments(args, dtype=None, device_mesh=None, device=None, non_blocking=False,
                 copy=False) -> tuple:
    """(dtype, device_mesh, device, non_blocking, copy) that ``x.to(*args, ...)`` names, in any
    of its forms: a dtype, a mesh, a torch device, another tensor (its dtype and mesh, as torch
    takes its dtype and device), torch's positional ``(non_blocking, copy)``; ``device=`` may be
    a mesh too, as in DTorch."""
    flags = []
    for a in args:
        if isinstance(a, torch.dtype) or isinstance(a, type) and a in PY_DTYPES:
            dtype = a
        elif isinstance(a, DeviceMesh):
            device_mesh = a
        elif isinstance(a, Tensor):
            dtype, device_mesh = a.dtype, a.device_mesh
        elif isinstance(a, (str, torch.device)):
            device = a
        elif isinstance(a, bool):
            flags.append(a)
        else:
            raise TypeError(f"to() received an invalid combination of arguments: {a!r}")
    if flags:  # torch's positional (non_blocking, copy)
        non_blocking, copy = (flags + [copy])[:2]
    if isinstance(device, DeviceMesh):
        device, device_mesh = None, device
    check_dtype("to", dtype)  # (a Python type is one: the call sends the dtype torch reads)
    if device_mesh is not None and not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"to(): argument 'device_mesh' must be a dtorch.DeviceMesh, not "
                        f"{type(device_mesh).__name__}")
    return PY_DTYPES.get(dtype, dtype), device_mesh, device, non_blocking, copy


def parser_tensor_to_function_arg(args, kwargs) -> tuple:
    """DTorch's ``Tensor.parser_tensor_to_function_arg``: the ``(device_mesh, dtype)`` that a
    ``to(*args, **kwargs)`` call names, a device given as its one-device mesh (``"cuda"``:
    ``DeviceMesh("cuda", [0])``), None for what it leaves out; keywords that are not
    ``to``'s are left to the caller (a pipeline's ``to`` takes its own).

    >>> import dtorch, torch
    >>> dtorch.Tensor.parser_tensor_to_function_arg(("cpu",), {"dtype": torch.float16})
    (DeviceMesh('cpu', dim_name: [], shape: (1,), data: [0]), torch.float16)
    """
    names = ("dtype", "device_mesh", "device", "non_blocking", "copy")
    dtype, mesh, device, _, _ = to_arguments(args, **{k: v for k, v in kwargs.items()
                                                      if k in names})
    if mesh is None and device is not None:
        mesh = DeviceMesh(device)
    return mesh, dtype


def to(input: Tensor, *args, dtype=None, device_mesh=None, device=None, non_blocking=False,
       copy=False):
    """``x.to(dtype)``, ``x.to(device_mesh)`` (same placements on another mesh with as many
    dims), ``x.to(other)`` (``other``'s dtype and mesh, as torch takes its dtype and device), or
    any mix (``x.to(mesh, torch.float16)``). ``device=`` may be a mesh too, as in DTorch; a
    torch device of the mesh's own type changes nothing. Like torch, it returns ``x`` itself
    when nothing changes (unless ``copy=True``).

    >>> import dtorch, torch
    >>> x = dtorch.arange(6, device_mesh=dtorch.DeviceMesh("cpu", [0, 1]))
    >>> x.to(torch.float32).dtype, x.to("cpu") is x
    (torch.float32, True)
    """
    dtype, device_mesh, device, non_blocking, copy = to_arguments(
        args, dtype, device_mesh, device, non_blocking, copy)
    if device is not None:
        _check_device(input, device)
    out = input
    if dtype is not None:
        out = issue("to", (out,), (dtype, non_blocking, copy))
    if device_mesh is not None:
        out = _on_mesh(out, device_mesh)
    return out.clone() if copy and out is input else out


# a cast to the input's own dtype returns the input itself, as in torch: flagged as a view
register(OpDef("to", "to(input: Tensor, dtype, non_blocking=False, copy=False)", torch.Tensor.to,
               cast_rule, methods=("to",), function=False, flags=VIEW, front=to))


# -- composites -----------------------------------------------------------------------------------


def type_as(input: Tensor, other: Tensor) -> Tensor:
    """``input`` cast to ``other``'s dtype (its mesh stays: ``to(other)`` takes both)."""
    check_tensor("type_as", other)
    return input.to(other.dtype)


def numel(input: Tensor) -> int:
    """The number of elements (metadata: no wait)."""
    return input.numel()


register(OpDef("type_as", "type_as(input: Tensor, other: Tensor)", None, None,
               methods=("type_as",), function=False, front=type_as))
register(OpDef("numel", "numel(input: Tensor)", None, None, front=numel))
