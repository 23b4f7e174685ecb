"""The ``dtorch`` command (``[project.scripts]``):

- ``dtorch node [--main IPv4:PORT] [--token-file FILE] [--bind ADDR] [--cpu-devices N]``: this
  machine's node agent (``cluster/node.py``; ``dtorch node --help``);
- ``dtorch token FILE``: writes a new cluster token (readable by its owner only), for the main
  node's ``MainNode.set_token_file`` (or ``DTORCH_TOKEN_FILE``) and every agent's
  ``--token-file``.
"""

from __future__ import annotations

import sys

USAGE = "usage: dtorch node [options] | dtorch token FILE   (dtorch node --help for options)"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["node"]:
        from .node import cli

        return cli(argv[1:])
    if argv[:1] == ["token"] and len(argv) == 2:
        from .auth import write_token

        try:
            write_token(argv[1])
        except FileExistsError:
            print(f"dtorch token: {argv[1]} exists; remove it first (agents holding the old "
                  f"token could no longer join)", file=sys.stderr)
            return 1
        return 0
    print(USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
