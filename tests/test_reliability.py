"""Reliability and security: a long kernel is not a dead host (stopped and killed processes are
in tests/test_lifecycle.py); Ctrl-C interrupts the program, not its runtime; only the runtime's
own processes can talk to it; the client never loses a record, and flow control keeps memory
flat however far ahead a program runs.

Programs that signal processes run in a subprocess of their own. Every wait has a deadline.
"""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import stat
import subprocess
import sys
import tempfile

import msgpack
import pytest
import torch
import zmq

import dtorch
from dtorch import Replicate, Shard, config, protocol as P
from dtorch.client import session as _session
from processes import (CLIENT_PRELUDE, TESTS_DIR, listening_sockets, rss_kb, runtime_pids,
                       socket_inodes)
from reliability_kernels import busy

def test_a_long_kernel_is_not_a_dead_host(mesh1):
    """20 s of Python holding the GIL on every device, seven heartbeat timeouts long."""
    x = dtorch.ones((3, 2), device_mesh=mesh1, placements=[Shard(0)])
    y = dtorch.local_map(busy, [Shard(0)])(x, 20.0)
    assert torch.equal(y.to_torch(), torch.full((3, 2), 2.0))
    assert (x * 3).sum().item() == 18.0


CTRL_C = CLIENT_PRELUDE + """
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, however pytest runs
sys.path.insert(0, os.path.dirname(os.path.abspath("reliability_kernels.py")))
from reliability_kernels import busy_until_released
mesh = dtorch.init_device_mesh("cpu", (2,))
x = dtorch.ones((2, 2), device_mesh=mesh, placements=[Shard(0)])
assert x.sum().item() == 4.0
slow = dtorch.local_map(busy_until_released, [Shard(0)])(x, 120.0)
try:
    print("WAITING", flush=True)  # inside: the interrupt may come at once
    slow.to_torch()
    interrupted = False
except KeyboardInterrupt:
    interrupted = True
controller, hosts = runtime_pids()
report(interrupted=interrupted, after=(x * 5).sum().item(), slow=slow.sum().item(),
       alive=all(map(alive, [controller, *hosts])))
"""


def test_ctrl_c_interrupts_the_program_not_its_runtime(tmp_path):
    """SIGINT to the whole foreground process group, as a terminal's Ctrl-C sends it, while a
    kernel computes (it ends only once the signal was sent: the test releases it then)."""
    release = tmp_path / "release"
    proc = subprocess.Popen([sys.executable, "-c", CTRL_C], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=TESTS_DIR,
                            start_new_session=True,  # its own group, so killpg spares pytest
                            env={**os.environ, "RELIABILITY_RELEASE": str(release)})
    try:
        assert proc.stdout.readline().strip() == "WAITING"
        os.killpg(proc.pid, signal.SIGINT)
        release.touch()
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    results = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert results, err[-3000:]
    r = __import__("json").loads(results[0][7:])
    assert r == {"interrupted": True, "after": 20.0, "slow": 8.0, "alive": True}


# -- security -------------------------------------------------------------------------------------


def _outsider(kind, endpoint: str, curve_server_key: bytes | None = None):
    """A socket of a process that is not the runtime's: plain, or CURVE with its own keys."""
    sock = zmq.Context.instance().socket(kind)
    sock.linger = 0
    if curve_server_key is not None:
        sock.curve_serverkey = curve_server_key
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
    sock.connect(endpoint)
    return sock


def _endpoint(sock) -> str:
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


@pytest.mark.parametrize("curve", [False, True], ids=["plain", "curve-with-own-keys"])
def test_an_outsider_cannot_forge_a_value(mesh1, curve):
    s = _session.current()
    server_key = s.keys.server_public if curve else None
    forger = _outsider(zmq.PUSH, _endpoint(s.results), server_key)
    x = dtorch.arange(6.0, device_mesh=mesh1, placements=[Shard(0)])
    first = next(s.requests) + 1
    for request in range(first, first + 8):  # the next fetches' request numbers
        forged = P.pack(P.Value(P.VALUE, request, [0], [6], "float32"))
        with contextlib.suppress(zmq.Again):  # refused peers may not even get to queue
            forger.send_multipart([forged, torch.full((6,), 999.0).numpy().tobytes()],
                                  zmq.NOBLOCK)
    for _ in range(4):
        assert torch.equal(x.to_torch(), torch.arange(6.0))
    forger.close()


@pytest.mark.parametrize("curve", [False, True], ids=["plain", "curve-with-own-keys"])
def test_an_outsider_cannot_steal_batches(mesh1, curve):
    s = _session.current()
    thief = _outsider(zmq.PULL, _endpoint(s.ops), s.keys.server_public if curve else None)
    secret = torch.tensor([31415.0, 27182.0])
    for _ in range(20):
        y = dtorch.from_torch(secret, device_mesh=mesh1) * 1.0
        assert torch.equal(y.to_torch(), secret)
    assert thief.poll(200) == 0, "an outsider received a batch"
    thief.close()


def test_outsider_frames_do_not_stop_the_controller(mesh1):
    controller, _ = runtime_pids()
    mine = socket_inodes(controller)
    ports = [a for inode, a in listening_sockets(with_port=True).items() if inode in mine]
    assert ports
    s = _session.current()
    for port in ports:
        for key in (None, s.keys.server_public):
            sock = _outsider(zmq.DEALER, f"tcp://{port}", key)
            with contextlib.suppress(zmq.Again):
                sock.send_multipart([b"\xc1garbage", msgpack.packb([P.HOST_READY, 0, 1])],
                                    zmq.NOBLOCK)
            sock.close()
    x = dtorch.ones((6,), device_mesh=mesh1, placements=[Shard(0)])
    assert x.redistribute(placements=[Replicate()]).sum().item() == 6.0


def test_keys_never_appear_in_argv_or_environment():
    s = _session.current()
    controller, hosts = runtime_pids()
    for pid in [controller, *hosts]:
        for name in ("cmdline", "environ"):
            with open(f"/proc/{pid}/{name}", "rb") as f:
                text = f.read()
            for key in s.keys:
                assert key not in text, f"a runtime key is in /proc/{pid}/{name}"


def test_the_rendezvous_store_is_private(mesh1):
    dtorch.ones((3,), device_mesh=mesh1, placements=[Shard(0)]).redistribute(
        placements=[Replicate()]).sum().item()  # process groups exist
    stores = glob.glob(os.path.join(tempfile.gettempdir(), "dtorch-store-*"))
    assert stores
    for d in stores:
        st = os.stat(d)
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()


# -- the client never loses a record ----------------------------------------------------------------


def test_a_record_that_cannot_be_sent_raises_at_the_next_call(mesh1):
    """A record that msgpack refuses (no public call makes one any more) is taken out of its
    batch, the rest of the batch runs, and the next call raises naming the op's call site."""
    s = _session.current()
    x = dtorch.ones((3,), device_mesh=mesh1, placements=[Shard(0)])
    y = x + 1.0
    bound = next(b for k, b in s.bound.items() if getattr(k[0], "name", None) == "add" and k[-1] is float)
    def site():  # this line, as the user's call site
        return s.site()

    s.append((P.OP, bound.call_id, site(), 0, next(s.ids), x._id, object()))
    z = x * 2  # in the same batch as the bad record
    s.flush()
    with pytest.raises(TypeError, match=r"dtorch\.add failed \(called at .*test_reliability"):
        dtorch.ones((1,), device_mesh=mesh1)
    assert torch.equal(z.to_torch(), torch.full((3,), 2.0))
    assert torch.equal(y.to_torch(), torch.full((3,), 2.0))
    assert s.fatal is None and s._flusher.is_alive()


def test_the_value_of_a_record_that_could_not_be_sent_raises_not_hangs(mesh1):
    """Its result never reaches the hosts, so no value can come: reading it raises the record's
    error at once (the read in the same batch as the record, and a read later), and the
    runtime stays usable."""
    s = _session.current()
    x = dtorch.ones((3,), device_mesh=mesh1, placements=[Shard(0)])
    _ = x + 1.0
    bound = next(b for k, b in s.bound.items() if getattr(k[0], "name", None) == "add" and k[-1] is float)
    lost = object.__new__(dtorch.Tensor)  # (a symbol, as dispatch makes one)
    lost._id, lost._spec = next(s.ids), bound.outs[0]
    def site():  # this line, as the user's call site
        return s.site()

    s.append((P.OP, bound.call_id, site(), 0, lost._id, x._id, object()))
    with pytest.raises(TypeError, match=r"dtorch\.add failed \(called at .*test_reliability"):
        lost.to_torch_async().get(10)  # its fetch flushes the record: raised, not awaited
    with pytest.raises(TypeError, match="could not be sent"):
        lost.to_torch()  # a later read raises again, before anything is sent
    assert torch.equal((x * 3).to_torch(), torch.full((3,), 3.0))


def test_flow_control_bounds_the_records_in_flight(mesh1):
    """With a bound of 8,000 records, 100,000 dependent ops never have more than the bound
    (plus one buffer) sent and not yet executed."""
    s = _session.current()
    with config.Context(max_inflight_ops=8000):
        window = 8000 // _session.MARKS
        x = dtorch.zeros((3,), device_mesh=mesh1, placements=[Shard(0)])
        dtorch.sync()  # the bound holds from the first flush under it: earlier tests' records
        # may have left up to a default window (50,000) unmarked
        most = 0
        for i in range(100_000):
            x = x + 1.0
            if i % 500 == 0:  # read, never change, the session's marks
                in_flight = sum(not mark.done() for mark in tuple(s.marks))
                most = max(most, in_flight * window + s.unmarked)
        assert torch.equal(x.to_torch(), torch.full((3,), 100_000.0))
    assert 0 < most <= 8000 + config.flush_records + window


def test_two_million_ops_in_flight_keep_every_process_flat(fusion_off):
    """2,000,000 dependent small ops with no sync: without flow control the host alone grew
    by 240 MB here; with it every process stays within a few tens of MB. (Without fusion: the
    loop would get hot, and the compiler's modules cost a host about 140 MB once, which is not
    what this test measures.)"""
    one = dtorch.DeviceMesh("cpu", [0])
    x = dtorch.zeros((4,), device_mesh=one)
    x.sum().item()
    controller, hosts = runtime_pids()
    pids = [os.getpid(), controller, *hosts]
    base = {pid: rss_kb(pid) for pid in pids}
    peak = dict(base)
    for i in range(2_000_000):
        x = x + 1.0
        if i % 50_000 == 0:
            peak = {pid: max(peak[pid], rss_kb(pid)) for pid in pids}
    assert x.sum().item() == 8_000_000.0
    growth_mb = {pid: (peak[pid] - base[pid]) / 1024 for pid in pids}
    print(f"\npeak growth under 2M ops in flight (MB): {growth_mb}")
    assert all(g < 64 for g in growth_mb.values()), growth_mb
