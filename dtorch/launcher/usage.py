"""What every ``dtorch`` command shares: its usage errors (one line on stderr, exit status 2,
as argparse has it) and how to run one in a lean process (``command``).
"""

from __future__ import annotations

import argparse
import sys

from .local import PACKAGE_DIR


class UsageError(ValueError):
    """Bad input to a ``dtorch`` command: ``cli.main`` prints it on one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """argparse, whose errors are UsageErrors naming ``--help``."""

    def error(self, message: str):
        raise UsageError(f"{message} ({self.prog} --help lists the options)")


# How to run ``dtorch`` without loading dtorch's public API (which imports torch, seconds on a
# busy machine): the bare package the runtime's own processes boot with (``launcher/local.py``).
_BOOT = ("import sys, types; p = types.ModuleType('dtorch'); p.__path__ = [{pkg!r}]; "
         "sys.modules['dtorch'] = p; from dtorch.launcher.cli import main; sys.exit(main())")


def command(*args) -> list:
    """The argv that runs ``dtorch *args`` in a lean process."""
    return [sys.executable, "-c", _BOOT.format(pkg=PACKAGE_DIR), *map(str, args)]
