"""MainNode: DTorch's handle on the cluster's main node, the machine the program runs on.

On one machine nothing needs declaring: the controller and hosts are this machine's processes,
their sockets bound to ``config.bind_host`` (loopback unless ``DTORCH_BIND_HOST`` says
otherwise). A program becomes a cluster's main node when it is given an address before the
runtime starts (``set_address``, else ``DTORCH_MAIN_NODE_ADDRESS``) and a token file
(``set_token_file``, else ``DTORCH_TOKEN_FILE``; ``dtorch token FILE`` makes one): its
controller then listens there for node agents holding that token (``launcher/machines.py``), one
per machine (``dtorch node``, ``docs/cluster.md``), and runs no host of its own (run an agent on
the main machine too to use its devices).

- ``wait_cluster_ready(n, timeout_second)`` starts the runtime and returns True once ``n``
  machines are ready (False when the time runs out); ``num_node_in_cluster`` counts them.
- ``devices()`` (``dtorch.cluster.devices()``) lists the global device ids, numbered machine by
  machine in the order machines joined, with their machine: a mesh may name any of them, and a
  machine that joins later adds ids for the meshes made after.
- ``get_address`` answers the address, else ``<bind_host>:0`` (one machine: no fixed port).

The questions travel to the controller as ClusterQuery records among the program's operators;
the answers come back on a socket of this module's, which admits only the runtime's processes.

>>> from dtorch.cluster.main_node import MainNode
>>> MainNode.num_node_in_cluster(), MainNode.wait_cluster_ready(1)
(1, True)
"""

from __future__ import annotations

import os
import socket
import time
from typing import NamedTuple

import zmq

from .. import config, current, protocol as P
from ..launcher import auth
from ..launcher.settings import (ADDRESS_ENV, TOKEN_ENV, ClusterSettings, check_address,
                                 settings)
ANSWER_GRACE_S = 10.0  # how much longer than its own timeout a query may take to be answered
_address = None  # set_address's, checked
_token_file = None  # set_token_file's
_asker = None  # (session, context, reply socket, its address): see _ask


class ClusterDevice(NamedTuple):
    """A device of the cluster: its global ``id`` (what a DeviceMesh names) and machine."""

    id: int
    device_type: str
    machine: int  # 1, 2, ... in the order machines joined (0: the main node itself)
    name: str  # the machine's host name
    address: str  # where its collectives listen


def cluster_settings() -> ClusterSettings | None:
    """The settings this program launches its runtime with: a cluster's main node's (None on
    one machine). A missing or unsafe token raises, naming the fix, at the call that starts
    the runtime."""
    return settings(_address, _token_file)


def is_main_node() -> bool:
    """Whether an address was given (``set_address``, else the variable): the runtime then
    starts as a cluster's main node."""
    return _address is not None or bool(os.environ.get(ADDRESS_ENV))


def has_token_file() -> bool:
    return bool(_token_file or os.environ.get(TOKEN_ENV))


def _runtime_started() -> bool:
    return current.running_session() is not None


class MainNode:
    """DTorch's ``dtorch.MainNode`` (static methods; see the module doc)."""

    @staticmethod
    def set_address(address: str) -> None:
        """Sets the main node's ``IPv4:port``. After the runtime has started (the first
        operator): ``ValueError("Cluster already start, node type: main")``, as in DTorch."""
        global _address
        address = check_address(address)
        if _runtime_started():
            raise ValueError("Cluster already start, node type: main")
        _address = address

    @staticmethod
    def set_token_file(path: str) -> None:
        """The cluster's token file, which every node agent reads too (``dtorch token FILE``
        writes one). Like ``set_address``, only before the runtime starts."""
        global _token_file
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"the token file must be a path, not {type(path).__name__}")
        if _runtime_started():
            raise ValueError("Cluster already start, node type: main")
        _token_file = os.path.expanduser(os.fspath(path))

    @staticmethod
    def get_address() -> str:
        """``set_address``'s address, else ``DTORCH_MAIN_NODE_ADDRESS``, else
        ``<config.bind_host>:0`` (the address this machine's runtime binds to; any port)."""
        if _address is not None:
            return _address
        if os.environ.get(ADDRESS_ENV):
            return check_address(os.environ[ADDRESS_ENV], ADDRESS_ENV)
        return f"{config.bind_host}:0"

    @staticmethod
    def wait_cluster_ready(num_nodes: int, timeout_second: float = 600) -> bool:
        """True once ``num_nodes`` machines are ready, False after ``timeout_second``. Starts
        the runtime. One machine (no address set): True for ``num_nodes <= 1``; more cannot
        come, which raises naming how to make this program a main node."""
        if isinstance(num_nodes, bool) or not isinstance(num_nodes, int):
            raise TypeError(f"num_nodes must be an int, not {type(num_nodes).__name__}")
        if cluster_settings() is None:
            if num_nodes <= 1:
                return True
            raise RuntimeError(
                f"MainNode.wait_cluster_ready({num_nodes}): this program is not a cluster's main "
                f"node, so no machine can join it: call MainNode.set_address('IPv4:port') and "
                f"MainNode.set_token_file(path) (or set {ADDRESS_ENV} and {TOKEN_ENV}) before the "
                f"runtime starts, and run `dtorch node` on each machine (docs/cluster.md)")
        return len(_ask(num_nodes, timeout_second)) >= num_nodes

    @staticmethod
    def num_node_in_cluster() -> int:
        """The ready machines of the cluster (1, this one, when it is not a cluster)."""
        if cluster_settings() is None:
            return 1
        return len(_ask(0, 0.0))


def devices() -> list:
    """The cluster's devices (``ClusterDevice``), by global id. On one machine: this machine's
    GPUs, else one CPU device per CPU host process (CPU ids are logical there: any id works)."""
    if cluster_settings() is None:
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        kind, n = ("cuda", n) if n else ("cpu", config.cpu_hosts)
        return [ClusterDevice(d, kind, 0, socket.gethostname(), config.bind_host)
                for d in range(n)]
    return [ClusterDevice(m.first_device + k, m.device_type, m.index, m.name, m.address)
            for m in _ask(0, 0.0) for k in range(m.devices)]


def _ask(min_nodes: int, timeout_s: float) -> list:
    """The ready machines (``protocol.Machine``), once at least ``min_nodes`` are or
    ``timeout_s`` has passed. Raises if the runtime fails meanwhile."""
    s = current.session()
    reply, address = _reply_socket(s)
    request = next(s.requests)
    s.append(P.ClusterQuery(P.CLUSTER_QUERY, request, address, min_nodes, float(timeout_s)))
    s.flush()
    give_up = time.monotonic() + timeout_s + ANSWER_GRACE_S
    while True:
        if reply.poll(int(config.heartbeat_interval_s * 1000)):
            info = P.ClusterInfo(*P.unpack(reply.recv()))
            if info.request == request:  # (an earlier, abandoned question's answer: dropped)
                return [P.Machine(*m) for m in info.machines]
        elif s.alarm:
            s.raise_alarm()
        elif time.monotonic() > give_up:
            raise TimeoutError(f"the dtorch controller did not answer a question about the "
                               f"cluster within {timeout_s + ANSWER_GRACE_S:.0f} s")


def _reply_socket(s):
    """This session's answer socket, in a zmq context of this module's (a socket left in the
    session's context would block its termination)."""
    global _asker
    if _asker is not None and _asker[0] is s:
        return _asker[2], _asker[3]
    if _asker is not None:
        _asker[2].close(0)
        _asker[1].term()
    ctx = zmq.Context()
    auth.Gatekeeper(ctx, s.keys)
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    auth.serve(sock, s.keys)
    sock.bind(f"tcp://{config.bind_host}:*")
    address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    _asker = (s, ctx, sock, address)
    return sock, address
