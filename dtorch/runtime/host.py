"""A host process: runs the program on its local devices (the Sub-Controller role).

Every host receives the same batches. The main thread lowers each record for the local devices
it touches (SPMD lowering: each device's block follows from the global spec and its mesh
coordinate) and queues kernels on the devices' streams; stream threads run them. Messages from
stream threads (values, errors, sync acknowledgements) go through one FIFO that the main thread
forwards to the controller, so they leave in the order they were made: a kernel error reported
before a sync acknowledgement reaches the client first, and the sync raises it.

Records are handled by a table from tag to handler (``Host.HANDLERS``). A kernel record becomes
an ``execute.KernelRun`` per local device, a replay one ``program.ProgramRun``; both run their
kernels through one step runner (``runtime/execute.py``). A kernel whose input failed does not
run: its outputs carry the first Failure on (poisoned), and reading them raises it; a
collective's members agree on failures instead (``runtime/failures.py``).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import os
import threading
import traceback

import torch
import zmq
from torch._C._distributed_c10d import FileStore

from .. import config, logs, protocol as P
from .. import kernels  # noqa: F401  (importing it registers every kernel a host runs)
from ..launcher import auth
from ..spec import MeshInfo, coordinate_of
from . import cpu_memory
from .calls import HostCall
from .devices import Device
from .execute import PREV, KernelRun
from .failures import Failure, tell
from .fusion import Fuser
from .program import HostProgram, ProgramRun, slots_of
from .stream import Blob, Event, TraceRecorder
from .vjp import Saved

log = logs.host


class Host:
    def __init__(self, index: int, device_type: str, controller_addr: str, keys: auth.Keys,
                 facts: config.RuntimeFacts):
        self.facts = facts
        self.log_kernels = config.debug >= 2  # read once: checked after every kernel
        self.waits = None  # streams the next kernel waits for (a WAIT record)
        self.tracer = None  # the TraceRecorder while tracing (a TRACE record), see on_trace
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
        self.recorded: dict = {}  # a recorded kernel's first result id -> (key, needs, gathered)
        self.programs: dict = {}  # replayed window shapes (runtime/program.py)
        self.host_steps: dict = {}  # steps the controller lowered once (P.DefineHostStep)
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
            from ..launcher import store as cluster_store

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

    def on_recorded(self, rec) -> None:
        r = P.Recorded(*rec)
        self.recorded[r.kernel] = (r.key, P.bits_of(r.needs), P.bits_of(r.gathered))

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
        if self.recorded:  # each device has made its slot: the announcements are used
            for c, m in members:
                if c.saves:
                    del self.recorded[m[P.OP_OUTS]]

    def on_define_program(self, rec) -> None:
        self.programs[P.DefineProgram(*rec).id] = HostProgram(self, rec)

    def on_define_host_step(self, rec) -> None:
        self.host_steps[rec[1]] = P.DefineHostStep(*rec).entries

    def on_host_step(self, rec) -> None:
        """A step the controller lowered from its Step record: its records, as if sent."""
        self.take(P.host_step_records(self.host_steps[rec[1]], rec[2:]))

    def take(self, records: list) -> None:
        """A batch's records, each to its handler (a bare id: a release)."""
        handlers = self.HANDLERS
        for rec in records:
            if type(rec) is int:
                self.on_release(rec)
            else:
                handlers[rec[0]](self, rec)

    def on_drop_step(self, rec) -> None:
        self.host_steps.pop(rec[1], None)

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
                        if type(r) is int:
                            self.on_release(r)
                        elif r[0] == P.RECORDED:
                            self.on_recorded(r)
                        else:
                            self.on_kernel(r)
                    return
            runs.append((dev, lowering, outside, probe, hot))
        for dev, lowering, outside, probe, hot in runs:
            survivors = {}
            for k in program.survivors:
                spec, out_devices = program.survivor_specs[k]
                if dev in out_devices:
                    dev.blobs[made[k]] = survivors[k] = Blob(spec, memory=dev.memory)
                    self.owners[made[k]] = out_devices
            slots = slots_of(lowering, self.graphs, dev.index, scalars) if lowering.slots \
                else ()
            dev.stream(program.stream).put(
                ProgramRun(lowering, outside, survivors, (outside_ids, made), scalars, self, probe,
                           hot, slots))
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
            inputs = self.saved_slots(call, dev, inputs, rec)
        if None in inputs:
            inputs = self.check_inputs(call, dev, inputs, operands, rec[P.OP_SITE])
        return inputs

    def saved_slots(self, call: HostCall, dev: Device, inputs, rec) -> list:
        """A recorded call gets a new Saved slot, and the bits of the operands to differentiate
        and not to keep (``vjp.recording``), after its operands, from its Recorded record; a
        VJP's key operand becomes the slot its forward filled. Slots are made and found here,
        in program order, so a release of the key (``on_release``) can never come before the
        kernel that fills it."""
        if call.saves:
            (key, needs, gathered), slot = self.recorded[rec[P.OP_OUTS]], Saved()
            self.graphs.setdefault(key, {})[dev.index] = slot
            return [*inputs, slot, needs, gathered]
        inputs = list(inputs)
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
                b.error = Failure(site, call.name, message)
                tell(self, b.error, operands[k])
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
            self.send(P.FetchFailed(P.FETCH_FAILED, request, *blob.error))
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
            recorder = self.tracer = self.tracer or TraceRecorder()
            for s in streams:
                s.put(lambda s=s: setattr(s, "tracer", recorder))
            return
        recorder, self.tracer = self.tracer or TraceRecorder(), None

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
        P.RECORDED: on_recorded,
        P.FETCH: on_fetch,
        P.SYNC: on_sync,
        P.WELCOME: on_welcome,
        P.TRACE: on_trace,
        P.DEFINE_PROGRAM: on_define_program,
        P.REPLAY: on_replay,
        P.DEFINE_HOST_STEP: on_define_host_step,
        P.HOST_STEP: on_host_step,
        P.DROP_STEP: on_drop_step,
    }

    # -- main loop ------------------------------------------------------------------------------
    def run(self) -> None:
        self.sock.send(P.pack(P.HostReady(P.HOST_READY, self.index, os.getpid())))
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._bell_r, zmq.POLLIN)
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
                self.take(records)
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
