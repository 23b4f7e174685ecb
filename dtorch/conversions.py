"""Conversions that need the client: ``to`` a dtype, a mesh or another tensor, ``type_as``,
``copy_`` from any layout or mesh, and ``equal``/``allclose``, which answer a Python bool.

They are thin fronts over registry entries (``ops/conversion.py``, and the cast ``to`` of
``ops/elementwise.py``) and over ``redistribute``.

>>> import dtorch, torch
>>> mesh = dtorch.DeviceMesh("cpu", [0, 1])
>>> x = dtorch.ones(4, 3, device_mesh=mesh, placements=[dtorch.Shard(0)])
>>> y = dtorch.zeros(4, 3, device_mesh=mesh)
>>> dtorch.equal(y.copy_(x), x), x.to(torch.float64).dtype
(True, torch.float64)
"""

from __future__ import annotations

import torch

from .client.dispatch import call_op, check_tensor
from .mesh import DeviceMesh
from .ops.conversion import source_placements
from .ops.creation import PY_DTYPES, check_dtype
from .tensor import Tensor


def _on_mesh(x: Tensor, mesh: DeviceMesh) -> Tensor:
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


def to(input: Tensor, *args, dtype=None, device_mesh=None, device=None, non_blocking=False,
       copy=False):
    """``x.to(dtype)``, ``x.to(device_mesh)`` (same placements on another mesh with as many
    dims), ``x.to(other)`` (``other``'s dtype and mesh, as torch takes its dtype and device), or
    any mix (``x.to(mesh, torch.float16)``). A torch device of the mesh's own type is accepted
    and changes nothing. Like torch, it returns ``x`` itself when nothing changes (unless
    ``copy=True``).

    >>> import dtorch, torch
    >>> x = dtorch.arange(6, device_mesh=dtorch.DeviceMesh("cpu", [0, 1]))
    >>> x.to(torch.float32).dtype, x.to("cpu") is x
    (torch.float32, True)
    """
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
    check_dtype("to", dtype)  # (a Python type is one: the call sends the dtype torch reads)
    if device_mesh is not None and not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"to(): argument 'device_mesh' must be a dtorch.DeviceMesh, not "
                        f"{type(device_mesh).__name__}")
    if device is not None:
        _check_device(input, device)
    out = input
    if dtype is not None:
        out = call_op("to", (out,), (dtype, non_blocking, copy))
    if device_mesh is not None:
        out = _on_mesh(out, device_mesh)
    return out.clone() if copy and out is input else out


def type_as(input: Tensor, other: Tensor) -> Tensor:
    """``input`` cast to ``other``'s dtype (its mesh stays: see ``to(other)`` for both)."""
    check_tensor("type_as", other)
    return to(input, other.dtype)


def copy_(input: Tensor, src: Tensor, non_blocking: bool = False) -> Tensor:
    """Copies ``src`` (broadcast and cast as torch does) into ``input``, which keeps its layout.
    ``src`` is redistributed to ``input``'s layout first, from any placements or mesh."""
    check_tensor("copy_", src, "src")
    if src.device_mesh != input.device_mesh:
        src = src.redistribute(input.device_mesh, source_placements(input._spec, src._spec))
    return call_op("copy_", (input, src), (non_blocking,))


def equal(input: Tensor, other: Tensor) -> bool:
    """True when both have the same shape and elements, as ``torch.equal``. It reads the
    answer, so it waits for the tensors' values (a sync point)."""
    check_tensor("equal", other)
    if tuple(input.shape) != tuple(other.shape):
        return False
    return bool(call_op("equal", (input, other), ()).item())


def allclose(input: Tensor, other: Tensor, rtol=1e-05, atol=1e-08, equal_nan=False) -> bool:
    """``torch.allclose`` (``other`` broadcasts). It reads the answer: a sync point."""
    check_tensor("allclose", other)
    return bool(call_op("allclose", (input, other), (rtol, atol, equal_nan)).item())


def numel(input: Tensor) -> int:
    """The number of elements (metadata: no wait)."""
    return input.numel()


FUNCTIONS = {"equal": equal, "allclose": allclose, "numel": numel}
METHODS = {"to": to, "type_as": type_as, "copy_": copy_, "equal": equal, "allclose": allclose}
