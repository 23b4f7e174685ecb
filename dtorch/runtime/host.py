"""A host process: runs the program on its local devices (the Sub-Controller role).

Every host receives the same batches. The main thread lowers each record for the local devices
it touches (SPMD lowering: each device's block follows from the global spec and its mesh
coordinate) and queues kernels on the devices' streams; stream threads run them. Messages from
stream threads (values, errors, sync acknowledgements) go through one FIFO that the main thread
forwards to the controller, so they leave in the order they were made: a kernel error reported
before a sync acknowledgement reaches the client first, and the sync raises it.

A kernel whose input failed does not run: its outputs carry the first failure on (poisoned), and
reading them raises it. Collectives are the exception, because their peers would wait for them
forever: every member takes part, and the members agree on whether any member's input failed
(``KernelRun._run_collective``), so a failure on one device poisons exactly the values that
depend on it, on every device.

Records are handled by a table from tag to handler (``Host.HANDLERS``).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import os
import threading
import time
import traceback

import torch
import zmq
from torch._C._distributed_c10d import AllreduceOptions, FileStore, ReduceOp

from .. import config, logs, protocol as P
from ..cluster import auth
from ..ops import registry  # importing ops registers every operator's kernel
from ..spec import MeshInfo, coordinate_of, span_devices
from .collectives import STEP_KERNELS, hop, is_hop
from . import cpu_memory
from .context import Groups, KernelContext
from .fusion import Fuser
from .program import Program, ProgramRun
from .stream import Blob, Event, Memory, Recorder, Stream
from .vjp import ForwardFailed, Saved, recording, vjp

log = logs.host


class Device:
    def __init__(self, host: Host, index: int, device_type: str):
        self.host, self.index = host, index
        # a GPU's ordinal is its index on its own machine (device ids count machine by machine)
        self.torch_device = torch.device("cpu") if device_type == "cpu" else torch.device(
            "cuda", index - host.facts.first_device())
        self.streams: dict = {}
        self.blobs: dict = {}
        # the bytes its blobs hold (a CUDA device reports torch.cuda's allocator instead)
        self.memory = Memory() if device_type == "cpu" else None
        self._groups = Groups(index, self.torch_device, host.store)
        # failure agreement runs on the CPU (reading a flag from a GPU would sync its stream)
        self._cpu_groups = self._groups if device_type == "cpu" else Groups(
            index, torch.device("cpu"), host.store, prefix="cpu-pg/")

    def stream(self, sid: int) -> Stream:
        s = self.streams.get(sid)
        if s is None:
            s = self.streams[sid] = Stream(f"dev{self.index}-stream{sid}", self.torch_device,
                                           on_error=self.host.on_stream_error,
                                           label=(self.index, sid))
            s.tracer = self.host.tracer  # a stream made while tracing records from its start
        return s

    def group(self, members: tuple):
        return self._groups.get(members)

    def cpu_group(self, members: tuple):
        """A gloo group of the same members, for small flags the CPU reads."""
        return self._cpu_groups.get(members)


class HostCall:
    """A call shape as this host runs it: the kernel, its static kwargs, and the local devices
    taking part (those of the result's mesh, plus the source mesh's for a move)."""

    __slots__ = ("name", "fn", "uses_context", "in_specs", "out_specs", "kwargs", "inplace",
                 "mask", "all_tensors", "devices", "out_devices", "contexts", "comm", "n_out",
                 "comm_dims", "receive_only", "saves", "reads_saved", "hop", "overwrites",
                 "view")

    def __init__(self, host: Host, rec):
        _, _, name, inputs, outputs, static, flags = rec
        step = STEP_KERNELS[name[len(P.STEP_PREFIX):]] if name.startswith(P.STEP_PREFIX) else None
        self.in_specs = [host.specs[i] if i else None for i in inputs]
        if step is not None:
            self.fn, self.uses_context, kwargs = step, True, {"mesh_dim": P.unpack(static)[0]}
            self.comm_dims = (kwargs["mesh_dim"],)
        elif name.startswith(P.VJP_PREFIX):
            forward = host.calls[int(name[len(P.VJP_PREFIX):])]
            needs, retain, dropped = P.unpack_static(static)
            self.fn, self.uses_context = vjp, True
            kwargs = {"needs": tuple(needs), "retain": retain, "dropped": tuple(dropped)}
            self.comm_dims = forward.comm_dims
            name = f"{forward.name} (backward)"  # how its errors name it
        else:
            op = registry.lookup(name)
            self.fn, self.uses_context = op.kernel, op.uses_context
            kwargs = dict(zip(P.wire_names(op.static_names), P.unpack_static(static)))
            first = next((s for s in self.in_specs if s is not None), None)
            self.comm_dims = (tuple(op.comm_dims(self.in_specs, **kwargs)) if op.comm_dims
                              else tuple(range(len(first.mesh.shape))) if first else ())
        # autograd: a recorded call keeps its graph (its last three operands: the key, the bits
        # of the operands to differentiate and of those not to keep), a VJP reads one (its
        # first operand: the key)
        self.saves = bool(flags & P.RECORD)
        self.reads_saved = name.endswith(" (backward)")
        if self.saves:  # the kernel and its context see the operands without key and bits
            self.fn, self.uses_context = recording(self.fn, self.uses_context), True
            self.in_specs = self.in_specs[:-3]
        self.name, self.kwargs = name, kwargs
        self.out_specs = [host.specs[i] for i in outputs]
        self.n_out = len(outputs)
        self.mask = [bool(i) for i in inputs]
        self.all_tensors = all(self.mask)
        self.inplace = bool(flags & P.INPLACE)
        self.overwrites = bool(flags & P.OVERWRITES)  # a failed operand 0 does not stop it
        self.view = bool(flags & P.VIEW)
        self.comm = bool(flags & P.COMM)  # a collective: its peers rely on it taking part
        meshes = [s.mesh for s in self.out_specs] + [s.mesh for s in self.in_specs if s]
        self.out_devices = host.local_devices(self.out_specs[0].mesh) if self.out_specs else []
        self.devices = list({d.index: d for m in meshes for d in host.local_devices(m)}.values())
        # a move's devices outside the source mesh read nothing: see Host.on_chain
        is_move = name == P.STEP_PREFIX + "move"
        self.receive_only = frozenset(
            set(self.out_specs[0].mesh.devices) - set(self.in_specs[0].mesh.devices)
            if is_move else ())
        self.hop = is_move and is_hop(self.in_specs[0], self.out_specs[0])
        self.contexts: dict = {}

    def context(self, device: Device):
        ctx = self.contexts.get(device.index)
        if ctx is None:
            ctx = self.contexts[device.index] = KernelContext(device, self.in_specs,
                                                              self.out_specs)
        return ctx


PREV = object()  # a chain step's operand that is the previous step's result


class KernelRun:
    """One kernel on one device, queued on a stream; or a chain of kernels each feeding the next
    (``passes.fuse_chains``), of which only the last step's results become blobs.
    A step is (HostCall, KernelContext or None, operands: Blob / PREV / scalar, site)."""

    __slots__ = ("steps", "outputs", "waits", "host", "key")

    def __init__(self, steps, outputs, waits, host, key):
        self.steps, self.outputs, self.waits, self.host = steps, outputs, waits, host
        self.key = key  # the kernel's first result id, naming its failure to the client

    def __call__(self) -> None:
        if self.waits:
            for e in self.waits:
                e.wait()
        if self.steps[0][0].comm:
            return self._run_collective()
        result = None
        for call, ctx, inputs, site in self.steps:
            args, repaired = [], None
            for x in inputs:
                if type(x) is Blob:
                    if x.error is not None:  # poisoned: pass the first failure on, quietly
                        target = x.overwritable(ctx) if call.overwrites and not args else None
                        if target is None:
                            return self._fail(x.error, report=False)
                        args.append(target)  # unless the kernel writes all of it
                        repaired = x
                        continue
                    args.append(x.tensor)
                else:
                    args.append(result if x is PREV else x)
            try:
                if ctx is not None:
                    result = call.fn(ctx, *args, **call.kwargs)
                else:
                    result = call.fn(*args, **call.kwargs)
            except ForwardFailed as e:  # reported when the forward failed
                return self._fail(e.error, report=False)
            except Exception as e:  # noqa: BLE001 - a kernel error becomes the client's error
                return self._fail((site, call.name, f"{type(e).__name__}: {e}"), report=True)
            if repaired is not None:
                repaired.overwritten(result)
            if self.host.log_kernels:
                log.debug("[dtorch host %d] %s %s done at %.6f", self.host.index,
                          threading.current_thread().name, call.name, time.perf_counter())
        self._store(result)

    @property
    def trace_name(self) -> str:
        """The kernel's name in a trace (a chain's joined with "+"); read only while tracing."""
        return "+".join(step[0].name for step in self.steps)

    @property
    def site(self) -> int:
        """The user's line that issued the (last) kernel."""
        return self.steps[-1][3]

    def _store(self, result) -> None:
        outputs = self.outputs
        if len(outputs) == 1:
            outputs[0].hold(result)
        else:
            for blob, value in zip(outputs, result):
                blob.hold(value)

    def _run_collective(self) -> None:
        """A collective never skips: its peers would wait for it forever. A member whose input
        failed takes part with zeros. Alongside, the members all-reduce (MAX) the site of their
        input's failure plus one (0: none), so all of them poison their outputs together; a
        member that learns of a peer's failure only knows its site, and its outputs carry
        ``(site, None, None)``, which the client reads as "poisoned by the failure there".
        The flag travels on another of gloo's threads while the collective runs. (A hop
        between meshes of one shape needs none of this: ``_run_hop``.)"""
        call, ctx, inputs, site = self.steps[0]
        if call.hop:
            return self._run_hop(call, ctx, inputs[0], site)
        error = first_failure(inputs) or (getattr(inputs[0], "error", None) if call.reads_saved
                                          else None)  # a VJP of a forward that did not run
        # a VJP's collectives are its graph's: a device whose forward failed has none, so the
        # peers learn of that (or of a failed gradient) before any of them starts
        missing = call.reads_saved and error is None and not hasattr(inputs[0], "outs")
        failed = error is not None or missing
        flag = torch.tensor([error[0] + 1 if error else site + 1 if missing else 0],
                            dtype=torch.int64)
        peers = failure_peers(ctx, call)
        agreed = failure = result = None
        if len(peers) > 1:
            opts = AllreduceOptions()
            opts.reduceOp = ReduceOp.MAX
            agreed = ctx.device.cpu_group(peers).allreduce([flag], opts)
            if call.reads_saved:
                failure, agreed = _agree(agreed, site, call), None
                failed = failed or bool(int(flag))
        try:
            if not (call.reads_saved and failed and not missing):
                args = [stand_in(ctx, k, x) for k, x in enumerate(inputs)]
                result = call.fn(ctx, *args, **call.kwargs)
        except Exception as e:  # noqa: BLE001 - a kernel error becomes the client's error
            failure = (site, call.name, f"{type(e).__name__}: {e}")
        if agreed is not None:
            failure = _agree(agreed, site, call) or failure
        if error is not None:
            return self._fail(error, report=False)
        if failure is not None:
            return self._fail(failure, report=True)
        if int(flag):
            return self._fail((int(flag) - 1, None, None), report=False)
        self._store(result)

    def _run_hop(self, call, ctx, block, site) -> None:
        """A pipeline hop (``collectives.hop``): each received block depends on its sender's
        input alone, and the sender's failure travels with it, so the receiver poisons its
        block exactly when that input failed, with no agreement among the other devices."""
        error = block.error if type(block) is Blob else None
        try:
            received, sender = hop(ctx, stand_in(ctx, 0, block), error[0] + 1 if error else 0)
        except Exception as e:  # noqa: BLE001 - a kernel error becomes the client's error
            return self._fail((site, call.name, f"{type(e).__name__}: {e}"), report=True)
        if sender:
            return self._fail((sender - 1, None, None), report=False)
        self._store(received)

    def _fail(self, error, report: bool) -> None:
        for blob in self.outputs:
            blob.error = error
        for call, _, inputs, _ in self.steps:  # a recorded call that did not run: its VJP fails
            if call.saves and not hasattr(inputs[-3], "outs"):  # alike (``saved_slots``)
                inputs[-3].error = error
        if report:
            self.host.send(P.KernelError(P.KERNEL_ERROR, *error, self.key))


def _agree(agreed, site, call):
    """Waits for the failure flags' all-reduce: None, or the failure of a peer that missed it."""
    try:
        agreed.wait()
    except Exception as e:  # noqa: BLE001 - e.g. a peer missed the deadline
        return site, call.name, f"{type(e).__name__}: {e}"
    return None


def first_failure(inputs):
    return next((x.error for x in inputs if type(x) is Blob and x.error is not None), None)


def stand_in(ctx, k: int, x):
    """Operand ``k`` of a collective: the blob's tensor, or zeros of its block's shape when the
    blob failed."""
    if type(x) is not Blob:
        return x
    if x.error is None:
        return x.tensor
    spec = ctx.in_specs[k]
    shape = spec.local_region(ctx.coord)[0]
    return torch.zeros(shape, dtype=getattr(torch, spec.dtype), device=ctx.device.torch_device)


def failure_peers(ctx, call: HostCall) -> tuple:
    """The devices that run one collective together: a move spans both meshes (every device of
    either runs it); every other step runs along one mesh dim of one mesh, and a COMM kernel
    along its ``comm_dims``."""
    src = next(s for s in call.in_specs if s is not None)  # a VJP's first operand is its key
    dst = call.out_specs[0]
    if src.mesh is not dst.mesh:
        return tuple(sorted(set(src.mesh.devices) | set(dst.mesh.devices)))
    return span_devices(src.mesh, call.comm_dims, ctx.coord)


class Host:
    def __init__(self, index: int, device_type: str, controller_addr: str, keys: auth.Keys,
                 facts: config.RuntimeFacts):
        self.facts = facts
        self.log_kernels = config.debug >= 2  # read once: checked after every kernel
        self.waits = None  # streams the next kernel waits for (a WAIT record)
        self.tracer = None  # the Recorder while tracing (a TRACE record), see on_trace
        self.index, self.device_type = index, device_type
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, str(index).encode())
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.setsockopt(zmq.RCVHWM, 0)  # batches queue here, none is ever dropped
        auth.join(self.sock, keys)
        self.sock.connect(controller_addr)
        self._keys = keys  # a cluster's store client proves membership with them too
        # any thread queues messages here and rings the bell; the main thread sends them
        self.outbox: collections.deque = collections.deque()
        self._bell_r, self._bell_w = os.pipe()
        os.set_blocking(self._bell_w, False)
        self.meshes: dict = {}
        self.specs: dict = {}
        self.calls: dict = {}
        self.devices: dict = {}  # local device index -> Device
        self.owners: dict = {}  # tensor id -> local devices holding a blob of it
        self.graphs: dict = {}  # tape node id -> {device: Saved} (autograd, runtime/vjp.py)
        self.programs: dict = {}  # replayed window shapes (runtime/program.py)
        self.fuser = Fuser(self)  # their hot stretches, compiled (runtime/fusion.py)
        self._local: dict = {}  # mesh id -> local Devices
        self._store_path = None  # the rendezvous store's file (Welcome)
        self._store_relay = ""  # or, on a machine of a cluster, its node agent (Welcome)
        self.cuda = device_type == "cuda"

    # -- sockets --------------------------------------------------------------------------------
    def send(self, msg, data=None) -> None:
        """From any thread: queue a message for the controller (they leave in this order)."""
        self.outbox.append([P.pack(msg)] if data is None else [P.pack(msg), data])
        try:
            os.write(self._bell_w, b"\0")
        except BlockingIOError:  # the pipe is full of rings: the main thread wakes anyway
            pass

    def forward_outbox(self) -> None:
        os.read(self._bell_r, 65536)
        outbox, sock = self.outbox, self.sock
        while outbox:
            sock.send_multipart(outbox.popleft(), copy=False)

    def on_stream_error(self, stream_name: str) -> None:
        """A stream item raised outside a kernel (a runtime bug): whoever waits on that stream
        would hang, so the client is told the runtime failed (the controller forwards Fatal)."""
        self.send(P.Fatal(P.FATAL, f"host {self.index} ({stream_name}) failed:\n"
                                   + traceback.format_exc()))

    def store(self):
        """A new client of the rendezvous store. Each device needs its own: a client blocks
        while it waits for a key, so devices sharing one would deadlock in a rendezvous."""
        if self._store_relay:  # the cluster's store, through this machine's node agent
            from ..cluster import store as cluster_store

            return cluster_store.connect(self._store_relay, self._keys, self.ctx,
                                         config.collective_timeout_s)
        store = FileStore(self._store_path, -1)
        store.set_timeout(datetime.timedelta(seconds=config.collective_timeout_s))
        return store

    # -- devices --------------------------------------------------------------------------------
    def local_devices(self, mesh) -> list:
        devices = self._local.get(mesh.wire_id)
        if devices is None:
            devices = []
            if mesh.device_type == self.device_type:
                for d in mesh.devices:
                    if self.facts.host_index(self.device_type, d) == self.index:
                        if d not in self.devices:
                            self.devices[d] = Device(self, d, self.device_type)
                        devices.append(self.devices[d])
            self._local[mesh.wire_id] = devices
        return devices

    # -- records --------------------------------------------------------------------------------
    def on_define_mesh(self, rec) -> None:
        m = P.DefineMesh(*rec)
        self.meshes[m.id] = MeshInfo(m.device_type, m.shape, m.devices, m.id)

    def on_define_spec(self, rec) -> None:
        self.specs[P.DefineSpec(*rec).id] = P.decode_spec(rec, self.meshes)

    def on_define_call(self, rec) -> None:
        self.calls[P.DefineCall(*rec).id] = HostCall(self, rec)

    def on_wait(self, rec) -> None:
        self.waits = P.items(rec)  # the streams the next kernel waits for

    def on_kernel(self, rec) -> None:
        self.on_chain((P.CHAIN, rec))

    def on_chain(self, rec) -> None:
        """A kernel, or a chain of kernels each reading the one before (only the last one's
        results become blobs), queued for every local device of the last kernel's mesh."""
        members = [(self.calls[m[P.OP_CALL]], m) for m in P.items(rec)]
        call, last = members[-1]
        outs = P.op_outs(last, call.n_out)
        waits, self.waits = self.waits, None
        for dev in call.devices:
            steps, prev = [], None
            for c, m in members:
                steps.append((c, c.context(dev) if c.uses_context else None,
                              self.operands(c, dev, m, prev), m[P.OP_SITE]))
                prev = m[P.OP_OUTS]
            if call.inplace:
                outputs = [steps[-1][2][0]]
            elif dev in call.out_devices:
                outputs = []
                for o, spec in zip(outs, call.out_specs):
                    dev.blobs[o] = b = Blob(spec, memory=dev.memory, view=call.view)
                    outputs.append(b)
                    self.owners[o] = call.out_devices
            else:
                outputs = []
            events = self.record_events(dev, waits) if waits else None
            stream = dev.stream(last[P.OP_STREAM])
            if events and dev.index in call.receive_only:
                # A move's waits are for its input, which a device outside the source mesh does
                # not hold: its receive need not wait for its own compute stream (which is what
                # lets a pipeline stage receive micro-batch i + 1 while it computes i). The
                # controller counts the wait as done, so the stream waits right after instead.
                stream.put(KernelRun(steps, outputs, None, self, outs[0] if outs else 0))
                stream.put(lambda events=events: [e.wait() for e in events])
            else:
                stream.put(KernelRun(steps, outputs, events, self, outs[0] if outs else 0))

    def on_define_program(self, rec) -> None:
        self.programs[P.DefineProgram(*rec).id] = Program(self, rec)

    def on_replay(self, rec) -> None:
        """A window of a program's shape: one task per local device, its outside inputs' blobs
        found now (as a kernel's are when it is queued), then the ones it releases let go."""
        program = self.programs[rec[1]]
        outside_ids, made, scalars = program.bind(rec)
        runs, same = [], self.fuser.scalars_key(scalars)
        for dev in program.devices:
            lowering, probe, hot = self.fuser.lowering(program, dev, scalars, same)
            blobs, outside = dev.blobs, [None] * program.n_outside
            for j in lowering.reads:
                outside[j] = b = blobs.get(outside_ids[j])
                if b is None:  # not this runtime's tensor: the kernels report it, as usual
                    for p in [probe] + [p for _, _, _, p, _ in runs]:
                        if p is not None:  # nothing copied: the compiler gives it up
                            p.done()
                    for r in program.expand(rec):
                        self.on_release(r) if type(r) is int else self.on_kernel(r)
                    return
            runs.append((dev, lowering, outside, probe, hot))
        for dev, lowering, outside, probe, hot in runs:
            survivors = {}
            for k in program.survivors:
                spec, out_devices = program.survivor_specs[k]
                if dev in out_devices:
                    dev.blobs[made[k]] = survivors[k] = Blob(spec, memory=dev.memory)
                    self.owners[made[k]] = out_devices
            dev.stream(program.stream).put(
                ProgramRun(lowering, outside, survivors, (outside_ids, made), scalars, self, probe,
                           hot))
        for j in program.released:
            self.on_release(outside_ids[j])

    def record_events(self, dev: Device, streams) -> list:
        """An Event recorded on each of ``streams`` after the work queued there so far."""
        events = []
        for t in streams:
            e = Event(self.cuda)
            dev.stream(t).put(e.record)
            events.append(e)
        return events

    def operands(self, call: HostCall, dev: Device, rec, prev) -> list:
        """A kernel's operands on ``dev``: Blobs for tensors (PREV for the chain's previous
        result, whose id ``prev`` has no blob), values for scalars."""
        operands, blobs = P.op_operands(rec, call.n_out), dev.blobs
        if call.all_tensors:
            inputs = [PREV if o == prev else blobs.get(o) for o in operands]
        else:
            inputs = [(PREV if o == prev else blobs.get(o)) if m else o
                      for o, m in zip(operands, call.mask)]
        if call.saves or call.reads_saved:
            inputs = self.saved_slots(call, dev, inputs)
        if None in inputs:
            inputs = self.check_inputs(call, dev, inputs, operands, rec[P.OP_SITE])
        return inputs

    def saved_slots(self, call: HostCall, dev: Device, inputs) -> list:
        """A recorded call's key operand becomes a new Saved slot, a VJP's the slot its
        forward filled: slots are made and found here, in program order, so a release of the
        key (``on_release``) can never come before the kernel that fills it."""
        inputs = list(inputs)
        if call.saves:
            key, slot = inputs[-3], Saved()
            inputs[-3] = self.graphs.setdefault(key, {})[dev.index] = slot
            return inputs
        key, retain = inputs[0], call.kwargs["retain"]
        table = self.graphs.get(key, {})
        inputs[0] = table.get(dev.index) if retain else table.pop(dev.index, None)
        if not table:
            self.graphs.pop(key, None)
        return inputs

    def check_inputs(self, call: HostCall, dev: Device, inputs, operands, site) -> list:
        """A device of an input's mesh holds no blob for it: the tensor is not this runtime's
        (it was made before a ``dtorch.shutdown()``). Poison the outputs rather than run the
        kernel on ``None``. (A move's devices outside the source mesh hold no input, and need
        none.)"""
        out = list(inputs)
        for k, (x, spec) in enumerate(zip(inputs, call.in_specs)):
            if x is None and spec is not None and dev.index in spec.mesh.devices:
                message = (f"operand {operands[k]} is not on this runtime (was it made before "
                           "dtorch.shutdown()?)")
                out[k] = b = Blob(spec)
                b.error = (site, call.name, message)
                self.send(P.KernelError(P.KERNEL_ERROR, *b.error, operands[k]))
        return out

    def on_release(self, tensor_id: int) -> None:
        for dev in self.owners.pop(tensor_id, ()):
            dev.blobs.pop(tensor_id, None)
        if self.graphs:
            self.graphs.pop(tensor_id, None)  # a tape node dropped: its kept graphs go too

    def on_fetch(self, rec) -> None:
        _, tensor_id, request, sid = rec
        for dev in self.owners.get(tensor_id, ()):
            blob = dev.blobs.get(tensor_id)
            if blob is None:  # not this runtime's tensor: check_inputs has said so already
                continue
            coord = coordinate_of(blob.spec.mesh, dev.index)
            # one block per distinct piece: coordinate 0 on every Replicate mesh dim
            if any(c and p.is_replicate() for c, p in zip(coord, blob.spec.placements)):
                continue
            dev.stream(sid).put(lambda b=blob, c=coord: self._send_value(b, c, request))

    def _send_value(self, blob: Blob, coord, request: int) -> None:
        if blob.error is not None:
            site, op, message = blob.error
            self.send(P.FetchFailed(P.FETCH_FAILED, request, site, op, message))
            return
        try:
            t = blob.tensor.detach().to("cpu", copy=True, memory_format=torch.contiguous_format)
        except Exception as e:  # noqa: BLE001 - e.g. a kernel that returned no tensor
            self.send(P.FetchFailed(P.FETCH_FAILED, request, -1, "to_torch", repr(e)))
            return
        data = P.buffer_of(t) if t.numel() else b""
        self.send(P.Value(P.VALUE, request, list(coord), list(t.shape), str(t.dtype)[6:]), data)

    def all_streams(self) -> list:
        return [s for dev in self.devices.values() for s in dev.streams.values()]

    def when_streams_reach(self, streams, each, last) -> None:
        """Queues ``each(stream)`` on every stream of ``streams`` and calls ``last()`` once all
        of them have run it (at once when there are none): "every stream got here"."""
        remaining, lock = [len(streams)], threading.Lock()

        def reached(s):
            each(s)
            with lock:
                remaining[0] -= 1
                done = remaining[0] == 0
            if done:
                last()

        if not streams:
            last()
        for s in streams:
            s.put(lambda s=s: reached(s))

    def on_sync(self, rec) -> None:
        sync = P.Sync(*rec)

        def synced():
            self.send(P.Synced(P.SYNCED, sync.token, self.index))

        self.when_streams_reach(self.all_streams(), lambda s: None,
                                (lambda: self.fuser.when_idle(synced)) if sync.compiles
                                else synced)

    def on_trace(self, rec) -> None:
        """Tracing on or off, at this point of every stream's queue. Off: once every stream has
        reached that point, this host's events go to the controller (before the Synced of the
        Sync that follows, since each stream runs its items in order)."""
        t = P.Trace(*rec)
        streams = self.all_streams()
        if t.on:
            recorder = self.tracer = self.tracer or Recorder()
            for s in streams:
                s.put(lambda s=s: setattr(s, "tracer", recorder))
            return
        recorder, self.tracer = self.tracer or Recorder(), None

        def off(s):
            s.tracer = None

        self.when_streams_reach(streams, off, lambda: self.send(P.TraceEvents(
            P.TRACE_EVENTS, t.request, self.index, os.getpid(), torch.get_num_threads(),
            recorder.events)))

    def on_welcome(self, rec) -> None:
        welcome = P.Welcome(*rec)
        self._store_path, self._store_relay = welcome.store_path, welcome.store_relay

    HANDLERS = {
        P.DEFINE_MESH: on_define_mesh,
        P.DEFINE_SPEC: on_define_spec,
        P.DEFINE_CALL: on_define_call,
        P.KERNEL: on_kernel,
        P.CHAIN: on_chain,
        P.WAIT: on_wait,
        P.FETCH: on_fetch,
        P.SYNC: on_sync,
        P.WELCOME: on_welcome,
        P.TRACE: on_trace,
        P.DEFINE_PROGRAM: on_define_program,
        P.REPLAY: on_replay,
    }

    # -- main loop ------------------------------------------------------------------------------
    def run(self) -> None:
        self.sock.send(P.pack(P.HostReady(P.HOST_READY, self.index, os.getpid())))
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._bell_r, zmq.POLLIN)
        handlers = self.HANDLERS
        while True:
            for sock, _ in poller.poll():
                if sock == self._bell_r:
                    self.forward_outbox()
                    continue
                frame = self.sock.recv(copy=False)
                try:
                    records = P.unpack(frame.buffer)
                except Exception as e:  # noqa: BLE001 - drop it; the controller is authenticated
                    log.error("[dtorch host %d] dropped a batch that does not decode: %s",
                              self.index, e)
                    continue
                for rec in records:
                    if type(rec) is int:
                        self.on_release(rec)
                    else:
                        handlers[rec[0]](self, rec)
                for dev in self.devices.values():
                    for stream in dev.streams.values():
                        stream.submit()


def main(argv, keys: auth.Keys, on_parent_exit) -> None:
    parser = argparse.ArgumentParser(prog="dtorch.runtime.host")
    parser.add_argument("--parent-fd", type=int, required=True)
    parser.add_argument("--life-fd", type=int, required=True)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--device-type", required=True)
    parser.add_argument("--controller", required=True)
    config.RuntimeFacts.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.device_type == "cpu":
        if not os.environ.get("OMP_NUM_THREADS"):  # torch has read the user's choice: it stands
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.cpu_hosts))
        cpu_memory.keep_freed_blocks()
    Host(args.index, args.device_type, args.controller, keys,
         config.RuntimeFacts.from_args(args)).run()
