"""Rewriting passes over the incremental subgraph, run in order on every batch (``PASSES``).

A batch is a list of nodes: Operators, releases (bare int ids), and the client's other records
(fetch, sync, set-graph, definitions) left as they came. Each pass is a named function
``(graph, nodes) -> nodes``; DEBUG=1 prints how many nodes each left.
"""

from __future__ import annotations

import msgpack

from .. import protocol as P
from ..protocol import COMM, IMPURE, INPLACE, VIEW
from ..placement import Replicate
from ..redistribute import COMM_STEPS, plan_redistribute
from ..spec import intern_spec
from .graph import Operator

COMM_STREAM = 0  # one per device, shared by all graphs: collectives keep one order everywhere


def compute_stream(graph_id: int) -> int:
    return graph_id + 1


# -- lower_redistribute ---------------------------------------------------------------------------


def _is_definition(node) -> bool:
    return isinstance(node, (list, tuple)) and node[0] <= P.DEFINE_CALL


def lower_redistribute(graph, nodes: list) -> list:
    """Replaces each redistribute by its plan: one Operator per step (collectives and local
    slicing), with controller-made temporaries released right after use.

    The batch's definitions move to its front. The controller registers all of them before the
    passes run, so a spec a plan passes through may already carry the id of a spec the client
    defines later in the batch; the hosts must have it before the step that uses it."""
    if not any(type(n) is Operator and n.call.op == "redistribute" for n in nodes):
        return nodes
    out = [node for node in nodes if _is_definition(node)]
    for node in nodes:
        if _is_definition(node):
            continue
        if not (isinstance(node, Operator) and node.call.op == "redistribute"):
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
            out.append(Operator.make(call, node.site, [target], [current]))
            if k:  # the previous temporary is no longer needed
                out.append(current)
            current, current_spec = target, spec
        if not steps:  # same value, same layout (e.g. R on a mesh that is moved onto itself)
            out.append(Operator.make(graph.step_call("copy", graph.spec_id(src, out),
                                                graph.spec_id(dst, out), msgpack.packb((0,)), 0,
                                                out), node.site, node.outs, node.operands))
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
            if not node.call.flags & (INPLACE | IMPURE) and all(
                o in unread_released for o in node.outs
            ):
                keep[k] = False
                dead_releases.update(node.outs)
                continue
            for i in node.inputs:
                unread_released.discard(i)
        elif node[0] == P.FETCH:
            unread_released.discard(node[1])
    return [
        n for n, kept in zip(nodes, keep) if kept and not (type(n) is int and n in dead_releases)
    ]


# -- assign_streams -------------------------------------------------------------------------------


class StreamState:
    """What stream assignment remembers across batches.

    Positions count the kernels queued on each stream. ``ready[id]`` is where an operand was
    produced; ``covered[s][t]`` is the position on stream t that stream s has already waited
    for. A kernel's ``waits`` lists the streams whose current tail it must wait for. A consumer on another stream than its producer
    waits unless already covered; an in-place write also waits for earlier reads of its
    storage on the communication stream (write-after-read)."""

    def __init__(self):
        self.position: dict = {}
        self.ready: dict = {}
        self.root: dict = {}  # view -> the operand whose storage it shares
        self.comm_reads: dict = {}  # storage root -> position of its last read on COMM_STREAM
        self.covered: dict = {}


def assign_streams(graph, nodes: list) -> list:
    """Puts collectives on the communication stream and the rest on the current graph's
    compute stream, adding the cross-stream waits they need (see StreamState)."""
    st = graph.streams
    ready, position = st.ready, st.position
    out = []
    for node in nodes:
        if type(node) is Operator:
            flags = node.call.flags
            s = COMM_STREAM if flags & COMM else compute_stream(graph.graph)
            node.rec[3] = s
            for i in node.inputs:
                produced = ready.get(i)
                if produced is not None and produced[0] != s:
                    _wait_for(st, node, produced)
                if s == COMM_STREAM:
                    st.comm_reads[st.root.get(i, i)] = position.get(s, 0) + 1
            if flags & INPLACE:
                r = st.root.get(node.outs[0], node.outs[0])
                if r in st.comm_reads:
                    _wait_for(st, node, (COMM_STREAM, st.comm_reads[r]))
            pos = position[s] = position.get(s, 0) + 1
            for o in node.outs:
                ready[o] = (s, pos)
            if flags & VIEW:
                root = st.root.get(node.operands[0], node.operands[0])
                for o in node.outs:  # split and unbind make several views
                    st.root[o] = root
            out.append(node)
        elif type(node) is int:
            ready.pop(node, None)
            if st.root:
                st.root.pop(node, None)
            if st.comm_reads:
                st.comm_reads.pop(node, None)
            out.append(node)
        elif node[0] == P.FETCH:
            s, _ = st.ready.get(node[1], (compute_stream(graph.graph), 0))
            out.append(P.HostFetch(P.FETCH, node[1], node[2], s))
        elif node[0] == P.SET_GRAPH:
            graph.graph = node[1]
        else:
            out.append(node)
    return out


def _wait_for(st: StreamState, node: Operator, produced) -> None:
    t, pos = produced
    s = node.stream
    if t == s:
        return
    covered = st.covered.setdefault(s, {})
    if covered.get(t, 0) >= pos:
        return
    # the host records an event on t after everything queued there so far, and s waits for it
    covered[t] = st.position.get(t, 0)
    if node.waits is None:
        node.waits = []
    node.waits.append(t)


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
            reads[node[1]] = reads.get(node[1], 0) + 2  # never an internal link
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
