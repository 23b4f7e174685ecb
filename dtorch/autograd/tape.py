"""The tape: which calls made which tensors, and the backward pass that walks it in reverse.

Recording. The client already knows every call's specs, so the tape is a recorder the session
holds (``Session.recorder``, a ``Recorder``): ``client/dispatch.issue`` hands it each call
while torch's grad mode is on (``torch.no_grad()`` and ``torch.inference_mode()`` stop it, as
decorators too), and it records those of which an operand requires grad. A recorded call's Op
comes after a Recorded record (``protocol.Recorded``: the key of the kept graph, which operands
to differentiate and which not to keep); the hosts run its kernel with autograd on and keep
its graph (``runtime/vjp.py``): what torch's autograd saves stays on the devices until the
backward has used it. A ``Node`` keeps the leaves among the operands, a ``Ref`` (id, spec,
node) of the others, its results' ids and specs, and the key of the kept graph; dropping the
node releases the key. Automatic redistributions that an op's rule asks for are recorded as
their own nodes, so an op's node always sees the layouts its kernel saw. No session holds the
recorder before a tensor requires grad (``start``): until then recording costs nothing.

Backward. Nodes are visited latest first. An operator's node issues one VJP call
(``runtime/vjp.py``: ``torch.autograd.grad`` of the kept graph on each device), on the
``dtorch.Graph`` its forward ran on (as torch runs a backward op on its forward's stream); a
redistribute's node issues the dual redistribute. Gradients are laid out in the *dual* of each
tensor's layout, which is what makes a device's local VJP its share of the global one:

    forward placement     Shard(d)    Replicate        Partial(sum)
    gradient placement    Shard(d)    Partial(sum)     Replicate

A Replicate operand used by every device receives each device's contribution, so its gradient
is their sum (Partial); a Partial operand stands for the sum of its pieces, and each piece's
gradient is the whole gradient (Replicate). Hence an all-gather's backward is a reduce-scatter,
an all-reduce's an all-reduce, a chunk's a pad, a pipeline hop's the hop back; a data-parallel
weight (Replicate on ``dp``) gets a Partial gradient that becomes its ``.grad`` through one
all-reduce. Gradients reaching a tensor in different layouts are summed after a redistribute;
a leaf's total is laid out as the leaf before it lands in ``.grad``.

With ``retain_graph=False`` every VJP frees its graph on the hosts, and every visited node is
marked used (a second backward raises torch's error).
"""

from __future__ import annotations

import itertools
import threading

import torch

from .. import protocol as P
from ..client import dispatch, session
from ..buckets import Buckets, coalescing, laid_out
from . import grad_sync
from ..placement import Partial, Replicate, Shard
from ..spec import intern_spec
from ..protocol import COMM, RECORD, wire_bits
from ..tensor import DTYPES, Tensor

_order = itertools.count()
_SUM = Partial("sum")
_REPLICATE = Replicate()
NOT_RECORDED = frozenset({"detach"})  # ops whose result has no history by definition


def dual(placement, what: str):
    """The gradient's placement for a tensor laid out ``placement`` (see the module doc)."""
    if isinstance(placement, Shard):
        return placement
    if placement.is_replicate():
        return _SUM
    if placement.reduce_op == "sum":
        return _REPLICATE
    raise NotImplementedError(f"dtorch autograd: no gradient through {what}, a "
                              f"Partial({placement.reduce_op!r}) tensor; redistribute it to "
                              f"Replicate first")


def dual_spec(spec, what: str):
    """The gradient's spec of a tensor laid out as ``spec``. A mesh dim of one device keeps its
    placement: Replicate and a Partial of one piece are the same there, and keeping it spares
    an all-reduce over a group of one."""
    return intern_spec(spec.shape, spec.dtype, spec.mesh,
                       tuple(p if n == 1 and not p.is_partial() else dual(p, what)
                             for p, n in zip(spec.placements, spec.mesh.shape)))


DIFFERENTIABLE = frozenset(name for name, d in DTYPES.items()
                           if d.is_floating_point or d.is_complex)


def differentiable(spec) -> bool:
    return spec.dtype in DIFFERENTIABLE


class Ref:
    """What the tape keeps of a tensor with history: its id, spec and node, not the tensor."""

    __slots__ = ("_id", "_spec", "_node")
    is_leaf = False

    def __init__(self, t: Tensor):
        self._id, self._spec, self._node = t._id, t._spec, t._node


class Node:
    """One recorded call: ``op`` (an OpDef, or None for a redistribute), the forward's call id,
    the operands (tensors and scalars, as the kernel read them), which of them need a gradient,
    the results' ids and specs, and ``key``: the id under which the hosts keep the kernel's
    autograd graph (an operator's; a redistribute keeps none)."""

    __slots__ = ("order", "op", "call_id", "operands", "needs", "out_ids", "out_specs", "key",
                 "gathered", "graph", "__weakref__")

    def __init__(self, op, call_id, operands, needs, outs, key=None):
        self.order = next(_order)
        self.op, self.call_id, self.key = op, call_id, key
        # a redistribute whose result the hosts keep no copy of (``gathered``): its Gather and
        # the result's index there
        self.gathered = None
        # a leaf is kept (its .grad is set); any other tensor only as a reference, so that its
        # blocks go when the program drops it (the hosts' graph keeps what the backward needs)
        self.operands = tuple(Ref(o) if isinstance(o, Tensor) and not o.is_leaf else o
                              for o in operands)
        self.needs = needs
        self.out_ids = tuple([t._id for t in outs])
        self.out_specs = tuple([t._spec for t in outs])
        self.graph = outs[0]._graph  # the graph the call ran on, which runs its VJP too

    def name(self) -> str:
        return "redistribute" if self.op is None else self.op.name

    def __del__(self):
        if self.key is not None:  # the hosts drop the graphs they keep for it
            session.release_id(self.key)

    def __repr__(self) -> str:
        return f"<dtorch backward of {self.name()}>"


def needs_of(bound, operands):
    """Called by ``dispatch.issue`` for every call while a session holds the tape: which
    operands require grad, when the call is to be recorded (grad mode on, one of them requires grad), else
    None. An in-place call is never recorded: on a tensor with history it raises; on a leaf
    (an initialisation, an optimizer step) it is allowed, as under ``no_grad``."""
    if not torch.is_grad_enabled():
        return None
    for o in operands:  # the common case, nothing requires grad, in the fewest steps
        if isinstance(o, Tensor) and getattr(o, "_requires_grad", False):
            break
    else:
        return None
    if bound.op is not None and bound.op.name in NOT_RECORDED:
        return None
    if bound.inplace:
        if not all(o.is_leaf for o in operands if isinstance(o, Tensor)):
            raise NotImplementedError(
                f"dtorch autograd: {bound.op.name} writes in place into a tensor whose history "
                f"is recorded; use the out-of-place form (e.g. y = x.add(z) for x.add_(z)), or "
                f"run it under torch.no_grad()")
        return None
    return tuple([isinstance(o, Tensor) and getattr(o, "_requires_grad", False)
                  for o in operands])


def announce(s, bound, operands, needs, kernel: int):
    """``(call id, key)`` of the call about to be issued, its first result ``kernel``, as
    autograd records it: an operator's call with the RECORD flag, after the Recorded record
    appended here, which tells the hosts to keep the kernel's graph under ``key`` (the tape
    node's), and the bits of the operands that need a gradient (``needs_bits``) and of those
    the graph must not keep (``gathered_bits``). A redistribute, and a communicating kernel
    without ``comm_grad`` (its node refuses at backward), keep no graph: key None."""
    op = bound.op
    if op is None or not (op.comm_grad or not op.flags & COMM):
        return bound.call_id, None
    if bound.recorded is None:
        name, inputs, outs, static, flags = bound.define
        bound.recorded = s.define_call(name, inputs, outs, static, flags | RECORD)
    key = next(s.ids)
    s.append((P.RECORDED, kernel, key, needs_bits(needs), gathered_bits(operands)))
    return bound.recorded, key


def needs_bits(needs):
    """The operands that need a gradient, as the record carries them (``wire_bits``)."""
    return wire_bits(sum(1 << k for k, need in enumerate(needs) if need))


def gathered_bits(operands):
    """The operands made by ``gathered``: the hosts' graph keeps no copy of their blocks."""
    return wire_bits(sum(1 << k for k, o in enumerate(operands) if _is_gathered(o)))


def _is_gathered(o) -> bool:
    node = getattr(o, "_node", None)
    return node is not None and node.gathered is not None


def record(bound, operands, outs, needs, key) -> None:
    """A tape node for the call just issued; its floating results now require grad."""
    node = Node(bound.op, bound.call_id, tuple(operands), needs, outs, key)
    for t in outs:
        if differentiable(t._spec):
            t._requires_grad = True
            t._node = node


class _Local(threading.local):
    region = None  # the thread's open selective-checkpoint region (``selective.Region``)


class Recorder:
    """The tape as a session holds it (``Session.recorder``): what ``client/dispatch.issue``
    calls for each call it issues (see there), and ``local.region``, to which it hands the
    operator calls of a thread inside a selective checkpoint."""

    __slots__ = ()
    needs_of = staticmethod(needs_of)
    announce = staticmethod(announce)
    record = staticmethod(record)
    local = _Local()


RECORDER = Recorder()


def start() -> None:
    """A tensor requires grad: every session records from now on (``Tensor.requires_grad``)."""
    session.install_recorder(RECORDER)


class Gather:
    """Parameters gathered together (``gathered``: a ZeRO-3 layer's), and the layouts they were
    gathered to; ``again``: gathered once more for the backward, while its VJPs run (a walk
    that stops on an error leaves it for a retry, until the tape goes, as the hosts keep the
    graphs of the nodes it did not visit)."""

    __slots__ = ("params", "specs", "again")

    def __init__(self, params, specs):
        self.params, self.specs, self.again = params, specs, None

    def gather(self) -> list:
        """The parameters laid out as ``specs``: those that an all-gather on one mesh dim makes
        whole go in one collective per bucket (``buckets.Buckets``), the others as
        redistributes. Not recorded: the tape's nodes are ``gathered``'s."""
        out = [None] * len(self.params)
        buckets = Buckets(out.__setitem__)
        with torch.no_grad():
            for k, (p, spec) in enumerate(zip(self.params, self.specs)):
                buckets.add(k, p, spec)
            buckets.flush()
        return out


def gathered(params, layouts) -> list:
    """``params`` redistributed to ``layouts`` (one placements list each) for the computation at
    hand (ZeRO-3: a layer's sharded parameters gathered whole before it runs), in as few
    collectives as their layouts allow (``Gather.gather``). Each result is recorded as a
    redistribute of its parameter (its gradient is the dual reduce-scatter, which the backward
    buckets), whose blocks the hosts' saved graphs do not keep: the backward gathers the group
    again, in one go, just before the first VJP that reads one of them, and lets it go after the
    last (``run_backward``), so a gathered parameter lives only while a layer's forward or
    backward runs."""
    group = Gather(tuple(params), tuple(p._spec.with_placements(tuple(layout))
                                        for p, layout in zip(params, layouts)))
    fulls = group.gather()
    if torch.is_grad_enabled():
        for k, (p, full) in enumerate(zip(group.params, fulls)):
            if p.requires_grad and differentiable(full._spec):
                node = Node(None, 0, (p,), (True,), (full,))
                node.gathered = (group, k)
                full._requires_grad, full._node = True, node
    return fulls


def _regathered(o):
    """A gathered operand (``gathered``) again, its whole group gathered once for the VJPs that
    read it."""
    group, k = o._node.gathered
    if group.again is None:
        group.again = group.gather()
    return group.again[k]


# -- backward -------------------------------------------------------------------------------------


def _add(total, g):
    """Gradients summed, the new one laid out as the first."""
    return g if total is None else total + laid_out(g, total._spec)


def _zeros(spec):
    import dtorch

    return dtorch.zeros(spec.shape, dtype=getattr(torch, spec.dtype), device_mesh=spec.mesh,
                        placements=list(spec.placements))


class Formula:
    """The ``op`` of a node whose VJP the client computes itself: ``vjp(grads)`` returns the
    operands' gradients. A selective checkpoint's kept product (``selective.py``), recorded
    without running its kernel, and a whole checkpointed region (``Recomputed``)."""

    def __init__(self, name: str, vjp):
        self.name, self.vjp = name, vjp


class Recomputed(Formula):
    """A region run without a tape (``checkpoint.py``): its VJP runs it again with one."""

    def __init__(self, vjp):
        super().__init__("checkpoint", vjp)


def _vjp(node, grads, retain: bool, s, site: int) -> list:
    """The operands' gradients (None where not needed) from the results' (None: zero), issued
    in session ``s`` at the backward's ``site``; called under ``no_grad``."""
    if isinstance(node.op, Formula):
        return node.op.vjp(grads)
    if node.op is None:  # a redistribute: the dual redistribute
        (g,) = grads
        source = node.operands[0]
        g = laid_out(g, dual_spec(node.out_specs[0], "redistribute"))
        if source.is_leaf and coalescing(g._spec, _grad_spec(source)) is not None:
            return [g]  # (ZeRO-3's gathered parameters) a bucket reduces it (``_land``)
        return [laid_out(g, dual_spec(source._spec, "redistribute"))]
    # the operands the hosts did not keep (``gathered``): gathered again, from their shards
    dropped = tuple(k for k, o in enumerate(node.operands) if _is_gathered(o))
    key = ("vjp", node.call_id, node.needs, retain, dropped)
    bound = s.bound.get(key)
    if bound is None:
        bound = s.bound[key] = _bind_vjp(s, node, retain, dropped)
    bound, grad_specs, needs = bound
    grads = [_zeros(spec) if g is None else laid_out(g, spec)
             for g, spec in zip(grads, grad_specs)]
    regathered = [_regathered(node.operands[k]) for k in dropped]
    result = dispatch.issue(s, bound, (node.key, *grads, *regathered), site, node.graph)
    found = iter(result if isinstance(result, tuple) else (result,))
    return [next(found) if need else None for need in needs]


def _bind_vjp(s, node, retain: bool, dropped: tuple) -> tuple:
    """``(Bound, the gradients' specs, which operands get one)``: the VJP call of ``node``'s
    forward call, which every node of that call with these needs shares."""
    name = node.op.name
    comm = node.op.flags & COMM
    if comm and not node.op.comm_grad or node.op.kernel is None:
        raise NotImplementedError(f"dtorch autograd: {name} has no gradient yet (its kernel "
                                  f"communicates, so the local VJP is not its gradient)")
    grad_specs = tuple(dual_spec(spec, name) for spec in node.out_specs)
    needs = tuple(need and differentiable(o._spec) for o, need in zip(node.operands, node.needs))
    outs = tuple(dual_spec(o._spec, name) for o, need in zip(node.operands, needs) if need)
    ins = (int, *grad_specs, *(node.operands[k]._spec for k in dropped))
    call_id = s.define_call(node.call_id, ins, outs, (needs, retain, dropped), comm,
                            P.CallKind.VJP)  # a COMM kernel's communicates
    return dispatch.Bound(call_id, outs, (False,) + (True,) * (len(ins) - 1)), grad_specs, needs


def run_backward(roots, root_grads, retain_graph: bool, wanted=None) -> dict:
    """Walks the tape back from ``roots`` with their gradients. Accumulates into the leaves'
    ``.grad`` (``wanted`` None) or returns ``{tensor id: gradient}`` for the tensors in
    ``wanted`` (``autograd.grad``).

    A leaf's gradient lands in ``.grad`` (its reduction issued: an all-reduce for a
    data-parallel weight) as soon as the last node that reads the leaf has run its VJP, so
    the reduction runs on the communication stream while the VJPs issued after it compute."""
    grads, leaves = {}, {}
    for t, g in zip(roots, root_grads):
        if t.is_leaf:
            leaves[t._id] = (t, _add(leaves.get(t._id, (t, None))[1], g))
        else:
            grads[t._id] = _add(grads.get(t._id), g)
    nodes = _reachable(roots)
    if wanted is not None and any(type(node.op) is Recomputed for node in nodes):
        raise RuntimeError("Checkpointing is not compatible with .grad() or when an `inputs` "
                           "parameter is passed to .backward(). Please use .backward() and do "
                           "not pass its `inputs` argument.")  # (torch's reentrant words)
    readers: dict = {}  # leaf id -> how many nodes still to visit read it
    regathers: dict = {}  # Gather -> how many nodes still to visit read one of its results
    for node in nodes:
        for x, need in zip(node.operands or (), node.needs):
            if need and x.is_leaf:
                readers[x._id] = readers.get(x._id, 0) + 1
        for group in _gathers_read(node):
            regathers[group] = regathers.get(group, 0) + 1
    found, buckets = {}, Buckets(_accumulate)
    s = session.current()
    site = s.site()  # the backward's line: every VJP it issues is attributed to it
    with torch.no_grad():
        for node in nodes:
            if node.operands is None:
                raise RuntimeError("Trying to backward through the graph a second time (or "
                                   "directly access saved tensors after they have already "
                                   "been freed); specify retain_graph=True the first time")
            outs = [grads.pop(i, None) for i in node.out_ids]
            if wanted is not None:
                found.update({i: g for i, g in zip(node.out_ids, outs)
                              if i in wanted and g is not None})
            gathers = _gathers_read(node) if regathers else ()
            in_grads = _vjp(node, outs, retain_graph, s, site) if any(
                g is not None for g in outs) \
                else ()
            for x, g in zip(node.operands, in_grads):
                if g is not None and not x.is_leaf:
                    grads[x._id] = _add(grads.get(x._id), g)
                elif g is not None:
                    leaves[x._id] = (x, _add(leaves.get(x._id, (x, None))[1], g))
            for x, need in zip(node.operands, node.needs):
                if need and x.is_leaf:
                    readers[x._id] -= 1
                    if readers[x._id] == 0 and wanted is None and x._id in leaves:
                        _land(buckets, *leaves.pop(x._id))
            for group in gathers:
                regathers[group] -= 1
                if not regathers[group]:
                    group.again = None  # the hosts free its blocks after its last VJP
            if not retain_graph:
                node.operands = None
        if wanted is not None:
            found.update({i: g for i, (_, g) in leaves.items() if i in wanted})
            return {i: laid_out(g, wanted[i]._spec) for i, g in found.items()}
        for leaf, g in leaves.values():  # roots that are leaves themselves
            _land(buckets, leaf, g)
        for leaf, g in grad_sync.take_synced():  # held while their sync was off, not reached
            buckets.add(leaf, g, _grad_spec(leaf))
        buckets.flush()
    return {}


def _gathers_read(node) -> set:
    """The Gathers (``gathered``) whose results ``node``'s VJP reads: it needs them again."""
    if node.op is None or node.operands is None:
        return set()
    return {o._node.gathered[0] for o in node.operands if _is_gathered(o)}


def _land(buckets, leaf, g) -> None:
    """A leaf's final gradient, on its way into ``.grad`` laid out as ``_grad_spec``: the
    reductions that coalesce (a data-parallel weight's all-reduce, ZeRO-2/3's reduce-scatter)
    wait in a bucket (``buckets.Buckets``), so small gradients pay one collective's
    latency, not one each, and a full bucket's runs on the communication stream while the rest
    of the backward computes. While the leaf's sync is off, one that needs a reduction is held
    unreduced instead (``grad_sync``)."""
    if leaf.requires_grad:
        spec = _grad_spec(leaf)
        g = grad_sync.settle(leaf, g, spec, _add, land_now)
        if g is not None:
            buckets.add(leaf, g, spec)


def land_now(leaf, g) -> None:
    """``g`` into ``leaf.grad`` by its own reduction (a held gradient read before a backward
    settles it)."""
    buckets = Buckets(_accumulate)
    with torch.no_grad():
        buckets.add(leaf, g, _grad_spec(leaf))
        buckets.flush()


def _accumulate(leaf, g) -> None:
    """``g`` into ``leaf.grad`` (torch adds to a gradient already there, which keeps the
    layout it has: one the user assigned may differ from ``_grad_spec``)."""
    leaf.grad = g if leaf.grad is None else leaf.grad + laid_out(g, leaf.grad._spec)


def _grad_spec(leaf):
    """How a leaf's ``.grad`` is laid out: as the leaf, or as its ``grad_placements`` (ZeRO-2
    sets them: a data-parallel gradient is then reduce-scattered, not all-reduced)."""
    placements = getattr(leaf, "grad_placements", None)
    if placements is None:
        return leaf._spec
    return intern_spec(leaf._spec.shape, leaf._spec.dtype, leaf._spec.mesh, tuple(placements))


def _reachable(roots) -> list:
    """The nodes behind ``roots``, latest first (a node runs after every later one that reads
    its results)."""
    seen, stack = {}, [t._node for t in roots if not t.is_leaf]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = node
        for x in node.operands or ():
            parent = getattr(x, "_node", None)
            if parent is not None and id(parent) not in seen:
                stack.append(parent)
    return sorted(seen.values(), key=lambda n: n.order, reverse=True)
