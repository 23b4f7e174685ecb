"""Operators whose kernel is a user's function: the host side of ``dtorch.local_map`` and
``dtorch.register_op`` (their fronts are in ``dtorch/extension.py``).

Nothing is pickled across a socket, so a user's function travels by reference: a
``(module, qualified name, import root)`` triple that each host imports (once) and looks up.
``import root`` is the ``sys.path`` entry the client found the module under; a host that cannot
import the module by name adds it to its own path first, so a module beside the user's script
works even when the script runs from another directory.

Both entries carry their user's details as static args, so a host needs nothing but this
module to run them, whichever host joins the run later:

- ``local_map``: ``fn`` on each device's local blocks, with the output specs the client worked out
  (shapes, dtypes, placements).
- ``custom_op``: an operator registered at run time; its metadata and placement rules live on the
  client (``EXTENSIONS``), its kernel is called by reference like local_map's.

A user's kernel may return on a device what the client's metadata run did not promise (a dtype
or shape that depends on values or on the device, a number, too few results). Both carriers
check every device's results against the output specs before the host stores them
(``check_results``): a mismatch is this kernel's error, reported at its call site, and poisons
only its dependents. Unchecked, a wrong block is found only by a later collective, whose peers
then exchange buffers of different sizes, and gloo aborts the host process: the whole runtime
is lost.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import torch

from ..placement import decode_placement, placements_str
from .registry import OpDef, register
from .rules import Call, Placed, expand

# name -> the user's OpDef (client only: its placement and metadata rules)
EXTENSIONS: dict = {}
_RESOLVED: dict = {}


def resolve(ref):
    """The function a reference names, importing its module on first use."""
    fn = _RESOLVED.get(ref)
    if fn is None:
        fn = _RESOLVED[ref] = _lookup(*ref)
    return fn


def _lookup(module: str, qualname: str, root):
    _full_package()
    try:
        obj = importlib.import_module(module)
    except ModuleNotFoundError:
        if root is None or root in sys.path:
            raise
        sys.path.append(root)
        obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _full_package() -> None:
    """Hosts run under a bare ``dtorch`` package (see cluster/local.py); a user's module that
    does ``import dtorch`` (to register its ops, or use Shard) needs the public API, so it is
    loaded once, before the first user module. It starts no runtime: only calls do."""
    package = sys.modules.get("dtorch")
    if package is None or hasattr(package, "Tensor"):
        return
    init = os.path.join(package.__path__[0], "__init__.py")
    spec = importlib.util.spec_from_file_location("dtorch", init,
                                                  submodule_search_locations=package.__path__)
    package.__spec__, package.__package__, package.__file__ = spec, "dtorch", init
    spec.loader.exec_module(package)


def _fill(args, slots, operands) -> list:
    """The user's positional args, with the tensors (operands) back in their slots."""
    out = list(args)
    for k, value in zip(slots, operands):
        out[k] = value
    return out


# -- local_map ------------------------------------------------------------------------------------


def _local_map(ctx, *operands, fn, slots, args, kwargs, outs):
    result = resolve(fn)(*_fill(args, slots, operands), **dict(kwargs))
    results = check_results(result, ctx, fn[1], f"the client's run of {fn[1]} on meta tensors")
    # blobs never share storage unless flagged as views
    results = tuple(r.clone() if any(isinstance(o, torch.Tensor) and _aliases(r, o)
                                     for o in operands) else r for r in results)
    return results[0] if len(results) == 1 else results


def check_results(result, ctx, name: str, promise: str) -> tuple:
    """A user kernel's results on this device, as a tuple, once each is the block its output
    spec promises: a tensor of the spec's dtype, of this device's local shape, on this device.
    Raises ``RuntimeError`` naming what was expected and what came back (``promise`` says where
    the expectation came from); the host reports it as the kernel's failure."""
    results = tuple(result) if isinstance(result, (tuple, list)) else (result,)
    where = f"on device {ctx.device.index}"
    if len(results) != len(ctx.out_specs):
        raise RuntimeError(f"{name} returned {len(results)} results {where}; {promise} gave "
                           f"{len(ctx.out_specs)}")
    for k, (r, spec) in enumerate(zip(results, ctx.out_specs)):
        want = (spec.local_region(ctx.out_coord)[0], getattr(torch, spec.dtype),
                ctx.device.torch_device)
        if not isinstance(r, torch.Tensor) or (tuple(r.shape), r.dtype, r.device) != want:
            raise RuntimeError(
                f"{name} result {k} {where} is {_describe(r)}; expected {_describe_block(*want)}"
                f", this device's block of global shape {tuple(spec.shape)} under placements "
                f"{placements_str(spec.placements)}, as {promise} found it")
    return results


def _describe(r) -> str:
    if isinstance(r, torch.Tensor):
        return _describe_block(tuple(r.shape), r.dtype, r.device)
    return f"a {type(r).__name__}, not a torch.Tensor"


def _describe_block(shape, dtype, device) -> str:
    return f"a {str(dtype)[6:]} tensor of local shape {shape} on {device}"


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.numel() > 0


def _local_map_meta(*operands, fn, slots, args, kwargs, outs):
    results = tuple(torch.empty(shape, dtype=dtype, device="meta") for shape, dtype, _ in outs)
    return results[0] if len(results) == 1 else results


def _local_map_rule(call) -> Placed:
    """The outputs take the placements the user gave; the inputs are used as they are."""
    return Placed(tuple(tuple(map(decode_placement, pl)) for _, _, pl in call.static["outs"]))


register(OpDef("local_map", "local_map(inputs: TensorList, fn, slots, args, kwargs, outs)",
               _local_map, _local_map_rule, meta=_local_map_meta, uses_context=True,
               function=False))


# -- custom_op ------------------------------------------------------------------------------------


def _custom_op(ctx, *operands, name, fn, kwargs, with_context):
    kernel = resolve(fn)
    if with_context:
        result = kernel(ctx, *operands, **dict(kwargs))
    else:
        result = kernel(*operands, **dict(kwargs))
    results = check_results(result, ctx, name, f"the meta rule of dtorch.{name}")
    return results[0] if len(results) == 1 else results


def _custom_meta(*operands, name, fn, kwargs, with_context):
    op = EXTENSIONS[name]
    return (op.meta or op.kernel)(*operands, **dict(kwargs))


def _custom_rule(call) -> Placed:
    """The user's rule sees the call as its own operator's (its name, params and static args),
    so its errors name the user's operator. Rows (a list) expand like every built-in rule."""
    op = EXTENSIONS[call.static["name"]]
    inner = Call(op, call.inputs, dict(call.static["kwargs"]), call.outs, call.mesh)
    placed = op.placement(inner)
    return placed if isinstance(placed, Placed) else expand(inner, placed)


register(OpDef("custom_op", "custom_op(inputs: TensorList, name, fn, kwargs, with_context)",
               _custom_op, _custom_rule, meta=_custom_meta, uses_context=True, function=False))
