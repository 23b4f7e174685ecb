"""The extension point: run any torch function on local shards (``local_map``), or register a new
operator (``register_op``), so a user is never stuck on a missing op.

Hosts are separate processes and nothing is pickled, so the function travels by reference
(module and qualified name) and each host imports it. It must therefore be importable by name:
a module-level function of an importable module, or a torch function. Lambdas, nested functions
and functions of the script being run (``__main__``) are refused with a ``TypeError`` at the
call: a host could import the script only by running it again, program and all. Put the function
in a module beside the script (hosts find it even when the script runs from elsewhere); that
module must not run a dtorch program when imported (guard it with ``if __name__ == "__main__"``).

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

from .client import frontend
from .client.dispatch import call_op, dispatch
from .ops.extension import EXTENSIONS, resolve
from .ops.registry import REGISTRY, OpDef, lookup
from .ops.rules import replicate_only
from .placement import Placement, encode_placement, local_shape, normalize_placements
from .tensor import Tensor

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
        out_specs = local_outputs(ref, specs, slots, _freeze(static), _freeze(kw),
                                  _freeze(outs))
        return call_op("local_map", tensors, (ref, slots, static, kw, out_specs))

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


def _freeze(value):
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


# -- register_op ----------------------------------------------------------------------------------


def register_op(signature: str, fn, placement=None, *, meta=None, methods=(), function=True,
                functional=False, uses_context=False, doc=""):
    """Registers an operator: ``signature`` (torch's style: tensor operands marked
    ``: Tensor``, every other parameter static), its kernel ``fn`` (run on each device's local
    blocks: ``fn(*local_operands, **static)``, or ``fn(ctx, ...)`` with ``uses_context``), and
    its placement rule for one mesh dim. Returns the new function, also installed as
    ``dtorch.<name>`` (unless ``function=False``), as the Tensor ``methods`` named, and in
    ``dtorch.nn.functional`` with ``functional=True``.

    - ``placement``: rows ``[(outputs, inputs), ...]`` of placements for one mesh dim (each a
      tuple: one per output, one per tensor operand); the all-Replicate row is always added and
      N-D meshes are matched one mesh dim at a time; a call matching no row raises
      ``ValueError`` naming the ``redistribute()`` to add. It may also be a function of the call
      (``ops.rules.Call``) returning rows or an ``ops.rules.Placed``. Default: Replicate only.
    - ``meta``: the metadata rule, called like ``fn`` on meta tensors of the global shapes;
      default: ``fn`` itself (memoized per call shape, as for every built-in op). On each
      device ``fn`` must return the blocks of what it promises (dtype, local shape, the device);
      any other result fails the call like an error raised in ``fn``.
    - ``fn`` must be importable by name on the hosts (see the module's doc).

    >>> import torch, dtorch
    >>> from dtorch import Shard
    >>> cumsum = dtorch.register_op("my_cumsum(input: Tensor, dim)", torch.cumsum,
    ...                             [((Shard(1),), (Shard(1),))])  # dims other than ``dim``
    >>> mesh = dtorch.DeviceMesh("cpu", [0, 1])
    >>> x = dtorch.ones((2, 3), device_mesh=mesh, placements=[Shard(1)])
    >>> cumsum(x, 0).to_torch()
    tensor([[1., 1., 1.],
            [2., 2., 2.]])
    """
    ref = function_ref(fn, "register_op")
    if uses_context and meta is None:
        raise TypeError("dtorch.register_op: a kernel that uses_context needs a meta= rule "
                        "(fn(ctx, ...) cannot run on the client)")
    rule = placement if callable(placement) else _rows_rule(placement or [])
    op = OpDef(signature.split("(", 1)[0].strip(), signature, resolve(ref), rule, meta=meta,
               methods=tuple(methods), function=function, functional=functional,
               uses_context=uses_context, doc=doc)
    if any(p.kind == "tensors" for p in op.params):
        raise NotImplementedError("dtorch.register_op: TensorList parameters are not supported "
                                  "yet; give each tensor its own parameter")
    if op.name in REGISTRY or op.name in EXTENSIONS:
        raise ValueError(f"operator {op.name!r} is already registered")
    EXTENSIONS[op.name] = op
    front = frontend.generate(op, _router(op.name, ref, uses_context))
    _install(op, front)
    return front


def _rows_rule(rows):
    return replicate_only if not rows else (lambda call: list(rows))


def _router(name, ref, uses_context):
    """What the generated front calls instead of the op itself: the ``custom_op`` carrier,
    with the user's static args by name (hosts know no user signature)."""
    carrier = lookup("custom_op")
    op = EXTENSIONS[name]

    def route(_op, operands, static):
        kwargs = tuple(zip(op.static_names, static))
        return dispatch(carrier, operands, (name, ref, kwargs, uses_context))

    return route


def _install(op, front) -> None:
    import dtorch
    from dtorch.nn import functional

    frontend.place(op, front, dtorch, functional, Tensor)
