"""Who may talk to a runtime: the processes that hold its keys, and no one else.

Every runtime makes two CURVE key pairs when its client starts: the *server* pair, which every
socket that binds presents, and the *member* pair, which every socket that connects presents.
The client hands all four keys to its children over the pipe they inherit (never argv or the
environment, which other processes can read in /proc), and they hand them on to theirs. A
binding socket admits a peer only when the peer proves it holds the member secret: a ZAP
handler (``Gatekeeper``) checks the key each handshake presents. Everything after the
handshake is encrypted, so a process without the keys can neither inject a frame, read one, nor
pose as a peer. Refusals are logged on the ``dtorch`` logger.

>>> keys = Keys.generate()
>>> Keys.from_bytes(keys.to_bytes()) == keys
True
"""

from __future__ import annotations

import logging
import threading
from typing import NamedTuple

import zmq
from zmq.utils import z85

log = logging.getLogger("dtorch")

_ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks who may connect (RFC 27)


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


def serve(sock: zmq.Socket, keys: Keys) -> None:
    """Makes ``sock`` (before it binds) admit only the runtime's members. Its context must have
    a running Gatekeeper."""
    sock.curve_server = True
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    # libzmq asks the ZAP handler only for sockets with a ZAP domain: without one, CURVE would
    # admit any client that knows the server's public key
    sock.zap_domain = b"dtorch"
    sock.zap_enforce_domain = True  # with no handler, refuse rather than admit everyone


def join(sock: zmq.Socket, keys: Keys) -> None:
    """Makes ``sock`` (before it connects) prove membership to a ``serve``d socket."""
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.member_public
    sock.curve_secretkey = keys.member_secret


class Gatekeeper:
    """The ZAP handler of one zmq context: admits CURVE clients that present the member key.
    One thread; it answers each handshake with a REP socket (the ZAP protocol is that small)."""

    def __init__(self, ctx: zmq.Context, keys: Keys):
        self._member = z85.decode(keys.member_public)
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
            version, request_id, _domain, address, _identity, mechanism, *credentials = request
            admitted = mechanism == b"CURVE" and credentials == [self._member]
            if not admitted:
                log.warning("dtorch: refused a %s connection from %s (not a member of this "
                            "runtime)", mechanism.decode(errors="replace"),
                            address.decode(errors="replace"))
            status = [b"200", b"OK"] if admitted else [b"400", b"not a member"]
            sock.send_multipart([version, request_id, *status, b"", b""])
