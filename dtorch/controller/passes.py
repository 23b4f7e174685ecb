"""Rewriting passes over the incremental subgraph, run in order on every batch (``PASSES``).

A batch is a list of nodes: Operators, releases (bare int ids), and the client's other records
(fetch, sync, definitions) left as they came. Each pass is a named function
``(graph, nodes) -> nodes``; ``run_passes`` logs each by name on the ``dtorch.controller``
logger at DEBUG (``DTORCH_DEBUG=1`` prints it) with the nodes it took and left, and adds each
to a trace as a span of its own (``dtorch.profiler``).
"""

from __future__ import annotations

import logging
import time

import msgpack

from .. import protocol as P
from ..protocol import COMM, IMPURE, INPLACE, RECORD, CallKind
from ..placement import Replicate
from ..redistribute import COMM_STEPS, plan_redistribute
from ..spec import intern_spec
from .logical_graph import Operator
from .streams import COMM_STREAM, compute_stream

# -- lower_redistribute ---------------------------------------------------------------------------


def lower_redistribute(graph, nodes: list) -> list:
    """Replaces each redistribute by its plan: one Operator per step (collectives and local
    slicing), with controller-made temporaries released right after use.

    The batch's definitions move to its front. The controller registers all of them before the
    passes run, so a spec a plan passes through may already carry the id of a spec the client
    defines later in the batch; the hosts must have it before the step that uses it."""
    if not any(type(n) is Operator and n.call.kind == CallKind.REDISTRIBUTE for n in nodes):
        return nodes
    out = [node for node in nodes if P.is_definition(node)]
    for node in nodes:
        if P.is_definition(node):
            continue
        if not (isinstance(node, Operator) and node.call.kind == CallKind.REDISTRIBUTE):
            out.append(node)
            continue
        src, dst = graph.specs[node.call.inputs[0]], graph.specs[node.call.outputs[0]]
        steps = plan_steps(src, dst)
        current = node.operands[0]
        current_spec = src
        for k, (kind, spec, mesh_dim) in enumerate(steps):
            last = k == len(steps) - 1
            target = node.outs[0] if last else graph.temp_id()
            call = graph.step_call(
                kind, graph.spec_id(current_spec, out), graph.spec_id(spec, out),
                msgpack.packb((mesh_dim,)), COMM if kind in COMM_STEPS or kind == "move" else 0,
                out,
            )
            out.append(Operator.make(call, node.site, node.graph, [target], [current]))
            if k:  # the previous temporary is no longer needed
                out.append(current)
            current, current_spec = target, spec
        if not steps:  # same value, same layout (e.g. R on a mesh that is moved onto itself)
            out.append(Operator.make(graph.step_call("copy", graph.spec_id(src, out),
                                                graph.spec_id(dst, out), msgpack.packb((0,)), 0,
                                                out), node.site, node.graph, node.outs,
                                     node.operands))
    return out


def plan_steps(src, dst) -> list:
    """[(step kind, spec after the step, mesh dim)] from spec ``src`` to spec ``dst``."""
    steps = []

    def on_mesh(spec, placements_to):
        state = list(spec.placements)
        for step in plan_redistribute(spec.placements, tuple(placements_to)):
            state[step.mesh_dim] = step.dst
            steps.append((step.kind, spec.with_placements(state), step.mesh_dim))
        return spec.with_placements(placements_to)

    if src.mesh is dst.mesh:
        on_mesh(src, dst.placements)
        return steps
    if src.mesh.shape == dst.mesh.shape:  # device c of one mesh sends its block to device c
        moved = intern_spec(src.shape, src.dtype, dst.mesh, src.placements)
    else:  # gather on the source mesh, device 0 broadcasts the whole value to the target mesh
        replicated = (Replicate(),) * len(src.mesh.shape)
        src = on_mesh(src, replicated)
        moved = intern_spec(src.shape, src.dtype, dst.mesh, (Replicate(),) * len(dst.mesh.shape))
    steps.append(("move", moved, 0))
    on_mesh(moved, dst.placements)
    return steps


# -- eliminate_dead_code --------------------------------------------------------------------------


def eliminate_dead_code(graph, nodes: list) -> list:
    """Drops operators whose every result is released in this batch before anything reads it,
    together with those releases. Walking backwards lets a chain of dead operators go at once.
    In-place and impure operators always stay (they write what others may read)."""
    unread_released = set()  # ids released later in the batch, not read since
    dead_releases = set()
    keep = [True] * len(nodes)
    for k in range(len(nodes) - 1, -1, -1):
        node = nodes[k]
        if type(node) is int:
            unread_released.add(node)
        elif isinstance(node, Operator):
            # a recorded call's graph is read by its VJP, which the graph does not show
            if not node.call.flags & (INPLACE | IMPURE | RECORD) and all(
                o in unread_released for o in node.outs
            ):
                keep[k] = False
                dead_releases.update(node.outs)
                continue
            for i in node.inputs:
                unread_released.discard(i)
        elif node[0] == P.FETCH:
            unread_released.discard(P.Fetch(*node).id)
    return [
        n for n, kept in zip(nodes, keep) if kept and not (type(n) is int and n in dead_releases)
    ]


# -- assign_streams -------------------------------------------------------------------------------


def assign_streams(graph, nodes: list) -> list:
    """Puts collectives on the communication stream and the rest on the compute stream of the
    graph their record names, and orders each access to a storage after the accesses on other
    streams it conflicts with, whichever graph issued them (the rule: ``controller/streams.py``,
    whose state ``graph.streams`` carries across batches). A fetch reads on a stream already
    past the storage's last write and its view's making, so it waits for nothing; later writes
    on other streams wait for it."""
    order = graph.streams
    out = []
    for node in nodes:
        if type(node) is Operator:
            rec = node.rec  # its graph, until now
            s = COMM_STREAM if node.call.flags & COMM else compute_stream(rec[P.OP_STREAM])
            rec[P.OP_STREAM] = s
            node.waits = order.kernel(node, s)
            out.append(node)
        elif type(node) is int:
            order.release(node)
            out.append(node)
        elif node[0] == P.FETCH:
            fetch = P.Fetch(*node)
            out.append(P.HostFetch(P.FETCH, fetch.id, fetch.request, order.fetch(fetch.id)))
        else:
            out.append(node)
    return out


# -- fuse_chains ----------------------------------------------------------------------------------


class Chain:
    """Operators each reading the previous one's only result, sent as one CHAIN record: a host
    runs them as one task and makes no blob for the results in between."""

    __slots__ = ("members",)

    def __init__(self, members: list):
        self.members = members


def fuse_chains(graph, nodes: list) -> list:
    """Merges producer -> consumer chains on one stream: an operator joins the chain when it
    reads the chain's last result, which nothing else in the batch reads and which the batch
    releases. Saves the hosts a blob, a table entry, a task and a release per link (the kernels
    themselves still run one by one). Releases met inside a chain are held until after it, since
    its kernels may still read those tensors."""
    reads, released = {}, set()
    for node in nodes:
        if type(node) is Operator:
            for i in node.inputs:
                reads[i] = reads.get(i, 0) + 1
        elif type(node) is int:
            released.add(node)
        elif node[0] == P.FETCH:
            fetched = P.HostFetch(*node).id  # assign_streams has placed it
            reads[fetched] = reads.get(fetched, 0) + 2  # never an internal link
    out, chain, held, links = [], [], [], set()

    def close():
        if chain:
            out.append(Chain(list(chain)) if len(chain) > 1 else chain[0])
            chain.clear()
        out.extend(held)
        held.clear()
        links.clear()

    for node in nodes:
        if type(node) is Operator:
            if chain and _links(graph, chain[-1], node, reads, released):
                links.add(chain[-1].outs[0])
                chain.append(node)
                continue
            close()
            chain.append(node)
        elif type(node) is int and chain:
            if node not in links:  # internal links' releases are dropped: they have no blob
                held.append(node)
        elif type(node) is not int and node[0] == P.RECORDED:
            out.append(node)  # it names its kernel: it goes ahead of the chain holding it
        else:
            close()
            out.append(node)
    close()
    return out


def _fusable(node: Operator) -> bool:
    return not node.call.flags & (COMM | INPLACE | IMPURE) and len(node.call.outputs) == 1


def _links(graph, a: Operator, b: Operator, reads, released) -> bool:
    link = a.outs[0]
    return (
        _fusable(a) and _fusable(b) and not b.waits and b.stream == a.stream
        and link in released and reads.get(link, 0) == b.inputs.count(link) > 0
        and graph.specs[a.call.outputs[0]].mesh is graph.specs[b.call.outputs[0]].mesh
    )


PASSES = (lower_redistribute, eliminate_dead_code, assign_streams, fuse_chains)
log = logging.getLogger("dtorch.controller")


def run_passes(graph, nodes: list, spans: list | None = None) -> list:
    """``PASSES`` over ``nodes``, each named with the nodes it took and left in the DEBUG log
    and, given ``spans`` (a trace's events: ``protocol.TraceEvents``), as a span."""
    for run_pass in PASSES:
        taken, t0 = len(nodes), time.time_ns()
        nodes = run_pass(graph, nodes)
        if spans is not None:
            spans.append((f"{run_pass.__name__}: {taken} -> {len(nodes)} nodes", P.CONTROLLER,
                          P.CONTROLLER, t0, time.time_ns(), 0))
        log.debug("%s: %d -> %d nodes", run_pass.__name__, taken, len(nodes))
    return nodes
