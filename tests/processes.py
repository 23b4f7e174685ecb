"""Watching the runtime's processes from a test: which pids it started, whether they live, their
memory, and client programs run in a subprocess of their own (so killing their runtime leaves the
test session's runtime alone). Every wait has a deadline."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def children(pid: int) -> list:
    """Direct children of ``pid`` (from /proc, no psutil)."""
    out = []
    for path in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            with open(path) as f:
                out += [int(p) for p in f.read().split()]
        except OSError:
            pass
    return out


def alive(pid: int) -> bool:
    """Running (a zombie has exited: only its parent has not read its status yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def runtime_pids() -> tuple:
    """(controller pid, [host pids]) of this process's dtorch runtime."""
    from dtorch.client import session

    controller = session._current.controller.pid
    return controller, children(controller)


def socket_inodes(pid: int) -> set:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(target[8:-1])
    return out


def listening_sockets(with_port: bool = False) -> dict:
    """inode -> local address of each listening TCP socket ("::" style for IPv6), as
    "ip:port" with ``with_port``."""
    out = {}
    for family in ("tcp", "tcp6"):
        with open(f"/proc/net/{family}") as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] != "0A":  # LISTEN
                    continue
                addr, port = fields[1].split(":")
                if family == "tcp":
                    ip = ".".join(str(b) for b in reversed(bytes.fromhex(addr)))
                else:
                    ip = "::" if int(addr, 16) == 0 else addr
                out[fields[9]] = f"{ip}:{int(port, 16)}" if with_port else ip
    return out


def wait_until(condition, timeout: float, interval: float = 0.01) -> float:
    """Polls ``condition`` until it holds; returns the seconds it took, or raises after
    ``timeout``."""
    t0 = time.monotonic()
    while not condition():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"condition not met within {timeout} s")
        time.sleep(interval)
    return time.monotonic() - t0


def run_client(code: str, timeout: float, args=(), env=None) -> dict:
    """Runs ``code`` as a client program in a fresh interpreter (``args`` in ``sys.argv[1:]``);
    it reports by printing one JSON object on a line starting with ``RESULT``; ``env``: changes
    to this process's environment, None removing a variable. Returns that object."""
    env = {k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None}
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=TESTS_DIR, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise AssertionError(f"client exited with {proc.returncode} and no result:\n"
                         f"stdout: {proc.stdout[-3000:]}\nstderr: {proc.stderr[-3000:]}")


def start_client(code: str) -> subprocess.Popen:
    """Starts ``code`` in a fresh interpreter with pipes for stdin and stdout. Its stderr (and
    its runtime's, which inherits it) goes to a file: a pipe nobody reads could fill and block
    them."""
    stderr = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=TESTS_DIR)
    proc.stderr_file = stderr
    return proc


def read_result(proc: subprocess.Popen, timeout: float) -> dict:
    """The next ``RESULT`` line the client prints (a blocking read, bounded by killing the
    client when ``timeout`` passes)."""
    timer = _kill_after(proc, timeout)
    try:
        for line in proc.stdout:
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT "):])
    finally:
        timer.cancel()
    proc.wait(timeout)
    proc.stderr_file.seek(0)
    raise AssertionError(f"client exited with {proc.returncode} and no result:\n"
                         f"{proc.stderr_file.read()[-3000:]}")


def _kill_after(proc, timeout):
    timer = threading.Timer(timeout, proc.kill)
    timer.daemon = True
    timer.start()
    return timer


# Client-side code shared by the scripts run in subprocesses: the pids of the runtime.
CLIENT_PRELUDE = f"""
import json, os, signal, sys, time
sys.path.insert(0, {TESTS_DIR!r})
import torch
import dtorch
from dtorch import Partial, Replicate, Shard
from processes import alive, children, first_error_after_kill, rss_kb, runtime_pids, wait_until

def report(**values):
    print("RESULT " + json.dumps(values), flush=True)
"""


def first_error_after_kill(issue, pid: int, kill_at: int = 2, rounds: int = 100,
                           wait_s: float = 30.0) -> tuple:
    """Issues ``issue()`` (a dtorch tensor) ``rounds`` times, reading each result, and SIGKILLs
    ``pid`` while round ``kill_at`` is on its way. Returns the first error's text ("hung" if a
    read waited ``wait_s``; None if none came) and the seconds from the kill to it."""
    killed = None
    try:
        for i in range(rounds):
            future = issue().to_torch_async()
            if i == kill_at:
                os.kill(pid, signal.SIGKILL)
                killed = time.monotonic()
            if not future.wait(wait_s):
                return "hung", None
            future.get()
    except RuntimeError as e:
        return str(e), time.monotonic() - killed if killed else None
    return None, None
