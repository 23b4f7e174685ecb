"""The runtime's knobs, declared in one place (``KNOBS``: each with its type, default, variable
and what it does), read as ``config.NAME``.

Each knob takes its value from its environment variable when dtorch is imported (a value that
is not one of its type raises ``ValueError`` naming the variable) and can be changed

- for a scope of the current thread (or asyncio task): ``with config.Context(debug=2): ...``.
  Scopes nest and restore what was in force when they end, also when the block raises; other
  threads keep their own values (a new thread starts with the process's);
- for the whole process: ``config.debug = 2``, which every context without a scope of its own
  for that knob sees.

A knob is read where its value is needed, in the thread that needs it: a scope changes what the
code of its own thread reads (the client's operators, the runtime processes it starts, which
inherit the values of the thread that starts them: ``launcher/local.py``), not what threads that
are already running read, such as the client's flusher thread.

The runtime's facts (``RuntimeFacts``: how many CPU hosts a machine runs, which devices are its
own) are no knobs: the process that starts a role builds them once and hands them down.

DTorch's variables (``dtorch.GlobalOption``) set two knobs where dtorch's own variable is not
set: DTORCH_COMM_TIMEOUT_SECOND the collective deadline, DTORCH_GRPC_TIMEOUT_SECOND (DTorch's
heartbeats travel over gRPC) the heartbeat timeout. As in DTorch, a timeout <= 0 is refused.
"""

from __future__ import annotations

import contextvars
import difflib
import math
import os
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Self


def seconds_from_env(name: str, environ, default: float | None = None) -> float | None:
    """The timeout in seconds that variable ``name`` of ``environ`` sets (``default`` when it is
    unset or empty). Not a number, or not a finite number > 0: ``ValueError`` naming it."""
    raw = environ.get(name, "")
    if raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of seconds") from None
    if not 0 < value < math.inf:
        raise ValueError(f"{name}={raw!r}: a timeout must be a finite number of seconds > 0")
    return value


# -- how a variable's text becomes a value ---------------------------------------------------------
def _integer(raw: str) -> int:
    return int(raw)


def _number(raw: str) -> float:
    return float(raw)


TRUE, FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")  # any case


def _flag(raw: str) -> bool:
    low = raw.strip().lower()
    if low in TRUE:
        return True
    if low in FALSE:
        return False
    raise ValueError("not a flag (1/true or 0/false)")


def _text(raw: str) -> str:
    return raw


def _debug_level(raw: str) -> int:
    # "graph" asks for the graphs (graph_dir), not for logs
    return 0 if raw == "graph" else int(raw)


PARSERS = {int: _integer, float: _number, bool: _flag, str: _text}
ACCEPTED = {int: (int,), float: (int, float), bool: (bool, int), str: (str,)}


@dataclass(frozen=True)
class Knob:
    """One knob. ``default`` is a value, or a function of the environment for a default that
    depends on the machine or on another variable. ``dtorch_name``: DTorch's variable for the
    same thing, read (as a timeout) where ``env`` is unset."""
    name: str
    type: type
    default: Any
    env: str | None
    doc: str
    optional: bool = False  # None is a value too
    parse: Callable[[str], Any] | None = None  # else PARSERS[type]
    dtorch_name: str | None = None

    def read(self, environ) -> Any:
        raw = environ.get(self.env, "") if self.env else ""
        if raw == "" and self.dtorch_name and environ.get(self.dtorch_name, ""):
            return seconds_from_env(self.dtorch_name, environ)
        if raw == "":
            return self.default(environ) if callable(self.default) else self.default
        try:
            return (self.parse or PARSERS[self.type])(raw)
        except ValueError as e:
            raise ValueError(f"{self.env}={raw!r}: {e} (the {self.type.__name__} of "
                             f"dtorch.config.{self.name}: {self.doc})") from None

    def check(self, value) -> None:
        if not (isinstance(value, ACCEPTED[self.type]) or value is None and self.optional):
            raise TypeError(f"dtorch.config.{self.name} is a {self.type.__name__}"
                            f"{' or None' if self.optional else ''}, not {value!r}")


def _cores(environ=None) -> int:
    return min(os.cpu_count() or 1, 8)


def _host_count(raw: str) -> int:
    return int(raw) or _cores()  # 0: as many as the default


def _graph_dir(environ) -> str | None:
    return "dtorch-graphs" if environ.get("DTORCH_DEBUG") == "graph" else None


def _fusion_cache_dir(environ) -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "dtorch", "inductor")


KNOBS = (
    Knob("debug", int, 0, "DTORCH_DEBUG", "1 logs each batch the controller dispatches, 2 also "
         "every kernel (at DEBUG, loggers dtorch.controller and dtorch.host); graph: graph_dir",
         parse=_debug_level),
    Knob("graph_dir", str, _graph_dir, "DTORCH_GRAPH_DIR", "where the controller writes each "
         "batch's graph after the passes, as DOT (controller/dot.py); None: nowhere",
         optional=True),
    Knob("cpu_hosts", int, _cores, "DTORCH_CPU_HOSTS", "host processes serving CPU devices "
         "(device d in host d % cpu_hosts); default: the number of cores, at most 8",
         parse=_host_count),
    Knob("flush_records", int, 4096, None, "records buffered before the client sends a batch"),
    Knob("flush_delay_s", float, 0.0005, None,
         "how long the first record of a batch may wait for company"),
    Knob("bind_host", str, "127.0.0.1", "DTORCH_BIND_HOST", "the address every socket binds to "
         "(zmq, gloo, the rendezvous store); children inherit the value in force"),
    Knob("shutdown_timeout_s", float, 5.0, None,
         "how long a stopping process waits for its children before killing them"),
    Knob("heartbeat_interval_s", float, 0.25, None,
         "how often every runtime process tells its parent it is alive (from a thread of its own)"),
    Knob("heartbeat_timeout_s", float, 3.0, "DTORCH_HEARTBEAT_TIMEOUT", "silence after which a "
         "parent declares a child dead, kills it and fails the runtime",
         dtorch_name="DTORCH_GRPC_TIMEOUT_SECOND"),
    Knob("collective_timeout_s", float, 120.0, "DTORCH_COLLECTIVE_TIMEOUT", "deadline of one "
         "collective and of a process group's rendezvous; past it the collective raises",
         dtorch_name="DTORCH_COMM_TIMEOUT_SECOND"),
    Knob("max_inflight_ops", int, 200000, "DTORCH_MAX_INFLIGHT_OPS", "records sent but not yet "
         "seen executed; past it the user's thread blocks, so memory stays flat"),
    Knob("replay", bool, True, "DTORCH_REPLAY", "the controller lowers a repeating run of "
         "records once and replays it (controller/replay.py); 0 lowers every record"),
    Knob("fusion", bool, True, "DTORCH_FUSION", "a host compiles the elementwise stretches of a "
         "hot program in the background and swaps them in (runtime/fusion.py); 0 never"),
    Knob("fusion_after", int, 256, "DTORCH_FUSION_AFTER",
         "replays in a row with the same scalars that make a program hot"),
    Knob("fusion_after_s", float, 2.0, "DTORCH_FUSION_AFTER_S", "device seconds a program's runs "
         "must also have taken to be hot (a compile costs seconds of a host's CPU)"),
    Knob("cuda_graphs", bool, True, "DTORCH_CUDA_GRAPHS", "on a GPU, a hot program is also "
         "captured whole as a CUDA graph (runtime/cuda_graphs.py); 0 never"),
    Knob("fusion_cache_dir", str, _fusion_cache_dir, "DTORCH_FUSION_CACHE", "where inductor "
         "caches compiled code on disk for the hosts (their TORCHINDUCTOR_CACHE_DIR)"),
    Knob("read_split_min", int, 8 << 20, "DTORCH_READ_SPLIT_MIN", "the fewest bytes each thread "
         "of a split checkpoint read gets (checkpoint/kernels.py)"),
    Knob("bucket_bytes", int, 4 << 20, "DTORCH_BUCKET_BYTES", "bytes of tensors on their way to "
         "one layout that fill a bucket, sent as one coalesced collective (buckets.py)"),
)
BY_NAME = {k.name: k for k in KNOBS}
DTORCH_NAMES = {k.name: (k.env, k.dtorch_name) for k in KNOBS if k.dtorch_name}


def from_dtorch_names(environ) -> dict:
    """The knobs that DTorch's variables in ``environ`` set (see ``DTORCH_NAMES``)."""
    return {knob: seconds_from_env(theirs, environ)
            for knob, (ours, theirs) in DTORCH_NAMES.items()
            if ours not in environ and environ.get(theirs, "") != ""}


def knob(name: str) -> Knob:
    """The knob called ``name``; another name: ``AttributeError`` naming the closest ones."""
    try:
        return BY_NAME[name]
    except KeyError:
        close = difflib.get_close_matches(name, BY_NAME, n=3)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        raise AttributeError(f"dtorch.config has no knob {name!r}{hint} "
                             f"(the knobs: {', '.join(BY_NAME)})") from None


# A knob's value is a one-item list in a ContextVar whose default list is the process's value:
# a read is one ContextVar.get, setting the process's value changes that default list in place,
# and a scope sets its own list.
_PROCESS = {k.name: [k.read(os.environ)] for k in KNOBS}
_VARS = {name: contextvars.ContextVar(f"dtorch.config.{name}", default=cell)
         for name, cell in _PROCESS.items()}


class Context:
    """Sets knobs for the current thread (context) while the block runs:
    ``with config.Context(flush_records=8): ...``; nests (also inside itself), and restores on
    the way out. The values are checked here, when it is made; a thread enters a Context of its
    own (the open scopes' tokens are kept on the instance)."""

    def __init__(self, **values):
        for name, value in values.items():
            knob(name).check(value)
        self.values = values
        self._tokens: list = []  # one list per ``with`` that is open

    def __enter__(self) -> Self:
        self._tokens.append([(_VARS[name], _VARS[name].set([value]))
                             for name, value in self.values.items()])
        return self

    def __exit__(self, *exc) -> None:
        for var, token in reversed(self._tokens.pop()):
            var.reset(token)


def _property(name: str) -> property:
    var, cell, check = _VARS[name], _PROCESS[name], BY_NAME[name].check

    def get(_module):
        return var.get()[0]

    def set_process_wide(_module, value):
        check(value)
        cell[0] = value

    return property(get, set_process_wide, doc=BY_NAME[name].doc)


class _ConfigModule(types.ModuleType):
    """This module, whose knobs are properties (``config.NAME`` reads the value in force)."""


def __getattr__(name: str):  # only for a name that is no attribute of the module: a typo
    knob(name)


for _name in BY_NAME:
    setattr(_ConfigModule, _name, _property(_name))
sys.modules[__name__].__class__ = _ConfigModule


@dataclass(frozen=True)
class RuntimeFacts:
    """What a machine's runtime is, decided once by the process that starts it and handed to
    each role it starts (on their command line): ``cpu_hosts`` host processes serve its CPU
    devices; ``machine_devices``, on a machine of a cluster, the global ids of its devices as
    (first, count), None on one machine, where every id is this machine's."""
    cpu_hosts: int
    machine_devices: tuple | None = None

    def argv(self) -> list:
        """The command line that hands these facts to a role (``from_args`` reads it)."""
        if self.machine_devices is None:
            return ["--cpu-hosts", self.cpu_hosts]
        first, count = self.machine_devices
        return ["--cpu-hosts", self.cpu_hosts, "--devices", f"{first}:{count}"]

    @staticmethod
    def add_arguments(parser) -> None:
        parser.add_argument("--cpu-hosts", type=int, required=True)
        parser.add_argument("--devices", default=None)  # FIRST:COUNT, on a machine of a cluster

    @classmethod
    def from_args(cls, args) -> RuntimeFacts:
        devices = tuple(int(n) for n in args.devices.split(":")) if args.devices else None
        return cls(args.cpu_hosts, devices)

    def first_device(self) -> int:
        """The global id of this machine's first device (its GPUs count from there)."""
        return self.machine_devices[0] if self.machine_devices else 0

    def host_index(self, device_type: str, device: int) -> int:
        """Which host process serves a device: one per GPU; CPU devices round-robin over
        ``cpu_hosts`` processes (several devices to a process, each on its own threads). CUDA
        hosts are numbered after the CPU ones. On a machine of a cluster, device ids are global
        (``machine_devices``): a device of another machine has no host here (-1)."""
        if self.machine_devices is not None:
            first, count = self.machine_devices
            if not first <= device < first + count:
                return -1
            device -= first
        if device_type == "cpu":
            return device % self.cpu_hosts
        return self.cpu_hosts + device
