"""The controller process: receives the client's batches, rewrites them, dispatches to hosts.

One loop polls three things: the client's batches, the hosts' messages (forwarded to the client,
except sync acknowledgements, which it gathers), and the hosts' life pipes, which carry their
heartbeats (see ``launcher/local.py``). A host that exits, or stays silent for
``config.heartbeat_timeout_s`` (then it is killed), ends the runtime with a Fatal error to the
client instead of a hang; a collective's failure that a death may be behind waits for it
(``controller/reports.py``), so that the client's first error names the death. Hosts start when
a mesh first names one of their devices, and each receives every batch: it runs the records that
touch its devices, so the controller's cost does not grow with the device count.

Every socket is authenticated (``launcher/auth.py``). The process groups' rendezvous store is a
file in a directory only this user can enter, not a network port: on one machine no other user
can read or write it.

The main node of a cluster (``--node-address``) starts no host of its own: node agents join it
(``launcher/machines.py``), each relaying every batch to its machine's hosts, and the controller
treats each ready machine as one more peer: it gets one copy of each batch, its sync
acknowledgement counts once, its hosts' messages reach the client as local hosts' do, and its
failure or silence fails the runtime naming the machine. The rendezvous store is then a table
here that the hosts reach through their agents (``launcher/store.py``).
"""

from __future__ import annotations

import argparse
import math
import os
import select
import shutil
import tempfile
import time
import traceback
from typing import ClassVar

import zmq

from .. import config, logs, protocol as P
from ..launcher import auth, local
from ..launcher.machines import JoinedAgent, Machines
from .dot import to_dot
from .logical_graph import LogicalGraph, Operator
from .passes import Chain, run_passes
from .replay import Replayer
from .reports import DEATH_GRACE_S, Reports, collective_names
from .step_templates import StepTemplate


# how long the tail of a batch that ended inside a loop waits for the next batch, whose first
# window it begins (``Replayer.run``), before it is lowered alone
HOLD_MS = 10
# while a failure report is held on a cluster's main node, how often it looks for a machine
# whose connection has closed (libzmq forgets a closed peer a few ms after it sees the close)
PROBE_MS = 10
log = logs.controller


class Batch:
    """A client batch as the intake takes it in: the records for the passes (``nodes``), the
    definitions every host gets first, and the request a Trace off answers (``stop``)."""

    __slots__ = ("definitions", "nodes", "step", "stop")

    def __init__(self):
        self.nodes, self.definitions, self.stop, self.step = [], [], None, None


class LostBatch(Exception):
    """A record the controller cannot take in: the runtime fails, and the batch is lost."""


class HostHandle:
    def __init__(self, index: int, child):
        self.index, self.child = index, child
        self.identity = str(index).encode()
        self.ready = False
        self.backlog: list = []


class Controller:
    def __init__(self, ops_addr: str, results_addr: str, keys: auth.Keys,
                 facts: config.RuntimeFacts, node_address: str | None = None,
                 cluster_keys: auth.Keys | None = None):
        self.keys, self.facts = keys, facts
        self.ctx = zmq.Context()
        self.gatekeeper = auth.Gatekeeper(self.ctx, keys)
        self.ops = self.ctx.socket(zmq.PULL)
        auth.join(self.ops, keys)
        self.ops.connect(ops_addr)
        self.results = self.ctx.socket(zmq.PUSH)
        self.results.setsockopt(zmq.LINGER, 2000)
        auth.join(self.results, keys)
        self.results.connect(results_addr)
        # what the client is told, held while a failure may be a death's (controller/reports.py)
        self.reports = Reports(lambda frames: self.results.send_multipart(frames, copy=False))
        self.collectives, self._calls_seen = frozenset(), 0  # the ops whose failure is held
        self.heard_after = 0.0  # a heartbeat read after this was written after the hold began
        self.host_sock = self.ctx.socket(zmq.ROUTER)
        self.host_sock.setsockopt(zmq.LINGER, 0)
        # A ROUTER silently drops what it cannot queue: never let it (no send limit), and make a
        # send to an unknown host an error rather than a silent loss.
        self.host_sock.setsockopt(zmq.SNDHWM, 0)
        self.host_sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        auth.serve(self.host_sock, keys)
        self.host_sock.bind(f"tcp://{config.bind_host}:*")
        self.host_addr = self.host_sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.poller = zmq.Poller()
        self.poller.register(self.ops, zmq.POLLIN)
        self.poller.register(self.host_sock, zmq.POLLIN)
        self.graph = LogicalGraph()
        self.replayer = Replayer(self.graph, self.lowered, self.encode)
        self.step_templates: dict = {}  # DefineStep id -> StepTemplate
        self.hosts: dict = {}  # host index -> HostHandle
        self.by_identity: dict = {}
        self.life_fds: dict = {}  # life pipe fd -> HostHandle
        self.syncs: dict = {}  # token -> hosts (or machines) yet to acknowledge
        # the process groups' rendezvous store (a torch FileStore), private to this user
        self.store_dir = tempfile.mkdtemp(prefix="dtorch-store-")
        self.death = None  # a host or machine died: the client's error, once its reports are in
        self.lost: list = []  # the devices of the dead host or machine (in the client's error)
        self.host_devices: dict = {}  # host index -> the devices it serves
        self.tracing = False  # a Trace on is in force: a host that starts now must trace too
        self.trace_events = None  # from a Trace on to its stop: each batch's passes
        self.graph_dir = config.graph_dir  # where each batch's graph goes (DOT), or None
        self.graphs_written = 0
        self.running = True
        self.machines = None  # a cluster's main node: the node agents (launcher/machines.py)
        if node_address is not None:
            self.machines = Machines(self.ctx, self.gatekeeper, node_address, cluster_keys, keys)
            self.poller.register(self.machines.sock, zmq.POLLIN)
            self.poller.register(self.machines.watch.monitor, zmq.POLLIN)

    # -- main loop ------------------------------------------------------------------------------
    def run(self) -> None:
        while self.running:
            held = self.replayer.held
            for sock, _ in self.poller.poll(self.poll_ms(held)):
                if sock is self.ops:
                    self.on_client_frame(self.ops.recv(copy=False))
                elif sock is self.host_sock:
                    self.on_host(self.host_sock.recv_multipart(copy=False))
                elif self.machines is not None and sock is self.machines.sock:
                    self.on_machine(self.machines.sock.recv_multipart(copy=False))
                elif self.machines is not None and sock is self.machines.watch.monitor:
                    self.machines.watch.on_event()
                else:
                    host = self.life_fds.get(sock)  # (None: found dead since the poll)
                    if host is not None and not host.child.read_life():
                        self.on_host_exit(host)
            if held and self.replayer.held is held:  # no batch came to take them along
                self.on_batch([], hold=False)
            self.check_hosts()
        self.stop()

    def poll_ms(self, held) -> int:
        """How long the loop may sleep: a heartbeat interval, less while records wait for the
        next batch or while a report is held (on a cluster, which probes the machines)."""
        ms = HOLD_MS if held else int(config.heartbeat_interval_s * 1000)
        left = self.reports.left_s(time.monotonic())
        if left is not None:
            ms = min(ms, math.ceil(left * 1000), PROBE_MS if self.machines is not None else ms)
        return ms

    def on_client_frame(self, frame) -> None:
        try:
            records = P.unpack(frame.buffer)
        except Exception as e:  # noqa: BLE001 - an authenticated peer's bug, not an outsider's
            log.error("dtorch controller: dropped a client batch that does not decode: %s", e)
            self.fatal(f"the controller received a batch it cannot decode ({e}); it is lost")
            return
        self.on_batch(records)

    def on_batch(self, records: list, hold: bool = True) -> None:
        t0, started = time.perf_counter(), time.time_ns()  # the hosts' trace clock: time_ns
        batch = Batch()
        nodes, intake = batch.nodes, self.INTAKE
        try:
            for rec in records:
                if type(rec) is int or rec[0] == P.OP:
                    nodes.append(rec)  # an operator stays its record until the passes need it
                else:
                    intake.get(rec[0], Controller.take_node)(self, rec, batch)
        except LostBatch as e:
            self.fatal(str(e))
            return
        records_out, steps_before = batch.definitions, self.replayer.replayed_steps
        if batch.step is None:
            self.replayer.run(nodes, records_out, hold)
        else:  # (a Step comes alone in its batch; records before it go first all the same)
            self.replayer.run(nodes, records_out)
            replayed = self.replayer.replayed
            self.replayer.run_step(self.step_templates[batch.step[1]], batch.step, records_out)
            self.replayer.replayed += replayed
        replayed = self.replayer.replayed
        made = self.replayer.replayed_steps - steps_before
        if self.trace_events is not None:  # tracing: the batch's passes, for dtorch.profiler
            self.trace_events.append(
                (f"passes: {len(records)} records -> {len(records_out)}"
                 + (f", {replayed} windows replayed" if replayed else "")
                 + (", a step lowered from its record" if made else ""),
                 P.CONTROLLER, P.CONTROLLER, started, time.time_ns(), 0))
            if batch.stop is not None:  # the batch that stopped the trace: answer with the hosts
                self.reports.send(P.TRACE_EVENTS, [P.pack(P.TraceEvents(
                    P.TRACE_EVENTS, batch.stop, P.CONTROLLER, os.getpid(), 0,
                    self.trace_events))])
                self.trace_events = None
        self.send_to_hosts(records_out)
        for token, waiting in list(self.syncs.items()):
            if not waiting:
                self.ack_sync(token)
        log.debug("batch: %d records -> %d, %d windows replayed, %.2f ms", len(records),
                  len(records_out), replayed, (time.perf_counter() - t0) * 1e3)

    # -- the intake: what each record of a client batch does here (``INTAKE``) -----------------
    # Definitions go first, as the client made them: a spec a redistribute's plan passes
    # through may carry the id of one the client defines later in the batch.
    def take_definition(self, rec, batch: Batch) -> None:
        self.graph.define(rec)
        batch.definitions.append(rec)

    def take_mesh(self, rec, batch: Batch) -> None:
        mesh = P.DefineMesh(*rec)
        self.graph.define(rec)
        if self.machines is None:
            self.ensure_hosts(mesh.device_type, mesh.devices)
        elif (error := self.machines.check_mesh(mesh.device_type, mesh.devices)):
            raise LostBatch(error)
        batch.definitions.append(rec)

    def take_call(self, rec, batch: Batch) -> None:
        self.graph.define(rec)
        if P.DefineCall(*rec).kind != P.CallKind.REDISTRIBUTE:  # lowered here, never sent
            batch.definitions.append(rec)

    def take_sync(self, rec, batch: Batch) -> None:
        self.syncs[P.Sync(*rec).token] = set(self.peers())
        batch.nodes.append(rec)

    def take_cluster_query(self, rec, batch: Batch) -> None:
        if self.machines is not None:  # MainNode asks only a cluster's main node
            self.machines.query(rec)

    def take_shutdown(self, rec, batch: Batch) -> None:
        self.running = False

    def take_graph_dir(self, rec, batch: Batch) -> None:
        self.graph_dir = rec[1]

    def take_trace(self, rec, batch: Batch) -> None:
        trace = P.Trace(*rec)
        self.tracing = bool(trace.on)
        self.trace_events = [] if trace.on else self.trace_events
        batch.stop = None if trace.on else trace.request
        batch.nodes.append(rec)

    def take_step_definition(self, rec, batch: Batch) -> None:
        self.step_templates[rec[1]] = StepTemplate(rec)

    def take_drop_step(self, rec, batch: Batch) -> None:
        """A replayed step is gone: its template goes, and its lowering's definition (here
        and, in the batch's order, on the hosts), if it had one."""
        template = self.step_templates.pop(rec[1], None)
        lowering = template.lowering if template is not None else None
        if lowering is not None and lowering.learnt is not None:
            self.graph.definitions[:] = [d for d in self.graph.definitions if not (
                d[0] == P.DEFINE_HOST_STEP and d[1] == lowering.definition)]
            batch.nodes.append([P.DROP_STEP, lowering.definition])

    def take_step(self, rec, batch: Batch) -> None:
        if batch.step is not None or rec[1] not in self.step_templates:
            raise LostBatch(f"a replayed step's record the controller cannot take: {rec[:2]}")
        batch.step = rec

    def take_node(self, rec, batch: Batch) -> None:
        """A record the passes carry to the hosts as it is (a fetch)."""
        batch.nodes.append(rec)

    INTAKE: ClassVar[dict] = {  # tag -> handler; any other record is a node (``take_node``)
        P.DEFINE_MESH: take_mesh, P.DEFINE_SPEC: take_definition, P.DEFINE_CALL: take_call,
        P.SYNC: take_sync, P.CLUSTER_QUERY: take_cluster_query, P.SHUTDOWN: take_shutdown,
        P.GRAPH: take_graph_dir, P.TRACE: take_trace,
        P.DEFINE_STEP: take_step_definition, P.STEP: take_step, P.DROP_STEP: take_drop_step,
    }

    def lowered(self, nodes: list) -> list:
        """The passes over a segment of the batch (``Replayer``), each a span of the trace
        when one is on; the segment's graph written if asked."""
        nodes = run_passes(self.graph, nodes, self.trace_events)
        if self.graph_dir is not None and nodes:
            self.write_graph(nodes)
        return nodes

    def write_graph(self, nodes: list) -> None:
        """The batch after the passes, as DOT in ``graph_dir`` (``batch-000001.dot`` ...)."""
        self.graphs_written += 1
        name = f"batch-{self.graphs_written:06d}"
        try:
            os.makedirs(self.graph_dir, exist_ok=True)
            with open(os.path.join(self.graph_dir, name + ".dot"), "w") as f:
                f.write(to_dot(nodes, name))
        except OSError as e:  # a debugging aid: the program goes on without it
            log.warning("dtorch controller: cannot write the graph of %s: %s", name, e)

    @staticmethod
    def encode(nodes: list) -> list:
        """Host records: an Operator's record becomes a KERNEL record in place."""
        out = []
        for node in nodes:
            if isinstance(node, Operator):
                if node.waits:
                    out.append([P.WAIT, *node.waits])
                node.rec[0] = P.KERNEL
                node = node.rec
            elif isinstance(node, Chain):
                first = node.members[0]
                if first.waits:
                    out.append([P.WAIT, *first.waits])
                for m in node.members:
                    m.rec[0] = P.KERNEL
                node = [P.CHAIN, *(m.rec for m in node.members)]
            out.append(node)
        return out

    def peers(self) -> list:
        """Who receives every batch and acknowledges every sync: the hosts, or on a cluster's
        main node the ready machines."""
        if self.machines is None:
            return list(self.hosts.values())
        return self.machines.ready_machines()

    def send_to_hosts(self, records: list) -> None:
        if not records:
            return
        frame = P.pack(records)
        for peer in self.peers():
            if peer.ready:
                self.send(peer, frame)
            else:
                peer.backlog.append(frame)

    def send(self, host, frame) -> None:
        """A frame to one host or machine. A send to a host whose connection has closed fails:
        that host has died or is dying, and its death (its pipe closes soon after) is what to
        report."""
        if isinstance(host, JoinedAgent):
            if not self.machines.send(host, P.NODE_BATCH, frame):
                self.on_peer_death(host, host.describe_closed())
            return
        try:
            self.host_sock.send_multipart([host.identity, frame], copy=False)
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            self.report_dead_hosts(timeout=DEATH_GRACE_S)
            self.on_host_death(host, f"{host.child.name} pid {host.child.pid} closed its "
                                     f"connection")

    # -- hosts ----------------------------------------------------------------------------------
    def ensure_hosts(self, device_type: str, devices) -> None:
        for d in devices:
            index = self.facts.host_index(device_type, d)
            self.host_devices.setdefault(index, set()).add(d)
            if index not in self.hosts:
                child = local.start_host(index, device_type, self.host_addr, self.keys, self.facts)
                host = self.hosts[index] = HostHandle(index, child)
                host.backlog.append(P.pack(self.graph.definitions))
                if self.tracing:
                    host.backlog.append(P.pack([P.Trace(P.TRACE, True, 0)]))
                self.by_identity[host.identity] = host
                self.life_fds[child.life_fd] = host
                self.poller.register(child.life_fd, zmq.POLLIN)

    def on_host(self, frames) -> None:
        host = self.by_identity.get(bytes(frames[0].buffer))
        try:
            msg = P.unpack(frames[1].buffer)
            tag = msg[0]
        except Exception as e:  # noqa: BLE001 - never let one frame stop the controller
            log.error("dtorch controller: dropped a frame from %s that does not decode: %s",
                      host.child.name if host else "an unknown host", e)
            return
        if host is None:
            log.error("dtorch controller: dropped a frame from unknown host %r", frames[0].bytes)
            return
        self.on_peer_message(host, tag, msg, frames)

    def on_machine(self, frames) -> None:
        try:
            machine, msg = self.machines.receive(frames)
        except Exception as e:  # noqa: BLE001 - never let one frame stop the controller
            log.error("dtorch controller: dropped a node agent's frame that does not decode: "
                      "%s", e)
            return
        if machine is None:
            return
        tag = msg[0]
        if tag == P.NODE_READY:
            machine.ready = True
            self.send(machine, P.pack(self.graph.definitions))
            if self.tracing:
                self.send(machine, P.pack([P.Trace(P.TRACE, True, 0)]))
        elif tag == P.NODE_FAILURE:
            message = f"{machine.describe()}: {P.NodeFailure(*msg).message}"
            if machine.ready:
                self.on_peer_death(machine, message)
            else:  # no program used it yet: go on without it
                log.warning("dtorch: %s; it left the cluster before it was ready", message)
                self.machines.drop(machine)
        else:
            self.on_peer_message(machine, tag, msg, frames)

    def on_peer_message(self, host, tag: int, msg, frames) -> None:
        """A message from a host, or one a machine's agent relayed from its hosts."""
        if tag == P.HOST_READY:
            host.ready = True
            welcome = P.pack([P.Welcome(P.WELCOME, os.path.join(self.store_dir, "store"))])
            for frame in [welcome, *host.backlog]:
                self.send(host, frame)
            host.backlog = []
        elif tag == P.SYNCED:
            request = P.Synced(*msg).token
            waiting = self.syncs.get(request)
            if waiting is not None:
                waiting.discard(host)
                if not waiting:
                    self.ack_sync(request)
        else:
            holding = self.reports.holding
            self.reports.send(tag, frames[1:], report=self.death_may_be_behind(tag, msg))
            if self.reports.holding and not holding:
                self.heard_after = self.look_for_deaths()

    def death_may_be_behind(self, tag: int, msg) -> bool:
        """A failure that a peer's death can cause: a collective's (its peers take part), or a
        host's Fatal (a stream that failed as a peer died)."""
        if tag == P.KERNEL_ERROR:
            op = P.KernelError(*msg).op
        elif tag == P.FETCH_FAILED:
            op = P.FetchFailed(*msg).op
        else:
            return tag == P.FATAL
        if len(self.graph.calls) != self._calls_seen:  # new call shapes since the last failure
            self.collectives = collective_names(self.graph.calls)
            self._calls_seen = len(self.graph.calls)
        return op in self.collectives

    def look_for_deaths(self) -> float:
        """Reads every host's life pipe now (a death shows as its end, a beat in it was written
        before now); returns when that was."""
        for host in list(self.life_fds.values()):
            if not host.child.read_life():
                self.on_host_exit(host)
        return time.monotonic()

    def heard_from_all(self) -> bool:
        """Every host has beaten since the hold began: none was dying when it began (a killed
        process writes nothing). A node agent's beat does not vouch for its hosts: on a
        cluster's main node a hold runs its course."""
        return self.machines is None and all(
            h.child.last_beat > self.heard_after for h in self.hosts.values())

    def report_dead_hosts(self, timeout: float) -> None:
        """Waits up to ``timeout`` for a host's life pipe to close, reading heartbeats on the
        way."""
        deadline = time.monotonic() + timeout
        while self.death is None and (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select(list(self.life_fds), [], [], left)
            for fd in ready:
                host = self.life_fds[fd]
                if not host.child.read_life():
                    self.on_host_exit(host)

    def ack_sync(self, token: int) -> None:
        del self.syncs[token]
        self.reports.send(P.SYNCED, [P.pack(P.Synced(P.SYNCED, token, -1))])

    def check_hosts(self) -> None:
        """Reports a death once a report of what it broke is in (or its grace has ended), ends
        a hold that no death came to, kills a host silent too long, and finds machines gone."""
        now = time.monotonic()
        if self.death is not None:
            if self.reports.has_report or now >= self.reports.until:
                self.fatal(self.death, self.lost)
            return
        if self.reports.holding and (now >= self.reports.until or self.heard_from_all()):
            self.reports.release()
        for host in self.hosts.values():
            if host.child.is_silent():
                host.child.kill()
                self.on_host_death(host, host.child.describe_silence())
                return
        if self.machines is not None:
            self.check_machines()

    def check_machines(self) -> None:
        """A machine whose connection has closed (probed at every beat, and often while a
        report is held) or that has been silent too long fails the runtime, or leaves the
        cluster if no program used it yet."""
        lost = {m: m.describe_closed() for m in self.machines.beat(self.reports.holding)}
        lost.update((m, m.describe_silence()) for m in self.machines.silent() if m not in lost)
        for machine, how in lost.items():
            if machine.ready:
                self.on_peer_death(machine, how)
                return
            log.warning("dtorch: %s; it left the cluster before it was ready", how)
            self.machines.drop(machine)

    def on_host_exit(self, host: HostHandle) -> None:
        host.child.popen.wait()
        self.on_host_death(host, host.child.describe_exit())

    def on_host_death(self, host: HostHandle, how: str) -> None:
        if self.life_fds.pop(host.child.life_fd, None) is not None:
            self.poller.unregister(host.child.life_fd)
        self.on_peer_death(host, how)

    def on_peer_death(self, peer, how: str) -> None:
        """The first death is the one to report; it waits (a hold) for the reports of the
        collectives it broke, so that the client's error names them too."""
        if self.death is None:
            self.death = f"{how}; its devices' work is lost"
            if isinstance(peer, JoinedAgent):
                self.lost = list(range(peer.first_device, peer.first_device + peer.join.devices))
            else:
                self.lost = sorted(self.host_devices.get(peer.index, ()))
            self.reports.hold()

    def fatal(self, message: str, lost=()) -> None:
        try:
            self.reports.fatal(message, lost)
        except zmq.ZMQError:
            pass
        self.running = False

    def stop(self) -> None:
        if self.machines is not None:
            self.machines.close("the runtime stopped")
        local.stop_all([h.child for h in self.hosts.values()], config.shutdown_timeout_s)
        shutil.rmtree(self.store_dir, ignore_errors=True)
        self.results.close(linger=2000)
        self.gatekeeper.close()
        self.ctx.destroy(linger=0)


def main(argv, keys: auth.Keys, on_parent_exit) -> None:
    parser = argparse.ArgumentParser(prog="dtorch.controller")
    parser.add_argument("--parent-fd", type=int, required=True)
    parser.add_argument("--life-fd", type=int, required=True)
    parser.add_argument("--ops", required=True)
    parser.add_argument("--results", required=True)
    config.RuntimeFacts.add_arguments(parser)
    parser.add_argument("--node-address")  # a cluster's main node: node agents join here
    parser.add_argument("--token-file")  # the cluster's keys (launcher/auth.py)
    args = parser.parse_args(argv)
    cluster_keys = auth.read_token(args.token_file) if args.node_address else None
    controller = Controller(args.ops, args.results, keys, config.RuntimeFacts.from_args(args),
                            args.node_address, cluster_keys)
    on_parent_exit(lambda: _stop_hosts(controller))
    try:
        controller.run()
    except Exception:  # noqa: BLE001 - report, then exit: the client must not hang
        controller.fatal("controller error:\n" + traceback.format_exc())
        controller.stop()
        raise


def _stop_hosts(controller: Controller) -> None:
    # The hosts also watch this process's pipe; killing them here only makes it faster, and
    # waiting for them means that once this process is gone, so are they.
    children = [h.child for h in list(controller.hosts.values())]
    for child in children:
        child.popen.kill()
    for child in children:
        child.popen.wait(config.shutdown_timeout_s)
    shutil.rmtree(controller.store_dir, ignore_errors=True)
