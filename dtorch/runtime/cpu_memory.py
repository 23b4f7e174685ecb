"""The CPU devices' caching allocator: glibc's malloc, told to keep the blocks it is given back.

A CPU tensor's memory comes from malloc. By default glibc serves a block of 128 kB or more (a
threshold that it raises as mmapped blocks are freed, up to 32 MB) with a fresh ``mmap``, unmaps
it when it is freed, and trims the heap's free top, so a host's kernels kept paying for fresh
pages: an elementwise op on 1M floats took a host 2-3x as long as with freed blocks kept
(``benchmarks/bench_fusion.py``, unfused). A host instead fixes the mmap threshold at glibc's
maximum, trims only past 32 MB of free heap top, and keeps one arena for all its threads: a
freed block stays in the process, and the next request of that size reuses it, already faulted
in. This is CUDA's caching allocator's bargain on the CPU: memory a program once used stays
with its host until ``Graph.empty_cache()`` (``release_cached``) gives it back to the system.
Blocks over 32 MB are still mmapped each time (glibc's cap).

glibc's own variables (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``) win: a host
started with either set keeps glibc's behaviour (the memory benchmarks set them, so that a
process's resident memory is its live memory). Where there is no glibc, nothing changes.
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # mallopt's parameters (malloc.h)
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's largest mmap threshold on 64-bit systems
TRIM_THRESHOLD = 32 << 20  # free memory at the top of a heap beyond this goes back
ARENAS = 1  # one heap for the host's threads, so what it keeps is kept once
GLIBC_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def _libc():
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def keep_freed_blocks() -> bool:
    """Makes this process's malloc keep freed blocks for reuse (see above); whether it did."""
    libc = _libc()
    if libc is None or any(v in os.environ for v in GLIBC_VARIABLES):
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)
                and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
                and libc.mallopt(M_ARENA_MAX, ARENAS))


def release_cached() -> None:
    """Gives the freed blocks this process keeps back to the system."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
