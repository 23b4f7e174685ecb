"""The runtime's loggers, one per role, all under ``dtorch`` (a user's ``logging`` setup for
``dtorch`` covers them all; ``dtorch.controller`` alone picks one role).

The client's go wherever the user's program sends its logs (Python's default: warnings and
errors to stderr). A runtime process (controller, host) sends its own to its stderr, which it
shares with the user's process (``to_stderr``, from ``launcher/local.child_main``).
"""

from __future__ import annotations

import logging
import sys

client = logging.getLogger("dtorch.client")  # the user's process: session, receiver, futures
controller = logging.getLogger("dtorch.controller")
host = logging.getLogger("dtorch.host")  # a host process: its loop, kernels and compiler
agent = logging.getLogger("dtorch.agent")  # a machine's node agent (launcher/node.py)
# the gatekeepers of a runtime's sockets (launcher/auth.py), in whichever process holds them
auth = logging.getLogger("dtorch.auth")


class _RoleLines(logging.Formatter):
    """A debug line names its role (``[dtorch controller] batch: ...``): it traces that role's
    work among the others' on one stderr. Warnings and errors already say who speaks, in the
    words a user reads."""

    def format(self, record) -> str:
        line = super().format(record)
        if record.levelno > logging.DEBUG:
            return line
        return f"[dtorch {record.name.rpartition('.')[2]}] {line}"


def to_stderr(debug: int) -> None:
    """This runtime process's logs, as plain lines on its stderr: every message at DEBUG once
    ``config.debug`` asks for them, else warnings and errors."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_RoleLines("%(message)s"))
    root = logging.getLogger("dtorch")
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if debug else logging.WARNING)
