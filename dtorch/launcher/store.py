"""The rendezvous store of a cluster: a key-value table in the main controller, reached over
authenticated sockets only.

On one machine process groups rendezvous through a torch ``FileStore`` in a directory only the
user can enter. Machines share no directory, and torch's ``TCPStore`` admits anyone who can reach
its port, so a cluster's store is a table in the main controller (``StoreServer``, no torch)
that hosts reach through their node agent: a host's store client (``connect``: a torch
``Store`` written in Python, which torch's process groups accept) sends each call as a
StoreRequest on a socket of its own to its agent, which forwards it over its CURVE connection to
the main controller, whose answer comes back the same way. Only holders of the cluster's token
(the agents) and of an agent's keys (its hosts) can read or write the store.

Each device has its own client (a client blocks while it waits for a key; see
``runtime/host.py``), so calls on one client are sequential: a request, then its reply. A
``get`` or ``wait`` for keys not yet set is parked in the controller until they are; the client
gives up after its timeout (``config.collective_timeout_s``), as a FileStore's wait would.
"""

from __future__ import annotations

import datetime
import functools
import uuid

import zmq

from .. import protocol as P
from . import auth


class StoreServer:
    """The main controller's table. ``handle(request, reply)`` answers each StoreRequest with
    ``reply(value)``, now or once the keys it waits for are set."""

    def __init__(self):
        self.data: dict = {}
        self.parked: list = []  # (keys, answer): gets and waits for keys not set yet

    def handle(self, req: P.StoreRequest, reply) -> None:
        op, args, data = req.op, req.args, self.data
        if op == "set":
            data[args[0]] = args[1]
            self._wake()
            reply(None)
        elif op == "get":
            self._when_set([args[0]], lambda: reply(data[args[0]]))
        elif op == "wait":
            self._when_set(args[0], lambda: reply(None))
        elif op == "add":
            value = int(data.get(args[0], b"0")) + args[1]
            data[args[0]] = str(value).encode()
            self._wake()
            reply(value)
        elif op == "check":
            reply(all(k in data for k in args[0]))
        elif op == "compare_set":
            key, expected, desired = args
            current = data.get(key)
            if (current is None and expected == b"") or current == expected:
                data[key] = current = desired
                self._wake()
            reply(expected if current is None else current)
        elif op == "delete_key":
            reply(data.pop(args[0], None) is not None)
        elif op == "num_keys":
            reply(len(data))
        else:
            raise ValueError(f"the rendezvous store has no operation {op!r}")

    def _when_set(self, keys, answer) -> None:
        if all(k in self.data for k in keys):
            answer()
        else:
            self.parked.append((keys, answer))

    def _wake(self) -> None:
        parked, self.parked = self.parked, []
        for keys, answer in parked:
            self._when_set(keys, answer)


def connect(endpoint: str, keys: auth.Keys, ctx: zmq.Context, timeout_s: float):
    """A torch Store whose calls go to the node agent at ``endpoint`` (a member of ``keys``)."""
    return _store_class()(endpoint, keys, ctx, timeout_s)


@functools.cache
def _store_class():
    # torch only here: the controller and the agents import this module without it
    from torch._C._distributed_c10d import Store

    class RelayStore(Store):
        def __init__(self, endpoint, keys, ctx, timeout_s):
            super().__init__()
            self._args = endpoint, keys, ctx
            self.identity = f"store:{uuid.uuid4().hex}"
            self.sock = ctx.socket(zmq.DEALER)
            self.sock.setsockopt(zmq.IDENTITY, self.identity.encode())
            self.sock.setsockopt(zmq.LINGER, 0)
            auth.join(self.sock, keys)
            self.sock.connect(endpoint)
            self.timeout_s = timeout_s

        def _call(self, op: str, *args):
            self.sock.send(P.pack(P.StoreRequest(P.STORE_REQUEST, self.identity, op, list(args))))
            if not self.sock.poll(int(self.timeout_s * 1000)):
                raise RuntimeError(f"the cluster's rendezvous store did not answer {op}"
                                   f"{list(args)[:1]} within {self.timeout_s:.0f} s "
                                   f"(config.collective_timeout_s): a peer never came")
            return P.StoreReply(*P.unpack(self.sock.recv())).value

        def set(self, key, value):
            self._call("set", key, bytes(value))

        def get(self, key):
            return self._call("get", key)

        def add(self, key, amount):
            return self._call("add", key, amount)

        def check(self, keys):
            return self._call("check", list(keys))

        def wait(self, keys, timeout=None):
            self._call("wait", list(keys))

        def compare_set(self, key, expected, desired):
            return self._call("compare_set", key, bytes(expected), bytes(desired))

        def delete_key(self, key):
            return self._call("delete_key", key)

        def num_keys(self):
            return self._call("num_keys")

        def set_timeout(self, timeout):
            self.timeout_s = timeout.total_seconds() if isinstance(
                timeout, datetime.timedelta) else float(timeout)

        def clone(self):
            return RelayStore(*self._args, self.timeout_s)

        def has_extended_api(self):
            return False

    return RelayStore
