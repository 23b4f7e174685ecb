"""What a cluster's main node launches with, as a value: ``ClusterSettings`` (where its controller
listens for node agents, and the token they hold), the variables that stand for them, and the
check of an address.

The user's side (``cluster/main_node.py``: ``MainNode.set_address``, ``set_token_file``) decides
the settings and hands them to the launcher (``local.start_controller``); the node agent
(``node.py``) reads the same variables for its own ``--main`` and ``--token-file``. Neither side
reads the other's module state.
"""

from __future__ import annotations

import ipaddress
import os
from typing import NamedTuple

from . import auth

ADDRESS_ENV = "DTORCH_MAIN_NODE_ADDRESS"
TOKEN_ENV = "DTORCH_TOKEN_FILE"


class ClusterSettings(NamedTuple):
    address: str  # where the main controller listens for node agents
    token_file: str


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


def settings(address: str | None, token_file: str | None) -> ClusterSettings | None:
    """The main node's settings from ``address`` and ``token_file`` (each None: its variable's),
    or None when there is no address (one machine). A missing or unsafe token raises, naming
    the fix."""
    if address is None and os.environ.get(ADDRESS_ENV):
        address = check_address(os.environ[ADDRESS_ENV], ADDRESS_ENV)
    if address is None:
        return None
    token = token_file or os.environ.get(TOKEN_ENV)
    if not token:
        raise ValueError(f"the main node at {address} needs a token file, which its node agents "
                         f"hold too: MainNode.set_token_file(path) or {TOKEN_ENV}=path "
                         f"(`dtorch token path` makes one)")
    auth.read_token(token)
    return ClusterSettings(address, os.path.abspath(token))
