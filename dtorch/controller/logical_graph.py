"""LogicalGraph: what the controller knows of the program.

Operands are tensor ids; an Operator is one call of an operator (its CallInfo says which
operator, the specs of its operands and results, static args and flags). The controller holds
only the incremental subgraph of the batch in hand; what was dispatched is remembered just as far
as later batches need it (where each live storage was last written and read: ``streams``, the
stream rule's ``StreamOrder``).
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

from .. import protocol as P
from ..spec import MeshInfo
from .streams import StreamOrder


class CallInfo(NamedTuple):
    id: int
    op: str  # its name in graphs and messages (``P.call_name``); what it is: ``kind``
    inputs: tuple  # spec ids (0: a Python scalar)
    outputs: tuple
    static: bytes
    flags: int
    reads: tuple  # where the tensor operands stand in an Operator's record
    scope: int  # the devices a host queues the kernel on, interned (LogicalGraph.scope)
    # for replay.shape_of, unpacked at once: (reads, the scalar operands' places, the place
    # after the results, which begin at P.OP_OUTS)
    places: tuple
    kind: int  # P.CallKind

    @classmethod
    def from_record(cls, rec, scope: int) -> CallInfo:
        _, i, target, inputs, outputs, static, flags, kind = P.DefineCall(*rec)
        first = P.OP_OUTS + len(outputs)
        reads = tuple(first + k for k, s in enumerate(inputs) if s)
        scalars = tuple(first + k for k, s in enumerate(inputs) if not s)
        return cls(i, P.call_name(kind, target), tuple(inputs), tuple(outputs), static,
                   P.bits_of(flags),
                   reads, scope, (reads, scalars, first), kind)


class Operator:
    """A node of the incremental subgraph. ``rec`` is its wire record,
    ``[OP, call, site, graph, *outs, *operands]``, which becomes the hosts' KERNEL record in
    place, the graph replaced by the stream (see protocol.py); ``outs`` and ``inputs`` (the
    tensor operands) are read off it once."""

    __slots__ = ("call", "rec", "outs", "inputs", "waits")

    def __init__(self, call: CallInfo, rec: list):
        self.call, self.rec = call, rec
        reads = call.reads
        self.outs = P.op_outs(rec, len(call.outputs))
        # the common arities spelled out: this runs once per operator
        if len(reads) == 1:
            self.inputs = (rec[reads[0]],)
        elif len(reads) == 2:
            self.inputs = (rec[reads[0]], rec[reads[1]])
        else:
            self.inputs = tuple(rec[k] for k in reads)
        self.waits = None  # streams to wait for, set by assign_streams

    @classmethod
    def make(cls, call: CallInfo, site: int, graph: int, outs, operands) -> Operator:
        return cls(call, [P.OP, call.id, site, graph, *outs, *operands])

    @property
    def operands(self) -> list:
        return P.op_operands(self.rec, len(self.call.outputs))

    @property
    def site(self) -> int:
        return self.rec[P.OP_SITE]

    @property
    def graph(self) -> int:
        """The dtorch.Graph that issued it (until ``assign_streams`` puts its stream there)."""
        return self.rec[P.OP_STREAM]

    @property
    def stream(self) -> int:
        return self.rec[P.OP_STREAM]

    def __repr__(self) -> str:
        return f"{self.call.op}{tuple(self.operands)}->{self.outs}@{self.stream}"


class LogicalGraph:
    def __init__(self):
        self.meshes: dict = {}
        self.specs: dict = {}  # spec id -> TensorSpec
        self.spec_ids: dict = {}  # TensorSpec -> id (for specs the controller makes)
        self.calls: dict = {}
        self.step_calls: dict = {}  # (op, in spec id, out spec id, static) -> CallInfo
        self.definitions: list = []  # every Define* record, for hosts that start late
        self.next_temp = -1  # the next controller-made operand's or spec's id (counting down)
        self._call_ids = itertools.count(-1, -1)
        self._scopes: dict = {}  # frozenset of (device type, device) -> small int
        self.streams = StreamOrder()

    # -- definitions ----------------------------------------------------------------------------
    def define(self, rec) -> None:
        tag = rec[0]
        if tag == P.DEFINE_MESH:
            m = P.DefineMesh(*rec)
            self.meshes[m.id] = MeshInfo(m.device_type, m.shape, m.devices, m.id)
        elif tag == P.DEFINE_SPEC:
            spec_id = P.DefineSpec(*rec).id
            spec = self.specs[spec_id] = P.decode_spec(rec, self.meshes)
            self.spec_ids.setdefault(spec, spec_id)
        elif tag == P.DEFINE_CALL:
            c = P.DefineCall(*rec)
            self.calls[c.id] = CallInfo.from_record(rec, self.scope((*c.inputs, *c.outputs)))
            if c.kind == P.CallKind.REDISTRIBUTE:  # lowered here, never sent
                return
        self.definitions.append(rec)

    def scope(self, spec_ids) -> int:
        """The devices of these specs' meshes as one small int. A host queues a kernel (and the
        events of its WAIT) on every local device of its operands' and results' meshes, so two
        calls of one scope wait on the same devices."""
        meshes = {self.specs[i].mesh for i in spec_ids if i}
        key = frozenset((m.device_type, d) for m in meshes for d in m.devices)
        return self._scopes.setdefault(key, len(self._scopes))

    def spec_id(self, spec, out: list) -> int:
        """Id of a spec the controller made (defined to the hosts through ``out``)."""
        i = self.spec_ids.get(spec)
        if i is None:
            i = self.temp_id()
            rec = list(P.define_spec(i, spec, spec.mesh.wire_id))
            self.define(rec)
            out.append(rec)
        return i

    def step_call(self, kind: str, src_id: int, dst_id: int, static: bytes, flags: int,
                  out: list) -> CallInfo:
        """The call shape of one redistribute step. Steps travel as calls of kind STEP, a
        namespace of their own: a step is not an operator (``chunk`` is both)."""
        key = (kind, src_id, dst_id, static)
        call = self.step_calls.get(key)
        if call is None:
            rec = P.DefineCall(P.DEFINE_CALL, next(self._call_ids), kind, [src_id], [dst_id],
                               static, flags, P.CallKind.STEP)
            self.define(rec)
            out.append(rec)
            call = self.step_calls[key] = self.calls[rec.id]
        return call

    def temp_id(self) -> int:
        i, self.next_temp = self.next_temp, self.next_temp - 1
        return i
