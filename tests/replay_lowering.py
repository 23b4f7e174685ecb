"""Lowering a program of client records both ways, for tests/test_replay_lowering.py: through
the controller's Replayer, and through a reference that takes the same decisions except that
where the first replayed a window, it runs the passes on that window alone. ``Builder`` writes
the programs (variables on two meshes and two graphs; reads, in-place writes, views,
collectives, fetches, releases), ``assert_lowered_alike`` compares the two lowerings record for
record (each REPLAY expanded by its program's definition) and the stream state they leave.
"""

from __future__ import annotations

import copy
from collections import Counter, deque

from dtorch import protocol as P
from dtorch.controller.logical_graph import LogicalGraph
from dtorch.controller.main import Controller
from dtorch.controller.passes import run_passes as passes_over
from dtorch.controller.replay import UNFIT, Replayer

# -- the calls: per mesh, the kinds of access the stream rule tells apart -------------------------
KINDS = {  # name -> (number of tensor operands, number of scalar operands, flags)
    "mul": (1, 1, 0),
    "add": (2, 0, 0),
    "add_": (2, 0, P.INPLACE),  # x.add_(y)
    "update_": (3, 0, P.INPLACE | P.writes(2)),  # an optimizer's step: writes operands 0 and 2
    "t": (1, 0, P.VIEW),
    "gather": (1, 0, P.COMM),  # a collective's result
    "all_reduce_": (1, 0, P.COMM | P.INPLACE),  # a collective in place
    "ones": (0, 0, 0),
    "mul_": (1, 1, P.INPLACE),
    "fwd": (1, 0, P.RECORD),  # a call autograd records (announced by a Recorded record)
    "vjp": (1, 1, 0),  # its VJP: the tape key (a scalar), the result's gradient
    "neg": (1, 0, 0),  # (the last: its call id is its mesh's largest)
}
MESHES = {1: [0, 1], 2: [2, 3]}  # two device sets: waits are recorded per scope


def call_id(kind: str, mesh: int) -> int:
    return 20 * mesh + list(KINDS).index(kind)


def make_graph() -> LogicalGraph:
    g = LogicalGraph()
    for mesh, devices in MESHES.items():
        g.define([P.DEFINE_MESH, mesh, "cpu", [2], devices])
        g.define([P.DEFINE_SPEC, mesh, [4, 4], "float32", mesh, ["S0"]])
        for kind, (tensors, scalars, flags) in KINDS.items():
            inputs = [0] + [mesh] if kind == "vjp" else [mesh] * tensors + [0] * scalars
            g.define([P.DEFINE_CALL, call_id(kind, mesh), kind, inputs, [mesh], b"", flags,
                      P.CallKind.VJP if kind == "vjp" else P.CallKind.OPERATOR])
    return g


class Builder:
    """Client records of a program over named variables, each holding a tensor id on a mesh;
    ``batches`` cuts them where the client's flushes would."""

    def __init__(self):
        self.records, self.ids, self.graph = [], 1000, 0
        self.vars: dict = {}  # name -> [id, mesh]
        self.kept: list = []  # (id, mesh) of results never released: they outlive their window

    def new(self) -> int:
        self.ids += 1
        return self.ids

    def on(self, graph: int) -> None:
        """The operators from now on are issued on ``graph`` (their records name it)."""
        self.graph = graph

    def op(self, kind, site, mesh, *operands, out=None) -> int:
        out = self.new() if out is None else out
        self.records.append([P.OP, call_id(kind, mesh), site, self.graph, out, *operands])
        return out

    def release(self, t: int) -> None:
        self.records.append(t)

    def replace(self, name, t) -> None:
        """``name`` now holds ``t``; its tensor before is released."""
        old = self.vars[name][0]
        self.vars[name][0] = t
        self.release(old)

    def id(self, name) -> int:
        return self.vars[name][0]

    def mesh(self, name) -> int:
        return self.vars[name][1]


def statement(b: Builder, kind: str, names: list, site: int, scalar):
    """One statement of a loop body or of the code between loops (``names``: its variables)."""
    x = names[0]
    m = b.mesh(x)
    if kind == "scale":  # x = x * c
        b.replace(x, b.op("mul", site, m, b.id(x), scalar))
    elif kind == "axpy":  # x = x + y
        b.replace(x, b.op("add", site, m, b.id(x), b.id(names[1])))
    elif kind == "chain":  # t = x * c; x = t + y
        t = b.op("mul", site, m, b.id(x), scalar)
        b.replace(x, b.op("add", site + 1, m, t, b.id(names[1])))
        b.release(t)
    elif kind == "iadd":  # x.add_(y)
        b.op("add_", site, m, b.id(x), b.id(names[1]), out=b.id(x))
    elif kind == "update":  # update_(x, y, z): writes x and z, reads y
        b.op("update_", site, m, b.id(x), b.id(names[1]), b.id(names[2]), out=b.id(x))
    elif kind == "view":  # v = x.t(); x = v * c
        v = b.op("t", site, m, b.id(x))
        b.replace(x, b.op("mul", site + 1, m, v, scalar))
        b.release(v)
    elif kind == "view_write":  # x.t().add_(y): a write through a view
        v = b.op("t", site, m, b.id(x))
        b.op("add_", site + 1, m, v, b.id(names[1]), out=v)
        b.release(v)
    elif kind == "dead":  # never read
        b.release(b.op("mul", site, m, b.id(x), scalar))
    elif kind == "keep":  # kept.append(x * c): outlives the window
        b.kept.append((b.op("mul", site, m, b.id(x), scalar), m))
    elif kind == "gather":  # x = x + all_gather(y): a window with a collective never replays
        g = b.op("gather", site, m, b.id(names[1]))
        b.replace(x, b.op("add", site + 1, m, b.id(x), g))
        b.release(g)
    elif kind == "negate":  # x = -x
        b.replace(x, b.op("neg", site, m, b.id(x)))
    elif kind == "train":  # y = fwd(x), recorded under a key; x = vjp(key, y); key dropped
        key = b.new()
        y = b.new()
        b.records.append([P.RECORDED, y, key, 1, 0])
        b.op("fwd", site, m, b.id(x), out=y)
        b.replace(x, b.op("vjp", site + 1, m, key, y))
        b.release(y)
        b.release(key)
    elif kind == "imul":  # x.mul_(c)
        b.op("mul_", site, m, b.id(x), scalar, out=b.id(x))
    else:
        raise AssertionError(kind)


BODY_KINDS = {  # kind -> how many distinct variables of one mesh it needs
    "scale": 1, "axpy": 2, "chain": 2, "iadd": 2, "update": 3, "view": 1, "view_write": 2,
    "dead": 1, "keep": 1, "imul": 1, "gather": 2, "negate": 1,
}
IN_PLACE = {"iadd", "update", "view_write", "imul"}
BETWEEN_KINDS = ["gather", "all_reduce", "write B", "read A", "read B", "read comm", "fetch",
                 "view B", "view keep", "view here", "view comm", "switch"]


def between(b: Builder, kind: str, x: str, site: int) -> None:
    """Code between loops: an access to ``x`` from another stream (or a fetch, or a switch of
    the graph the next loop runs in). Where ``x`` gets a new tensor, later loops read that."""
    m, graph = b.mesh(x), b.graph
    if kind == "gather":  # x = all_gather(x): written on the communication stream
        b.replace(x, b.op("gather", site, m, b.id(x)))
    elif kind == "all_reduce":  # a collective writes x in place
        b.op("all_reduce_", site, m, b.id(x), out=b.id(x))
    elif kind == "write B":  # the other graph's compute stream writes x in place
        b.on(1 - graph)
        b.op("mul_", site, m, b.id(x), 1.5, out=b.id(x))
        b.on(graph)
    elif kind == "read B":
        b.on(1 - graph)
        b.release(b.op("mul", site, m, b.id(x), 2.0))  # (dropped: it is never read)
        b.kept.append((b.op("mul", site + 1, m, b.id(x), 2.0), m))
        b.on(graph)
    elif kind == "read comm":  # a collective reads x
        b.kept.append((b.op("gather", site, m, b.id(x)), m))
    elif kind == "read A":  # this graph's compute stream reads x (it waits for x's writer)
        b.kept.append((b.op("mul", site, m, b.id(x), 2.0), m))
    elif kind == "fetch":
        b.records.append([P.FETCH, b.id(x), site])
    elif kind == "view B":  # x = x.t(), made on the other graph's stream (its base released)
        b.on(1 - graph)
        b.replace(x, b.op("t", site, m, b.id(x)))
        b.on(graph)
    elif kind in ("view keep", "view here"):  # a view of x made on the other graph or this
        b.on(1 - graph if kind == "view keep" else graph)  # one, x kept too
        b.vars[f"v{site}"] = [b.op("t", site, m, b.id(x)), m]
        b.on(graph)
    elif kind == "view comm":  # x = all_gather(x).t()
        g = b.op("gather", site, m, b.id(x))
        b.replace(x, b.op("t", site + 1, m, g))
        b.release(g)
    elif kind == "switch":
        b.on(1 - graph)
    else:
        raise AssertionError(kind)


def probe_and_release(b: Builder, site: int) -> None:
    """Every live tensor read by a collective and written by each graph's compute stream, then
    released: the waits these need tell whether the stream state was right."""
    tensors = [tuple(v) for v in b.vars.values()] + b.kept
    for t, m in tensors:
        g = b.op("gather", site, m, t)
        b.records.append([P.FETCH, g, site])  # (a collective's result nothing reads is dropped)
        b.release(g)
        for graph in (1 - b.graph, b.graph):
            b.on(graph)
            b.op("mul_", site + 1, m, t, 1.0, out=t)
    for t, _ in tensors:
        b.release(t)


# -- lowering a program both ways ------------------------------------------------------------------


class Decisions(dict):
    """The real Replayer's programs, logging what became of each window looked up."""

    def __init__(self):
        super().__init__()
        self.log: list = []

    def get(self, key, default=None):
        self.log.append("lowered with its neighbours")
        return super().get(key, default)


class Logging(Replayer):
    def __init__(self, g):
        super().__init__(g, run_passes(g), Controller.encode)
        self.programs = Decisions()

    def advance(self, program, outside, made):
        if super().advance(program, outside, made):
            self.programs.log[-1] = "replayed"
            return True
        return False

    def learn(self, key, window, outside, made, n_scalars, lowered, out):
        self.programs.log[-1] = "lowered alone"
        super().learn(key, window, outside, made, n_scalars, lowered, out)


class Forced(dict):
    """The reference's programs: a window the real Replayer replayed (or lowered alone) is a
    miss here, so the passes lower it alone; one it lowered with its neighbours is so here."""

    def __init__(self, log):
        super().__init__()
        self.log = iter(log)

    def get(self, key, default=None):
        return None if next(self.log) != "lowered with its neighbours" else UNFIT


def run_passes(g):
    """The controller's passes over ``g``, as a function of the nodes (``Replayer``'s)."""
    return lambda nodes: passes_over(g, nodes)


def lower(batches, hold):
    """``(replayed output, reference output, decisions, real graph, reference graph)``."""
    g = make_graph()
    real = Logging(g)
    out = []
    for batch in copy.deepcopy(batches):
        real.run(batch, out, hold)
    real.run([], out)
    h = make_graph()
    reference = Replayer(h, run_passes(h), Controller.encode)
    reference.programs = Forced(real.programs.log)
    expected = []
    for batch in copy.deepcopy(batches):
        reference.run(batch, expected, hold)
    reference.run([], expected)
    return out, expected, real.programs.log, g, h


def expand(g, records) -> list:
    """``records`` with each REPLAY replaced by what it stands for: its program's kernels with
    this window's ids and scalars, then the releases it makes (``runtime/program.expand``);
    each HOST_STEP by its records (``P.host_step_records``), expanded in turn."""
    programs, steps, out = {}, {}, []
    records = deque(records)
    while records:
        rec = records.popleft()
        if type(rec) is not int and rec[0] == P.DEFINE_PROGRAM:
            programs[rec[1]] = P.DefineProgram(*rec)
        elif type(rec) is not int and rec[0] == P.DEFINE_HOST_STEP:
            steps[rec[1]] = P.DefineHostStep(*rec).entries
        elif type(rec) is not int and rec[0] == P.HOST_STEP:  # (its records may hold REPLAYs)
            records.extendleft(reversed(P.host_step_records(steps[rec[1]], rec[2:])))
        elif type(rec) is not int and rec[0] == P.REPLAY:
            d = programs[rec[1]]
            outside = rec[2:2 + d.n_outside]
            made = rec[2 + d.n_outside:2 + d.n_outside + d.n_made]
            scalars = rec[2 + d.n_outside + d.n_made:]
            assert len(scalars) == d.n_scalars

            def tensor(ref, made=made, outside=outside):
                return made[ref] if ref >= 0 else outside[-1 - ref]

            for call, site, stream, outs, operands, *recorded in d.steps:
                values = [tensor(r) if spec else scalars[r]
                          for r, spec in zip(operands, g.calls[call].inputs)]
                if recorded:
                    (key, needs, gathered), = recorded
                    out.append([P.RECORDED, tensor(outs[0]), scalars[key], needs, gathered])
                out.append([P.KERNEL, call, site, stream, *map(tensor, outs), *values])
            alive = set(d.survivors)
            out += [outside[j] for j in d.released]
            out += [t for k, t in enumerate(made) if k not in alive]
        else:
            out.append(rec)
    return out


def normalized(g, records, initial) -> list:
    """What the hosts are told, in a form that two correct lowerings share: chains as their
    kernels (a chain's links freed after it: they get no blob), and the releases of what the
    hosts hold gathered, sorted, before the next record that is not a kernel (releases of ids no
    kernel made are dropped: a replay releases its dead code's results too), and each Recorded
    record as part of the kernel it announces (the passes put it ahead of the chain holding its
    kernel, a replay's expansion just ahead of the kernel). Fails on a kernel that reads a tensor
    released before, or one nothing made, and on a Recorded whose kernel never comes."""
    live, freed, out, pending = set(initial), set(), [], []
    announced: dict = {}  # a Recorded's kernel -> its record

    def flush():
        out.extend(sorted(pending))
        pending.clear()

    def kernel(rec):
        call = g.calls[rec[P.OP_CALL]]
        n = len(call.outputs)
        for t, spec in zip(P.op_operands(rec, n), call.inputs):
            if spec:
                assert t in live, f"{rec} reads {t}, " + ("released" if t in freed else
                                                          "never made")
        live.update(P.op_outs(rec, n))
        recorded = announced.pop(rec[P.OP_OUTS], None) if n else None
        out.append(["kernel", *(("float", repr(v)) if type(v) is float else v for v in rec[1:]),
                    *([("recorded", *recorded[2:])] if recorded else [])])

    for rec in records:
        if type(rec) is int:
            if rec in live:
                live.discard(rec)
                freed.add(rec)
                pending.append(rec)
        elif rec[0] == P.RECORDED:
            announced[rec[1]] = list(rec)
        elif rec[0] == P.KERNEL:
            kernel(rec)
        elif rec[0] == P.CHAIN:
            members = P.items(rec)
            for m in members:
                kernel(m)
            for m in members[:-1]:
                live.discard(m[P.OP_OUTS])
                pending.append(m[P.OP_OUTS])
        elif P.is_definition(rec) or rec[0] == P.DEFINE_PROGRAM:
            continue
        else:
            flush()
            out.append(list(rec))
    flush()
    assert not announced, f"Recorded records of no kernel: {announced}"
    return out


def stream_state(g) -> tuple:
    """The whole stream state (``StreamOrder.state``): a replay leaves the pass's, positions
    included."""
    return g.streams.state()


def initial_ids(batches) -> set:
    """The ids the program reads that none of its records makes (tensors made before it)."""
    g, made, read = make_graph(), set(), set()
    for batch in batches:
        for rec in batch:
            if type(rec) is not int and rec[0] == P.OP:
                call = g.calls[rec[P.OP_CALL]]
                n = len(call.outputs)
                read.update(t for t, s in zip(P.op_operands(rec, n), call.inputs) if s)
                if not call.flags & P.INPLACE:  # (an in-place call's result is its operand)
                    made.update(P.op_outs(rec, n))
    return read - made


def assert_lowered_alike(batches, hold=False) -> Counter:
    """Lowers ``batches`` both ways and asserts the hosts get the same records; returns what
    became of the windows."""
    out, expected, log, g, h = lower(batches, hold)
    initial = initial_ids(batches)
    assert normalized(g, expand(g, out), initial) == normalized(h, expected, initial)
    assert stream_state(g) == stream_state(h)
    return Counter(log)


def cut(records, points) -> list:
    points = sorted({p for p in points if 0 < p < len(records)})
    return [records[a:b] for a, b in zip([0, *points], [*points, len(records)])]
