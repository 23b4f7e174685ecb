"""The extension point: run any torch function on local shards (``local_map``), or register a new
operator (``register_op``), so a user is never stuck on a missing op.

Hosts are separate processes and nothing is pickled, so a user's function travels by reference:
a ``(module, qualified name, import root)`` triple that each host imports (once) and looks up.
It must therefore be importable by name: a module-level function of an importable module, or a
torch function. Lambdas, nested functions and functions of the script being run (``__main__``)
are refused with a ``TypeError`` at the call: a host could import the script only by running it
again, program and all. Put the function in a module beside the script (``import root`` is the
``sys.path`` entry the client found the module under; a host that cannot import the module by
name adds it to its own path first, so this works even when the script runs from elsewhere);
that module must not run a dtorch program when imported (guard it with
``if __name__ == "__main__"``).

Both forms run through a carrier entry that takes the user's details as static args, so a host
needs nothing but this module to run them, whichever host joins the run later:

- ``local_map``: ``fn`` on each device's local blocks, with the output specs the client worked out
  (shapes, dtypes, placements).
- ``custom_op``: the kernel of an operator registered at run time. ``register_op``
  (``client/user_ops.py``: it generates and places a front, the client's work) makes an
  ordinary registry entry (its metadata and placement rules are used on the client, as every
  entry's are) whose front routes the call through this carrier.

A user's kernel may return on a device what the client's metadata run did not promise (a dtype
or shape that depends on values or on the device, a number, too few results). Both carriers
check every device's results against the output specs before the host stores them
(``check_results``): a mismatch is this kernel's error, reported at its call site, and poisons
only its dependents. Unchecked, a wrong block is found only by a later collective, whose peers
then exchange buffers of different sizes, and gloo aborts the host process: the whole runtime
is lost.

>>> import torch, dtorch
>>> mesh = dtorch.DeviceMesh("cpu", [0, 1])
>>> x = dtorch.arange(6., device_mesh=mesh, placements=[dtorch.Shard(0)])
>>> dtorch.local_map(torch.cumsum, [dtorch.Shard(0)])(x, 0).to_torch()  # a cumsum per shard
tensor([ 0.,  1.,  3.,  3.,  7., 12.])
"""

from __future__ import annotations

import importlib
import os
import sys

import torch

from ..placement import (
    Placement,
    decode_placement,
    encode_placement,
    local_shape,
    normalize_placements,
    placements_str,
)
from ..tensor import Tensor
from .registry import OpDef, freeze, issue, lookup, register
from .rules import Call, Placed, expand

_RESOLVED: dict = {}


def resolve(ref):
    """The function a reference names, importing its module on first use."""
    fn = _RESOLVED.get(ref)
    if fn is None:
        fn = _RESOLVED[ref] = _lookup(*ref)
    return fn


def _lookup(module: str, qualname: str, root):
    try:
        obj = importlib.import_module(module)
    except ModuleNotFoundError:
        if root is None:
            raise
        if root not in sys.path:
            sys.path.append(root)
        # the finder of a directory already on the path may hold a stale listing of it (its
        # modification time is coarse): read it again
        importlib.invalidate_caches()
        obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


# -- references -----------------------------------------------------------------------------------


def function_ref(fn, who: str) -> tuple:
    """(module, qualified name, import root) naming ``fn`` on the hosts; ``fn`` may also be
    given as a dotted name (``"torch.cumsum"``, ``"mypkg.ops:Ops.fn"``)."""
    if isinstance(fn, str):
        module, qualname = _split_name(fn)
    else:
        module, qualname = _name_of(fn, who)
    ref = (module, qualname, _import_root(module))
    found = _try_resolve(ref)
    if isinstance(fn, str) and found is None:
        raise ValueError(f"dtorch.{who}: cannot import {fn!r}")
    if not isinstance(fn, str) and found is not fn and found != fn:
        raise TypeError(f"dtorch.{who}: {fn!r} is not reachable as {module}.{qualname}; pass a "
                        f"module-level function, or its dotted name as a string")
    return ref


def _name_of(fn, who: str) -> tuple:
    qualname = getattr(fn, "__qualname__", None)
    owner = getattr(fn, "__objclass__", None)  # methods of C types (torch.Tensor.add)
    module = getattr(fn, "__module__", None) or getattr(owner, "__module__", None)
    if module is None or qualname is None:
        raise TypeError(f"dtorch.{who}: {fn!r} has no module-level name to import on the hosts")
    if "<" in qualname:
        raise TypeError(f"dtorch.{who}: {qualname} is a lambda or a nested function; hosts import "
                        f"functions by name (nothing is pickled): define it at module level")
    if module == "__main__":
        raise TypeError(f"dtorch.{who}: {qualname} is defined in the script being run "
                        f"(__main__), which the hosts cannot import without running it again; "
                        f"move it to a module beside the script and import it from there")
    if _try_resolve((module, qualname, None)) is not fn:
        # builtins report an internal class (torch.cumsum: _VariableFunctionsClass.cumsum)
        name = getattr(fn, "__name__", qualname)
        if _try_resolve((module, name, None)) is fn:
            qualname = name
    return module, qualname


def _split_name(name: str) -> tuple:
    if ":" in name:
        return tuple(name.split(":", 1))
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):  # the longest importable module prefix
        try:
            importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        return ".".join(parts[:i]), ".".join(parts[i:])
    return name, ""


def _import_root(module: str):
    """The sys.path entry this process imports ``module`` from (None for built-in modules)."""
    mod = sys.modules.get(module)
    path = getattr(mod, "__file__", None)
    if path is None:
        return None
    for _ in range(module.count(".") + 1 + path.endswith("__init__.py")):
        path = os.path.dirname(path)
    return path


def _try_resolve(ref):
    try:
        return resolve(ref)
    except (ImportError, AttributeError):
        return None


# -- local_map ------------------------------------------------------------------------------------


def local_map(fn, out_placements, in_placements=None):
    """``fn`` run on each device's local blocks, as a function of distributed tensors.

    ``fn`` gets the local torch tensors in place of the dtorch tensors (other arguments pass as
    they are: numbers, strings, tuples, dtypes) and returns a tensor or a tuple of them: the
    device's block of each result. ``out_placements`` gives each result's placements (a list
    per result, or one list for a single result): ``Shard(d)`` blocks are joined, a
    ``Replicate()`` result must be the same on every device (dtorch does not check), a
    ``Partial()`` one is each device's contribution. ``in_placements`` (one list per argument,
    None for non-tensors) makes the call check its inputs' placements.

    Result shapes and dtypes are found by running ``fn`` on meta tensors of each device's local
    shapes (on the client, once per call shape); the blocks must then be those of one global
    shape under ``out_placements`` (``numpy.array_split`` chunks), or the call raises
    ``ValueError``. On the hosts, each device's results must then be those blocks (tensors of
    that dtype and local shape, on the device): any other result fails the call like an error
    raised in ``fn``, reported at the next read. ``fn`` must be importable by name (see the
    module's doc).

    >>> import torch, dtorch
    >>> mesh = dtorch.DeviceMesh("cpu", [0, 1])
    >>> x = dtorch.ones((4, 3), device_mesh=mesh, placements=[dtorch.Shard(0)])
    >>> row_sums = dtorch.local_map(torch.sum, [dtorch.Partial()])
    >>> row_sums(x).to_torch()
    tensor(12.)
    """
    ref = function_ref(fn, "local_map")
    single = not out_placements or isinstance(out_placements[0], Placement)
    outs = [list(out_placements)] if single else [list(p) for p in out_placements]

    def mapped(*args, **kwargs):
        slots = tuple(k for k, a in enumerate(args) if isinstance(a, Tensor))
        tensors = tuple(args[k] for k in slots)
        _check_args(fn, args, kwargs, slots, in_placements)
        static = tuple(None if k in slots else a for k, a in enumerate(args))
        kw = tuple(sorted(kwargs.items()))
        specs = tuple(t._spec for t in tensors)
        out_specs = local_outputs(ref, specs, slots, freeze(static), freeze(kw),
                                  freeze(outs))
        return issue("local_map", tensors, (ref, slots, static, kw, out_specs))

    mapped.__name__ = mapped.__qualname__ = f"local_map({ref[1]})"
    mapped.__doc__ = f"{ref[0]}.{ref[1]} on local blocks (dtorch.local_map)."
    return mapped


def _check_args(fn, args, kwargs, slots, in_placements) -> None:
    if not slots:
        raise TypeError(f"dtorch.local_map({fn!r}): give at least one dtorch.Tensor argument "
                        f"(positionally): it says which mesh to run on")
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            raise TypeError("dtorch.local_map: got a torch.Tensor argument; make it a "
                            "dtorch.Tensor first with dtorch.from_torch(t, device_mesh=..., "
                            "placements=...)")
        if isinstance(a, Tensor) and any(v is a for v in kwargs.values()):
            raise TypeError("dtorch.local_map: pass dtorch.Tensor arguments positionally")
    if in_placements is None:
        return
    for k in slots:
        want, t = in_placements[k], args[k]
        if want is not None and tuple(want) != t._spec.placements:
            raise ValueError(f"dtorch.local_map({fn!r}): argument {k} has placements "
                             f"{t.placements}, in_placements asks for {list(want)}; "
                             f"redistribute first: "
                             f"arg = arg.redistribute(placements={list(want)!r})")


_OUTPUTS: dict = {}


def local_outputs(ref, specs, slots, args, kwargs, outs) -> tuple:
    """Each result's (global shape, dtype, encoded placements), from ``fn`` on meta tensors of
    every device's local shapes (memoized: specs and meshes are interned)."""
    key = (ref, specs, slots, args, kwargs, outs)
    found = _OUTPUTS.get(key)
    if found is None:
        found = _OUTPUTS[key] = local_outputs_uncached(ref, specs, slots, args, kwargs, outs)
    return found


def local_outputs_uncached(ref, specs, slots, args, kwargs, outs) -> tuple:
    fn, mesh = resolve(ref), specs[0].mesh
    locals_ = {}  # mesh coord -> [(local shape, dtype)] of each result
    for coord in mesh.coordinates():
        operands = [torch.empty(s.local_region(coord)[0], dtype=getattr(torch, s.dtype),
                                device="meta") for s in specs]
        call_args = list(args)
        for k, o in zip(slots, operands):
            call_args[k] = o
        try:
            result = fn(*call_args, **dict(kwargs))
        except Exception as e:
            e.add_note(f"(dtorch.local_map runs {ref[1]} on meta tensors of the local shapes "
                       f"to infer its results; it must not read values)")
            raise
        results = list(result) if isinstance(result, (tuple, list)) else [result]
        if len(results) != len(outs):
            raise ValueError(f"dtorch.local_map({ref[1]}): it returns {len(results)} results "
                             f"but out_placements gives {len(outs)}")
        locals_[tuple(coord)] = [(tuple(r.shape), r.dtype) for r in results]
    return tuple(_global_output(ref[1], mesh, [v[k] for v in locals_.values()],
                                list(locals_), pl) for k, pl in enumerate(outs))


def _global_output(name, mesh, blocks, coords, placements) -> tuple:
    """The global (shape, dtype, placements) whose ``array_split`` blocks are ``blocks``."""
    ndim = len(blocks[0][0])
    if any(len(s) != ndim or d != blocks[0][1] for s, d in blocks):
        raise ValueError(f"dtorch.local_map({name}): its results differ in rank or dtype "
                         f"between devices: {sorted(set(blocks))}")
    placements = normalize_placements(placements, mesh.ndim, ndim)
    shape = []
    for d in range(ndim):
        mesh_dims = [i for i, p in enumerate(placements) if p.is_shard(d)]
        shape.append(sum(s[d] for (s, _), c in zip(blocks, coords)
                         if all(c[i] == 0 for i in range(mesh.ndim) if i not in mesh_dims)))
    for (s, _), c in zip(blocks, coords):
        if local_shape(shape, mesh.shape, placements, c) != s:
            raise ValueError(
                f"dtorch.local_map({name}): its local results have shapes "
                f"{[b[0] for b in blocks]} on the mesh's devices, which are not the blocks of "
                f"one global shape under placements {list(placements)} (numpy.array_split "
                f"chunks); choose out_placements that match, e.g. Replicate() where every "
                f"device computes the whole result")
    return tuple(shape), blocks[0][1], tuple(encode_placement(p) for p in placements)


# -- the carriers (run on the hosts) ---------------------------------------------------------------


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
               function=False, sub_splits=True))  # (the user states the outputs' layout)


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
    op = lookup(name)
    return (op.meta or op.kernel)(*operands, **dict(kwargs))


def _custom_rule(call) -> Placed:
    """The user's rule sees the call as its own operator's (its name, params and static args),
    so its errors name the user's operator. Rows (a list) expand like every built-in rule."""
    op = lookup(call.static["name"])
    inner = Call(op, call.inputs, dict(call.static["kwargs"]), call.outs, call.mesh)
    placed = op.placement(inner)
    return placed if isinstance(placed, Placed) else expand(inner, placed)


register(OpDef("custom_op", "custom_op(inputs: TensorList, name, fn, kwargs, with_context)",
               _custom_op, _custom_rule, meta=_custom_meta, uses_context=True, function=False))
