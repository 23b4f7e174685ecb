"""CPU time of processes and their threads from /proc (Linux): where a benchmark's cores go."""

import os

from procmem import children

TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def thread_seconds(pid) -> dict:
    """Each thread's CPU seconds (user + system) so far, by (thread id, name)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except FileNotFoundError:  # ended meanwhile
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[(int(tid), name)] = (int(fields[11]) + int(fields[12])) * TICK_S
    return out


def descendants(pid: int) -> list:
    found = []
    for child in children(pid):
        found += [child, *descendants(child)]
    return found


def role(pid: int, program: str) -> str:
    """A dtorch process's role, from its command line: controller, host N, or ``program``."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv = f.read().split(b"\0")
    if any(b"dtorch.controller.main" in a for a in argv):
        return "controller"
    if any(b"dtorch.runtime.host" in a for a in argv):
        return f"host {argv[argv.index(b'--index') + 1].decode()}"
    return program


class CpuMeter:
    """CPU seconds spent between ``start`` and ``stop`` by this process and its descendants,
    by role (``role``) and kind of thread: communication (gloo's threads, a host's
    ``devD-stream0``), a host's compute streams (``devD-stream1`` and up, with the intra-op
    threads they start, which inherit their name) and its other threads."""

    def __init__(self, program: str = "client"):
        self.program = program  # what this process is called

    def start(self) -> None:
        self.before = self._read()

    def stop(self) -> dict:
        after, shares = self._read(), {}
        for key, seconds in after.items():
            spent = seconds - self.before.get(key, 0.0)
            if spent > 0:
                shares[key[0] + self._kind(key)] = shares.get(key[0] + self._kind(key), 0.0) + spent
        return shares

    @staticmethod
    def _kind(key) -> str:
        name = key[2]
        if "gloo" in name or name.endswith("stream0"):
            return ": comm"
        if not key[0].startswith("host"):
            return ""
        return ": compute" if name.startswith("dev") else ": other"

    def _read(self) -> dict:
        seconds = {}
        for pid in [os.getpid(), *descendants(os.getpid())]:
            try:
                who = role(pid, self.program)
                for (tid, name), s in thread_seconds(pid).items():
                    seconds[(who, tid, name)] = s
            except (FileNotFoundError, ProcessLookupError, ValueError):
                continue
        return seconds
