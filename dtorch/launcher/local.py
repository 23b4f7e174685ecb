"""Local launcher: starts the controller and hosts as child processes tied to their parent.

Lifetimes ride on pipes, not on polling. Each child gets the read end of a *parent pipe* whose
write end only its parent holds: the parent first writes the runtime's keys into it (see
``auth.py``; nothing secret goes through argv or the environment), and a watcher thread in the
child exits it when the pipe reaches EOF (the parent exited, however it died, SIGKILL included).
The parent holds the read end of a *life pipe* that only the child writes: a heartbeat thread in
the child writes one byte every ``config.heartbeat_interval_s``, independent of whatever the
child's other threads are doing, so the parent sees a child exit (EOF) at once and a child that
stopped (SIGSTOP, a deadlock with the GIL held, a machine gone) within
``config.heartbeat_timeout_s``.

Children start in a session of their own and ignore SIGINT: Ctrl-C in a terminal interrupts the
user's program, not the runtime it is using, and Ctrl-Z stops only the program.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

from .. import config, logs

# Until a child has loaded its module, its heartbeats may pause for longer: on a busy machine the
# interpreter's start, and imports that hold the GIL in C for seconds (torch's), can stall the
# heartbeat thread. The child says it has loaded with one LOADED byte among its beats.
STARTUP_ALLOWANCE_S = 10.0
BEAT, LOADED = b"\1", b"\2"


class Child:
    def __init__(self, name: str, popen: subprocess.Popen, life_fd: int, parent_fd: int):
        self.name, self.popen = name, popen
        self.life_fd = life_fd  # readable on each heartbeat; EOF once the child has exited
        self._parent_fd = parent_fd  # closing it tells the child to exit
        self.last_beat = time.monotonic()
        self.loaded = False  # the child has loaded its module: no startup allowance now

    @property
    def pid(self) -> int:
        return self.popen.pid

    def read_life(self) -> bool:
        """Takes the heartbeats waiting in the life pipe; False once the child has exited."""
        try:
            beats = os.read(self.life_fd, 4096)
        except BlockingIOError:
            return True
        if beats:
            self.last_beat = time.monotonic()
            self.loaded = self.loaded or LOADED in beats
        return bool(beats)

    def silence(self) -> float:
        """Seconds since the child's last heartbeat."""
        return time.monotonic() - self.last_beat

    def is_silent(self) -> bool:
        """Silent past ``config.heartbeat_timeout_s``: stopped, hung or gone. Beats waiting in
        the pipe are read first: the reader may not have run for a while (another of its
        process's threads held the GIL that long: a full garbage collection of a large heap),
        and they say the child was not silent. An exit is not silence: the reader's poll of the
        pipe tells it."""
        limit = config.heartbeat_timeout_s + (0.0 if self.loaded else STARTUP_ALLOWANCE_S)
        return self.silence() > limit and self.read_life() and self.silence() > limit

    def describe_exit(self) -> str:
        code = self.popen.poll()
        if code is None:
            return f"{self.name} pid {self.pid} closed its pipe"
        if code < 0:
            return f"{self.name} pid {self.pid} was killed by {signal.Signals(-code).name}"
        return f"{self.name} pid {self.pid} exited with status {code}"

    def describe_silence(self) -> str:
        return (f"{self.name} pid {self.pid} sent no heartbeat for {self.silence():.1f} s "
                f"(stopped, hung or gone; the limit is config.heartbeat_timeout_s = "
                f"{config.heartbeat_timeout_s} s), so it was killed")

    def kill(self) -> None:
        """SIGKILL, which also ends a stopped process; the status is reaped by ``stop``."""
        try:
            self.popen.kill()
        except OSError:
            pass

    def request_exit(self) -> None:
        """Closes the child's parent pipe: it exits at once (see ``child_main``)."""
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


# Children import their module under a bare ``dtorch`` package, skipping dtorch/__init__.py (the
# client's public API, which imports torch): the controller never needs torch and starts in a
# fraction of the time, and no role runs the client's code. ``child_main`` runs before the module
# is imported, so the heartbeat beats while a host spends seconds importing torch.
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_BOOT = (
    "import sys, types; p = types.ModuleType('dtorch'); p.__path__ = [{pkg!r}]; "
    "sys.modules['dtorch'] = p; from dtorch.launcher.local import child_main; "
    "child_main({module!r}, sys.argv[1:])"
)
# the knobs a child reads from the environment at import follow this process's values
_INHERITED_KNOBS = ("bind_host", "heartbeat_timeout_s", "collective_timeout_s")


def spawn(name: str, module: str, args, keys) -> Child:
    parent_r, parent_w = os.pipe()  # the child watches parent_r
    life_r, life_w = os.pipe()  # the parent watches life_r
    popen = subprocess.Popen(
        [sys.executable, "-c", _BOOT.format(pkg=PACKAGE_DIR, module=module),
         "--parent-fd", str(parent_r), "--life-fd", str(life_w), *map(str, args)],
        pass_fds=(parent_r, life_w),
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        env=_child_environment(),
    )
    os.close(parent_r)
    os.close(life_w)
    os.set_blocking(life_r, False)
    secret = keys.to_bytes()
    os.write(parent_w, len(secret).to_bytes(2, "big") + secret)  # far below a pipe's buffer
    return Child(name, popen, life_r, parent_w)


def _child_environment() -> dict:
    """This process's environment and the inherited knobs' values in force in this thread; and
    where inductor caches the code that hosts compile (``runtime/fusion.py``), unless the user
    chose that."""
    env = {**os.environ,
           **{config.knob(name).env: str(getattr(config, name)) for name in _INHERITED_KNOBS}}
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", config.fusion_cache_dir)
    return env


def child_main(module: str, argv: list) -> None:
    """A child's first code: reads its keys from the parent pipe, starts the parent watcher and
    the heartbeat, then runs ``module.main(argv, keys, on_parent_exit)``, where
    ``on_parent_exit`` registers what to do before exiting with the parent."""
    from importlib import import_module

    from .auth import Keys

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logs.to_stderr(config.debug)
    parent_fd = int(argv[argv.index("--parent-fd") + 1])
    life_fd = int(argv[argv.index("--life-fd") + 1])
    size = int.from_bytes(_read_exactly(parent_fd, 2), "big")
    keys = Keys.from_bytes(_read_exactly(parent_fd, size))
    on_exit: list = []

    def watch_parent():
        while os.read(parent_fd, 1):
            pass
        try:
            for fn in on_exit:
                fn()
        finally:
            os._exit(0)

    def beat():
        os.set_blocking(life_fd, False)
        while True:
            try:
                os.write(life_fd, BEAT)
            except BlockingIOError:  # the parent is not reading (stopped): it is not our death
                pass
            except OSError:  # the parent is gone; the watcher exits us
                return
            time.sleep(config.heartbeat_interval_s)  # a clock, not a synchronization

    threading.Thread(target=watch_parent, name="dtorch-parent-watch", daemon=True).start()
    threading.Thread(target=beat, name="dtorch-heartbeat", daemon=True).start()
    sys.modules["dtorch"].__getattr__ = _public_api
    main = import_module(module).main
    with contextlib.suppress(BlockingIOError):  # a full pipe: the parent is not reading
        os.write(life_fd, LOADED)
    main(argv, keys, on_exit.append)


def _public_api(name: str):
    """The bare package's missing attributes: a user's kernel module that a host imports (see
    ``ops/extension.py``) and that uses ``dtorch.Shard`` or ``dtorch.register_op`` gets the
    public package, loaded then, as in any process that imports dtorch. The runtime's own code
    never asks for it."""
    package = sys.modules["dtorch"]
    if name.startswith("__"):  # the import system's probes (``__spec__``, ``__file__``)
        raise AttributeError(name)
    here = os.path.join(package.__path__[0], name)
    if os.path.isdir(here) or os.path.exists(here + ".py"):
        # a submodule not imported yet (``from .. import protocol``): the import system
        # imports it when this fails, without the public package and its torch
        raise AttributeError(name)
    del package.__getattr__
    import importlib.util

    init = os.path.join(package.__path__[0], "__init__.py")
    spec = importlib.util.spec_from_file_location("dtorch", init,
                                                  submodule_search_locations=package.__path__)
    package.__spec__, package.__package__, package.__file__ = spec, "dtorch", init
    spec.loader.exec_module(package)
    return getattr(package, name)


def _read_exactly(fd: int, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = os.read(fd, n - len(out))
        if not chunk:
            os._exit(0)  # the parent died before it could hand us our keys
        out += chunk
    return out


def start_controller(ops_addr: str, results_addr: str, keys, facts: config.RuntimeFacts,
                     cluster=None) -> Child:
    """The controller of the machine ``facts`` describes; the main node of a cluster when
    given its ``settings.ClusterSettings`` (it then listens at its address for node agents
    holding the cluster's token)."""
    extra = ["--node-address", cluster.address, "--token-file", cluster.token_file] if cluster \
        else []
    return spawn("controller", "dtorch.controller.main",
                 ["--ops", ops_addr, "--results", results_addr, *facts.argv(), *extra], keys)


def start_host(index: int, device_type: str, controller_addr: str, keys,
               facts: config.RuntimeFacts) -> Child:
    """Host ``index`` of the machine ``facts`` describes."""
    return spawn(f"host {index}", "dtorch.runtime.host",
                 ["--index", index, "--device-type", device_type, "--controller",
                  controller_addr, *facts.argv()], keys)
