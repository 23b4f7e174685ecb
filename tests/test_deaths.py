"""A process that dies during a collective is named in the first error the program sees.

The survivors of a host killed in the middle of an all-gather report gloo's ``Connection reset by
peer`` at once, often before the controller sees the death itself; the controller holds such
reports until it has found the death, heard from every host, or waited ``DEATH_GRACE_S``
(``controller/reports.py``). So the first exception the program gets says which process died
and how, and then which collective the death broke and where it was called. The same holds for a
machine of a cluster: its node agent killed (the main node finds its connection closed) or a
host of it killed (its agent reports it).

Each program that kills runs in a subprocess of its own and reports every trial: the first
error it caught and the time from the kill to that error. Other kernel errors are not held: a
failing kernel on a healthy runtime still raises at once.
"""

from __future__ import annotations

import re
import socket
import statistics
import time

import pytest
import torch

import dtorch
from dtorch import Replicate
from dtorch.controller.logical_graph import LogicalGraph
from dtorch.controller.reports import DEATH_GRACE_S, Reports, collective_names
from dtorch import protocol as P
import extension_kernels as K
from processes import CLIENT_PRELUDE, run_client

DEATH_NOTICE_S = 5.0  # the promise: a dead process is a client error within seconds

# Each trial: a fresh runtime on two devices (one host each), a big collective in a loop that
# reads its result, and a SIGKILL of one host while the third one is on its way.
HOST_DEATHS = CLIENT_PRELUDE + """
def collective(x):
    return x.redistribute(placements=[Replicate()]).sum()  # the call site

trials, results, pids = [t.split(":") for t in sys.argv[1].split(",")], [], []
for op, victim in trials:
    mesh = dtorch.init_device_mesh("cpu", (2,))
    x = dtorch.randn(1 << 21, device_mesh=mesh, placements=[Shard(0)])
    if op == "all_reduce":
        x = x.redistribute(placements=[Replicate()]).redistribute(placements=[Partial()])
    collective(x).item()
    controller, hosts = runtime_pids()
    pid = hosts[int(victim)]
    pids += [controller, *hosts]
    first, latency = first_error_after_kill(lambda: collective(x), pid)
    results.append(dict(op=op, pid=pid, first=first, latency=latency))
    dtorch.shutdown()
    wait_until(lambda: not any(map(alive, pids)), 10)
report(results=results)
"""
HOST_SITE = next(i + 1 for i, line in enumerate(HOST_DEATHS.splitlines())
                 if line.endswith("# the call site"))


def summary(latencies) -> str:
    return (f"median {statistics.median(latencies) * 1e3:.0f} ms, "
            f"max {max(latencies) * 1e3:.0f} ms over {len(latencies)} trials")


def test_a_host_killed_during_a_collective_is_named_in_the_first_error():
    """Each host killed in turn, so that the survivor is once the host of the value's first
    block (its fetch fails with gloo's error, which the controller holds) and once the other."""
    trials = ["all_gather:1", "all_reduce:1", "all_gather:0", "all_reduce:0"]
    r = run_client(HOST_DEATHS, timeout=240, args=[",".join(trials)],
                   env={"DTORCH_CPU_HOSTS": "2"})["results"]
    latencies = [t["latency"] for t in r]
    print(f"\nkill -> first error: {summary([t for t in latencies if t is not None])}")
    for t in r:
        first = t["first"]
        assert first is not None and first != "hung", t
        assert t["latency"] is not None, first  # it came after the kill, not before
        assert re.search(rf"^dtorch runtime failed: host \d pid {t['pid']} was killed by "
                         rf"SIGKILL; its devices' work is lost", first), first
        # ...then the collective it broke and its call site
        assert f"step:{t['op']} failed (called at <string>:{HOST_SITE})" in first, first
        assert t["latency"] < DEATH_NOTICE_S, t


# A main node (this program) with two machines, node agents on 127.0.0.2 and .3 with one host
# each; each trial kills one machine's agent or its host during a collective over both machines:
# the machine without device 0 (the other one's host reads the value's first block, and its
# fetch fails with gloo's error), or for "agent0" the one with device 0.
MACHINE_DEATHS = CLIENT_PRELUDE + """
import subprocess, tempfile
from dtorch.launcher import auth, node

port, trials = int(sys.argv[1]), sys.argv[2].split(",")
tmp = tempfile.mkdtemp(prefix="dtorch-deaths-")
token = os.path.join(tmp, "token")
auth.write_token(token)
main = f"127.0.0.1:{port}"
env = {**os.environ, "DTORCH_CPU_HOSTS": "1"}

def start(bind):
    log = open(os.path.join(tmp, f"agent-{bind}.log"), "a")
    argv = node.command("--main", main, "--token-file", token, "--bind", bind,
                        "--cpu-devices", 2, "--timeout-second", 120)
    return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)

def collective(x):
    return x.redistribute(placements=[Replicate()]).sum()  # the call site

agents = {bind: start(bind) for bind in ("127.0.0.2", "127.0.0.3")}
dtorch.MainNode.set_address(main)
dtorch.MainNode.set_token_file(token)
results, pids = [], []
try:
    for what in trials:
        assert dtorch.MainNode.wait_cluster_ready(2, timeout_second=180), [
            open(os.path.join(tmp, f"agent-{b}.log")).read()[-2000:] for b in agents]
        devices = dtorch.cluster.devices()
        first_holder = devices[0].address
        victim = first_holder if what == "agent0" else next(
            d.address for d in devices if d.address != first_holder)
        agent = agents[victim]
        machine = next(d.machine for d in devices if d.address == victim)
        mesh = dtorch.DeviceMesh("cpu", [d.id for d in devices])
        x = dtorch.randn(1 << 21, device_mesh=mesh, placements=[Shard(0)])
        collective(x).item()
        host = children(agent.pid)[0]
        pid = host if what == "host" else agent.pid
        pids += [agent.pid, host]
        first, latency = first_error_after_kill(lambda: collective(x), pid)
        results.append(dict(what=what, machine=machine, address=victim, agent=agent.pid,
                            host=host, first=first, latency=latency))
        dtorch.shutdown()
        if what != "host":
            agent.wait(10)
            agents[victim] = start(victim)
finally:
    dtorch.shutdown()
    for agent in agents.values():
        agent.terminate()
    for agent in agents.values():
        agent.wait(30)
    wait_until(lambda: not any(map(alive, pids)), 10)
logs = {b: open(os.path.join(tmp, f"agent-{b}.log")).read() for b in agents}
report(results=results, refused=[b for b, log in logs.items() if "token file" in log])
"""
MACHINE_SITE = next(i + 1 for i, line in enumerate(MACHINE_DEATHS.splitlines())
                    if line.endswith("# the call site"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_machine_that_dies_during_a_collective_is_named_in_the_first_error():
    """Its node agent killed: the main node finds the agent's connection closed; its host
    killed: the agent reports it. Either way the first error names the machine."""
    trials = ["agent", "host", "agent0"]
    out = run_client(MACHINE_DEATHS, timeout=420, args=[str(free_port()), ",".join(trials)])
    r = out["results"]
    latencies = [t["latency"] for t in r if t["latency"] is not None]
    print(f"\nmachine kill -> first error: {summary(latencies)}")
    assert [t["what"] for t in r] == trials
    for t in r:
        first = t["first"]
        assert first is not None and first != "hung" and t["latency"] is not None, t
        machine = rf"^dtorch runtime failed: machine {t['machine']} \(\S+ at {t['address']}, " \
                  rf"node agent pid {t['agent']}\)"
        if t["what"] != "host":
            assert re.search(machine + " closed its connection", first), first
        else:
            assert re.search(machine + rf": host 0 pid {t['host']} was killed by SIGKILL", first), \
                first
        assert "its devices' work is lost" in first, first
        assert f"step:all_gather failed (called at <string>:{MACHINE_SITE})" in first, first
        assert t["latency"] < DEATH_NOTICE_S, t
    assert out["refused"] == []  # an agent that served a failed runtime joins the next one


# -- what is held, and what is not ----------------------------------------------------------------


def test_an_ordinary_kernel_error_is_not_held(mesh1):
    """A kernel that raises on a healthy runtime reaches the user without the hold (which
    lasts until every host has beaten, or DEATH_GRACE_S): the median of five is far below it."""
    x = dtorch.from_torch(torch.ones(6), device_mesh=mesh1, placements=[Replicate()])
    failed = dtorch.local_map(K.fails_on_values, [Replicate()])(x)  # hosts import the kernel
    with pytest.raises(RuntimeError, match="boom on the host"):
        dtorch.sync()
    latencies = []
    for _ in range(5):
        t0 = time.monotonic()
        failed = dtorch.local_map(K.fails_on_values, [Replicate()])(x)  # noqa: F841 (kept)
        with pytest.raises(RuntimeError, match="boom on the host"):
            dtorch.sync()
        latencies.append(time.monotonic() - t0)
    print(f"\nan ordinary kernel error: {summary(latencies)}")
    assert statistics.median(latencies) < DEATH_GRACE_S / 10, latencies


def test_only_a_collectives_failure_is_held():
    """The names under which hosts report a collective's failure: COMM calls (redistribute
    steps, operators that run collectives) and their backward, no other call."""
    graph = LogicalGraph()
    graph.define([P.DEFINE_MESH, 1, "cpu", [2], [0, 1]])
    graph.define([P.DEFINE_SPEC, 1, [4], "float32", 1, ["S0"]])
    graph.define([P.DEFINE_SPEC, 2, [4], "float32", 1, ["R"]])
    graph.define([P.DEFINE_CALL, 1, "mul", [1, 0], [1], b"", 0])
    graph.define([P.DEFINE_CALL, 2, "scaled_dot_product_attention", [1], [1], b"", P.COMM])
    graph.step_call("all_gather", 1, 2, b"", P.COMM, [])
    graph.step_call("chunk", 2, 1, b"", 0, [])
    names = collective_names(graph.calls)
    assert names == {"step:all_gather", "scaled_dot_product_attention",
                     "step:all_gather (backward)", "scaled_dot_product_attention (backward)"}


def test_the_client_hears_what_was_held_in_order():
    sent = []
    reports = Reports(lambda frames: sent.append(frames[0]))
    reports.send(P.VALUE, [b"before"])
    reports.send(P.FETCH_FAILED, [b"collective"], report=True)
    reports.send(P.SYNCED, [b"synced"])
    assert sent == [b"before"] and reports.holding
    reports.release()  # no death came
    assert sent == [b"before", b"collective", b"synced"] and not reports.holding
    reports.send(P.VALUE, [b"after"])
    assert sent[-1] == b"after"


# A late peer (asleep, alive) makes the survivor's all-gather miss its deadline: a collective's
# failure with no death behind it, which the controller holds and then lets go.
LATE_PEER = CLIENT_PRELUDE + """
import reliability_kernels as K
slow = dtorch.register_op("slow_on_device_1(input: Tensor, seconds)", K.slow_on_device_1,
                          [((Shard(0),), (Shard(0),))], uses_context=True,
                          meta=lambda input, seconds: torch.empty_like(input))
mesh = dtorch.DeviceMesh("cpu", [0, 1])
x = dtorch.from_torch(torch.arange(4.0), device_mesh=mesh, placements=[Shard(0)])
x.redistribute(placements=[Replicate()]).to_torch()  # the group exists on both devices
t0 = time.monotonic()
late = slow(x, float(sys.argv[1])).redistribute(placements=[Replicate()])  # the call site
try:
    late.to_torch_async().get(60)  # device 0's block: its all-gather misses the deadline
    error = None
except RuntimeError as e:
    error = str(e)
report(error=error, latency=time.monotonic() - t0)
"""
LATE_SITE = next(i + 1 for i, line in enumerate(LATE_PEER.splitlines())
                 if line.endswith("# the call site"))


def test_a_collectives_failure_with_no_death_behind_it_is_let_go():
    """The failure reaches the user once every host has beaten since it came, and it is the
    collective's own error, not a runtime failure."""
    deadline_s = 2.0
    r = run_client(LATE_PEER, timeout=120, args=[str(3 * deadline_s)],
                   env={"DTORCH_COLLECTIVE_TIMEOUT": str(deadline_s), "DTORCH_CPU_HOSTS": "2"})
    print(f"\nthe late peer's collective failed {r['latency']:.2f} s after the call "
          f"(deadline {deadline_s} s)")
    assert r["error"] is not None
    assert re.search(rf"^dtorch.step:all_gather failed \(called at <string>:{LATE_SITE}\): ",
                     r["error"]), r["error"]
    assert "runtime failed" not in r["error"]
    assert deadline_s * 0.75 <= r["latency"] < 2 * deadline_s, r
