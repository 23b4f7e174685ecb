"""The whole wire vocabulary between client, controller and hosts, in one place.

Every socket is authenticated and encrypted (ZeroMQ CURVE, keys per runtime; see
``launcher/auth.py``), so every frame comes from a process of this runtime.

Every message is a tuple whose first field is its tag; batches are msgpack lists of records, sent
as one frame. Nothing is ever pickled. The hot records stay small and flat: an operator is
``(OP, call_id, site, graph, *out_ids, *operands)`` where operands are tensor ids and Python
scalars (how many of each, and which is which, is fixed by the call template), and a release is a
bare int (the tensor id). ``graph`` is the id of the dtorch.Graph the issuing thread issues to
(each record carries its own, so threads issuing at once never move each other's operators onto
another graph). The controller turns an OP record into the hosts' KERNEL record in place: it sets
the tag, replaces the graph by the stream, and puts a WAIT record before it when it must wait for
other streams.

Client -> controller (a batch of records):
    DefineMesh, DefineSpec, DefineCall   metadata, each sent once before first use
    Op (after a Recorded when autograd records it), release (int), Fetch, Sync, Shutdown
    DefineStep, Step   a replayed step's records with holes, once; then each replay of it
Controller -> hosts (a batch): the Define* records, then Kernel (after a Wait when it must wait
    for other streams; a Recorded passes through before it), Chain, release, HostFetch, Sync
Host -> controller -> client: Value (+ a data frame), FetchFailed, KernelError, Synced, HostReady
Controller -> host: Welcome (once, as a batch of one). Controller -> client: Fatal.
Many machines (``launcher/node.py``, ``launcher/machines.py``): a node agent joins the main
controller with NodeJoin and is answered NodeWelcome (its machine index and first device id);
once its hosts are up it sends NodeReady, and from then on receives every batch (one copy per
machine) as ``[NODE_BATCH, batch]`` and control messages (NodeWelcome, NodeBeat, NodeBye,
StoreReply) as ``[NODE_CONTROL, record]``. Upstream it sends its hosts' messages as they are
(a SYNCED only once all its hosts have synced), NodeBeat, NodeFailure, and its hosts'
StoreRequests (the rendezvous store is the main controller's, ``launcher/store.py``). The client
asks the controller about the cluster with a ClusterQuery record in its batch, answered with
ClusterInfo on a socket of its own (``cluster/main_node.py``).
Tracing (``dtorch.profiler``): the client's Trace record travels with the batch to every host,
which switches its streams' recording at that point of their queues; a Trace off is followed by
a Sync, and each host answers it with TraceEvents before its Synced, so the client has every
host's events once the sync returns.
"""

from __future__ import annotations

import ctypes
from enum import IntEnum
from typing import NamedTuple

import msgpack

from .placement import decode_placement, encode_placement
from .spec import intern_spec

# call flags (DefineCall.flags): what the controller must know of an operator without its entry
INPLACE = 1  # writes operand 0 and returns it
VIEW = 2  # output aliases operand 0's storage
IMPURE = 4  # must run even when nothing reads its outputs
COMM = 8  # runs on the communication stream
RECORD = 16  # autograd records it: the host keeps its autograd graph for the backward (each
# call's Op comes after a Recorded record that says under which key)
OVERWRITES = 32  # an INPLACE call that writes every element of operand 0 and reads none: it
# runs on an operand 0 that carries a failure, and clears it (``stream.Blob.overwritable``)
WRITES = 1 << 8  # WRITES << k: an INPLACE call also writes its operand k in place (``writes``)


def writes(*operands: int) -> int:
    """The flags of an INPLACE call that also writes these operands (an optimizer's state)."""
    return sum(WRITES << k for k in operands)


def written(flags: int) -> tuple:
    """The operands besides operand 0 that a call with ``flags`` writes in place."""
    return tuple(k for k in range(flags.bit_length() - 8) if flags & (WRITES << k))



class CallKind(IntEnum):
    """What a DefineCall defines, and so what its ``target`` is."""

    OPERATOR = 0  # target: the registered operator's name ("add", "custom_op")
    REDISTRIBUTE = 1  # target: None. The controller lowers it into steps: it never reaches a host
    STEP = 2  # target: the redistribute step's kind ("all_gather"), a namespace of its own
    VJP = 3  # target: the id of the forward call (an int) whose kept graph it differentiates


def call_name(kind: int, target) -> str:
    """How messages, graphs and traces name a call (a step as ``step:all_gather``)."""
    if kind == CallKind.OPERATOR:
        return target
    if kind == CallKind.STEP:
        return f"step:{target}"
    if kind == CallKind.VJP:
        return f"vjp:{target}"
    return "redistribute"

# tags
DEFINE_MESH, DEFINE_SPEC, DEFINE_CALL, OP, FETCH, SYNC = range(6)
SHUTDOWN = 7  # (6 was a record that switched the graph; operators now carry theirs)
KERNEL, WAIT = 8, 9
VALUE, FETCH_FAILED, KERNEL_ERROR, SYNCED, HOST_READY, WELCOME, FATAL = range(10, 17)
CHAIN = 17
TRACE, TRACE_EVENTS = 18, 19
GRAPH = 40  # (GRAPH, directory or None): where the controller writes each batch's graph (DOT)
NODE_JOIN, NODE_WELCOME, NODE_READY, NODE_BEAT, NODE_FAILURE, NODE_BYE = range(20, 26)
STORE_REQUEST, STORE_REPLY, CLUSTER_QUERY, CLUSTER_INFO = range(26, 30)
DEFINE_PROGRAM, REPLAY = 30, 31
RECORDED = 32
DEFINE_STEP, STEP = 33, 34
DEFINE_HOST_STEP, HOST_STEP = 35, 36
DROP_STEP = 37  # (DROP_STEP, template id): a replayed step gone; controller and hosts forget it

# the first frame of what the main controller sends a node agent: a batch it relays to its
# hosts without decoding it, or a control record for the agent itself
NODE_BATCH, NODE_CONTROL = b"B", b"C"
CONTROLLER = -1  # the host index of what the controller itself sends (a Synced, TraceEvents)
CLIENT = -2  # the host index of the client's own TraceEvents (``dtorch.profiler``)
FUSION_TRACK = 1 << 16  # the stream id of a device's kernel-fusion compiles in TraceEvents


class DefineMesh(NamedTuple):
    tag: int
    id: int
    device_type: str
    shape: list
    devices: list


class DefineSpec(NamedTuple):
    tag: int
    id: int
    shape: list
    dtype: str  # torch dtype name without "torch.", e.g. "float32"
    mesh: int
    placements: list  # encoded placements: "S0", "R", "Psum"


def define_spec(spec_id: int, spec, mesh_id: int) -> DefineSpec:
    """The record that defines ``spec`` (a TensorSpec) to the other roles."""
    return DefineSpec(DEFINE_SPEC, spec_id, list(spec.shape), spec.dtype, mesh_id,
                      [encode_placement(p) for p in spec.placements])


def decode_spec(rec, meshes: dict):
    """The interned TensorSpec a DefineSpec record (a list off the wire) defines."""
    d = DefineSpec(*rec)
    return intern_spec(d.shape, d.dtype, meshes[d.mesh], map(decode_placement, d.placements))


class DefineCall(NamedTuple):
    """One call shape of an operator: everything about a call that is not an id or a value."""

    tag: int
    id: int
    target: object  # what ``kind`` says: an operator's or a step's name, a forward call's id
    inputs: list  # spec id per operand; 0 for a Python scalar (passed by value)
    outputs: list  # spec id per output
    static: bytes  # msgpack of the static args, decoded only by hosts (see pack_static)
    flags: int  # INPLACE, VIEW, IMPURE, COMM, RECORD, OVERWRITES, WRITES (above)
    kind: int = CallKind.OPERATOR  # (last, so that an operator's record may leave it out)


class Recorded(NamedTuple):
    """Sent just before the Op of a call autograd records (a call with the RECORD flag): the
    hosts keep the kernel's autograd graph under ``key`` (the tape node's id; its release drops
    the graphs). ``needs``: the bits of the operands to differentiate, ``gathered``: of those
    the graph must not keep (``runtime/vjp.py``), as ``wire_bits``. ``kernel``: the call's
    first result id, which names the kernel it announces wherever the passes put the two."""

    tag: int
    kernel: int
    key: int
    needs: object
    gathered: object


class DefineProgram(NamedTuple):
    """A window of kernels the controller replays (controller/replay.py), as hosts keep it.

    A step is ``[call, site, stream, outs, operands]``. A result or tensor operand is a *ref*:
    k >= 0 the window's k-th result, -1 - j its j-th outside input (an in-place kernel's result
    is its operand's ref); a scalar operand is the index of its value in the Replay record."""

    tag: int
    id: int
    n_outside: int
    n_made: int
    n_scalars: int
    steps: list
    survivors: list  # refs of the results the window leaves alive: they get blobs
    released: list  # the outside inputs (by number) it releases


class DefineStep(NamedTuple):
    """A replayed step's records with holes (``dtorch.step_replay``), as the client learnt
    them, sent once; each replay of it is then one Step record. A release among ``entries``
    is the index of its id in a Step's ids; any other record is ``[fields, holes, dynamic]``:
    ``holes`` the ``[position, index]`` of each id a replay fills in, ``dynamic`` the
    positions of the scalars a replay brings (in the order of the records). The controller
    keeps it (``controller/step_templates.py``); hosts never see it."""

    tag: int
    id: int
    n_ids: int
    entries: list


class DefineHostStep(NamedTuple):
    """What the hosts get for a replayed step that the controller has learnt to lower from
    its Step record alone (``controller/step_lowering.py``): the records with holes
    (``entries``), sent once; each replay is then one HostStep record, whose values fill the
    holes (``host_step_records``). An entry is ``[kind, fields, holes]``: a record (RECORD)
    ``fields`` with ``holes`` ``[[place, value index], ...]``; a release (RELEASE) its id, or
    (holes >= 0) the value at that index; a chain (CHAIN_ENTRY) ``fields`` its kernels as
    ``[fields, holes]``."""

    tag: int
    id: int
    entries: list


RECORD_ENTRY, RELEASE_ENTRY, CHAIN_ENTRY = 0, 1, 2  # a DefineHostStep entry's kind


def host_step_records(entries, values) -> list:
    """The records a HostStep stands for: ``entries`` (``DefineHostStep``) with ``values``."""
    def filled(fields, holes):
        rec = list(fields)
        for k, j in holes:
            rec[k] = values[j]
        return rec

    return [(fields if holes < 0 else values[holes]) if kind == RELEASE_ENTRY
            else filled(fields, holes) if kind == RECORD_ENTRY
            else [CHAIN, *(filled(*member) for member in fields)]
            for kind, fields, holes in entries]


# Step:   (STEP, template, *ids, *dynamic scalars)   client -> controller, alone in its batch
#         one replay of a DefineStep: its ids (made, the previous replay's made, the
#         arguments' ids) and the scalars that change (an optimizer's step counts and rate)
# HostStep: (HOST_STEP, definition, *ids, *dynamic scalars, *temporaries)  controller -> hosts
#         a Step the controller lowered from the record alone (``DefineHostStep``)
# Replay: (REPLAY, program, *outside ids, *result ids, *scalar values)   controller -> hosts
#         one window of a DefineProgram's shape, its ids and values bound in order
# Op:     (OP, call, site, graph, *outs, *operands)   client -> controller
# Kernel: (KERNEL, call, site, stream, *outs, *operands) controller -> hosts
#         ``site`` indexes the client's table of the user's file:line, echoed back in errors.
#         The record stays a flat tuple (the hot path builds one per operator); its fields are
#         read by the names below, and how many results and operands it has by its DefineCall.
# Chain:  (CHAIN, kernel, kernel, ...) kernels each reading the previous one's only result, which
#         gets no blob: one host task runs them all (see controller/passes.fuse_chains).
# Wait:   (WAIT, *streams)  the next Kernel first waits for the work queued so far on these
#         streams (the host records an Event on each).
# Recorded: announces the Kernel of a recorded call (see the class), as WAIT does a wait.


# OP_STREAM holds an Op's graph until the controller assigns the stream; OP_OUTS: the first
# result's id
OP_CALL, OP_SITE, OP_STREAM, OP_OUTS = 1, 2, 3, 4


def op_outs(rec, n_outs: int):
    """The result ids of an Op/Kernel record whose call has ``n_outs`` results."""
    return rec[OP_OUTS:OP_OUTS + n_outs]


def op_operands(rec, n_outs: int):
    """The operands (tensor ids and scalar values) of an Op/Kernel record."""
    return rec[OP_OUTS + n_outs:]


def wire_bits(bits: int):
    """A bit set (an int) as a record carries it: an int while msgpack can pack one (63 bits),
    bytes beyond (a Recorded's bits per operand of a call with more operands: ``stack`` of
    70)."""
    return bits if bits < 1 << 63 else bits.to_bytes((bits.bit_length() + 7) // 8, "little")


def bits_of(value) -> int:
    """The bit set ``wire_bits`` sent."""
    return int.from_bytes(value, "little") if isinstance(value, bytes) else value


def items(rec):
    """What a WAIT (its streams) or a CHAIN (its kernels) record lists after its tag."""
    return rec[1:]


def is_definition(rec) -> bool:
    """A DefineMesh, DefineSpec or DefineCall record (not a release, a bare int, nor one of
    the controller's graph nodes)."""
    return isinstance(rec, (list, tuple)) and rec[0] <= DEFINE_CALL


class Fetch(NamedTuple):
    tag: int
    id: int
    request: int


class Sync(NamedTuple):
    tag: int
    token: int
    compiles: int = 0  # 1: hosts also wait for the kernel fusions started so far to be done


class HostFetch(NamedTuple):
    """A Fetch placed on the stream of its storage's last write, or of its view's making if
    that came later: it needs no waits (``passes.assign_streams``)."""

    tag: int
    id: int
    request: int
    stream: int


class Value(NamedTuple):
    tag: int
    request: int
    coord: list
    shape: list
    dtype: str


class FetchFailed(NamedTuple):
    tag: int
    request: int
    site: int
    op: str
    message: str


class KernelError(NamedTuple):
    tag: int
    site: int
    op: str
    message: str
    kernel: int  # id of the failed kernel's first result: every device reports, the client
    # tells the user once


class Synced(NamedTuple):
    tag: int
    token: int
    host: int  # the host's index; from a node agent (all its hosts synced): its machine's


class HostReady(NamedTuple):
    tag: int
    host: int
    pid: int


class Welcome(NamedTuple):
    tag: int
    store_path: str  # the FileStore that process groups rendezvous through
    # on a machine of a cluster: the node agent's endpoint that relays the cluster's
    # rendezvous store (``launcher/store.py``); store_path is then unused
    store_relay: str = ""


class Trace(NamedTuple):
    """Starts (``on``) or stops kernel recording on every host, in program order. A stop names
    the ``request`` that the hosts' TraceEvents answer."""

    tag: int
    on: bool
    request: int


class TraceEvents(NamedTuple):
    """One host's recorded kernels since its Trace on: ``events`` is a list of
    ``[name, device, stream, start_ns, end_ns, site]`` (``time.time_ns()``, one clock for
    every process of the machine; ``site``: the client's call-site index). The controller
    answers too, as host ``CONTROLLER``, with one event per batch: its passes (device and
    stream -1)."""

    tag: int
    request: int
    host: int
    pid: int
    threads: int  # torch.get_num_threads() on that host
    events: list


class Fatal(NamedTuple):
    tag: int
    message: str
    # the KernelErrors of the collectives the cause broke (controller/reports.py): in the same
    # message, so the client's first error names the cause and then what it broke
    broke: list = ()
    # the global ids of the devices a death took (the dead host's, or the dead machine's); ()
    # when the cause is no death
    lost: list = ()


# -- many machines --------------------------------------------------------------------------------
class NodeJoin(NamedTuple):
    """A node agent asks to join; ``address`` is where its hosts' collectives listen."""

    tag: int
    name: str  # the machine's host name
    address: str
    device_type: str
    devices: int  # how many devices it serves
    rank: int  # its rank under a launcher (SLURM_PROCID, the Ray node's index), else -1
    pid: int


class NodeWelcome(NamedTuple):
    tag: int
    machine: int  # its index in the cluster (1, 2, ...: machine 0 is the main node)
    first_device: int  # global id of its first device: ids go machine by machine


class NodeReady(NamedTuple):
    tag: int
    hosts: int  # host processes started and connected


class NodeBeat(NamedTuple):
    """Sent both ways every ``config.heartbeat_interval_s``: each side declares the other gone
    after ``config.heartbeat_timeout_s`` without any message."""

    tag: int


class NodeFailure(NamedTuple):
    tag: int
    message: str  # e.g. which of its hosts died, and how


class NodeBye(NamedTuple):
    tag: int
    reason: str  # the runtime ended: the agent stops its hosts and waits for the next one


class StoreRequest(NamedTuple):
    """One call on the cluster's rendezvous store (``launcher/store.py``): ``op`` is a torch
    Store method name, ``args`` its arguments."""

    tag: int
    client: str  # the asking store client's socket identity, which the reply goes to
    op: str
    args: list


class StoreReply(NamedTuple):
    tag: int
    client: str
    value: object  # what the Store method returns (bytes, int, bool or None)


class ClusterQuery(NamedTuple):
    """The client asks for the cluster's machines once at least ``min_nodes`` are ready, or
    ``timeout_s`` has passed (0: at once); answered with ClusterInfo on ``reply_to``."""

    tag: int
    request: int
    reply_to: str
    min_nodes: int
    timeout_s: float


class Machine(NamedTuple):
    """One ready machine of a cluster, as ClusterInfo lists it."""

    index: int
    name: str
    address: str
    device_type: str
    first_device: int
    devices: int
    rank: int
    pid: int


class ClusterInfo(NamedTuple):
    tag: int
    request: int
    machines: list  # Machine fields, one list per ready machine, by index


def pack(records) -> bytes:
    return msgpack.packb(records, use_bin_type=True)


def unpack(frame) -> list:
    return msgpack.unpackb(frame, raw=False, use_list=True, strict_map_key=False)


# -- static args: torch dtypes travel as ext type 1 with their name -----------------------------
_DTYPE_EXT = 1


# Static args the client consumes itself: the layout of a result is in its output spec
CLIENT_ONLY = frozenset(("device_mesh", "placements"))


def wire_static(static: dict) -> dict:
    """The static args of a call that travel to the kernel, by name, in signature order."""
    return {k: v for k, v in static.items() if k not in CLIENT_ONLY}


def wire_names(static_names) -> list:
    """The names of the static args a kernel receives, in the order they travel."""
    return [n for n in static_names if n not in CLIENT_ONLY]


def pack_static(static: tuple) -> bytes:
    def encode(obj):
        import torch  # only reached for non-msgpack types, so the controller never imports it

        if isinstance(obj, torch.dtype):
            return msgpack.ExtType(_DTYPE_EXT, str(obj)[6:].encode())
        if isinstance(obj, torch.Size):
            return list(obj)
        raise TypeError(f"cannot send static argument {obj!r} of type {type(obj).__name__}")

    return msgpack.packb(static, default=encode, use_bin_type=True)


def unpack_static(blob: bytes) -> list:
    import torch

    def ext(code, data):
        if code == _DTYPE_EXT:
            return getattr(torch, data.decode())
        return msgpack.ExtType(code, data)

    return msgpack.unpackb(blob, ext_hook=ext, raw=False, use_list=False)


def buffer_of(t):
    """The memory of a contiguous CPU tensor as a writable buffer of bytes, without a copy: what
    a tensor's value travels as (zmq sends the buffer as it is) and what a checkpoint reads
    into. The buffer keeps the tensor alive. (No NumPy: dtorch does not depend on it.)"""
    n = t.numel() * t.element_size()
    if not n:
        return bytearray()
    buf = (ctypes.c_uint8 * n).from_address(t.data_ptr())
    buf.tensor = t
    return buf
