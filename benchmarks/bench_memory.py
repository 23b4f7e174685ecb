"""Peak memory of a program with many temporaries: dtorch on a 1-device mesh vs torch eager
(goal: <= 0.9x).

The program is a function whose locals each hold a 16 MB temporary read once by the next line,
as model code is written: in torch eager every local lives until the function returns, so its
peak is all of them. dtorch's controller sees the releases of those locals in the same batch as
the operators, so a host frees each temporary right after its last use (a chain of them gets no
blob at all). Figures are peak resident memory (``VmHWM``) above the resident memory at the start
of the timed call: torch's in a fresh process of its own, dtorch's in the host process.
Median of ``BENCH_REPEATS`` calls each.

Both processes start with glibc's mmap threshold fixed at 128 kB (``MALLOC_MMAP_THRESHOLD_``):
by default glibc raises it once a large block is freed, and keeps later large blocks in its heap
after they are freed, so resident memory would show the allocator's high-water mark, not the
live tensors'. Fixed, every tensor of this size is mapped when made and unmapped when freed.
"""

import os
import statistics
import subprocess
import sys

import torch

import dtorch
from procmem import children, reset_peak, status_kb

NUMEL = 4 * 1024 * 1024  # 16 MB of float32
REPEATS = int(os.environ.get("BENCH_REPEATS", "5"))


def block(x):
    a = x * 2.0
    b = a + 1.0
    c = b.sin()
    d = c * c
    e = d - 0.5
    f = e.abs()
    g = f.sqrt()
    h = g + x
    return h.sum()


def held(x):
    """The case with nothing to win: 8 temporaries all read at the end."""
    parts = [x * float(k) for k in range(8)]
    total = parts[0].sum()
    for p in parts[1:]:
        total = total + p.sum()
    return total


PROGRAMS = {"8 temporaries read once each": block, "8 temporaries all read at the end": held}


def torch_peaks(name: str) -> list:
    """Peak MB above the start of each call, in a fresh interpreter (so nothing else of this
    process's history is in its figures)."""
    code = (
        "import sys; sys.path.insert(0, %r)\n"
        "import torch, bench_memory as b\n"
        "from procmem import reset_peak, status_kb\n"
        "f = b.PROGRAMS[%r]\n"
        "x = torch.rand(b.NUMEL); f(x).item()\n"
        "for _ in range(b.REPEATS):\n"
        "    reset_peak('self'); base = status_kb('self', 'VmRSS')\n"
        "    f(x).item()\n"
        "    print((status_kb('self', 'VmHWM') - base) / 1024)\n" % (os.path.dirname(__file__),
                                                                   name))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return [float(v) for v in out.stdout.split()]


def dtorch_peaks(name: str) -> list:
    f = PROGRAMS[name]
    mesh = dtorch.DeviceMesh("cpu", [0])
    x = dtorch.from_torch(torch.rand(NUMEL), device_mesh=mesh)
    f(x).item()
    host = next(p for p in children(os.getpid()) for p in [p, *children(p)]
                if "dtorch.runtime.host" in open(f"/proc/{p}/cmdline").read())
    peaks = []
    for _ in range(REPEATS):
        dtorch.sync()
        reset_peak(host)
        base = status_kb(host, "VmRSS")
        f(x).item()
        peaks.append((status_kb(host, "VmHWM") - base) / 1024)
    return peaks


def main():
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"  # read by glibc in processes started now
    print(f"temporaries of {NUMEL * 4 / 2**20:.0f} MB, peaks above the start, medians of "
          f"{REPEATS}:")
    for name in PROGRAMS:
        t = statistics.median(torch_peaks(name))
        d = statistics.median(dtorch_peaks(name))
        print(f"  {name:34s} torch eager +{t:6.1f} MB   dtorch host +{d:6.1f} MB   "
              f"ratio {d / t:.2f}x (goal <= 0.9x)")


if __name__ == "__main__":
    main()
