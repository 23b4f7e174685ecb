"""A process's resident memory from /proc (Linux): the figures the memory benchmarks report."""

import os


def status_kb(pid, field: str) -> int:
    """A ``/proc/<pid>/status`` field in kB (``VmRSS``, ``VmHWM``); ``pid`` may be "self"."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def reset_peak(pid) -> None:
    """The kernel's peak RSS (VmHWM) starts again from the current RSS."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def children(pid: int) -> list:
    out = []
    for path in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{path}/children") as f:
            out += [int(p) for p in f.read().split()]
    return out
