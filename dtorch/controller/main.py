"""The controller process: receives the client's batches, rewrites them, dispatches to hosts.

One loop polls three things: the client's batches, the hosts' messages (forwarded to the client,
except sync acknowledgements, which it gathers), and the hosts' life pipes (a host that exits
ends the runtime with a Fatal error to the client instead of a hang). Hosts start when a mesh
first names one of their devices, and each receives every batch: it runs the records that touch
its devices, so the controller's cost does not grow with the device count.
"""

from __future__ import annotations

import argparse
import select
import socket
import sys
import time
import traceback

import zmq

from .. import config, protocol as P
from ..cluster import local
from .graph import LogicalGraph, Operator
from .passes import PASSES, Chain, StreamState


# A killed host's peers can see its sockets close (and report a failed collective) before its
# life pipe closes: the kernel closes a dying process's files in fd order. A host's Fatal waits
# this long for a death to blame first.
DEATH_GRACE_S = 1.0


class HostHandle:
    def __init__(self, index: int, child):
        self.index, self.child = index, child
        self.identity = str(index).encode()
        self.ready = False
        self.backlog: list = []


class Controller:
    def __init__(self, ops_addr: str, results_addr: str):
        self.ctx = zmq.Context()
        self.ops = self.ctx.socket(zmq.PULL)
        self.ops.connect(ops_addr)
        self.results = self.ctx.socket(zmq.PUSH)
        self.results.setsockopt(zmq.LINGER, 2000)
        self.results.connect(results_addr)
        self.host_sock = self.ctx.socket(zmq.ROUTER)
        self.host_sock.setsockopt(zmq.LINGER, 0)
        # A ROUTER silently drops what it cannot queue: never let it (no send limit), and make a
        # send to an unknown host an error rather than a silent loss.
        self.host_sock.setsockopt(zmq.SNDHWM, 0)
        self.host_sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.host_sock.bind(f"tcp://{config.bind_host}:*")
        self.host_addr = self.host_sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.poller = zmq.Poller()
        self.poller.register(self.ops, zmq.POLLIN)
        self.poller.register(self.host_sock, zmq.POLLIN)
        self.graph = LogicalGraph()
        self.graph.streams = StreamState()
        self.hosts: dict = {}  # host index -> HostHandle
        self.by_identity: dict = {}
        self.life_fds: dict = {}  # life pipe fd -> HostHandle
        self.syncs: dict = {}  # token -> host indices yet to acknowledge
        # the rendezvous store's listening socket, bound here (on bind_host, with no race for
        # the port) and handed to the first host started, which serves the store on it
        self.store_listener = _listen(config.bind_host)
        self.store_port = self.store_listener.getsockname()[1]
        self.store_host = None  # index of the host serving the store
        self.running = True

    # -- main loop ------------------------------------------------------------------------------
    def run(self) -> None:
        while self.running:
            for sock, _ in self.poller.poll():
                if sock is self.ops:
                    self.on_batch(P.unpack(self.ops.recv(copy=False).buffer))
                elif sock is self.host_sock:
                    self.on_host(self.host_sock.recv_multipart(copy=False))
                else:
                    self.on_host_exit(self.life_fds[sock])
        self.stop()

    def on_batch(self, records: list) -> None:
        t0 = time.perf_counter()
        nodes, calls = [], self.graph.calls
        for rec in records:
            if type(rec) is int:
                nodes.append(rec)
            elif rec[0] == P.OP:
                nodes.append(Operator(calls[rec[1]], rec))
            elif rec[0] <= P.DEFINE_CALL:
                self.graph.define(rec)
                if rec[0] == P.DEFINE_MESH:
                    self.ensure_hosts(rec[2], rec[4])
                if rec[0] != P.DEFINE_CALL or rec[2] != "redistribute":
                    nodes.append(rec)
            elif rec[0] == P.SYNC:
                self.syncs[rec[1]] = {h.index for h in self.hosts.values()}
                nodes.append(rec)
            elif rec[0] == P.SHUTDOWN:
                self.running = False
            else:
                nodes.append(rec)
        n_in = len(nodes)
        for run_pass in PASSES:
            nodes = run_pass(self.graph, nodes)
        self.send_to_hosts(self.encode(nodes))
        for token, waiting in list(self.syncs.items()):
            if not waiting:
                self.ack_sync(token)
        if config.debug:
            ms = (time.perf_counter() - t0) * 1e3
            print(f"[dtorch controller] batch: {len(records)} records, {n_in} nodes -> "
                  f"{len(nodes)} after {[p.__name__ for p in PASSES]}, {ms:.2f} ms",
                  file=sys.stderr)

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

    def send_to_hosts(self, records: list) -> None:
        if not records:
            return
        frame = P.pack(records)
        for host in self.hosts.values():
            if host.ready:
                self.host_sock.send_multipart([host.identity, frame], copy=False)
            else:
                host.backlog.append(frame)

    # -- hosts ----------------------------------------------------------------------------------
    def ensure_hosts(self, device_type: str, devices) -> None:
        for d in devices:
            index = local.host_index(device_type, d)
            if index not in self.hosts:
                store_fd = None
                if self.store_host is None:
                    self.store_host, store_fd = index, self.store_listener.fileno()
                child = local.start_host(index, device_type, self.host_addr, store_fd)
                if store_fd is not None:  # the host holds it now
                    self.store_listener.close()
                host = self.hosts[index] = HostHandle(index, child)
                host.backlog.append(P.pack(self.graph.definitions))
                self.by_identity[host.identity] = host
                self.life_fds[child.life_fd] = host
                self.poller.register(child.life_fd, zmq.POLLIN)

    def on_host(self, frames) -> None:
        host = self.by_identity[bytes(frames[0].buffer)]
        msg = P.unpack(frames[1].buffer)
        tag = msg[0]
        if tag == P.HOST_READY:
            host.ready = True
            master = host.index == self.store_host
            welcome = P.pack([P.Welcome(P.WELCOME, self.store_port, master)])
            self.host_sock.send_multipart([host.identity, welcome])
            for frame in host.backlog:
                self.host_sock.send_multipart([host.identity, frame], copy=False)
            host.backlog = []
        elif tag == P.SYNCED:
            waiting = self.syncs.get(msg[1])
            if waiting is not None:
                waiting.discard(host.index)
                if not waiting:
                    self.ack_sync(msg[1])
        else:
            if tag == P.FATAL:  # a host failing as a peer host dies: name the death first
                self.report_dead_hosts(timeout=DEATH_GRACE_S)
            self.results.send_multipart(frames[1:], copy=False)

    def report_dead_hosts(self, timeout: float) -> None:
        dead, _, _ = select.select(list(self.life_fds), [], [], timeout)
        for fd in dead:
            self.on_host_exit(self.life_fds[fd])

    def ack_sync(self, token: int) -> None:
        del self.syncs[token]
        self.results.send(P.pack(P.Synced(P.SYNCED, token, -1)))

    def on_host_exit(self, host: HostHandle) -> None:
        host.child.popen.wait()
        self.fatal(f"{host.child.describe_exit()}; its devices' work is lost")

    def fatal(self, message: str) -> None:
        try:
            self.results.send(P.pack(P.Fatal(P.FATAL, message)))
        except zmq.ZMQError:
            pass
        self.running = False

    def stop(self) -> None:
        local.stop_all([h.child for h in self.hosts.values()], config.shutdown_timeout_s)
        self.results.close(linger=2000)
        self.ctx.destroy(linger=0)


def _listen(host: str) -> socket.socket:
    s = socket.socket()
    s.bind((host, 0))
    s.listen(128)
    return s


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="dtorch.controller")
    parser.add_argument("--parent-fd", type=int, required=True)
    parser.add_argument("--life-fd", type=int, required=True)
    parser.add_argument("--ops", required=True)
    parser.add_argument("--results", required=True)
    parser.add_argument("--cpu-hosts", type=int, required=True)
    args = parser.parse_args(argv)
    config.cpu_hosts = args.cpu_hosts
    controller = Controller(args.ops, args.results)
    local.exit_with_parent(args.parent_fd, on_exit=lambda: _stop_hosts(controller))
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
