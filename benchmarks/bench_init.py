"""Building a tensor-parallel model: what each host keeps, and its peak, eagerly and deferred.

    python benchmarks/bench_init.py [layers=8] [dim=2560] [tp=2]

``layers`` column-parallel ``Linear(dim, dim)`` layers (no bias) on a tp mesh of ``tp`` CPU
devices, one host process each; a host's share of the weights is ``layers * dim**2 * 4 / tp``
bytes. Three builds, each measured on every host as the growth of its private resident memory
(USS, ``/proc/<pid>/smaps_rollup``) and of its peak resident memory (``VmHWM`` after resetting
it), over what the host held before:

1. eager: the layers built as usual (each weight drawn by ``kaiming_uniform_`` in place);
2. deferred: built inside ``dtorch.nn.init_empty()`` (no values: nothing drawn or allocated);
3. deferred, then ``dtorch.load_checkpoint`` of the eager model's checkpoint.

For comparison, torch in this process: the peak growth of building the same layers whole (what
one process without tensor parallelism holds). Goals (printed): eager keeps at most 1.1x the
share; deferred adds nothing; the load's peak is at most the share plus one read buffer (the
largest tensor, ``dim**2 * 4`` bytes).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import torch

import dtorch
from dtorch.client import session
from procmem import children, reset_peak, status_kb

MB = 1 << 20


def uss_mb(pid: int) -> float:
    """Private (unshared) resident memory of ``pid``, in MiB."""
    kb = 0
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith(("Private_Clean", "Private_Dirty")):
                kb += int(line.split()[1])
    return kb / 1024


class Hosts:
    """The runtime's host processes, measured from a mark."""

    def __init__(self):
        self.pids = children(session._current.controller.pid)

    def mark(self) -> None:
        dtorch.sync()
        for pid in self.pids:
            reset_peak(pid)
        self.base = {pid: (uss_mb(pid), status_kb(pid, "VmRSS") / 1024) for pid in self.pids}

    def growth(self) -> tuple:
        """(max USS growth, max peak growth) over the hosts since the mark, in MiB."""
        dtorch.sync()
        kept = max(uss_mb(p) - self.base[p][0] for p in self.pids)
        peak = max(status_kb(p, "VmHWM") / 1024 - self.base[p][1] for p in self.pids)
        return kept, peak


def main() -> None:
    given = [int(a) for a in sys.argv[1:4]]
    layers, dim, tp = given + [8, 2560, 2][len(given):]
    mesh = dtorch.init_device_mesh("cpu", (tp,), mesh_dim_names=["tp"])
    dtorch.ones(1, device_mesh=mesh).to_torch()  # the runtime up
    hosts = Hosts()
    share, largest = layers * dim * dim * 4 / tp / MB, dim * dim * 4 / MB

    def build():
        return dtorch.nn.Sequential(*[dtorch.nn.Linear(
            dim, dim, bias=False, device_mesh=mesh, tp_shard_type="col") for _ in range(layers)])

    print(f"{layers} x Linear({dim}, {dim}) on tp{tp}: a host's share {share:.1f} MiB, the "
          f"largest tensor {largest:.1f} MiB")
    rows = []
    hosts.mark()
    model = build()
    rows.append(("eager", *hosts.growth()))
    directory = tempfile.mkdtemp(prefix="dtorch-bench-init-")
    try:
        dtorch.save_checkpoint(model, directory)
        del model
        dtorch.sync()
        dtorch.default_graph.empty_cache()
        hosts.mark()
        with dtorch.nn.init_empty():
            model = build()
        rows.append(("deferred (init_empty)", *hosts.growth()))
        dtorch.load_checkpoint(model, directory)
        rows.append(("deferred + load_checkpoint", *hosts.growth()))
    finally:
        shutil.rmtree(directory, ignore_errors=True)

    before = status_kb("self", "VmRSS")
    reset_peak(os.getpid())
    whole = [torch.nn.Linear(dim, dim, bias=False) for _ in range(layers)]
    torch_peak = (status_kb("self", "VmHWM") - before) / 1024
    del whole

    print(f"{'build':<28} {'kept MiB':>9} {'x share':>8} {'peak MiB':>9} {'x share':>8}")
    for name, kept, peak in rows:
        print(f"{name:<28} {kept:9.1f} {kept / share:8.2f} {peak:9.1f} {peak / share:8.2f}")
    print(f"{'torch, whole, 1 process':<28} {'':>9} {'':>8} {torch_peak:9.1f} "
          f"{torch_peak / share:8.2f}")
    eager, deferred, loaded = rows
    print(f"goals: eager keeps <= 1.1x share: {eager[1] <= 1.1 * share}; deferred adds "
          f"nothing (< 1 MiB): {deferred[2] < 1}; load peak <= share + largest: "
          f"{loaded[2] <= share + largest + 1}")


if __name__ == "__main__":
    main()
