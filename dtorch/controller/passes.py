"""Rewriting passes over the incremental subgraph, run in order on every batch (``PASSES``).

A batch is a list of nodes: Operators, releases (bare int ids), and the client's other records
(fetch, sync, definitions) left as they came. Each pass is a named function
``(graph, nodes) -> nodes``; DEBUG=1 prints how many nodes each left.
"""

from __future__ import annotations

import msgpack

from .. import protocol as P
from ..protocol import COMM, IMPURE, INPLACE, RECORD, VIEW, WRITES, CallKind, written
from ..placement import Replicate
from ..redistribute import COMM_STEPS, plan_redistribute
from ..spec import intern_spec
from .graph import Operator

COMM_STREAM = 0  # one per device, shared by all graphs: collectives keep one order everywhere


def compute_stream(graph_id: int) -> int:
    return graph_id + 1


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
# A storage is the memory behind a tensor and its views. Every access to it happens on one stream
# at one position (kernels and fetches count the items queued on each stream). A wait is for the
# event the host records at the other stream's tail, and a write waits for every access on the
# other streams, so the last write is ordered after all that came before it: a reader need only
# wait for the last write, and a writer for the accesses since. A storage's record is a list,
# as one is made per result and a list costs a fraction of a class instance to make:
#
#     [stream of the last write, its position, the last access's position on that stream,
#      {other stream: its last access since the write} or None, live views of it]

WRITER, WRITTEN, LAST, OTHERS, VIEWS = range(5)


class StreamState:
    """What stream assignment remembers across batches.

    ``position[s]`` counts the items queued on stream s. ``storages`` holds the record (above)
    of every live tensor's storage, keyed by the id of the tensor that made it. ``roots[v]`` is
    ``(storage key, stream, position, scope)`` for a view v (a VIEW operator's result, or a view
    of a view): the view's own handle is made there, so its users also wait for that point.
    ``covered[s, scope][t]`` is the position on stream t that stream s has waited for on the
    devices of ``scope`` (``CallInfo.scope``): a host records a WAIT's events on the waiting
    kernel's devices only."""

    def __init__(self):
        self.position: dict = {}
        self.storages: dict = {}
        self.roots: dict = {}
        self.covered: dict = {}


def assign_streams(graph, nodes: list) -> list:
    """Puts collectives on the communication stream and the rest on the compute stream of the
    graph their record names, and orders each access to a storage after the accesses on other streams it
    conflicts with, whichever graph issued them:

        read after write    a kernel waits for the last write of each storage it reads
        write after read    an in-place kernel waits for the reads since the last write
        write after write   ... and for that write (a result is a fresh storage: no wait)

    An in-place kernel writes operand 0, and the operands its ``WRITES`` flags name.

    A VIEW operator reads operand 0's storage (it may copy: ``contiguous``, ``reshape``) and its
    results alias it. A fetch reads on a stream already past the storage's last write and its
    view's making, so it waits for nothing; later writes on other streams wait for it."""
    st = graph.streams
    position, storages, roots = st.position, st.storages, st.roots
    out = []
    for node in nodes:
        if type(node) is Operator:
            flags = node.call.flags
            rec = node.rec  # its graph, until now
            s = COMM_STREAM if flags & COMM else compute_stream(rec[P.OP_STREAM])
            rec[P.OP_STREAM] = s
            pos = position[s] = position.get(s, 0) + 1
            after = None  # stream -> the position on it this kernel must come after
            for i in node.inputs:
                view = roots.get(i)
                m = storages.get(i if view is None else view[0])
                if m is not None:
                    if m[WRITER] == s:
                        m[LAST] = pos
                    else:  # read after write
                        after = _join(after, m[WRITER], m[WRITTEN])
                        touch(m, s, pos)
                if view is not None and view[1] != s:  # the view's handle is made there
                    after = _join(after, view[1], view[2])
            if flags & (INPLACE | VIEW):
                after = _write_or_alias(st, node, s, pos, after)
                if flags >= WRITES:  # the other operands it writes in place
                    for k in written(flags):
                        after = _write(st, node.operands[k], s, pos, after)
            else:
                for o in node.outs:
                    storages[o] = [s, pos, pos, None, 0]
            if after:
                _wait_for_each(st, node, after)
            out.append(node)
        elif type(node) is int:
            view = roots.pop(node, None) if roots else None
            r = node if view is None else view[0]
            m = storages.pop(r, None)
            if m is not None and m[VIEWS]:  # one of its ids is gone, not the storage
                m[VIEWS] -= 1
                storages[r] = m
            out.append(node)
        elif node[0] == P.FETCH:
            fetch = P.Fetch(*node)
            out.append(P.HostFetch(P.FETCH, fetch.id, fetch.request,
                                   _fetch_stream(graph, fetch.id)))
        else:
            out.append(node)
    return out


def _write(st: StreamState, base: int, s: int, pos: int, after):
    """A write of tensor ``base``'s storage at position ``pos`` of stream ``s``, after every
    access to it on the other streams. Returns what the kernel must come after."""
    view = st.roots.get(base)
    r = base if view is None else view[0]
    m = st.storages.get(r)
    if m is None:  # a tensor this runtime did not make: nothing to order against
        st.storages[r] = [s, pos, pos, None, 0]
        return after
    if m[WRITER] != s:  # write after write, and after the reads on the writer's stream
        after = _join(after, m[WRITER], m[LAST])
    if m[OTHERS] is not None:
        for t, p in m[OTHERS].items():  # write after read
            if t != s:
                after = _join(after, t, p)
    m[:VIEWS] = s, pos, pos, None
    return after


def _join(after, t: int, pos: int) -> dict:
    """``after`` (None: empty) now also comes after position ``pos`` of stream ``t``."""
    if after is None:
        return {t: pos}
    if after.get(t, 0) < pos:
        after[t] = pos
    return after


def touch(m: list, s: int, pos: int) -> None:
    """Records an access to storage ``m`` at position ``pos`` of stream ``s``."""
    if m[WRITER] == s:
        m[LAST] = pos
    elif m[OTHERS] is None:
        m[OTHERS] = {s: pos}
    else:
        m[OTHERS][s] = pos


def _write_or_alias(st: StreamState, node: Operator, s: int, pos: int, after):
    """An in-place kernel writes operand 0's storage (``_write``); a view's results share it.
    Returns what the kernel must come after."""
    base = node.operands[0]
    if node.call.flags & INPLACE:
        return _write(st, base, s, pos, after)
    view = st.roots.get(base)
    r = base if view is None else view[0]
    m = st.storages.get(r)
    if m is None:
        for o in node.outs:
            st.storages[o] = [s, pos, pos, None, 0]
    else:
        for o in node.outs:  # split and unbind make several views
            st.roots[o] = (r, s, pos, node.call.scope)
        m[VIEWS] += len(node.outs)
    return after


def _fetch_stream(graph, tensor_id: int) -> int:
    """A fetch queues on the stream of its storage's last write, or of its view's making if
    that came later (the view read the storage, so it came after the write; a later write
    waited for it): either way it needs no wait. It counts as a read there, so a write queued
    later on another stream waits for it (write after read)."""
    st = graph.streams
    view = st.roots.get(tensor_id)
    m = st.storages.get(tensor_id if view is None else view[0])
    if m is None:  # nothing made it (a fetch of a released id fails on any stream)
        return compute_stream(0)
    s = m[WRITER]
    if view is not None and view[1] != s and not _has_waited(st, s, view):
        s = view[1]  # made after the last write
    pos = st.position[s] = st.position.get(s, 0) + 1
    touch(m, s, pos)
    return s


def _has_waited(st: StreamState, s: int, view: tuple) -> bool:
    """Stream ``s`` has waited for the point where ``view`` was made, on the view's devices."""
    _, t, pos, scope = view
    return st.covered.get((s, scope), {}).get(t, 0) >= pos


def _wait_for_each(st: StreamState, node: Operator, after: dict) -> None:
    """Waits for each stream of ``after`` (stream -> position, none the node's own). A stream
    whose own waits cover the others' positions goes first, so those need no wait of their
    own (a compute stream that waited for a collective which waited for another graph)."""
    streams = list(after)
    if len(streams) > 1:
        scope = node.call.scope

        def covers(t):
            seen = st.covered.get((t, scope), {})
            return sum(seen.get(u, 0) >= p for u, p in after.items())

        streams.sort(key=covers, reverse=True)
    for t in streams:
        _wait_for(st, node, t, after[t])


def _wait_for(st: StreamState, node: Operator, t: int, pos: int) -> None:
    """Makes ``node`` wait for stream ``t`` up to ``pos``, unless its stream has waited that
    far already. The host records the event at t's tail, so the wait covers all of t queued so
    far, and all that t had waited for: that is kept too, so a wait through a third stream is
    not repeated."""
    s, scope = node.rec[P.OP_STREAM], node.call.scope
    covered = st.covered.get((s, scope))
    if covered is None:
        covered = st.covered[s, scope] = {}
    if covered.get(t, 0) >= pos:
        return
    covered[t] = st.position.get(t, 0)
    for u, q in st.covered.get((t, scope), {}).items():
        if u != s and covered.get(u, 0) < q:
            covered[u] = q
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
