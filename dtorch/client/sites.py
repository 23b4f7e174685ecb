"""Call sites: the user's ``file:line`` of each operator, as a small index that travels in its
record and comes back in the errors that name it (``names[index]``).

A site is found by the calling frame's code object and bytecode offset, both free to read: a
line number costs a walk of the code's line table, paid once per call site. Frames of dtorch's
own code are skipped, and torch's: its decorators (``torch.no_grad`` around an optimizer's
``step``, the optimizer's profiling hook) and ``Module.__call__`` are never the user's line.
Any thread may look up a site; the tables grow under a lock (a lookup that finds its entry
takes none), so two threads never give two sites one index.
"""

from __future__ import annotations

import os
import sys
import threading

import torch

MAX_CODES = 4096  # code objects whose call sites are kept looked up
_INSIDE: dict = {}  # ``by_code``'s mark for dtorch's own code and torch's
_SKIPPED_DIRS = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                 os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)


class CallSites:
    """``site(depth)``: the index of the calling user's line; ``names``: index -> "file:line"
    (0 is "<unknown>")."""

    def __init__(self) -> None:
        self.names: list = ["<unknown>"]
        self.sites: dict = {}  # (file, line) -> index in names
        self.by_code: dict = {}  # id(code) -> {bytecode offset: site index}, or _INSIDE
        self.codes: list = []  # the code objects of by_code, kept alive
        self._lock = threading.Lock()

    def site(self, depth: int = 2) -> int:
        """Index of the user's ``file:line``: the first frame outside dtorch and torch, from
        ``depth`` frames up (2: the caller of the caller)."""
        try:
            f = sys._getframe(depth)
        except ValueError:  # called from C with no user frame below (a thread's target)
            return 0
        by_code = self.by_code
        while True:
            sites = by_code.get(id(f.f_code))
            if sites is None:
                sites = self._code_sites(f.f_code)
            if sites is not _INSIDE:
                break
            f = f.f_back
            if f is None:
                return 0  # "<unknown>"
        index = sites.get(f.f_lasti)
        if index is None:
            index = sites[f.f_lasti] = self._index(f.f_code.co_filename, f.f_lineno)
        return index

    def _code_sites(self, code) -> dict:
        """``by_code``'s entry for a code object met for the first time: ``_INSIDE`` for
        dtorch's own code, else its call sites by bytecode offset. The code is kept alive, so its
        id names no other while it stands here. A cache: past ``MAX_CODES`` (code compiled
        again and again, by ``exec``) it starts again, the sites' indices stay."""
        with self._lock:
            if len(self.codes) >= MAX_CODES:
                self.codes.clear()
                self.by_code.clear()
            self.codes.append(code)
            sites = _INSIDE if code.co_filename.startswith(_SKIPPED_DIRS) else {}
            self.by_code[id(code)] = sites
        return sites

    def _index(self, filename: str, line: int) -> int:
        # keyed by name, not code object: equal code elsewhere compares equal
        key = (filename, line)
        with self._lock:
            index = self.sites.get(key)
            if index is None:
                self.names.append(f"{filename}:{line}")
                index = self.sites[key] = len(self.names) - 1
        return index
