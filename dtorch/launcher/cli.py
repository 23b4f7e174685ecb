"""The ``dtorch`` command (``[project.scripts]``):

- ``dtorch node [--main IPv4:PORT] [--token-file FILE] [--bind ADDR] [--cpu-devices N]``: this
  machine's node agent (``launcher/node.py``; ``dtorch node --help``);
- ``dtorch token FILE``: writes a new cluster token (readable by its owner only), for the main
  node's ``MainNode.set_token_file`` (or ``DTORCH_TOKEN_FILE``) and every agent's
  ``--token-file``.

Bad input (an argument, or a variable standing for one) is one line on stderr and exit status
2, as argparse has it, never a traceback.

>>> main(["node", "--main", "localhost:13000", "--token-file", "t"])
2
"""

from __future__ import annotations

import sys

from . import node
from .auth import write_token
from .usage import Parser, UsageError

USAGE = "usage: dtorch node [options] | dtorch token FILE   (dtorch node --help for options)"


def token(argv) -> int:
    """``dtorch token FILE``."""
    p = Parser(prog="dtorch token", description="Writes a new cluster token (the cluster's "
                                                "keys) to FILE, readable by its owner only.")
    p.add_argument("file", metavar="FILE")
    path = p.parse_args(argv).file
    try:
        write_token(path)
    except FileExistsError:
        raise UsageError(f"{path} exists; remove it first (agents holding the old token could "
                         f"no longer join)") from None
    except OSError as e:
        raise UsageError(f"cannot write {path}: {e.strerror}") from None
    return 0


COMMANDS = {"node": node.cli, "token": token}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    name = argv[0] if argv else None
    if name in ("-h", "--help"):
        print(USAGE)
        return 0
    if name not in COMMANDS:
        what = "no command" if name is None else f"no command {name!r}"
        print(f"dtorch: error: {what}; {USAGE}", file=sys.stderr)
        return 2
    try:
        return COMMANDS[name](argv[1:])
    except UsageError as e:
        print(f"dtorch {name}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # python -m: the errors node.py raises are the package module's
    from dtorch.launcher.cli import main as package_main

    sys.exit(package_main())
