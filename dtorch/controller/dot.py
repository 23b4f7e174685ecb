"""A batch's LogicalGraph after the passes, as Graphviz DOT (``dtorch.profiler.graph``).

What the hosts will run, drawn as it will run: one cluster per stream (the communication
stream, each graph's compute stream), in it the batch's kernels in their order, a chain
(``passes.fuse_chains``: one host task) as a dashed box around its kernels. A solid edge is a
tensor one kernel makes and another reads, labelled with its id; an id made by an earlier batch
enters from an ellipse. A dashed red edge is a wait for another stream (``passes.assign_streams``):
from that stream's latest kernel in this batch, or from the stream itself when its kernel came in
an earlier batch. A grey note is a release (the id's blocks go once its readers have run);
syncs, fetches and trace switches are plain text where they stand in the program.
"""

from __future__ import annotations

from .. import protocol as P
from .logical_graph import Operator
from .passes import Chain
from .streams import COMM_STREAM

_TAGS = {P.SYNC: "sync", P.FETCH: "fetch", P.TRACE: "trace"}


def to_dot(nodes: list, name: str = "batch") -> str:
    """The DOT source of ``nodes`` (a batch after ``PASSES``)."""
    lines = [f'digraph "{name}" {{', "  rankdir=TB;",
             '  node [shape=box, fontname="Helvetica", fontsize=10];',
             '  edge [fontname="Helvetica", fontsize=9];']
    streams: dict = {}  # stream -> [node lines] of its cluster
    edges, made, last = [], {}, {}  # made: tensor id -> node; last: stream -> latest kernel
    outside = set()
    for k, node in enumerate(nodes):
        members = node.members if isinstance(node, Chain) else [node]
        if isinstance(members[0], Operator):
            stream = members[0].stream
            body = streams.setdefault(stream, [])
            if len(members) > 1:
                body.append(f'    subgraph "cluster_chain{k}" {{ style=dashed; label="chain";')
            for j, op in enumerate(members):
                vid = f"k{k}_{j}"
                outs = ", ".join(f"t{o}" for o in op.outs)
                body.append(f'    {vid} [label="{op.call.op}\\n-> {outs}"];')
                for t in op.waits or ():  # (a chain's first kernel waits for all of it)
                    src = last.get(t) or _stream_node(t, outside, lines)
                    edges.append(f'  {src} -> {vid} [style=dashed, color=red, label="wait"];')
                for i in op.inputs:
                    src = made.get(i)
                    if src is None:
                        src = f"t{i}"
                        if src not in outside:
                            outside.add(src)
                            lines.append(f'  {src} [shape=ellipse, label="t{i}"];')
                    edges.append(f'  {src} -> {vid} [label="t{i}"];')
                for o in op.outs:
                    made[o] = vid
            if len(members) > 1:
                body.append("    }")
            last[stream] = f"k{k}_{len(members) - 1}"
        elif type(node) is int:
            vid = f"r{k}"
            lines.append(f'  {vid} [shape=note, color=gray, fontcolor=gray, '
                         f'label="release t{node}"];')
            if node in made:
                edges.append(f"  {made[node]} -> {vid} [style=dotted, color=gray];")
        elif isinstance(node, (list, tuple)) and node and node[0] in _TAGS:
            lines.append(f'  x{k} [shape=plaintext, label="{_TAGS[node[0]]}"];')
    for stream, body in sorted(streams.items()):
        label = "communication stream" if stream == COMM_STREAM else \
            f"compute stream (graph {stream - 1})"
        lines.append(f'  subgraph "cluster_stream{stream}" {{ label="{label}";')
        lines += body
        lines.append("  }")
    lines += edges
    lines.append("}")
    return "\n".join(lines) + "\n"


def _stream_node(stream: int, outside: set, lines: list) -> str:
    """A node standing for ``stream``'s work of earlier batches."""
    vid = f"s{stream}"
    if vid not in outside:
        outside.add(vid)
        lines.append(f'  {vid} [shape=cds, label="stream {stream} (earlier work)"];')
    return vid
