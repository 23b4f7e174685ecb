"""Lifecycle: the runtime's processes live exactly as long as the client. A host or controller
that dies makes the client raise within seconds (no hang) and ``dtorch.shutdown()`` lets a new
runtime start; a client that exits, however it exits, leaves no process behind; large meshes
start and run on a small machine; sockets carry no pickle and bind to loopback.

Each program that kills processes runs in a subprocess of its own, so the test session's runtime
is never harmed. Every wait has a deadline.
"""

from __future__ import annotations

import ast
import os
import pathlib
import signal
import subprocess
import sys

import pytest
import torch

import dtorch
from dtorch import Replicate, Shard
from processes import (
    CLIENT_PRELUDE,
    alive,
    listening_sockets,
    read_result,
    run_client,
    runtime_pids,
    socket_inodes,
    start_client,
    wait_until,
)

DEATH_NOTICE_S = 5.0  # the promise: a dead or silent process is reported within 5 s
GONE_S = 1.0  # the promise: no runtime process outlives its client by more than 1 s

# A client that kills (SIGKILL) or stops (SIGSTOP) one of its own runtime's processes, then keeps
# working until dtorch raises; it reports how long that took, then restarts the runtime.
KILL_ONE = CLIENT_PRELUDE + """
victim, how = sys.argv[1], sys.argv[2]
mesh = dtorch.init_device_mesh("cpu", (4,))
x = dtorch.from_torch(torch.arange(8.0), device_mesh=mesh, placements=[Shard(0)])
assert x.redistribute(placements=[Replicate()]).sum().item() == 28.0
controller, hosts = runtime_pids()
pid = controller if victim == "controller" else hosts[0]
os.kill(pid, getattr(signal, how))
t0 = time.monotonic()
error = None
try:
    while time.monotonic() - t0 < 30:  # keep issuing work and reading values
        f = (x * 2).redistribute(placements=[Replicate()]).sum().to_torch_async()
        if not f.wait(30):
            break  # hung: the test fails on error None
        f.get()
        dtorch.sync()
except RuntimeError as e:
    error = str(e)
latency = time.monotonic() - t0
try:
    (x + 1).sum().item()  # every later call raises too, until a shutdown
    again = None
except RuntimeError as e:
    again = str(e)
dtorch.shutdown()
gone = wait_until(lambda: not any(map(alive, [controller, *hosts])), 10)
fresh = dtorch.init_device_mesh("cpu", (4,))
y = dtorch.from_torch(torch.arange(8.0), device_mesh=fresh, placements=[Shard(0)])
report(error=error, again=again, latency=latency, gone=gone, pid=pid,
       restarted=y.redistribute(placements=[Replicate()]).sum().item())
"""


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
@pytest.mark.parametrize("victim", ["host", "controller"])
def test_a_dead_or_silent_process_raises_quickly_and_shutdown_restarts(victim, how):
    """A killed process closes its pipe; a stopped one stops its heartbeat, and is killed."""
    r = run_client(KILL_ONE, timeout=120, args=[victim, how])
    print(f"\n{victim} {how} noticed after {r['latency'] * 1e3:.0f} ms")
    assert r["error"] is not None, "the client did not raise"
    assert r["latency"] < DEATH_NOTICE_S
    if how == "SIGSTOP":
        assert "no heartbeat" in r["error"] and str(r["pid"]) in r["error"]
    else:
        assert ("SIGKILL" if victim == "host" else "controller") in r["error"]
    assert r["again"] is not None and "shutdown()" in r["again"]
    assert r["restarted"] == 28.0
    assert not alive(r["pid"])


# A client with a 4-device mesh that prints its runtime's pids, then exits or waits to be killed.
CLIENT_WITH_MESH = CLIENT_PRELUDE + """
mesh = dtorch.init_device_mesh("cpu", (4,))
x = dtorch.from_torch(torch.arange(8.0), device_mesh=mesh, placements=[Shard(0)])
assert x.redistribute(placements=[Replicate()]).sum().item() == 28.0
big = x * 2  # pending work and live blobs at exit
controller, hosts = runtime_pids()
report(pids=[controller, *hosts])
sys.stdin.readline()  # "exit" or EOF: exit normally; or be killed meanwhile
"""


@pytest.mark.parametrize("how", ["exit", "SIGKILL", "SIGTERM"])
def test_no_runtime_process_outlives_its_client(how):
    proc, pids = start_client(CLIENT_WITH_MESH), []
    try:
        pids = read_result(proc, timeout=120)["pids"]
        assert len(pids) >= 2 and all(map(alive, pids))
        if how == "exit":
            proc.stdin.write("exit\n")
            proc.stdin.flush()
        else:
            proc.send_signal(getattr(signal, how))
        proc.wait(30)
        gone = wait_until(lambda: not any(map(alive, pids)), GONE_S)
        print(f"\nclient {how}: runtime gone {gone * 1e3:.0f} ms after the client")
    finally:
        proc.kill()
        proc.wait(30)
        for pid in pids:
            if alive(pid):  # leave nothing behind even when the test fails
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("after", ["", "x.sum().item()"])
def test_a_client_exits_with_its_own_status(after):
    """Exiting at once, while the runtime is still starting, is clean too (no abort from a
    thread still inside torch)."""
    code = f"import sys, dtorch\nx = dtorch.ones(2) * 2\n{after}\nsys.exit(3)\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "terminate" not in proc.stderr


def test_shutdown_stops_every_process_and_restart_works():
    r = run_client(CLIENT_PRELUDE + """
mesh = dtorch.init_device_mesh("cpu", (4,))
x = dtorch.ones(8, device_mesh=mesh, placements=[Shard(0)])
first = x.sum().item()
pids = [runtime_pids()[0], *runtime_pids()[1]]
m = dtorch.ones((2, 400, 400), device_mesh=dtorch.DeviceMesh("cpu", [0, 1]),
                placements=[Shard(0)])
for _ in range(20):
    m = (m @ m) / 400
awaited = m.sum().to_torch_async()  # still computing when the runtime stops
t0 = time.monotonic()
dtorch.shutdown()
took = time.monotonic() - t0
try:
    awaited.get(10)
    abandoned = "a value"
except TimeoutError:
    abandoned = "hang"
except RuntimeError as e:
    abandoned = str(e)
left = [p for p in pids if alive(p)]
y = dtorch.ones(8, device_mesh=mesh, placements=[Shard(0)])
report(first=first, took=took, left=left, again=y.sum().item(), abandoned=abandoned,
       new_pids=[runtime_pids()[0], *runtime_pids()[1]], old=pids)
""", timeout=120)
    assert r["first"] == r["again"] == 8.0
    assert r["left"] == [] and r["took"] < 5
    print(f"\nawaited at shutdown: {r['abandoned']}")
    assert r["abandoned"] in ("a value", "dtorch runtime failed: dtorch.shutdown() was called")
    assert not set(r["new_pids"]) & set(r["old"])


# -- large meshes on a small machine --------------------------------------------------------------

MESH_PROGRAM = CLIENT_PRELUDE + """
shape = tuple(json.loads(sys.argv[1]))
t0 = time.monotonic()
mesh = dtorch.init_device_mesh("cpu", shape)
n = len(shape)
t = torch.arange(64 * 4 * 3, dtype=torch.float32).reshape(64 * 4, 3)
x = dtorch.from_torch(t, device_mesh=mesh, placements=[Shard(0)] * n)
y = x * 2 + 1
first = y.sum().item()
first_s = time.monotonic() - t0
ok = []
for d in range(n):  # all-gather over each mesh dim in turn, then back
    placements = [Shard(0)] * n
    placements[d] = Replicate()
    z = y.redistribute(placements=placements)
    ok.append(torch.equal(z.to_torch(), t * 2 + 1))
    ok.append(torch.equal((z - 1).redistribute(placements=[Shard(0)] * n).to_torch(), t * 2))
full = y.redistribute(placements=[Replicate()] * n).to_torch()
report(first=first, first_s=first_s, ok=ok, full=torch.equal(full, t * 2 + 1),
       total_s=time.monotonic() - t0, hosts=len(runtime_pids()[1]))
"""


def run_mesh(shape) -> dict:
    return run_client(MESH_PROGRAM, timeout=300, args=[str(list(shape))])


def test_a_tensor_of_an_ended_runtime_releases_nothing_in_the_next():
    """Its id was never this runtime's: its death must not reach the new runtime (a stray
    record there would be a batch the program never issued)."""
    from dtorch.client import session

    old = dtorch.ones(4, device_mesh=dtorch.DeviceMesh("cpu", [0]))
    assert old.sum().item() == 4.0
    dtorch.shutdown()
    new = dtorch.full((4,), 7.0, device_mesh=dtorch.DeviceMesh("cpu", [0]))
    s = session.current()
    s.flush()
    del old
    assert list(s.records) == []
    del new
    assert len(s.records) == 1  # (the new runtime's own tensor is released as ever)


def test_8_devices_are_usable_within_seconds():
    r = run_mesh((8,))
    print(f"\n8 devices: first value after {r['first_s']:.2f} s, all done after "
          f"{r['total_s']:.2f} s")
    assert r["first"] == float(sum(range(768)) * 2 + 768)
    assert all(r["ok"]) and r["full"]
    assert r["first_s"] < 20


def test_64_devices_on_a_small_machine():
    r = run_mesh((4, 4, 4))
    print(f"\n64 devices on {os.cpu_count()} cores, {r['hosts']} host processes: first value "
          f"after {r['first_s']:.2f} s, all done after {r['total_s']:.2f} s")
    assert all(r["ok"]) and len(r["ok"]) == 6 and r["full"]
    assert r["total_s"] < 240


# -- what crosses a socket ------------------------------------------------------------------------

PACKAGE = pathlib.Path(dtorch.__file__).parent


def test_no_pickle_in_the_package():
    """Nothing in dtorch can pickle: no module imports pickle (or its relatives), and no zmq
    call that pickles (send_pyobj / recv_pyobj) or is meant for Python objects is used."""
    banned_modules = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve",
                      "copyreg"}
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                names = {(node.module or "").split(".")[0]}
            elif isinstance(node, ast.Attribute):
                names = set()
                assert node.attr not in ("send_pyobj", "recv_pyobj"), f"{path}:{node.lineno}"
            else:
                continue
            assert not names & banned_modules, f"{path}:{node.lineno} imports {names}"


def test_no_pickle_at_run_time(tmp_path):
    """Every process of a runtime runs with pickle's entry points trapped (a sitecustomize on
    PYTHONPATH, which the children inherit, and which notes each process it arms): none is
    called."""
    log, armed, site = tmp_path / "pickles.log", tmp_path / "armed.log", tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(f"""
import os, pickle, traceback
def _trap(name, fn):
    def trapped(*args, **kwargs):
        with open({str(log)!r}, "a") as f:
            f.write(f"pid {{os.getpid()}}: pickle.{{name}}\\n{{''.join(traceback.format_stack())}}")
        return fn(*args, **kwargs)
    return trapped
for _name in ("dumps", "dump", "loads", "load"):
    setattr(pickle, _name, _trap(_name, getattr(pickle, _name)))
with open({str(armed)!r}, "a") as f:
    f.write(f"{{os.getpid()}}\\n")
""")
    r = run_client(CLIENT_PRELUDE + """
mesh = dtorch.DeviceMesh("cpu", [[0, 1], [2, 3]])
x = dtorch.randn((8, 6), device_mesh=mesh, placements=[Shard(0), Replicate()])
y = (x @ x.redistribute(placements=[Replicate(), Replicate()]).t()).relu()
z = y.redistribute(dtorch.DeviceMesh("cpu", [4, 5]), [Replicate()])
report(shape=list(z.to_torch().shape), pids=[os.getpid(), runtime_pids()[0], *runtime_pids()[1]])
""", timeout=120, env={"PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    assert r["shape"] == [8, 8]
    assert set(r["pids"]) <= {int(p) for p in armed.read_text().split()}
    assert not log.exists(), log.read_text()[:3000]


def test_sockets_listen_on_loopback_only():
    """Every listening TCP socket of the client, the controller and the hosts (found through
    /proc: the socket inodes each process holds) is bound to 127.0.0.1."""
    mesh = dtorch.DeviceMesh("cpu", [0, 1, 2, 3])
    x = dtorch.ones(8, device_mesh=mesh, placements=[Shard(0)])
    assert x.redistribute(placements=[Replicate()]).sum().item() == 8.0
    controller, hosts = runtime_pids()
    listening = listening_sockets()
    seen = 0
    for pid in [os.getpid(), controller, *hosts]:
        for inode in socket_inodes(pid):
            if inode in listening:
                seen += 1
                assert listening[inode] == "127.0.0.1", (pid, listening[inode])
    assert seen >= 2 + len(hosts)  # the client's two, the controller's one, one+ per host


def test_bind_host_is_configurable():
    """``config.bind_host`` (DTORCH_BIND_HOST) reaches every process: with 127.0.0.2 every
    listening socket of the runtime is bound there."""
    r = run_client(CLIENT_PRELUDE + """
from processes import listening_sockets, socket_inodes
mesh = dtorch.DeviceMesh("cpu", [0, 1, 2, 3])
x = dtorch.ones(8, device_mesh=mesh, placements=[Shard(0)])
total = x.redistribute(placements=[Replicate()]).sum().item()
controller, hosts = runtime_pids()
listening = listening_sockets()
addrs = [listening[i] for p in [os.getpid(), controller, *hosts] for i in socket_inodes(p)
         if i in listening]
report(total=total, addrs=addrs)
""", timeout=120, env={"DTORCH_BIND_HOST": "127.0.0.2"})
    assert r["total"] == 8.0
    assert r["addrs"] and set(r["addrs"]) == {"127.0.0.2"}, r["addrs"]


def test_the_runtime_survives_this_file():
    """The test session's own runtime is still there and right after the tests above."""
    assert torch.equal(dtorch.tensor([1, 2]).mul(3).to_torch(), torch.tensor([3, 6]))


def test_a_host_that_starts_late_gets_every_definition_it_needs():
    """A host started after redistributes and other calls were defined receives the earlier
    definitions (but not the client's redistribute calls, which only the controller lowers)."""
    result = run_client(CLIENT_PRELUDE + """
one = dtorch.DeviceMesh("cpu", [0])
t = torch.randn(5, 7, 3)
x = dtorch.from_torch(t, one, [Shard(2)]).redistribute(placements=[Replicate()])
assert torch.equal(x.to_torch(), t)
y = dtorch.from_torch(t, dtorch.DeviceMesh("cpu", [0, 1, 2]), [Shard(0)])   # starts host 1
report(ok=torch.equal((y * 2).to_torch(), t * 2))
""", timeout=120)
    assert result["ok"]
