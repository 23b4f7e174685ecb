"""Local launcher: starts the controller and hosts as child processes tied to their parent.

Lifetimes ride on pipes, not on polling: each child gets the read end of a pipe whose write end
only its parent holds, and a watcher thread exits the child when that pipe reaches EOF (the parent
exited, however it died, SIGKILL included). The parent likewise holds the read end of a pipe only
the child writes, so it sees a child's death at once (``Child.life_fd`` polls readable).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from .. import config


class Child:
    def __init__(self, name: str, popen: subprocess.Popen, life_fd: int, parent_fd: int):
        self.name, self.popen = name, popen
        self.life_fd = life_fd  # readable (EOF) once the child has exited
        self._parent_fd = parent_fd  # closing it tells the child to exit

    @property
    def pid(self) -> int:
        return self.popen.pid

    def describe_exit(self) -> str:
        code = self.popen.poll()
        if code is None:
            return f"{self.name} pid {self.pid} closed its pipe"
        if code < 0:
            return f"{self.name} pid {self.pid} was killed by {signal.Signals(-code).name}"
        return f"{self.name} pid {self.pid} exited with status {code}"

    def request_exit(self) -> None:
        """Closes the child's parent pipe: it exits at once (see ``exit_with_parent``)."""
        if self._parent_fd is not None:
            os.close(self._parent_fd)
            self._parent_fd = None

    def stop(self, timeout: float) -> None:
        """Asks the child to exit, then kills it after ``timeout``."""
        stop_all([self], timeout)

    def _reap(self, timeout: float) -> None:
        try:
            self.popen.wait(max(timeout, 0))
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
        if self.life_fd is not None:
            os.close(self.life_fd)
            self.life_fd = None


def stop_all(children, timeout: float) -> None:
    """Asks every child to exit at once, then kills those still running ``timeout`` seconds
    later: one deadline for all, so stopping many hosts takes no longer than stopping one."""
    for child in children:
        child.request_exit()
    deadline = time.monotonic() + timeout
    for child in children:
        child._reap(deadline - time.monotonic())


# Children import their module under a stub ``dtorch`` package, skipping dtorch/__init__.py (the
# client's public API, which imports torch): the controller never needs torch and starts in a
# fraction of the time.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_BOOT = (
    "import sys, types; p = types.ModuleType('dtorch'); p.__path__ = [{pkg!r}]; "
    "sys.modules['dtorch'] = p; from {module} import main; main(sys.argv[1:])"
)


def spawn(name: str, module: str, args, pass_fds=()) -> Child:
    parent_r, parent_w = os.pipe()  # the child watches parent_r
    life_r, life_w = os.pipe()  # the parent watches life_r
    popen = subprocess.Popen(
        [sys.executable, "-c", _BOOT.format(pkg=_PACKAGE_DIR, module=module),
         "--parent-fd", str(parent_r), "--life-fd", str(life_w), *map(str, args)],
        pass_fds=(parent_r, life_w, *pass_fds),
        stdin=subprocess.DEVNULL,
        # the knobs children read at import follow this process's values (config.override)
        env={**os.environ, "DTORCH_BIND_HOST": config.bind_host},
    )
    os.close(parent_r)
    os.close(life_w)
    return Child(name, popen, life_r, parent_w)


def exit_with_parent(parent_fd: int, on_exit=None) -> None:
    """In a child: exit as soon as the parent's pipe closes."""

    def watch():
        while os.read(parent_fd, 1):
            pass
        try:
            if on_exit is not None:
                on_exit()
        finally:
            os._exit(0)

    threading.Thread(target=watch, name="dtorch-parent-watch", daemon=True).start()


def host_index(device_type: str, device: int) -> int:
    """Which host process serves a device: one per GPU; CPU devices round-robin over
    ``config.cpu_hosts`` processes (several devices to a process, each on its own threads).
    CUDA hosts are numbered after the CPU ones."""
    if device_type == "cpu":
        return device % config.cpu_hosts
    return config.cpu_hosts + device


def start_controller(ops_addr: str, results_addr: str) -> Child:
    return spawn("controller", "dtorch.controller.main",
                 ["--ops", ops_addr, "--results", results_addr, "--cpu-hosts", config.cpu_hosts])


def start_host(index: int, device_type: str, controller_addr: str, store_fd=None) -> Child:
    """``store_fd``: a listening socket on which this host serves the rendezvous store."""
    args = ["--index", index, "--device-type", device_type, "--controller", controller_addr,
            "--cpu-hosts", config.cpu_hosts]
    if store_fd is None:
        return spawn(f"host {index}", "dtorch.runtime.host", args)
    return spawn(f"host {index}", "dtorch.runtime.host", [*args, "--store-fd", store_fd],
                 pass_fds=(store_fd,))
