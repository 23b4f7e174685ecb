"""A machine's node agent without a cluster: its token file, its command line (bad input is one
line and status 2), the rendezvous store it relays, and its handshake with a main node (one cut
short is tried again, a wrong token is refused and logged on both sides). tests/test_cluster.py
runs real clusters.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess

import pytest

import dtorch
from dtorch import protocol as P
from dtorch.cluster import main_node
from dtorch.launcher import auth, cli, node, usage
from dtorch.launcher.store import StoreServer
from processes import wait_until


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
    with pytest.raises(usage.UsageError, match="--bind"):
        node.settings(["--main", "10.0.0.1:13000", "--token-file", token], {})
    args = node.settings(["--main", "10.0.0.1:13000", "--token-file", token, "--bind",
                          "10.0.0.7"], {})
    assert args.bind == "10.0.0.7"
    assert node.settings(["--main", "127.0.0.1:13000", "--token-file", token], {}).bind == \
        "127.0.0.1"
    with pytest.raises(usage.UsageError, match="--token-file"):
        node.settings(["--main", "127.0.0.1:13000"], {})
    with pytest.raises(usage.UsageError, match="IPv4:port"):
        node.settings(["--main", "main-node:13000", "--token-file", token], {})
    with pytest.raises(usage.UsageError, match="DTORCH_MAIN_NODE_ADDRESS 'main-node:1'"):
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
    proc = subprocess.run(usage.command(*argv), capture_output=True, text=True, timeout=60,
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
    proc = subprocess.run(usage.command("token", path), capture_output=True, text=True,
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
    monkeypatch.delenv(main_node.ADDRESS_ENV, raising=False)
    assert main_node.cluster_settings() is None
    with pytest.raises(RuntimeError, match="set_address"):
        dtorch.MainNode.wait_cluster_ready(2, timeout_second=1)


class FakeMainNode:
    """A main node's node socket (``launcher/machines.py``'s, served with ``keys``) at ``port``,
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
def agent_of(token):
    """An agent of ``token``'s cluster in this process, for a main node at a port (no hosts
    start: the fake main node never welcomes it). It changes no knob of this process: its
    bind address and host count are its own, handed to the hosts it starts."""
    from dtorch import config

    knobs = config.bind_host, config.cpu_hosts
    made = []

    def make(port: int, keys=None) -> node.Agent:
        made.append(node.Agent(f"127.0.0.1:{port}", keys or auth.read_token(token),
                               "127.0.0.1", 1))
        return made[-1]

    yield make
    for agent in made:
        agent.gatekeeper.close()
        agent.ctx.destroy(0)
    assert (config.bind_host, config.cpu_hosts) == knobs


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
