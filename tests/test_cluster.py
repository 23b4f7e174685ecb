"""Many machines, on this one: each "machine" is a node agent (``dtorch node``) bound to a
loopback address of its own (127.0.0.2, 127.0.0.3, ...) with its own host processes, joined to
this test session's runtime as the cluster's main node (at 127.0.0.1).

Each test gets the machines it needs (the ``cluster`` of two, or ``three_machines``, the third
joined through a fake SLURM environment and the ``dtorch`` console script), whatever the tests
before it killed or added: they run in any order. Values across machines equal torch's: every
redistribute transition, tensor parallel matmuls, pipeline stages on different machines. A wrong
token is refused, logged and leaves the cluster alone. A killed agent and a stopped one each
become a client error naming its machine within 5 s, leave no process behind, and a fresh
runtime over the agents left works.

Agents run as processes of this test (they are the machines); every wait has a deadline. What a
node agent does without a cluster (token, command line, handshakes) is tests/test_node_agent.py.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import torch

import dtorch
from dtorch import Partial, Replicate, Shard
from dtorch.cluster import main_node
from dtorch.launcher import auth, node, slurm
from helpers import assert_close, distribute
from processes import CLIENT_PRELUDE, alive, children, run_client, wait_until

R, S0, S1, P_SUM = Replicate(), Shard(0), Shard(1), Partial()
ONE_D = [R, S0, S1, P_SUM, Partial("max"), Partial("avg")]
TWO_D = [list(p) for p in itertools.product([R, S0, S1, P_SUM], repeat=2)]
READY_S = 180  # a machine's hosts import torch: seconds each on a busy machine
DEADLINE_S = 5.0  # the bound on noticing a silent machine


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def check_all(x, t, targets) -> None:
    """Issues every redistribute first (they pipeline), then checks each value and layout."""
    outs = [x.redistribute(placements=list(dst)) for dst in targets]
    for dst, y in zip(targets, outs):
        assert y.placements == list(dst), (x.placements, dst)
        assert_close(y, t)


# -- the cluster ----------------------------------------------------------------------------------


def free_port() -> int:
    """A free port that a SLURM job id can name (``slurm.port``)."""
    for port in range(slurm.BASE_PORT + os.getpid() % 10000, slurm.BASE_PORT + slurm.PORTS):
        with socket.socket() as s:
            with contextlib.suppress(OSError):
                s.bind(("127.0.0.1", port))
                return port
    raise RuntimeError("no free port")


class Cluster:
    def __init__(self, tmp: str):
        self.tmp = tmp
        self.token = os.path.join(tmp, "token")
        auth.write_token(self.token)
        self.port = free_port()
        self.main = f"127.0.0.1:{self.port}"
        self.agents: dict = {}  # bind address -> Popen
        self.specs: dict = {}  # bind address -> (argv, env) it was started with
        # one host process per machine: a "machine" here shares two cores with the others
        self.env = {**os.environ, "DTORCH_CPU_HOSTS": "1"}

    def start(self, bind: str, devices: int = 2, token: str | None = None, argv=None,
              env=None) -> subprocess.Popen:
        self.specs[bind] = (argv, env)  # (how ``keep`` starts it again)
        log = open(os.path.join(self.tmp, f"agent-{bind}-{len(self.agents)}.log"), "w+")
        argv = argv or node.command("--main", self.main, "--token-file", token or self.token,
                                    "--bind", bind, "--cpu-devices", devices)
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                env={**self.env, **(env or {})})
        proc.log = log
        self.agents[bind] = proc
        return proc

    def log_of(self, bind: str) -> str:
        log = self.agents[bind].log
        log.seek(0)
        return log.read()

    def machine_of(self, bind: str) -> int:
        return next(d.machine for d in dtorch.cluster.devices() if d.address == bind)

    def devices_of(self, bind: str) -> list:
        return [d.id for d in dtorch.cluster.devices() if d.address == bind]

    def stop(self, binds=None) -> None:
        """Stops the agents of ``binds`` (default: all) and their hosts."""
        procs = [p for b, p in self.agents.items() if binds is None or b in binds]
        hosts = [pid for proc in procs for pid in children(proc.pid)]
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            proc.log.close()
        wait_until(lambda: not any(map(alive, hosts)), timeout=30)  # no host left behind

    def keep(self, wanted) -> None:
        """Makes the cluster the machines ``wanted`` (bind addresses), whatever an earlier test
        did to it: an agent it killed is started again, one it added is stopped. When the
        machines must change, the runtime stops first (the next call starts one that the
        agents join)."""
        running = {b for b, p in self.agents.items() if p.poll() is None}
        if running == set(wanted) and dtorch.MainNode.num_node_in_cluster() == len(wanted):
            return
        dtorch.shutdown()
        self.stop(running - set(wanted))
        for bind in set(wanted) - running:
            argv, env = self.specs.get(bind, (None, None))
            self.start(bind, argv=argv, env=env)
        assert dtorch.MainNode.wait_cluster_ready(len(wanted), timeout_second=READY_S), \
            "".join(self.log_of(b) for b in wanted)
        assert dtorch.MainNode.num_node_in_cluster() == len(wanted)


TWO = ("127.0.0.2", "127.0.0.3")
THIRD = "127.0.0.1"  # joins late, through srun's environment (``slurm_agent``)


@pytest.fixture(scope="module")
def agents():
    """This session's runtime as a cluster's main node, and the node agents started so far;
    the fixtures below give each test the machines it needs, whatever the tests before it
    killed or added (they run in any order)."""
    dtorch.shutdown()
    saved = main_node._address, main_node._token_file
    with tempfile.TemporaryDirectory(prefix="dtorch-cluster-") as tmp:
        c = Cluster(tmp)
        try:
            dtorch.MainNode.set_address(c.main)
            dtorch.MainNode.set_token_file(c.token)
            yield c
        finally:
            dtorch.shutdown()
            main_node._address, main_node._token_file = saved
            c.stop()


@pytest.fixture
def cluster(agents):
    """Two machines, 127.0.0.2 and .3 (devices 0, 1 and 2, 3)."""
    agents.keep(TWO)
    return agents


@pytest.fixture
def three_machines(agents):
    """The two machines and a third that joined late (devices 4, 5)."""
    if THIRD not in agents.specs:
        agents.specs[THIRD] = slurm_agent(agents)
    agents.keep((*TWO, THIRD))
    return agents


def slurm_agent(cluster) -> tuple:
    """(argv, env) of an agent started as ``srun dtorch node`` would start it: the console
    script, its main node and token from srun's environment."""
    env = {"SLURM_JOB_ID": str(cluster.port - slurm.BASE_PORT), "SLURM_PROCID": "2",
           "SLURMD_NODENAME": "fake-slurm-node", "SLURM_LAUNCH_NODE_IPADDR": "127.0.0.1",
           "DTORCH_TOKEN_FILE": cluster.token}
    script = os.path.join(os.path.dirname(sys.executable), "dtorch")
    argv = [script, "node", "--cpu-devices", "2"] if os.path.exists(script) else \
        [sys.executable, "-m", "dtorch.launcher.cli", "node", "--cpu-devices", "2"]
    return argv, env


def test_devices_are_numbered_machine_by_machine(cluster):
    assert dtorch.MainNode.num_node_in_cluster() == 2
    assert dtorch.MainNode.wait_cluster_ready(2, timeout_second=0) is True
    devices = dtorch.cluster.devices()
    assert [d.id for d in devices] == [0, 1, 2, 3]
    assert [d.machine for d in devices] == [1, 1, 2, 2]
    assert {d.address for d in devices} == {"127.0.0.2", "127.0.0.3"}
    assert len({d.address for d in devices if d.machine == 1}) == 1
    assert dtorch.MainNode.get_address() == cluster.main


def test_a_mesh_beyond_the_cluster_fails_naming_the_fix(cluster):
    """Checked by the controller, which alone knows the machines: it fails the runtime (the
    fixture's next test starts a fresh one, which the agents join again)."""
    x = dtorch.ones((4,), device_mesh=dtorch.DeviceMesh("cpu", [0, 7]))
    with pytest.raises(RuntimeError, match=r"devices \[7\].*wait_cluster_ready"):
        x.sum().item()
    dtorch.shutdown()
    assert dtorch.MainNode.wait_cluster_ready(2, timeout_second=READY_S)


@pytest.mark.parametrize("shape", [(6, 3), (5, 7)], ids=str)
def test_every_1d_transition_over_two_machines(cluster, shape):
    mesh = dtorch.DeviceMesh("cpu", [0, 1, 2, 3])
    t = rand(*shape)
    for src in ONE_D:
        x = distribute(t, mesh, [src])
        check_all(x, t, [[dst] for dst in ONE_D + [Partial("min")] if dst != src])


@pytest.mark.parametrize("layout", [[[0, 1], [2, 3]], [[0, 2], [1, 3]]],
                         ids=["dp-across-machines", "tp-across-machines"])
def test_every_2d_transition_over_two_machines(cluster, layout):
    mesh = dtorch.DeviceMesh("cpu", layout)
    t = rand(4, 6, seed=1)
    for src in TWO_D:
        check_all(distribute(t, mesh, src), t, [dst for dst in TWO_D if dst != src])


def tp_mlp(mesh, tp_dim: int):
    """Column- then row-parallel matmuls on mesh dim ``tp_dim``, against torch."""
    x, w1, w2 = rand(8, 6, seed=2), rand(6, 10, seed=3), rand(10, 6, seed=4)
    rest = [R] * mesh.ndim

    def on(tp_placement):
        p = list(rest)
        p[tp_dim] = tp_placement
        return p

    dx = dtorch.from_torch(x, device_mesh=mesh, placements=rest)
    dw1 = dtorch.from_torch(w1, device_mesh=mesh, placements=on(S1))
    dw2 = dtorch.from_torch(w2, device_mesh=mesh, placements=on(S0))
    h = dtorch.relu(dx @ dw1)
    assert h.placements == on(S1)
    y = h @ dw2
    assert y.placements == on(P_SUM)
    assert_close(y.redistribute(placements=rest), torch.relu(x @ w1) @ w2)


def test_tensor_parallel_matmuls_across_machines(cluster):
    tp_mlp(dtorch.DeviceMesh("cpu", [0, 1, 2, 3]), 0)
    tp_mlp(dtorch.DeviceMesh("cpu", [[0, 2], [1, 3]], mesh_dim_names=["dp", "tp"]), 1)


def test_pipeline_stages_on_different_machines(cluster):
    first, second = (dtorch.DeviceMesh("cpu", cluster.devices_of(a))
                     for a in ("127.0.0.2", "127.0.0.3"))
    torch.manual_seed(0)
    stages = [dtorch.nn.Linear(6, 6, device_mesh=m) for m in (first, second)]
    t = rand(8, 6, seed=5)
    x = dtorch.from_torch(t, device_mesh=first)
    y = dtorch.nn.pipeline(stages, x, microbatches=4)
    assert y.device_mesh == second
    twins = [torch.nn.Linear(6, 6) for _ in stages]
    for twin, stage in zip(twins, stages):
        twin.load_state_dict({k: v.to_torch() for k, v in stage.state_dict().items()})
    with torch.no_grad():
        assert_close(y, twins[1](twins[0](t)))


def test_a_wrong_token_is_refused_and_logged(cluster, tmp_path):
    wrong = str(tmp_path / "wrong")
    auth.write_token(wrong)
    proc = cluster.start("127.0.0.9", token=wrong)
    assert proc.wait(60) == 1
    assert "refused this node agent" in cluster.log_of("127.0.0.9")
    assert dtorch.MainNode.num_node_in_cluster() == 2  # the cluster is unaffected
    x = dtorch.arange(8.0, device_mesh=dtorch.DeviceMesh("cpu", [0, 1, 2, 3]),
                      placements=[S0])
    assert x.redistribute(placements=[R]).sum().item() == 28.0


def test_a_machine_joining_late_serves_the_meshes_made_after(cluster):
    """The third machine comes through srun's environment and the console script, while a
    runtime serves the other two."""
    dtorch.sync()
    before = dtorch.cluster.devices()
    argv, env = slurm_agent(cluster)
    cluster.start(THIRD, argv=argv, env=env)
    assert dtorch.MainNode.wait_cluster_ready(3, timeout_second=READY_S), cluster.log_of(THIRD)
    devices = dtorch.cluster.devices()
    assert devices[:4] == before
    assert [(d.id, d.machine, d.name) for d in devices[4:]] == [
        (4, 3, "fake-slurm-node"), (5, 3, "fake-slurm-node")]


def test_every_1d_transition_over_three_machines(three_machines):
    mesh = dtorch.DeviceMesh("cpu", list(range(6)))
    t = rand(7, 5, seed=6)
    for src in ONE_D:
        check_all(distribute(t, mesh, [src]), t,
                  [[dst] for dst in ONE_D + [Partial("min")] if dst != src])


def test_every_2d_transition_over_three_machines(three_machines):
    mesh = dtorch.DeviceMesh("cpu", [[0, 1], [2, 3], [4, 5]], mesh_dim_names=["dp", "tp"])
    t = rand(6, 4, seed=7)
    for src in TWO_D:
        check_all(distribute(t, mesh, src), t, [dst for dst in TWO_D if dst != src])
    tp_mlp(mesh, 1)
    tp_mlp(dtorch.DeviceMesh("cpu", [[0, 2, 4], [1, 3, 5]]), 1)  # tp across all three


def _error_within_deadline(what: str) -> float:
    """Seconds until a sync raises the runtime's failure naming ``what``."""
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=what):
        dtorch.sync()
    elapsed = time.monotonic() - t0
    print(f"\nthe client's error came {elapsed:.2f} s after the machine went silent")
    return elapsed


def test_a_killed_agent_is_a_client_error_within_5s(cluster):
    """...naming its machine; its hosts exit with it, and a fresh runtime over the agent left
    works (it stops its hosts when the runtime ends and joins the next one)."""
    victim = "127.0.0.3"
    machine = cluster.machine_of(victim)
    proc = cluster.agents[victim]
    hosts = children(proc.pid)
    assert hosts
    proc.kill()
    elapsed = _error_within_deadline(rf"machine {machine} \(.* at {victim}, node agent pid "
                                     rf"{proc.pid}\)")
    assert elapsed < DEADLINE_S, elapsed
    wait_until(lambda: not any(map(alive, hosts)), timeout=10)  # no orphan
    dtorch.shutdown()
    assert dtorch.MainNode.wait_cluster_ready(1, timeout_second=READY_S)
    assert dtorch.MainNode.num_node_in_cluster() == 1
    mesh = dtorch.DeviceMesh("cpu", [0, 1])
    x = dtorch.from_torch(torch.arange(8.0), device_mesh=mesh, placements=[S0])
    assert torch.equal(x.redistribute(placements=[R]).to_torch(), torch.arange(8.0))


def test_a_stopped_agent_is_a_client_error_within_5s(cluster):
    victim = "127.0.0.2"
    machine = cluster.machine_of(victim)
    proc = cluster.agents[victim]
    hosts = children(proc.pid)
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        elapsed = _error_within_deadline(rf"machine {machine} \(.* at {victim}, .*sent "
                                         rf"nothing for")
        assert elapsed < DEADLINE_S, elapsed
    finally:
        proc.kill()  # a stopped process dies of SIGKILL too; its hosts follow
        dtorch.shutdown()
    wait_until(lambda: not any(map(alive, hosts)), timeout=10)


def _elastic_reference(seed: int, steps: int) -> tuple:
    """The test program's ``steps`` global batches, its ``build`` and the losses of an
    uninterrupted elastic run of them over the cluster's 4 devices."""
    import elastic_program as program

    g = torch.Generator().manual_seed(seed)
    batches = [torch.randint(0, program.VOCAB, (program.BATCH, program.SEQ), generator=g)
               for _ in range(steps)]
    build = functools.partial(program.build, zero=0)
    with dtorch.elastic.Elastic(build, (4,), ["dp"], devices="cluster") as run:
        reference = [run.step(program.train_step, b) for b in batches]
    return program, batches, build, reference


def test_elastic_run_loses_a_machine_goes_on_and_grows_back_when_it_rejoins(cluster):
    """dtorch.elastic over the cluster: machine 2's agent SIGKILLed during step 4, the run
    goes on on machine 1's devices (dp 4 -> 2, the runtime started again and the devices
    numbered anew); the agent started again joins, and at the next step boundary dp grows back
    to 4. Every loss equals the uninterrupted run's (the same global batches)."""
    program, batches, build, reference = _elastic_reference(1, 10)
    victim = "127.0.0.3"
    doomed = cluster.agents[victim]
    hosts = children(doomed.pid)
    losses, timer = [], threading.Timer(0.02, doomed.kill)
    with dtorch.elastic.Elastic(build, (4,), ["dp"], devices="cluster", regrow=True) as run:
        for k, batch in enumerate(batches, 1):
            if k == 4:
                doomed_ids = set(cluster.devices_of(victim))  # numbered by join order
                timer.start()
            losses.append(run.step(program.train_step, batch))
            if run.events and run.events[-1].kind == "recovered":
                cluster.start(victim)  # the machine is back: its agent joins this runtime
                assert dtorch.MainNode.wait_cluster_ready(2, timeout_second=READY_S)
        events = [(e.kind, e.mesh_shape) for e in run.events]
    timer.join()
    wait_until(lambda: not any(map(alive, hosts)), timeout=10)
    assert events == [("lost", (2,)), ("recovered", (2,)), ("grown", (4,))], run.events
    assert len(doomed_ids) == 2 and set(run.events[0].lost_devices) == doomed_ids
    assert losses == pytest.approx(reference, abs=1e-5)


def test_elastic_run_waits_for_a_lost_machine_with_shrink_off(cluster):
    """shrink=False over the cluster: a lost machine is waited for, not dropped. Machine 2's
    agent SIGKILLed during step 3 and started again as soon as the loss is seen; the run goes
    on on dp 4 once it has joined, every loss the uninterrupted run's."""
    program, batches, build, reference = _elastic_reference(2, 6)
    victim = "127.0.0.3"
    doomed = cluster.agents[victim]
    hosts = children(doomed.pid)
    restarts = []

    def on_event(event):
        if event.kind == "lost":  # the machine comes back while the run waits for it
            restarts.append(threading.Thread(target=cluster.start, args=[victim]))
            restarts[-1].start()

    losses, timer = [], threading.Timer(0.02, doomed.kill)
    with dtorch.elastic.Elastic(build, (4,), ["dp"], devices="cluster", shrink=False,
                                on_event=on_event, rejoin_timeout_s=60) as run:
        for k, batch in enumerate(batches, 1):
            if k == 3:
                timer.start()
            losses.append(run.step(program.train_step, batch))
        events = [(e.kind, e.mesh_shape) for e in run.events]
    timer.join()
    for thread in restarts:
        thread.join()
    wait_until(lambda: not any(map(alive, hosts)), timeout=10)
    assert events == [("lost", (4,)), ("recovered", (4,))], run.events
    assert "waiting up to 60 s for the machines to join again" in run.events[0].message
    assert losses == pytest.approx(reference, abs=1e-5)


def test_elastic_run_stops_when_the_lost_machine_does_not_come_back(cluster):
    """shrink=False, and the machine stays away: after rejoin_timeout_s the run raises
    Unrecoverable naming the wait, with the last committed snapshot (readable on one
    machine's devices)."""
    import elastic_program as program

    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, program.VOCAB, (program.BATCH, program.SEQ), generator=g)
               for _ in range(4)]
    doomed = cluster.agents["127.0.0.3"]
    timer = threading.Timer(0.02, doomed.kill)
    run = dtorch.elastic.Elastic(lambda mesh: program.build(mesh, 0), (4,), ["dp"],
                                 devices="cluster", shrink=False, rejoin_timeout_s=1)
    with pytest.raises(dtorch.elastic.Unrecoverable, match=r"did not join within 1 s") as e:
        for k, batch in enumerate(batches, 1):
            if k == 3:
                timer.start()
            run.step(program.train_step, batch)
    timer.join()
    try:
        assert e.value.step in (1, 2) and e.value.snapshot == run.directory
        assert dtorch.MainNode.wait_cluster_ready(1, timeout_second=READY_S)  # the survivor
        model = program.build(dtorch.DeviceMesh("cpu", [0, 1], mesh_dim_names=["dp"]),
                              0)["model"]
        dtorch.load_checkpoint(model, e.value.snapshot, key_map=lambda k: (
            k[len("model/"):] if k.startswith("model/") else None))
    finally:
        run.close()
        dtorch.shutdown()


# -- Ray ------------------------------------------------------------------------------------------

RAY_CLIENT = CLIENT_PRELUDE + """
import ray
from ray.cluster_utils import Cluster
import dtorch.cluster.ray
simulated = Cluster(initialize_head=True, head_node_args={"num_cpus": 1,
                                                          "node_ip_address": "127.0.0.1"})
simulated.add_node(num_cpus=1, node_ip_address="127.0.0.1")
ray.init(address=simulated.address)
launched = dtorch.cluster.ray.start(num_nodes=2, cpu_devices_per_node=1, timeout_second=240)
devices = dtorch.cluster.devices()
mesh = dtorch.DeviceMesh("cpu", [0, 1])
x = dtorch.from_torch(torch.arange(6.0), device_mesh=mesh, placements=[Shard(0)])
total = x.redistribute(placements=[Replicate()]).sum().item()
report(nodes=dtorch.MainNode.num_node_in_cluster(), machines=[d.machine for d in devices],
       names=sorted({d.name.split(" (")[0] for d in devices}), total=total)
dtorch.shutdown()
launched.shutdown()
ray.shutdown()
simulated.shutdown()
"""


def test_the_ray_launcher_places_an_agent_per_node():
    pytest.importorskip("ray")
    # Ray's simulated nodes on loopback: its "no multi-machine clusters" switch keeps every
    # address at 127.0.0.1 (it would pick this machine's network address otherwise)
    result = run_client(RAY_CLIENT, timeout=250, env={"DTORCH_CPU_HOSTS": "1",
                                                      "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})
    assert result == {"nodes": 2, "machines": [1, 2], "names": ["ray node 0", "ray node 1"],
                      "total": 15.0}
