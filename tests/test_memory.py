"""Memory: dropping the last client reference frees the blobs on the hosts (once the kernels
already queued on them have run), and a long loop keeps every process flat: the hosts' blob
tables, the controller's stream state and the client's bookkeeping do not grow. Measured as the
resident memory (VmRSS) of the runtime's processes."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import torch

import dtorch
from dtorch import Replicate, Shard
from dtorch.client import session
from processes import CLIENT_PRELUDE, rss_kb, run_client, runtime_pids, wait_until

MB = 1024  # VmRSS is in kB


def hosts_rss_kb() -> int:
    return sum(rss_kb(p) for p in runtime_pids()[1])


def test_dropping_the_last_reference_frees_host_memory():
    mesh = dtorch.DeviceMesh("cpu", [0, 1])
    assert dtorch.ones(2, device_mesh=mesh, placements=[Shard(0)]).sum().item() == 2  # hosts up
    before = hosts_rss_kb()
    big = dtorch.ones((2, 16 * 2**20), device_mesh=mesh, placements=[Shard(0)])  # 64 MB/device
    dtorch.sync()
    held = hosts_rss_kb()
    del big
    gc.collect()
    dtorch.sync()  # after this the hosts have run the release
    freed = hosts_rss_kb()
    print(f"\nhosts' RSS: {before // MB} MB, {held // MB} MB holding 128 MB, "
          f"{freed // MB} MB after the drop")
    assert held - before > 100 * MB
    assert freed - before < 16 * MB


def test_a_drop_alone_frees_host_memory():
    """No later operator or wait is needed to send the release: the program may go on with
    other things (here: polling) while the hosts free the memory."""
    mesh = dtorch.DeviceMesh("cpu", [0, 1])
    big = dtorch.ones((2, 16 * 2**20), device_mesh=mesh, placements=[Shard(0)])
    dtorch.sync()
    held = hosts_rss_kb()
    del big
    took = wait_until(lambda: held - hosts_rss_kb() > 100 * MB, timeout=5)
    print(f"\n128 MB freed {took * 1e3:.0f} ms after the drop")


def test_a_blob_dropped_while_kernels_use_it_lives_until_they_ran():
    mesh = dtorch.DeviceMesh("cpu", [0, 1])
    m = dtorch.ones((2, 600, 600), device_mesh=mesh, placements=[Shard(0)])
    busy = m
    for _ in range(8):  # keeps the devices' compute streams busy while the drop arrives
        busy = (busy @ m) / 600
    big = dtorch.ones((2, 8 * 2**20), device_mesh=mesh, placements=[Shard(0)])
    total = (big * 2).sum()
    del big  # queued after the kernels that read it: they must still see it
    session.current().flush()
    assert total.item() == 2.0 * 2 * 8 * 2**20
    assert torch.equal(busy.to_torch(), torch.ones(2, 600, 600))


def test_waits_leave_no_client_bookkeeping():
    s = session.current()
    x = dtorch.arange(6, device_mesh=dtorch.DeviceMesh("cpu", [0, 1]), placements=[Shard(0)])
    futures = [(x + k).to_torch_async() for k in range(200)]
    assert [int(f.get(60)[0]) for f in futures] == list(range(200))
    dtorch.sync()
    assert s.pending == {} and s.errors == []
    assert len(s.records) < 10  # at most the releases issued since the last flush
    sites = len(s.call_sites.sites)
    for k in range(100):
        (x * k).redistribute(placements=[Replicate()]).sum().item()
    assert len(s.call_sites.sites) == sites + 1  # one call site more, not one per call
    assert s.pending == {}


LOOP = CLIENT_PRELUDE + """
from dtorch.client import session
N = 100_000
mesh = dtorch.DeviceMesh("cpu", [0, 1])
x = dtorch.ones((2, 16384), device_mesh=mesh, placements=[Shard(0)])  # 64 KB per device

def loop(n):
    acc = x
    for i in range(n):
        acc = acc + x  # a new tensor each time; the one before is dropped
        if i % 10_000 == 0:  # now and then a read and a collective
            assert acc.redistribute(placements=[Replicate()]).sum().item() == (i + 2) * 32768
    return acc

# warm: caches, allocator pools, threads, and the loop's fused code (the hosts' compiler and
# its modules come once, and cost a host about 140 MB): until a loop runs fused code and starts
# no compile, since how many loops make it hot depends on the machine (config.fusion_after_s)
deadline, warm = time.monotonic() + 120, 0
while warm < 2 or dtorch.config.fusion and time.monotonic() < deadline:
    with dtorch.profiler.profile() as prof:
        assert loop(N).sum().item() == 2 * 16384 * (N + 1)
        dtorch.sync(compiles=True)
    warm += 1
    names = [e["name"] for e in prof.kernels()]
    if any("fused)" in n for n in names) and not any(n.startswith("fused ") for n in names):
        break
controller, hosts = runtime_pids()
pids = [controller, *hosts]
before = [rss_kb(p) for p in pids]
t0 = time.monotonic()
assert loop(N).sum().item() == 2 * 16384 * (N + 1)
seconds = time.monotonic() - t0
after = [rss_kb(p) for p in pids]
s = session._current
report(before=before, after=after, seconds=seconds, pending=len(s.pending),
       errors=len(s.errors), records=len(s.records), failures=len(s.failures))
"""


def test_100k_tensors_keep_every_process_flat():
    r = run_client(LOOP, timeout=300)
    growth = [(a - b) / MB for a, b in zip(r["after"], r["before"])]
    print(f"\n100k tensors in {r['seconds']:.1f} s; RSS before/after (MB): controller "
          f"{r['before'][0] / MB:.0f}/{r['after'][0] / MB:.0f}, hosts "
          + ", ".join(f"{b / MB:.0f}/{a / MB:.0f}" for b, a in zip(r["before"][1:],
                                                                   r["after"][1:])))
    # a blob kept per tensor would be 6 GB per host; a dict entry per tensor 10 MB or more
    assert max(growth) < 8, growth
    assert r["pending"] == r["errors"] == r["failures"] == 0
    assert r["records"] < 10


def test_cpu_hosts_keep_freed_blocks_unless_glibc_is_told_otherwise():
    """runtime/cpu_memory.py: a host's malloc keeps freed blocks (and gives them back on
    request), but glibc's own variables leave glibc's behaviour in place."""
    code = ("from dtorch.runtime import cpu_memory; print(cpu_memory.keep_freed_blocks()); "
            "cpu_memory.release_cached()")
    plain = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    for env, expected in ((plain, "True"), ({**plain, "MALLOC_TRIM_THRESHOLD_": "131072"},
                                            "False")):
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=60, check=True).stdout.strip()
        assert out == expected
