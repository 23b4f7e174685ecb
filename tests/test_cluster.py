"""Many machines, on this one: each "machine" is a node agent (``dtorch node``) bound to a
loopback address of its own (127.0.0.2, 127.0.0.3, ...) with its own host processes, joined to
this test session's runtime as the cluster's main node (at 127.0.0.1).

The module's cluster starts with two machines; a third joins later (through a fake SLURM
environment and the ``dtorch`` console script), and meshes made after it joined use it. Values
across machines equal torch's: every redistribute transition, tensor parallel matmuls, pipeline
stages on different machines. A wrong token is refused, logged and leaves the cluster alone. The
last tests kill an agent and stop another: each becomes a client error naming its machine within
5 s, leaves no process behind, and a fresh runtime over the agents left works.

Agents run as processes of this test (they are the machines); every wait has a deadline.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest
import torch

import dtorch
from dtorch import Partial, Replicate, Shard
from dtorch.cluster import auth, cli, main_node, node, slurm
from dtorch.cluster.store import StoreServer
from dtorch import protocol as P
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


# -- no processes ---------------------------------------------------------------------------------


@pytest.fixture
def token(tmp_path):
    path = str(tmp_path / "token")
    auth.write_token(path)
    return path


def test_a_token_file_is_private_and_checked(token, tmp_path):
    assert os.stat(token).st_mode & 0o077 == 0
    assert auth.read_token(token) == auth.read_token(token)
    os.chmod(token, 0o644)
    with pytest.raises(PermissionError, match="chmod 600"):
        auth.read_token(token)
    with pytest.raises(FileNotFoundError, match="dtorch token"):
        auth.read_token(str(tmp_path / "missing"))


def test_binding_beyond_loopback_must_be_asked_for(token):
    with pytest.raises(cli.UsageError, match="--bind"):
        node.settings(["--main", "10.0.0.1:13000", "--token-file", token], {})
    args = node.settings(["--main", "10.0.0.1:13000", "--token-file", token, "--bind",
                          "10.0.0.7"], {})
    assert args.bind == "10.0.0.7"
    assert node.settings(["--main", "127.0.0.1:13000", "--token-file", token], {}).bind == \
        "127.0.0.1"
    with pytest.raises(cli.UsageError, match="--token-file"):
        node.settings(["--main", "127.0.0.1:13000"], {})
    with pytest.raises(cli.UsageError, match="IPv4:port"):
        node.settings(["--main", "main-node:13000", "--token-file", token], {})
    with pytest.raises(cli.UsageError, match="DTORCH_MAIN_NODE_ADDRESS 'main-node:1'"):
        node.settings(["--token-file", token], {"DTORCH_MAIN_NODE_ADDRESS": "main-node:1"})


BAD_COMMANDS = [  # (argv after ``dtorch``, what the one line must say)
    (["node", "--main", "localhost:13000"], r"--main 'localhost:13000' is not 'IPv4:port'"),
    (["node", "--main", "127.0.0.1:13000"], r"no token: pass --token-file"),
    (["node", "--main", "127.0.0.1:13000", "--token-file", "{missing}"],
     r"cannot read the cluster token file .* make one with `dtorch token"),
    (["node", "--main", "127.0.0.1:13000", "--token-file", "{token}", "--bind", "eth0"],
     r"--bind 'eth0' is not an IPv4 address"),
    (["node", "--main", "127.0.0.1:13000", "--token-file", "{token}", "--cpu-devices", "0"],
     r"--cpu-devices must be at least 1"),
    (["node", "--cpu-devices", "four"], r"argument --cpu-devices: invalid int value"),
    (["node", "--timeout-second", "-1", "--main", "127.0.0.1:1", "--token-file", "{token}"],
     r"--timeout-second must be a number of seconds > 0"),
    (["node", "--frob"], r"unrecognized arguments: --frob \(dtorch node --help"),
    (["token"], r"the following arguments are required: FILE"),
    (["token", "{token}"], r"exists; remove it first"),
    (["token", "{missing}/sub/token"], r"cannot write .*: No such file or directory"),
    (["frob"], r"no command 'frob'; usage: dtorch node"),
]


@pytest.mark.parametrize("argv, says", BAD_COMMANDS, ids=[" ".join(a) for a, _ in BAD_COMMANDS])
def test_bad_command_line_input_is_one_line_and_status_2(token, tmp_path, argv, says):
    """As argparse has it, for every kind of bad input: no traceback, no usage block."""
    argv = [a.format(token=token, missing=tmp_path / "missing") for a in argv]
    proc = subprocess.run(cli.command(*argv), capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in os.environ.items()
                               if k not in ("DTORCH_MAIN_NODE_ADDRESS", "DTORCH_TOKEN_FILE")})
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"dtorch {argv[0]}: error: " if argv[0] in cli.COMMANDS
                               else "dtorch: error: "), lines
    assert re.search(says, lines[0]), lines[0]


def test_a_good_token_command_writes_a_private_token(tmp_path):
    path = tmp_path / "token"
    proc = subprocess.run(cli.command("token", path), capture_output=True, text=True,
                          timeout=60)
    assert (proc.returncode, proc.stderr) == (0, "")
    assert os.stat(path).st_mode & 0o077 == 0
    assert auth.read_token(str(path))


def test_srun_needs_no_arguments(token):
    """The agent's settings from a SLURM task's environment alone."""
    env = {"SLURM_JOB_ID": "777", "SLURM_PROCID": "3", "SLURMD_NODENAME": "cpu12",
           "SLURM_LAUNCH_NODE_IPADDR": "127.0.0.1", "DTORCH_TOKEN_FILE": token}
    args = node.settings([], env)
    assert (args.main, args.rank, args.name, args.bind, args.token_file) == (
        f"127.0.0.1:{13000 + 777}", 3, "cpu12", "127.0.0.1", token)
    # the script's own address wins over SLURM's guess
    env["DTORCH_MAIN_NODE_ADDRESS"] = "127.0.0.1:15000"
    assert node.settings([], env).main == "127.0.0.1:15000"


def test_the_store_parks_a_get_until_its_key_is_set():
    store, answers = StoreServer(), []
    ask = lambda op, *args: store.handle(  # noqa: E731
        P.StoreRequest(P.STORE_REQUEST, "c", op, list(args)), answers.append)
    ask("get", "k")
    ask("wait", ["k", "j"])
    assert answers == []
    ask("set", "k", b"v")
    assert answers == [b"v", None]  # the parked get's answer, then the set's
    ask("set", "j", b"w")
    assert answers[-2:] == [None, None] and len(answers) == 4
    ask("add", "n", 2)
    ask("add", "n", 3)
    ask("check", ["n", "x"])
    assert answers[-3:] == [2, 5, False]


def test_one_machine_cannot_wait_for_more(monkeypatch):
    """(A program that is no main node: the cluster tests' settings put aside, as they may run
    before this test or around it.)"""
    monkeypatch.setattr(main_node, "_address", None)
    monkeypatch.delenv(main_node.ENV, raising=False)
    assert main_node.cluster_settings() is None
    with pytest.raises(RuntimeError, match="set_address"):
        dtorch.MainNode.wait_cluster_ready(2, timeout_second=1)


class FakeMainNode:
    """A main node's node socket (``cluster/machines.py``'s, served with ``keys``) at ``port``,
    that welcomes nobody: it answers an agent's join with goodbye, which ends the agent's run."""

    def __init__(self, keys: auth.Keys, port: int):
        import zmq

        self.ctx = zmq.Context()
        self.gatekeeper = auth.Gatekeeper(self.ctx, keys)
        self.gatekeeper.admit(auth.CLUSTER_DOMAIN, keys)
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        auth.serve(self.sock, keys, auth.CLUSTER_DOMAIN)
        self.sock.bind(f"tcp://127.0.0.1:{port}")

    def send_bye_on_join(self, timeout_s: float) -> bool:
        if not self.sock.poll(timeout_s * 1000):
            return False
        identity, frame = self.sock.recv_multipart()
        assert P.unpack(frame)[0] == P.NODE_JOIN
        self.sock.send_multipart([identity, P.NODE_CONTROL, P.pack(P.NodeBye(P.NODE_BYE, "test"))])
        return True

    def close(self) -> None:
        self.sock.close(0)
        self.gatekeeper.close()
        self.ctx.destroy(0)


def serve_one_in_thread(agent: node.Agent) -> tuple:
    """Runs one of the agent's runs on a thread; returns (thread, outcome: [result or error])."""
    import threading

    outcome = []

    def serve():
        try:
            outcome.append(agent.serve_one(wait_s=60))
        except Exception as e:  # noqa: BLE001 - the test reads it
            outcome.append(e)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread, outcome


@pytest.fixture
def agent_of(token, monkeypatch):
    """An agent of ``token``'s cluster in this process, for a main node at a port (no hosts
    start: the fake main node never welcomes it). Its settings go back after the test."""
    from dtorch import config

    monkeypatch.setattr(config, "bind_host", config.bind_host)
    monkeypatch.setattr(config, "cpu_hosts", config.cpu_hosts)
    made = []

    def make(port: int, keys=None) -> node.Agent:
        made.append(node.Agent(f"127.0.0.1:{port}", keys or auth.read_token(token),
                               "127.0.0.1", config.cpu_hosts))
        return made[-1]

    yield make
    for agent in made:
        agent.gatekeeper.close()
        agent.ctx.destroy(0)


def test_a_handshake_cut_short_is_not_a_wrong_token(token, agent_of, caplog):
    """The main node goes away in mid-handshake (a runtime ending as the agent reconnects):
    the agent says so and joins the next main node at the same address."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as zmq's listener
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        with caplog.at_level("WARNING", logger="dtorch"):
            thread, outcome = serve_one_in_thread(agent_of(port))
            conn, _ = listener.accept()
            conn.recv(64)  # the agent's greeting: its handshake has begun
            conn.close()  # the main node goes away
    main = FakeMainNode(auth.read_token(token), port)
    try:
        assert main.send_bye_on_join(timeout_s=30), outcome
        thread.join(30)
        assert outcome == [True]  # served to its end, not refused
    finally:
        main.close()
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "lost during its handshake (the main node went away" in logged, logged
    assert "token" not in logged


def test_a_real_key_mismatch_says_the_token_is_wrong(agent_of, tmp_path):
    other = str(tmp_path / "other")
    auth.write_token(other)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    main = FakeMainNode(auth.read_token(other), port)
    try:
        thread, outcome = serve_one_in_thread(agent_of(port))
        thread.join(30)
    finally:
        main.close()
    assert len(outcome) == 1 and isinstance(outcome[0], node.Refused), outcome
    assert f"127.0.0.1:{port} refused this node agent" in str(outcome[0])
    assert "token file is not the cluster's" in str(outcome[0])


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
        [sys.executable, "-m", "dtorch.cluster.cli", "node", "--cpu-devices", "2"]
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


def test_the_controller_logs_a_refused_handshake(caplog):
    """What the main node logs when a peer with another token knocks (the controller logs to
    its stderr; here the same watch runs in this process)."""
    import zmq

    good, bad = auth.Keys.generate(), auth.Keys.generate()
    ctx = zmq.Context()
    gatekeeper = auth.Gatekeeper(ctx, good)
    gatekeeper.admit(auth.CLUSTER_DOMAIN, good)
    server = ctx.socket(zmq.ROUTER)
    auth.serve(server, good, auth.CLUSTER_DOMAIN)
    watch = auth.HandshakeWatch(server, "the main node")
    server.bind("tcp://127.0.0.1:*")
    intruder = ctx.socket(zmq.DEALER)
    auth.join(intruder, bad)
    intruder.connect(server.getsockopt_string(zmq.LAST_ENDPOINT))
    intruder.send(b"hello")

    def logged():
        if watch.monitor.poll(10):
            watch.on_event()
        return any("does not hold this cluster's token" in r.getMessage()
                   for r in caplog.records)

    with caplog.at_level("WARNING", logger="dtorch"):
        wait_until(logged, timeout=10)
    assert server.poll(100) == 0  # nothing got through
    for s in (intruder, server):
        s.close(0)
    watch.close()
    ctx.term()


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
