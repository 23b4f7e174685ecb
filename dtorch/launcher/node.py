"""The node agent (the seed's Sub-Controller): one per machine of a cluster, started by
``dtorch node`` (by hand, under ``srun``, or as a Ray actor; see ``docs/cluster.md``).

It joins the main controller at ``--main`` over a CURVE connection that only holders of the
cluster's token can make (``launcher/auth.py``; a refused agent says so and exits 1), is given
its machine's index and the global id of its first device, starts its machine's host
processes with the local launcher (``launcher/local.py``: the same pipes tie their lifetimes and
carry their heartbeats), and once they are up tells the main controller it is ready. Then it
relays: each batch arrives once per machine and goes to every local host undecoded; the hosts'
messages go up as they are, except sync acknowledgements, which it gathers into one per
machine. Its hosts reach the cluster's rendezvous store through it (``launcher/store.py``).

Failures: a host that exits or goes silent is reported to the main controller (which fails the
runtime naming the machine and the host). Both ends beat every
``config.heartbeat_interval_s``; when the main controller says goodbye or is silent for
``config.heartbeat_timeout_s``, the agent stops its hosts and waits for the next runtime at the
same address (``--timeout-second``, DTorch's worker option, bounds that wait). Killed, the agent
takes its hosts along: they exit when its pipe closes.

Addresses: the hosts' collectives listen on ``--bind`` (loopback by default). Anything else must
be asked for: a main node off this machine's loopback needs ``--bind ADDR`` or ``--bind auto``
(the address that routes to the main node).
"""

from __future__ import annotations

import argparse
import collections
import ipaddress
import logging
import os
import signal
import socket
import sys
import time
import uuid

import zmq

from .. import config, logs, protocol as P
from . import auth, local, slurm
from .settings import ADDRESS_ENV as MAIN_ENV, TOKEN_ENV, check_address
from .usage import Parser, UsageError, command as dtorch_command

log = logs.agent
DEFAULT_WAIT_S = 600.0  # DTorch's worker --timeout-second
# A main node that cannot read an agent's hello (another cluster's token) closes the connection
# without a word, just as a main node that goes away in mid-handshake does (a runtime that
# ends): the agent tells them apart by trying again. A wrong token fails every handshake; a
# main node gone is not there to answer the next one (or a new one answers it).
CUT_SHORT_LIMIT = 3  # handshakes cut short in a row, the main node listening each time


class Refused(Exception):
    """The main node refused this agent's handshake: the token is not the cluster's (or no
    dtorch main node listens there)."""


class Agent:
    def __init__(self, main: str, cluster_keys: auth.Keys, bind: str, devices: int,
                 rank: int = -1, name: str | None = None, device_type: str = "cpu"):
        self.main, self.cluster_keys, self.bind = main, cluster_keys, bind
        self.devices, self.rank, self.device_type = devices, rank, device_type
        self.name = name or socket.gethostname()
        self.cpu_hosts = min(config.cpu_hosts, devices) if device_type == "cpu" else \
            config.cpu_hosts
        self.ctx = zmq.Context()
        self.local_keys = auth.Keys.generate()  # this machine's processes' (launcher/auth.py)
        self.gatekeeper = auth.Gatekeeper(self.ctx, self.local_keys)

    def serve_forever(self, wait_s: float = DEFAULT_WAIT_S) -> None:
        """Serves one runtime after another; returns once no main node came for ``wait_s``."""
        while self.serve_one(wait_s):
            pass

    def serve_one(self, wait_s: float) -> bool:
        """Joins the next runtime and serves it to its end; False when none came in time."""
        run = Run(self)
        try:
            return run.serve(wait_s)
        finally:
            run.close()


class Run:
    """One runtime, as this machine serves it: from the join to the main controller's end."""

    def __init__(self, agent: Agent):
        self.agent = agent
        ctx = agent.ctx
        self.up = ctx.socket(zmq.DEALER)
        # an identity of its own, kept across reconnects (the main node has ROUTER_HANDOVER)
        self.up.setsockopt(zmq.IDENTITY, uuid.uuid4().hex.encode())
        self.up.setsockopt(zmq.LINGER, 1000)
        self.up.setsockopt(zmq.SNDHWM, 0)  # values and errors queue, none is ever dropped
        self.up.setsockopt(zmq.RCVHWM, 0)
        auth.join(self.up, agent.cluster_keys)
        self.monitor = self.up.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED
                                                  | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                                                  | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                                  | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        self.up.connect(f"tcp://{agent.main}")
        self.down = ctx.socket(zmq.ROUTER)  # the hosts and their store clients connect here
        self.down.setsockopt(zmq.LINGER, 0)
        self.down.setsockopt(zmq.SNDHWM, 0)
        self.down.setsockopt(zmq.ROUTER_MANDATORY, 1)
        auth.serve(self.down, agent.local_keys)
        self.down.bind(f"tcp://{agent.bind}:*")
        self.down_addr = self.down.getsockopt_string(zmq.LAST_ENDPOINT)
        self.poller = zmq.Poller()
        for s in (self.up, self.monitor, self.down):
            self.poller.register(s, zmq.POLLIN)
        self.welcome = None  # NodeWelcome, once joined
        self.hosts: dict = {}  # identity -> Child
        self.life_fds: dict = {}  # life pipe fd -> Child
        self.ready: set = set()  # identities of the hosts that said HOST_READY
        self.synced = collections.Counter()  # sync token -> hosts that acknowledged it
        self.heard = self.beaten = 0.0  # when the main controller was last heard, last beaten
        self.cut_short = 0  # handshakes cut short since the last one that succeeded

    # -- the loop -------------------------------------------------------------------------------
    def serve(self, wait_s: float) -> bool:
        give_up = time.monotonic() + wait_s
        interval_ms = int(config.heartbeat_interval_s * 1000)
        while True:
            for sock, _ in self.poller.poll(interval_ms):
                if sock is self.up:
                    if not self.on_main(self.up.recv_multipart(copy=False)):
                        return True
                elif sock is self.down:
                    self.on_local(self.down.recv_multipart(copy=False))
                elif sock is self.monitor:
                    self.on_handshake()
                else:
                    self.on_life(self.life_fds[sock])
            now = time.monotonic()
            if self.welcome is None:
                if now > give_up:
                    log.error("dtorch node: no main node at %s within %.0f s; exiting",
                              self.agent.main, wait_s)
                    return False
                continue
            if now - self.heard > config.heartbeat_timeout_s:
                log.warning("dtorch node: the main node at %s went silent; stopping this "
                            "machine's hosts", self.agent.main)
                return True
            if now - self.beaten >= config.heartbeat_interval_s:
                self.beaten = now
                self.up.send(P.pack(P.NodeBeat(P.NODE_BEAT)))
            self.check_hosts()

    def on_handshake(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                self.on_cut_short()
                continue
            if event != zmq.EVENT_HANDSHAKE_SUCCEEDED:  # refused by name (ZAP), or garbled
                raise Refused(self.refusal(event))
            self.cut_short = 0
            if self.welcome is None:  # (again after a reconnect: a join may have been lost)
                a = self.agent
                self.up.send(P.pack(P.NodeJoin(P.NODE_JOIN, a.name, a.bind, a.device_type,
                                               a.devices, a.rank, os.getpid())))

    def on_cut_short(self) -> None:
        """The connection closed in mid-handshake: the main node went away (zmq connects
        again, to the next runtime), or it could not read this agent's keys."""
        self.cut_short += 1
        if self.cut_short >= CUT_SHORT_LIMIT:
            raise Refused(self.refusal(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL))
        log.warning("dtorch node: the connection to the main node at %s was lost during its "
                    "handshake (the main node went away, or the network dropped it); trying "
                    "again", self.agent.main)

    def refusal(self, event: int) -> str:
        main = f"the main node at {self.agent.main} refused this node agent"
        if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            return f"{main} (a handshake protocol error: is a dtorch main node listening there?)"
        times = f" ({self.cut_short} handshakes in a row)" if self.cut_short else ""
        return (f"{main}{times}: its token file is not the cluster's (the main node's "
                f"MainNode.set_token_file / DTORCH_TOKEN_FILE)")

    def on_main(self, frames) -> bool:
        """A frame from the main controller; False once the runtime has ended."""
        self.heard = time.monotonic()
        kind = frames[0].bytes
        if kind == P.NODE_BATCH:
            for identity in self.hosts:
                self.down.send_multipart([identity, frames[1]], copy=False)
            return True
        msg = P.unpack(frames[1].buffer)
        tag = msg[0]
        if tag == P.STORE_REPLY:
            with_client = P.StoreReply(*msg).client.encode()
            try:
                self.down.send_multipart([with_client, frames[1]], copy=False)
            except zmq.ZMQError:  # the asking client gave up (timed out) and closed
                pass
        elif tag == P.NODE_WELCOME and self.welcome is None:
            self.welcome = P.NodeWelcome(*msg)
            self.start_hosts()
        elif tag == P.NODE_BYE:
            log.info("dtorch node: the runtime ended (%s)", P.NodeBye(*msg).reason)
            return False
        return True

    # -- hosts ----------------------------------------------------------------------------------
    def start_hosts(self) -> None:
        a, w = self.agent, self.welcome
        facts = config.RuntimeFacts(a.cpu_hosts, (w.first_device, a.devices))
        n = facts.cpu_hosts if a.device_type == "cpu" else a.devices
        for index in range(n):
            with config.Context(bind_host=a.bind):  # inherited: their collectives listen there
                child = local.start_host(index, a.device_type, self.down_addr, a.local_keys, facts)
            self.hosts[str(index).encode()] = child
            self.life_fds[child.life_fd] = child
            self.poller.register(child.life_fd, zmq.POLLIN)
        log.info("dtorch node: joined %s as machine %d (devices %d-%d); starting %d host(s)",
                 a.main, w.machine, w.first_device, w.first_device + a.devices - 1, n)

    def on_local(self, frames) -> None:
        identity = frames[0].bytes
        msg = P.unpack(frames[1].buffer)
        tag = msg[0]
        if tag == P.STORE_REQUEST:  # the client named itself in the request
            self.up.send(frames[1], copy=False)
        elif identity not in self.hosts:
            log.error("dtorch node: dropped a frame from unknown host %r", identity)
        elif tag == P.HOST_READY:
            welcome = P.Welcome(P.WELCOME, "", self.down_addr)
            self.down.send_multipart([identity, P.pack([welcome])])
            self.ready.add(identity)
            if len(self.ready) == len(self.hosts):
                self.up.send(P.pack(P.NodeReady(P.NODE_READY, len(self.hosts))))
                log.info("dtorch node: ready")
        elif tag == P.SYNCED:
            token = P.Synced(*msg).token
            self.synced[token] += 1
            if self.synced[token] == len(self.hosts):
                del self.synced[token]
                self.up.send(P.pack(P.Synced(P.SYNCED, token, self.welcome.machine)))
        else:
            self.up.send_multipart(frames[1:], copy=False)

    def on_life(self, child) -> None:
        if not child.read_life():
            child.popen.wait()
            self.host_failed(child, child.describe_exit())

    def check_hosts(self) -> None:
        for child in list(self.life_fds.values()):
            if child.is_silent():
                child.kill()
                self.host_failed(child, child.describe_silence())

    def host_failed(self, child, how: str) -> None:
        """Tells the main controller (which fails the runtime); the others run on until it
        says goodbye."""
        self.poller.unregister(child.life_fd)
        del self.life_fds[child.life_fd]
        log.error("dtorch node: %s", how)
        self.up.send(P.pack(P.NodeFailure(P.NODE_FAILURE, how)))

    def close(self) -> None:
        local.stop_all(self.hosts.values(), config.shutdown_timeout_s)
        self.up.disable_monitor()
        self.monitor.close(0)
        self.up.close()
        self.down.close(0)


# -- the command line -------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="dtorch node",
        description="A machine's node agent: joins the dtorch main node, runs this machine's "
                    "devices for it, and serves one runtime after another.")
    p.add_argument("--main", help="the main node's IPv4:port (default: DTORCH_MAIN_NODE_ADDRESS,"
                                  " or under SLURM the node that ran srun)")
    p.add_argument("--token-file", help="the cluster's token (default: DTORCH_TOKEN_FILE); "
                                        "make one with `dtorch token FILE`")
    p.add_argument("--bind", help="the address this machine's collectives listen on: "
                                  "127.0.0.1 unless given; 'auto' picks the one that routes "
                                  "to the main node (the default under SLURM)")
    p.add_argument("--cpu-devices", type=int, help="CPU devices this machine serves (default: "
                                                   "its cores, at most 8)")
    p.add_argument("--rank", type=int, default=None, help="this machine's rank under a "
                                                          "launcher (SLURM_PROCID under srun)")
    p.add_argument("--timeout-second", type=float, default=None,
                   help=f"how long to wait for a main node, each time (default "
                        f"{DEFAULT_WAIT_S:.0f})")
    return p


def settings(argv, environ) -> argparse.Namespace:
    """The agent's settings: its arguments, then the environment (DTorch's variables, then
    SLURM's: ``launcher/slurm.py``), then the defaults. Bad input raises UsageError naming the
    fix."""
    args = parser().parse_args(argv)
    under_slurm = slurm.defaults(environ)
    source = "--main" if args.main else MAIN_ENV if environ.get(MAIN_ENV) else \
        "SLURM_LAUNCH_NODE_IPADDR's main node"
    args.main = args.main or environ.get(MAIN_ENV) or under_slurm.get("main")
    if not args.main:
        raise UsageError(f"no main node: pass --main IPv4:PORT (or set {MAIN_ENV})")
    try:
        check_address(args.main, source)
    except ValueError as e:
        raise UsageError(str(e)) from None
    args.token_file = args.token_file or environ.get(TOKEN_ENV)
    if not args.token_file:
        raise UsageError(f"no token: pass --token-file FILE (or set {TOKEN_ENV}), the file the "
                         f"main node reads (`dtorch token FILE` makes one)")
    if args.rank is None:
        args.rank = under_slurm.get("rank", -1)
    if args.cpu_devices is None:
        args.cpu_devices = under_slurm.get("cpu_devices") or config.cpu_hosts
    if args.cpu_devices < 1:
        raise UsageError("--cpu-devices must be at least 1")
    if args.timeout_second is None:
        args.timeout_second = DEFAULT_WAIT_S
    if not args.timeout_second > 0:  # (NaN too)
        raise UsageError("--timeout-second must be a number of seconds > 0")
    args.bind = bind_address(args.bind or under_slurm.get("bind") or "127.0.0.1", args.main)
    args.name = under_slurm.get("name")
    return args


def bind_address(bind: str, main: str) -> str:
    """The address the hosts' collectives listen on: ``bind``, or for ``auto`` the one that
    routes to ``main``. A loopback address is refused when the main node is not on this
    machine."""
    main_ip = main.rpartition(":")[0]
    if bind == "auto":
        try:
            bind = route_to(main_ip)
        except OSError as e:
            raise UsageError(f"--bind auto: no route to the main node {main_ip} "
                             f"({e.strerror}); pass --bind with this machine's address") from None
    try:
        loopback = ipaddress.IPv4Address(bind).is_loopback
    except ValueError:
        raise UsageError(f"--bind {bind!r} is not an IPv4 address (nor 'auto')") from None
    if loopback and not ipaddress.IPv4Address(main_ip).is_loopback:
        raise UsageError(f"the main node {main} is not on this machine, but this machine's "
                         f"collectives would listen on {bind}, which other machines cannot "
                         f"reach: pass --bind with this machine's address (or --bind auto). "
                         f"dtorch listens beyond loopback only when asked.")
    return bind


def route_to(ip: str) -> str:
    """This machine's address on the route to ``ip`` (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((ip, 9))
        return s.getsockname()[0]


def cli(argv=None, environ=None) -> int:
    """``dtorch node``: returns the exit status; bad input raises UsageError (``dtorch``
    prints it, exit status 2: ``launcher/cli.py``)."""
    environ = os.environ if environ is None else environ
    args = settings(sys.argv[1:] if argv is None else argv, environ)
    try:
        keys = auth.read_token(args.token_file)
    except (OSError, ValueError) as e:
        raise UsageError(str(e)) from None
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # SIGTERM (srun's, Ray's) ends the agent through its finally blocks: its hosts stop too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    agent = Agent(args.main, keys, args.bind, args.cpu_devices, args.rank, args.name)
    log.info("dtorch node: pid %d serves %d CPU devices on %s for the main node %s",
             os.getpid(), args.cpu_devices, args.bind, args.main)
    try:
        agent.serve_forever(args.timeout_second)
    except Refused as e:
        log.error("dtorch node: %s", e)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


def command(*args) -> list:
    """The argv that runs ``dtorch node *args`` in a lean process (``cli.command``)."""
    return dtorch_command("node", *args)
