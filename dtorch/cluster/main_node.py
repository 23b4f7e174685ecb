"""MainNode: DTorch's handle on the cluster's main node, for one machine.

The main node is the machine the program runs on; in dtorch it is the user's process with its
controller and host processes, all on this machine, their sockets bound to ``config.bind_host``
(loopback unless ``DTORCH_BIND_HOST`` says otherwise) on ports the system picks. Clusters of
several machines (node agents started by a CLI on each one) are a later feature, so:

- ``set_address`` checks and keeps the address a multi-machine cluster would listen on; it does
  not move any socket. As in DTorch, it must come before the runtime starts.
- ``get_address`` answers it, else ``DTORCH_MAIN_NODE_ADDRESS``, else ``<bind_host>:0``: port 0
  because dtorch has no fixed port; each socket takes a free one.
- ``wait_cluster_ready(n)`` is True at once for one machine and raises ``NotImplementedError``
  for more (waiting for machines that cannot join would only spend the timeout).
- ``num_node_in_cluster`` is 1.

>>> from dtorch.cluster.main_node import MainNode
>>> MainNode.num_node_in_cluster(), MainNode.wait_cluster_ready(1)
(1, True)
"""

from __future__ import annotations

import ipaddress
import os

from .. import config

ENV = "DTORCH_MAIN_NODE_ADDRESS"
_address = None  # set_address's, checked


def check_address(address, source: str = "the address") -> str:
    """``address`` if it is ``IPv4:port`` (DTorch's form; a hostname is not one), else
    ``ValueError`` naming ``source``."""
    if not isinstance(address, str):
        raise TypeError(f"{source} must be a str 'IPv4:port', not {type(address).__name__}")
    ip, sep, port = address.rpartition(":")
    try:
        ipaddress.IPv4Address(ip)
        ok = bool(sep) and port.isdigit() and 0 < int(port) < 65536
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"{source} {address!r} is not 'IPv4:port' (e.g. '10.0.0.1:13000'; "
                         f"hostnames are not accepted)")
    return address


def _runtime_started() -> bool:
    from ..client import session  # only when asked: importing this module starts nothing

    s = session._current
    return s is not None and not s.closed


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
    def get_address() -> str:
        """``set_address``'s address, else ``DTORCH_MAIN_NODE_ADDRESS``, else
        ``<config.bind_host>:0`` (the address this machine's runtime binds to; any port)."""
        if _address is not None:
            return _address
        if os.environ.get(ENV):
            return check_address(os.environ[ENV], ENV)
        return f"{config.bind_host}:0"

    @staticmethod
    def wait_cluster_ready(num_nodes: int, timeout_second: float = 600) -> bool:
        """True when ``num_nodes`` machines are in the cluster: at once for ``num_nodes <= 1``
        (this machine). More: ``NotImplementedError``, since dtorch runs on one machine yet."""
        if isinstance(num_nodes, bool) or not isinstance(num_nodes, int):
            raise TypeError(f"num_nodes must be an int, not {type(num_nodes).__name__}")
        if num_nodes <= 1:
            return True
        raise NotImplementedError(
            f"MainNode.wait_cluster_ready({num_nodes}): dtorch runs on one machine for now "
            f"(its devices and processes); clusters of several machines are a later feature"
        )

    @staticmethod
    def num_node_in_cluster() -> int:
        """The machines in the cluster: 1, this one."""
        return 1
