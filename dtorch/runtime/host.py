"""A host process: runs the program on its local devices (the Sub-Controller role).

Every host receives the same batches. The main thread lowers each record for the local devices
it touches (SPMD lowering: each device's block follows from the global spec and its mesh
coordinate) and queues kernels on the devices' streams; stream threads run them. Messages from
stream threads (values, errors, sync acknowledgements) reach the controller through an inproc
socket that the main thread forwards.

Records are handled by a table from tag to handler (``Host.HANDLERS``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import threading

import torch
import zmq
from torch._C._distributed_c10d import TCPStore

from .. import config, protocol as P
from ..cluster import local
from ..ops import registry  # importing ops registers every operator's kernel
from ..ops.creation import CLIENT_ONLY
from ..placement import decode_placement
from ..spec import MeshInfo, coordinate_of, intern_spec
from .collectives import STEP_KERNELS
from .context import Groups, KernelContext
from .stream import Blob, Event, Stream

OUTBOX = "inproc://outbox"
STORE_TIMEOUT = datetime.timedelta(minutes=5)


class Device:
    def __init__(self, host: Host, index: int, device_type: str):
        self.host, self.index = host, index
        self.torch_device = torch.device("cpu") if device_type == "cpu" else torch.device(
            "cuda", index)
        self.streams: dict = {}
        self.blobs: dict = {}
        self._groups = Groups(index, self.torch_device, host.store)

    def stream(self, sid: int) -> Stream:
        s = self.streams.get(sid)
        if s is None:
            s = self.streams[sid] = Stream(f"dev{self.index}-stream{sid}", self.torch_device,
                                           on_start=self.host.connect_outbox)
        return s

    def group(self, members: tuple):
        return self._groups.get(members)


class HostCall:
    """A call shape as this host runs it: the kernel, its static kwargs, and the local devices
    taking part (those of the result's mesh, plus the source mesh's for a move)."""

    __slots__ = ("name", "fn", "uses_context", "in_specs", "out_specs", "kwargs", "inplace",
                 "mask", "devices", "out_devices", "contexts")

    def __init__(self, host: Host, rec):
        _, _, name, inputs, outputs, static, flags = rec
        step = STEP_KERNELS.get(name)
        if step is not None:
            self.fn, self.uses_context, kwargs = step, True, {"mesh_dim": P.unpack(static)[0]}
        else:
            op = registry.lookup(name)
            self.fn, self.uses_context = op.kernel, op.uses_context
            kwargs = dict(zip([n for n in op.static_names if n not in CLIENT_ONLY],
                              P.unpack_static(static)))
        self.name, self.kwargs = name, kwargs
        self.in_specs = [host.specs[i] if i else None for i in inputs]
        self.out_specs = [host.specs[i] for i in outputs]
        self.mask = [bool(i) for i in inputs]
        self.inplace = bool(flags & P.INPLACE)
        meshes = [s.mesh for s in self.out_specs] + [s.mesh for s in self.in_specs if s]
        self.out_devices = host.local_devices(self.out_specs[0].mesh) if self.out_specs else []
        self.devices = list({d.index: d for m in meshes for d in host.local_devices(m)}.values())
        self.contexts: dict = {}

    def context(self, device: Device):
        ctx = self.contexts.get(device.index)
        if ctx is None:
            ctx = self.contexts[device.index] = KernelContext(device, self.in_specs,
                                                              self.out_specs)
        return ctx


class KernelRun:
    """One kernel on one device, queued on a stream."""

    __slots__ = ("call", "ctx", "inputs", "outputs", "waits", "site", "host")

    def __init__(self, call, ctx, inputs, outputs, waits, site, host):
        self.call, self.ctx, self.inputs, self.outputs = call, ctx, inputs, outputs
        self.waits, self.site, self.host = waits, site, host

    def __call__(self) -> None:
        for e in self.waits:
            e.wait()
        args = []
        for x in self.inputs:
            if type(x) is Blob:
                if x.error is not None:  # poisoned: pass the first failure on, quietly
                    return self._fail(x.error, report=False)
                args.append(x.tensor)
            else:
                args.append(x)
        call = self.call
        try:
            if call.uses_context:
                result = call.fn(self.ctx, *args, **call.kwargs)
            else:
                result = call.fn(*args, **call.kwargs)
        except Exception as e:  # noqa: BLE001 - a kernel error becomes the client's error
            return self._fail((self.site, call.name, f"{type(e).__name__}: {e}"), report=True)
        outputs = self.outputs
        if len(outputs) == 1:
            outputs[0].tensor = result
        else:
            for blob, value in zip(outputs, result):
                blob.tensor = value

    def _fail(self, error, report: bool) -> None:
        for blob in self.outputs:
            blob.error = error
        if report:
            self.host.send(P.KernelError(P.KERNEL_ERROR, *error))


class Host:
    def __init__(self, index: int, device_type: str, controller_addr: str):
        self.index, self.device_type = index, device_type
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, str(index).encode())
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.connect(controller_addr)
        self.outbox = self.ctx.socket(zmq.PULL)
        self.outbox.bind(OUTBOX)
        self._thread_socks = threading.local()
        self.meshes: dict = {}
        self.specs: dict = {}
        self.calls: dict = {}
        self.devices: dict = {}  # local device index -> Device
        self.owners: dict = {}  # tensor id -> local devices holding a blob of it
        self._local: dict = {}  # mesh id -> local Devices
        self._store_master = None
        self._store_port = None
        self.cuda = device_type == "cuda"

    # -- sockets --------------------------------------------------------------------------------
    def connect_outbox(self) -> None:
        sock = self.ctx.socket(zmq.PUSH)
        sock.connect(OUTBOX)
        self._thread_socks.sock = sock

    def send(self, msg, data=None) -> None:
        """From a stream thread: queue a message for the controller."""
        frames = [P.pack(msg)] if data is None else [P.pack(msg), data]
        self._thread_socks.sock.send_multipart(frames, copy=False)

    def store(self):
        """A new client of the rendezvous store. Each device needs its own: a client blocks
        while it waits for a key, so devices sharing one would deadlock in a rendezvous."""
        return TCPStore("127.0.0.1", self._store_port, None, False, STORE_TIMEOUT)

    # -- devices --------------------------------------------------------------------------------
    def local_devices(self, mesh) -> list:
        devices = self._local.get(mesh.wire_id)
        if devices is None:
            devices = []
            if mesh.device_type == self.device_type:
                for d in mesh.devices:
                    if local.host_index(self.device_type, d) == self.index:
                        if d not in self.devices:
                            self.devices[d] = Device(self, d, self.device_type)
                        devices.append(self.devices[d])
            self._local[mesh.wire_id] = devices
        return devices

    # -- records --------------------------------------------------------------------------------
    def on_define_mesh(self, rec) -> None:
        _, i, device_type, shape, devices = rec
        self.meshes[i] = MeshInfo(device_type, shape, devices, i)

    def on_define_spec(self, rec) -> None:
        _, i, shape, dtype, mesh, placements = rec
        self.specs[i] = intern_spec(shape, dtype, self.meshes[mesh],
                                    map(decode_placement, placements))

    def on_define_call(self, rec) -> None:
        self.calls[rec[1]] = HostCall(self, rec)

    def on_kernel(self, rec) -> None:
        _, call_id, site, sid, waits, outs, operands = rec
        call = self.calls[call_id]
        mask = call.mask
        for dev in call.devices:
            blobs = dev.blobs
            inputs = [blobs.get(o) if m else o for o, m in zip(operands, mask)]
            if call.inplace:
                outputs = [inputs[0]]
            elif dev in call.out_devices:
                outputs = []
                for o, spec in zip(outs, call.out_specs):
                    blobs[o] = b = Blob(spec)
                    outputs.append(b)
                    self.owners[o] = call.out_devices
            else:
                outputs = []
            events = []
            for t in waits:
                e = Event(self.cuda)
                dev.stream(t).put(e.record)
                events.append(e)
            ctx = call.context(dev) if call.uses_context else None
            dev.stream(sid).put(KernelRun(call, ctx, inputs, outputs, events, site, self))

    def on_release(self, tensor_id: int) -> None:
        for dev in self.owners.pop(tensor_id, ()):
            dev.blobs.pop(tensor_id, None)

    def on_fetch(self, rec) -> None:
        _, tensor_id, request, sid, waits = rec
        for dev in self.owners.get(tensor_id, ()):
            blob = dev.blobs[tensor_id]
            coord = coordinate_of(blob.spec.mesh, dev.index)
            # one block per distinct piece: coordinate 0 on every Replicate mesh dim
            if any(c and p.is_replicate() for c, p in zip(coord, blob.spec.placements)):
                continue
            events = []
            for t in waits:
                e = Event(self.cuda)
                dev.stream(t).put(e.record)
                events.append(e)
            dev.stream(sid).put(lambda b=blob, c=coord, ev=events: self._send_value(b, c,
                                                                                  request, ev))

    def _send_value(self, blob: Blob, coord, request: int, events) -> None:
        for e in events:
            e.wait()
        if blob.error is not None:
            site, op, message = blob.error
            self.send(P.FetchFailed(P.FETCH_FAILED, request, site, op, message))
            return
        t = blob.tensor.detach().to("cpu", copy=True).contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
        self.send(P.Value(P.VALUE, request, list(coord), list(t.shape), str(t.dtype)[6:]), data)

    def on_sync(self, rec) -> None:
        token = rec[1]
        streams = [s for dev in self.devices.values() for s in dev.streams.values()]
        if not streams:
            self.sock.send(P.pack(P.Synced(P.SYNCED, token, self.index)))
            return
        remaining = [len(streams)]
        lock = threading.Lock()

        def done():
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                self.send(P.Synced(P.SYNCED, token, self.index))

        for s in streams:
            s.put(done)

    def on_welcome(self, rec) -> None:
        _, port, master = rec
        self._store_port = port
        if master:  # serve the store the process groups rendezvous through
            self._store_master = TCPStore("127.0.0.1", port, None, True, STORE_TIMEOUT,
                                          wait_for_workers=False)

    HANDLERS = {
        P.DEFINE_MESH: on_define_mesh,
        P.DEFINE_SPEC: on_define_spec,
        P.DEFINE_CALL: on_define_call,
        P.KERNEL: on_kernel,
        P.FETCH: on_fetch,
        P.SYNC: on_sync,
        P.WELCOME: on_welcome,
    }

    # -- main loop ------------------------------------------------------------------------------
    def run(self) -> None:
        self.sock.send(P.pack(P.HostReady(P.HOST_READY, self.index, os.getpid())))
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.outbox, zmq.POLLIN)
        handlers = self.HANDLERS
        while True:
            for sock, _ in poller.poll():
                if sock is self.outbox:
                    self.sock.send_multipart(self.outbox.recv_multipart(copy=False), copy=False)
                    continue
                for rec in P.unpack(self.sock.recv(copy=False).buffer):
                    if type(rec) is int:
                        self.on_release(rec)
                    else:
                        handlers[rec[0]](self, rec)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="dtorch.runtime.host")
    parser.add_argument("--parent-fd", type=int, required=True)
    parser.add_argument("--life-fd", type=int, required=True)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--device-type", required=True)
    parser.add_argument("--controller", required=True)
    parser.add_argument("--cpu-hosts", type=int, required=True)
    args = parser.parse_args(argv)
    local.exit_with_parent(args.parent_fd)
    config.cpu_hosts = args.cpu_hosts
    if args.device_type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.cpu_hosts))
    Host(args.index, args.device_type, args.controller).run()
