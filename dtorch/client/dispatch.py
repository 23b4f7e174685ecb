"""The client's hot path: from an operator call to one appended record.

``dispatch`` looks the call up in the session's bound-call cache, keyed on (operator, static
args, each operand's interned spec or Python type). A hit costs a dict lookup, new ids and a
tuple append. A miss runs ``bind``: the metadata rule (torch on meta tensors, or the entry's own),
the placement rule, the automatic redistributions the rule asks for, and one DefineCall record.
Errors therefore raise here, at the user's line, before anything is sent.

A session may hold a recorder (``Session.recorder``: autograd's tape, once a tensor requires
grad), which ``issue`` hands every call: ``needs_of(bound, operands)`` says which operands need
a gradient, or None when the call is not recorded; ``announce(session, bound, operands, needs,
first result id)`` gives the id of the call as recorded and the key of what the hosts keep,
having appended the record that announces it; ``record(bound, operands, results, needs, key)``
follows the call's Op. Without a recorder a call costs one attribute test more.

Each call runs on one graph (``graph_of``), whose id its Op record carries and whose compute
streams run it; its results belong to that graph (``Tensor.graph``).
"""

from __future__ import annotations

import sys

import torch

from .. import protocol as P
from ..current import current_graph, entered_graph
from ..mesh import DeviceMesh
from ..ops.creation import PY_DTYPES
from ..ops.registry import INPLACE, freeze, lookup
from ..ops.rules import Call, check_sub_splits, inplace_error
from ..placement import Replicate, normalize_placements
from ..spec import intern_spec
from ..tensor import Tensor, symbol
from . import session as _session

_REPLICATE = Replicate()
_OP = P.OP
_new = object.__new__


class Bound:
    """A call shape whose metadata and placements are known: what a cache hit needs. ``op``:
    the entry (None for a redistribute), for the recorder."""

    __slots__ = ("call_id", "outs", "mask", "tensors", "pre", "post", "inplace", "single",
                 "plain", "op", "define", "recorded")

    def __init__(self, call_id, outs, mask, pre=(), post=(), inplace=False, op=None,
                 define=None):
        self.call_id, self.outs, self.mask = call_id, outs, mask
        # the operands' usual shapes, for ``dispatch``: one tensor, first (1), or two tensors (2)
        self.tensors = (1 if mask[:1] == (True,) and True not in mask[1:] else
                        2 if mask == (True, True) else 0)
        self.pre, self.post, self.inplace = pre, post, inplace
        self.single = len(outs) == 1
        self.plain = self.single and not pre and not post and not inplace
        self.op = op
        # the DefineCall's arguments, for the recorder's variant of the call, made once
        self.define, self.recorded = define, None


def dispatch(op, operands: tuple, static: tuple, depth: int = 2):
    """Issues ``op``; ``depth``: the frame, counted from ``Session.site``, where the search for
    the user's line starts (a generated front passes 3, its caller's: materializing the front's
    own frame costs as much as the rest of the search)."""
    s = _session._current
    if s is None or s.closed or s.alarm:
        s = _session.current()  # starts the runtime, or raises its failure or unsent records
    # static args' types are part of the key: 6 == 6.0 in Python, but arange(6) is int64 and
    # arange(6.) float32
    if len(static) == 1:  # the usual case, spelled out
        kind = type(static[0])
        kinds = (kind,) if kind in _FLAT else _kinds(static)
    else:
        kinds = tuple(map(type, static))
        if not _FLAT.issuperset(kinds):  # a size or dims: (3.0, 2) == (3, 2) too
            kinds = _kinds(static)
    if len(operands) == 2:  # the usual case, spelled out: this runs for every operator
        a, c = operands
        key = (op, static, kinds, a._spec if isinstance(a, Tensor) else type(a),
               c._spec if isinstance(c, Tensor) else type(c))
    else:
        key = (op, static, kinds,
               *[o._spec if isinstance(o, Tensor) else type(o) for o in operands])
    try:
        bound = s.bound.get(key)
    except TypeError:  # a list among the static args
        static = freeze(static)
        key = (op, static) + key[2:]
        bound = s.bound.get(key)
    if bound is None:
        sent = as_sent(op, operands, static)
        if sent is not None:  # e.g. a NumPy scalar: the call again, keyed as its Python number
            return dispatch(op, *sent)
        bound = s.bound[key] = bind(s, op, operands, static)
    site = s.site(depth)
    tensors = bound.tensors  # the usual cases of ``graph_of``, spelled out: one graph
    if tensors == 1 or tensors == 2 and operands[0]._graph is operands[1]._graph:
        graph = operands[0]._graph
    else:
        graph = graph_of(operands, bound.mask)
    if bound.plain and s.recorder is None:  # ``issue``'s usual case, inlined: saves 10% a call
        t = _new(Tensor)
        t._id, t._spec, t._graph = next(s.ids), bound.outs[0], graph
        s.append((_OP, bound.call_id, site, graph._id, t._id,
                  *_wire_operands(operands, bound.mask)))
        return t
    return issue(s, bound, operands, site, graph)


# static args' types that need no look inside (anything else may be a sequence of numbers)
_FLAT = frozenset({int, float, bool, type(None), str, torch.dtype})


def _kinds(value):
    """The types in a static arg or tuple of them, sequences' items included."""
    if isinstance(value, (tuple, list)):
        return type(value), tuple(map(_kinds, value))
    return type(value)


def graph_of(operands, mask):
    """The graph a call runs on: its tensor operands' graph; when they are on several, the
    calling thread's innermost ``with graph:`` if it is one of them, else the first tensor
    operand's; with no tensor operand (a factory), the thread's current graph."""
    graphs = [o._graph for o, m in zip(operands, mask) if m]
    if not graphs:
        return current_graph()
    entered = entered_graph()
    return entered if any(g is entered for g in graphs) else graphs[0]


def issue(s, b: Bound, operands, site: int, graph):
    """Issues the bound call ``b`` on ``graph`` (``graph_of``: the caller's choice), with the
    redistributions its rule asks for before and after it; an operator's call inside a
    selective checkpoint's region goes to the region (``recorder.local.region``), which issues
    it or gives its kept output."""
    recorder = s.recorder
    if recorder is not None and b.op is not None:
        region = recorder.local.region
        if region is not None:
            return region.issue(s, b, operands, site, graph)
    if b.pre:
        operands = list(operands)
        for k, rb in b.pre:
            operands[k] = issue(s, rb, (operands[k],), site, graph)
    vals = _wire_operands(operands, b.mask)
    call_id, ids, graph_id = b.call_id, s.ids, graph._id
    needs = None if recorder is None else recorder.needs_of(b, operands)
    if b.inplace:
        target = operands[0]
        s.append((P.OP, call_id, site, graph_id, target._id, *vals))
        return target
    if b.single:
        t = symbol(next(ids), b.outs[0], graph)
        if needs is not None:
            call_id, key = recorder.announce(s, b, operands, needs, t._id)
        s.append((P.OP, call_id, site, graph_id, t._id, *vals))
        if needs is not None:
            recorder.record(b, operands, (t,), needs, key)
        return issue(s, b.post[0], (t,), site, graph) if b.post else t
    outs = [symbol(next(ids), spec, graph) for spec in b.outs]
    if needs is not None:
        call_id, key = recorder.announce(s, b, operands, needs, outs[0]._id)
    s.append((P.OP, call_id, site, graph_id, *[t._id for t in outs], *vals))
    if needs is not None:
        recorder.record(b, operands, outs, needs, key)
    if b.post:
        outs = [issue(s, rb, (t,), site, graph) if rb else t for t, rb in zip(outs, b.post)]
    return tuple(outs)


def _wire_operands(operands, mask) -> tuple:
    """Tensor operands travel as ids, Python scalars as values. One and two operands, the usual
    cases, are spelled out: this runs for every operator."""
    if len(operands) == 1:
        a = operands[0]
        return (a._id if mask[0] else a,)
    if len(operands) == 2:
        a, c = operands
        return (a._id if mask[0] else a, c._id if mask[1] else c)
    return tuple(o._id if m else o for o, m in zip(operands, mask))


# -- what torch accepts, in the forms dtorch sends (cache miss) -----------------------------------
# A call with such a value never gets a Bound of its own: it misses, ``as_sent`` replaces the
# value, and the call is dispatched again, to hit the Bound of the form sent. So a hit never
# converts anything, and a 0-dim tensor (whose dtype the key does not see) is always right.

BY_VALUE = (bool, int, float, bytes, type(None))  # operands that travel as values, not ids


def _numpy_scalar(value) -> bool:
    """A NumPy number or bool (a NumPy scalar means NumPy is imported; dtorch never does)."""
    np = sys.modules.get("numpy")
    return np is not None and isinstance(value, (np.number, np.bool_))


def _number(value):
    """A NumPy scalar as torch reads it: integers as int, everything else as float (so
    ``x + np.bool_(True)`` is a float tensor, as in torch), a complex128 as complex."""
    np = sys.modules["numpy"]
    if isinstance(value, np.integer):
        return int(value)
    return complex(value) if isinstance(value, complex) else float(value)


def _sent_static(value):
    """A static arg as dtorch sends it: NumPy scalars and 0-dim torch tensors as their Python
    numbers, a Python type as the dtype torch reads it as (``dtype=float`` is float64)."""
    if isinstance(value, (tuple, list)):
        items = [_sent_static(v) for v in value]
        same = all(a is b for a, b in zip(items, value))
        return value if same else type(value)(items)
    if _numpy_scalar(value):
        return _number(value)
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return value.item()
    if isinstance(value, type) and value in PY_DTYPES:
        return PY_DTYPES[value]
    return value


def _sent_operand(value, mesh):
    """An operand as dtorch sends it: a NumPy scalar as its Python number, a torch tensor as a
    Replicate dtorch tensor on the call's mesh (its value copied to every device at each call,
    as torch's functions on dtorch tensors take one: ``client/overrides.py``; a 0-dim one so
    keeps torch's type promotion: int tensor + float64 0-dim tensor is float64), an int or float
    subclass as the number."""
    if _numpy_scalar(value):
        return _number(value)
    if isinstance(value, torch.Tensor):
        m = mesh()
        return lookup("from_torch").front(value, m, [_REPLICATE] * m.ndim)
    if type(value) not in BY_VALUE and isinstance(value, (int, float)):
        return float(value) if isinstance(value, float) else int(value)
    return value


def as_sent(op, operands: tuple, static: tuple):
    """``(operands, static)`` with the values torch accepts but dtorch does not send as they
    are replaced by what it sends, or None when there are none."""
    def mesh():
        return call_mesh(op, [o for o in operands if isinstance(o, Tensor)],
                         dict(zip(op.static_names, static)))

    new_operands = tuple(o if isinstance(o, Tensor) or type(o) in BY_VALUE else
                         _sent_operand(o, mesh) for o in operands)
    new_static = _sent_static(static)
    changed = new_static is not static or any(a is not b for a, b in zip(new_operands, operands))
    return (new_operands, new_static) if changed else None


# -- binding (cache miss) -------------------------------------------------------------------------


def factory_mesh(name: str, device_mesh) -> DeviceMesh:
    """A factory's ``device_mesh`` (its front has resolved the default: ``ops/creation.layout``;
    an operator registered with no tensor operands takes the default graph's)."""
    if device_mesh is None:
        return current_graph().default_device_mesh
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"dtorch.{name}: device_mesh must be a dtorch.DeviceMesh, got "
                        f"{device_mesh!r}")
    return device_mesh


def call_mesh(op, tensors, kw) -> DeviceMesh:
    """The mesh a call runs on: its operands' (all on one mesh), or a factory's device_mesh."""
    if not tensors:
        return factory_mesh(op.name, kw.get("device_mesh"))
    mesh = tensors[0]._spec.mesh
    for t in tensors[1:]:
        if t._spec.mesh != mesh:
            raise ValueError(
                f"dtorch.{op.name}: operands live on different meshes ({mesh} and "
                f"{t._spec.mesh}); move one with .redistribute(device_mesh=...) first"
            )
    return mesh


def check_by_value(op, operands) -> None:
    """Refuses the operands left after ``as_sent`` that cannot travel by value (msgpack would
    fail later, in the flusher thread): what torch accepts but dtorch cannot send yet (complex
    numbers). (Torch tensors are dtorch tensors by then: ``_sent_operand``.)"""
    for o in operands:
        if isinstance(o, Tensor) or type(o) in BY_VALUE:
            continue
        fix = ("pass it as a 0-dim tensor, torch.tensor(value)" if isinstance(o, complex) else
               "make it a dtorch.Tensor with dtorch.from_torch")
        raise TypeError(f"dtorch.{op.name}: a {type(o).__name__} operand ({o!r}) cannot be sent "
                        f"to the devices; {fix}")


def bind(s, op, operands, static) -> Bound:
    tensors = [o for o in operands if isinstance(o, Tensor)]
    kw = dict(zip(op.static_names, static))
    mesh = call_mesh(op, tensors, kw)
    meta = op.meta or op.kernel
    args = [
        torch.empty(o._spec.shape, dtype=o.dtype, device="meta") if isinstance(o, Tensor) else o
        for o in operands
    ]
    result = meta(*args, **P.wire_static(kw))  # torch's own errors for what torch refuses
    check_by_value(op, operands)  # and dtorch's for what it accepts but cannot send
    results = list(result) if isinstance(result, (tuple, list)) else [result]
    outs = [(tuple(r.shape), r.dtype) for r in results]
    inputs = tuple(o._spec if isinstance(o, Tensor) else type(o) for o in operands)
    call = Call(op, inputs, kw, outs, mesh)
    placed = op.placement(call)
    if not op.sub_splits:
        check_sub_splits(call, placed)
    held = outs
    if placed.accumulate is not None:  # the kernel computes in it; ``post`` casts back
        kw = {**kw, "dtype": placed.accumulate}
        held = [(shape, placed.accumulate) for shape, _ in outs]
    out_specs = tuple(
        intern_spec(shape, str(dtype)[6:], mesh, pl)
        for (shape, dtype), pl in zip(held, placed.outs)
    )
    # torch's ``inplace=True`` argument makes that call an in-place one
    flags = op.flags | (INPLACE if kw.get("inplace") is True else 0)
    if op.written is not None:
        flags |= P.writes(*op.written(len(operands), kw))
    inplace = bool(flags & INPLACE)
    # the metadata rule has refused shape and dtype changes as torch does; placements remain
    if inplace and (out_specs[0] is not tensors[0]._spec or placed.pre and any(
            placed.pre[k] for k in (0, *P.written(flags)) if k < len(placed.pre))):
        raise inplace_error(call, placed)  # (operands it writes in place must be as they are)
    tensor_slots = [k for k, o in enumerate(operands) if isinstance(o, Tensor)]
    pre = tuple(
        (k, bind_redistribute(s, operands[k]._spec, operands[k]._spec.with_placements(target)))
        for k, target in zip(tensor_slots, placed.pre or ())
        if target is not None
    )
    post = ()
    if placed.accumulate is not None:
        post = tuple(bind_accumulated(s, spec, spec.with_placements(target), dtype)
                     for spec, target, (_, dtype) in zip(out_specs, placed.post, outs))
    elif placed.post and any(placed.post):
        post = tuple(
            bind_redistribute(s, spec, spec.with_placements(target)) if target else None
            for spec, target in zip(out_specs, placed.post)
        )
    define = (op.name, inputs, out_specs, tuple(P.wire_static(kw).values()), flags)
    call_id = s.define_call(*define)
    mask = tuple(isinstance(o, Tensor) for o in operands)
    return Bound(call_id, out_specs, mask, pre, post, inplace, op, define)


def bind_redistribute(s, src, dst) -> Bound:
    key = (P.CallKind.REDISTRIBUTE, src, dst)
    bound = s.bound.get(key)
    if bound is None:
        call_id = s.define_call(None, (src,), (dst,), (), 0, P.CallKind.REDISTRIBUTE)
        bound = s.bound[key] = Bound(call_id, (dst,), (True,))
    return bound


def bind_accumulated(s, src, dst, dtype: torch.dtype) -> Bound:
    """Redistributes ``src`` to ``dst`` in the accumulation dtype they are held in, then casts
    the result to ``dtype``: one Bound whose ``post`` is the cast."""
    cast = lookup("to")
    final = intern_spec(dst.shape, str(dtype)[6:], dst.mesh, dst.placements)
    define = (cast.name, (dst,), (final,), (dtype, False, False), cast.flags)
    cast_id = s.define_call(*define)
    reduce = bind_redistribute(s, src, dst)
    return Bound(reduce.call_id, (dst,), (True,),
                 post=(Bound(cast_id, (final,), (True,), op=cast, define=define),))


def redistribute(t: Tensor, device_mesh=None, placements=None, graph=None) -> Tensor:
    """``Tensor.redistribute``: the same value laid out on ``device_mesh`` (default: this
    tensor's) with ``placements`` (default: all Replicate). Unchanged layout returns ``t``.
    ``graph``: the graph it runs on and its result belongs to (default: ``t``'s; an async
    checkpoint's snapshot takes its copy on a graph of its own).

    >>> import dtorch
    >>> mesh = dtorch.DeviceMesh("cpu", [0, 1])
    >>> x = dtorch.arange(6, device_mesh=mesh, placements=[dtorch.Shard(0)])
    >>> x.redistribute(placements=[dtorch.Replicate()]).placements
    [Replicate()]
    """
    spec = t._spec
    mesh = spec.mesh if device_mesh is None else device_mesh
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"device_mesh must be a dtorch.DeviceMesh, got {mesh!r}")
    if mesh.device_type != spec.mesh.device_type:
        raise NotImplementedError("moving a tensor between device types is not supported yet")
    placements = normalize_placements(placements, len(mesh.shape), len(spec.shape))
    dst = intern_spec(spec.shape, spec.dtype, mesh, placements)  # (S on one device is R)
    if dst is spec:
        return t
    s = _session.current()
    b = bind_redistribute(s, spec, dst)
    return issue(s, b, (t,), s.site(), t._graph if graph is None else graph)
