"""The main node's side of a cluster: the node agents that joined the main controller.

The controller of a cluster's main node (``MainNode.set_address``) listens at that address with
a ROUTER socket that admits only holders of the cluster's token (``auth.CLUSTER_DOMAIN``; the
other connections are refused and logged, ``auth.HandshakeWatch``). A node agent
(``launcher/node.py``) joins with NodeJoin and is given its machine's index and the global id of
its first device: ids are numbered machine by machine in the order machines join, so a machine
that joins late extends the id space and serves the meshes made after it joined. Once its hosts
are up it sends NodeReady; only then does it count in the cluster, receive the definitions made
so far and every later batch (one copy per machine: the agent relays it to its hosts), and take
part in syncs (the agent acknowledges a sync once all its hosts have).

Both sides send a NodeBeat every ``config.heartbeat_interval_s``; a machine whose connection
closed (its agent killed: the beat cannot be sent) or that is silent for
``config.heartbeat_timeout_s`` (its agent stopped, its network gone) fails the runtime with an
error that names it. The cluster's rendezvous store (``launcher/store.py``) lives
here too, and so do the client's questions about the cluster (``ClusterQuery``), answered on a
socket of the client's own once enough machines are ready or their time is up.
"""

from __future__ import annotations

import time

import zmq

from .. import config, protocol as P
from . import auth
from .store import StoreServer


class JoinedAgent:
    """A node agent that joined, as the main controller sees it."""

    def __init__(self, identity: bytes, index: int, join: P.NodeJoin, first_device: int):
        self.identity, self.index, self.join = identity, index, join
        self.first_device = first_device
        self.ready = False
        self.last_heard = time.monotonic()

    def describe(self) -> str:
        j = self.join
        return f"machine {self.index} ({j.name} at {j.address}, node agent pid {j.pid})"

    def describe_closed(self) -> str:
        return (f"{self.describe()} closed its connection (its node agent exited or was "
                f"killed, or its network is gone)")

    def describe_silence(self) -> str:
        return (f"{self.describe()} sent nothing for {time.monotonic() - self.last_heard:.1f} s "
                f"(its node agent was killed or stopped, or its network is gone; the limit is "
                f"config.heartbeat_timeout_s = {config.heartbeat_timeout_s} s)")

    def record(self) -> list:
        j = self.join
        return list(P.Machine(self.index, j.name, j.address, j.device_type, self.first_device,
                              j.devices, j.rank, j.pid))


class Machines:
    def __init__(self, ctx: zmq.Context, gatekeeper: auth.Gatekeeper, address: str,
                 cluster_keys: auth.Keys, runtime_keys: auth.Keys):
        self.ctx, self.runtime_keys = ctx, runtime_keys
        gatekeeper.admit(auth.CLUSTER_DOMAIN, cluster_keys)
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)  # as the hosts' socket: never drop a batch
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # an agent that reconnects keeps its id
        auth.serve(self.sock, cluster_keys, auth.CLUSTER_DOMAIN)
        self.watch = auth.HandshakeWatch(self.sock, f"the main node {address}")
        try:
            self.sock.bind(f"tcp://{address}")
        except zmq.ZMQError as e:
            raise RuntimeError(f"the main node cannot listen at {address} ({e}): is another "
                               f"dtorch program using that port? Pick another with "
                               f"MainNode.set_address") from None
        self.by_identity: dict = {}
        self.joined: list = []  # in the order they joined
        self.next_device = 0  # the first device id of the next machine to join
        self.count = 0  # machines that ever joined: the next one's index is one more
        self.store = StoreServer()
        self.queries: list = []  # (ClusterQuery, deadline) not answered yet
        self.replies: dict = {}  # a client's reply address -> PUSH socket
        self.last_beat = 0.0

    def ready_machines(self) -> list:
        return [m for m in self.joined if m.ready]

    # -- messages -------------------------------------------------------------------------------
    def receive(self, frames):
        """Handles what an agent sent, except what the controller must act on, which it
        returns as (machine, message) (else (None, None)): NodeReady, NodeFailure and its
        hosts' messages."""
        identity = bytes(frames[0].buffer)
        msg = P.unpack(frames[1].buffer)
        tag = msg[0]
        machine = self.by_identity.get(identity)
        if machine is not None:
            machine.last_heard = time.monotonic()
        if tag == P.NODE_JOIN:
            self._on_join(identity, machine, P.NodeJoin(*msg))
        elif machine is None or tag == P.NODE_BEAT:
            pass  # a beat, or an agent of a runtime that has ended
        elif tag == P.STORE_REQUEST:
            req = P.StoreRequest(*msg)
            self.store.handle(req, lambda value: self.control(
                machine, P.StoreReply(P.STORE_REPLY, req.client, value)))
        else:
            return machine, msg
        return None, None

    def _on_join(self, identity: bytes, machine, join: P.NodeJoin) -> None:
        if machine is None:  # not a repeated join (the agent rejoins after a reconnect)
            self.count += 1
            machine = JoinedAgent(identity, self.count, join, self.next_device)
            self.next_device += join.devices
            self.joined.append(machine)
            self.by_identity[identity] = machine
        self.control(machine, P.NodeWelcome(P.NODE_WELCOME, machine.index, machine.first_device))

    def send(self, machine: JoinedAgent, kind: bytes, frame) -> bool:
        """A frame to an agent; False when its connection has closed."""
        try:
            self.sock.send_multipart([machine.identity, kind, frame], copy=False)
            return True
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            return False

    def control(self, machine: JoinedAgent, record) -> bool:
        return self.send(machine, P.NODE_CONTROL, P.pack(record))

    def beat(self, probe: bool = False) -> list:
        """Beats every machine once a heartbeat interval (``probe``: now); returns those whose
        connection has closed (the beat could not be sent: libzmq forgets a peer whose
        connection closed, a killed agent's at once)."""
        now, closed = time.monotonic(), []
        if probe or now - self.last_beat >= config.heartbeat_interval_s:
            self.last_beat = now
            beat = P.pack(P.NodeBeat(P.NODE_BEAT))
            closed = [m for m in self.joined if not self.send(m, P.NODE_CONTROL, beat)]
        self.answer_queries(now)
        return closed

    def silent(self) -> list:
        limit = config.heartbeat_timeout_s
        return [m for m in self.joined if time.monotonic() - m.last_heard > limit]

    def drop(self, machine: JoinedAgent) -> None:
        """Forgets a machine that failed before it was ready: no program used it yet, so the
        runtime goes on without it (its device ids stay unused)."""
        self.joined.remove(machine)
        del self.by_identity[machine.identity]

    # -- meshes ---------------------------------------------------------------------------------
    def check_mesh(self, device_type: str, devices) -> str | None:
        """Why a mesh over ``devices`` cannot run on this cluster (None: it can)."""
        ready = self.ready_machines()
        ours = {d for m in ready if m.join.device_type == device_type
                for d in range(m.first_device, m.first_device + m.join.devices)}
        missing = sorted(set(devices) - ours)
        if not missing:
            return None
        have = ", ".join(f"{m.index}: {m.join.device_type} {m.first_device}-"
                         f"{m.first_device + m.join.devices - 1}" for m in ready) or "none"
        return (f"a DeviceMesh('{device_type}', ...) names devices {missing}, which no ready "
                f"machine of the cluster has (machines and their devices: {have}); "
                f"dtorch.cluster.devices() lists them, and MainNode.wait_cluster_ready(n) waits "
                f"for machines still joining")

    # -- the client's questions -----------------------------------------------------------------
    def query(self, rec) -> None:
        q = P.ClusterQuery(*rec)
        self.queries.append((q, time.monotonic() + q.timeout_s))
        self.answer_queries(time.monotonic())

    def answer_queries(self, now: float) -> None:
        if not self.queries:
            return
        ready = self.ready_machines()
        waiting = []
        for q, deadline in self.queries:
            if len(ready) >= q.min_nodes or now >= deadline:
                self._reply(q, P.ClusterInfo(P.CLUSTER_INFO, q.request,
                                             [m.record() for m in ready]))
            else:
                waiting.append((q, deadline))
        self.queries = waiting

    def _reply(self, q: P.ClusterQuery, info: P.ClusterInfo) -> None:
        sock = self.replies.get(q.reply_to)
        if sock is None:
            sock = self.replies[q.reply_to] = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            auth.join(sock, self.runtime_keys)
            sock.connect(q.reply_to)
        sock.send(P.pack(info))

    def close(self, reason: str) -> None:
        """Tells every agent the runtime ended (they stop their hosts), then closes."""
        bye = P.pack(P.NodeBye(P.NODE_BYE, reason))
        for m in self.joined:
            self.send(m, P.NODE_CONTROL, bye)
        self.watch.close()
        self.sock.close(linger=1000)  # the byes must leave before the process does
        for sock in self.replies.values():
            sock.close(0)
