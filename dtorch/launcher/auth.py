"""Who may talk to a runtime: the processes that hold its keys, and no one else.

Every runtime makes two CURVE key pairs when its client starts: the *server* pair, which every
socket that binds presents, and the *member* pair, which every socket that connects presents.
The client hands all four keys to its children over the pipe they inherit (never argv or the
environment, which other processes can read in /proc), and they hand them on to theirs. A
binding socket admits a peer only when the peer proves it holds the member secret: a ZAP
handler (``Gatekeeper``) checks the key each handshake presents. Everything after the
handshake is encrypted, so a process without the keys can neither inject a frame, read one, nor
pose as a peer. Refusals are logged on the ``dtorch`` logger.

A cluster of machines (``launcher/node.py``) has keys of its own, the same four, kept in a *token
file* (``dtorch token FILE`` writes one, readable by its owner only) that the main node and every
node agent read: the main controller's node socket serves them under a second ZAP domain
(``CLUSTER_DOMAIN``), so a runtime's own sockets never admit a node agent, nor its node socket a
runtime's process. A peer with another token fails the handshake before ZAP can see it (it
does not even know the server's key): ``HandshakeWatch`` logs those refusals on the serving
side, and the refused side learns of them from its socket monitor (``launcher/node.py``).

>>> keys = Keys.generate()
>>> Keys.from_bytes(keys.to_bytes()) == keys
True
"""

from __future__ import annotations

import os
import socket
import stat
import threading
from typing import NamedTuple

import zmq
from zmq.utils import z85

from .. import logs

log = logs.auth

_ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks who may connect (RFC 27)
RUNTIME_DOMAIN, CLUSTER_DOMAIN = b"dtorch", b"dtorch-cluster"
_STOP = b"stop"  # a request of one frame, which libzmq never sends: the handler's end


class Keys(NamedTuple):
    server_public: bytes
    server_secret: bytes
    member_public: bytes
    member_secret: bytes

    @classmethod
    def generate(cls) -> Keys:
        return cls(*zmq.curve_keypair(), *zmq.curve_keypair())

    def to_bytes(self) -> bytes:
        """40 z85 characters per key, no separator."""
        return b"".join(self)

    @classmethod
    def from_bytes(cls, blob: bytes) -> Keys:
        if len(blob) != 160:
            raise ValueError(f"runtime keys must be 160 bytes, got {len(blob)}")
        return cls(*(blob[i:i + 40] for i in range(0, 160, 40)))


def serve(sock: zmq.Socket, keys: Keys, domain: bytes = RUNTIME_DOMAIN) -> None:
    """Makes ``sock`` (before it binds) admit only the members of ``keys``. Its context must
    have a running Gatekeeper that admits them in ``domain``."""
    sock.curve_server = True
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    # libzmq asks the ZAP handler only for sockets with a ZAP domain: without one, CURVE would
    # admit any client that knows the server's public key
    sock.zap_domain = domain
    sock.zap_enforce_domain = True  # with no handler, refuse rather than admit everyone


def join(sock: zmq.Socket, keys: Keys) -> None:
    """Makes ``sock`` (before it connects) prove membership to a ``serve``d socket."""
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.member_public
    sock.curve_secretkey = keys.member_secret


class Gatekeeper:
    """The ZAP handler of one zmq context: admits CURVE clients that present the member key of
    their socket's domain. One thread; it answers each handshake with a REP socket (the ZAP
    protocol is that small)."""

    def __init__(self, ctx: zmq.Context, keys: Keys):
        self._members = {RUNTIME_DOMAIN: z85.decode(keys.member_public)}
        self._ctx = ctx
        self._sock = ctx.socket(zmq.REP)
        self._sock.linger = 0
        self._sock.bind(_ZAP_ENDPOINT)
        self._thread = threading.Thread(target=self._run, name="dtorch-gatekeeper", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        sock = self._sock
        while True:
            try:
                request = sock.recv_multipart()
            except zmq.ZMQError:  # the context is terminating
                sock.close(0)
                return
            if request == [_STOP]:
                sock.close(0)
                return
            version, request_id, domain, address, _identity, mechanism, *credentials = request
            member = self._members.get(domain)
            admitted = mechanism == b"CURVE" and member is not None and credentials == [member]
            if not admitted:
                what = "cluster" if domain == CLUSTER_DOMAIN else "runtime"
                log.warning("dtorch: refused a %s connection from %s (not a member of this "
                            "%s)", mechanism.decode(errors="replace"),
                            address.decode(errors="replace"), what)
            status = [b"200", b"OK"] if admitted else [b"400", b"not a member"]
            sock.send_multipart([version, request_id, *status, b"", b""])

    def close(self) -> None:
        """Ends the handler's thread, which closes its socket itself: ``Context.destroy``
        would close it under the thread blocked reading it (libzmq then aborts)."""
        stop = self._ctx.socket(zmq.REQ)
        stop.linger = 0
        stop.connect(_ZAP_ENDPOINT)
        stop.send(_STOP)
        self._thread.join()
        stop.close(0)

    def admit(self, domain: bytes, keys: Keys) -> None:
        """Also admits ``keys``' members on the sockets ``serve``d in ``domain``."""
        self._members = {**self._members, domain: z85.decode(keys.member_public)}


# -- a cluster's token file -------------------------------------------------------------------------
def write_token(path: str) -> None:
    """Writes new cluster keys to ``path`` (a new file, readable by its owner only)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(Keys.generate().to_bytes())


def read_token(path: str) -> Keys:
    """The cluster keys in token file ``path``; an error naming the fix when it is missing,
    readable by others, or not a token."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise FileNotFoundError(f"cannot read the cluster token file {path!r} ({e.strerror}); "
                                f"make one with `dtorch token {path}`") from None
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise PermissionError(f"the cluster token file {path!r} is readable by other users: "
                              f"run `chmod 600 {path}` (whoever reads it can join the cluster)")
    with open(path, "rb") as f:
        blob = f.read().strip()
    try:
        return Keys.from_bytes(blob)
    except ValueError:
        raise ValueError(f"{path!r} is not a dtorch cluster token (160 z85 characters); make "
                         f"one with `dtorch token FILE`") from None


# -- refused handshakes ---------------------------------------------------------------------------
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


class HandshakeWatch:
    """Logs the connections a served socket refused before ZAP saw them (a peer with another
    cluster's keys): a connection accepted, then closed without a handshake. Poll ``monitor``
    and call ``on_event`` when it is readable."""

    def __init__(self, sock: zmq.Socket, what: str):
        self.what = what
        self.monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
                                               | zmq.EVENT_HANDSHAKE_SUCCEEDED
                                               | _HANDSHAKE_FAILED)
        # connections not yet through their handshake, oldest first: fd -> peer. libzmq names
        # the connection of an accept and a close by its fd, but not that of a handshake, so a
        # success is taken as the oldest pending one's (handshakes take equally long)
        self._pending: dict = {}

    def on_event(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            kind, fd = event["event"], event["value"]
            if kind == zmq.EVENT_ACCEPTED:
                self._pending[fd] = _peer_of(fd)
            elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                if self._pending:
                    del self._pending[next(iter(self._pending))]
            elif fd in self._pending:  # closed or failed before its handshake succeeded
                log.warning("dtorch: refused a connection to %s from %s: it does not hold this "
                            "cluster's token", self.what, self._pending.pop(fd))

    def close(self) -> None:
        self.monitor.close(0)


def _peer_of(fd: int) -> str:
    """The peer address of a socket the monitor names by its file descriptor, if still open."""
    try:
        with socket.socket(fileno=os.dup(fd)) as s:
            return "%s:%d" % s.getpeername()[:2]
    except OSError:
        return "an unknown address"

