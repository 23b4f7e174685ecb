"""GlobalOption: DTorch's read-only view of the runtime's options, by their DTorch names.

Each getter answers what dtorch actually does with the option, so a DTorch program that reads
them learns the truth about this runtime:

| getter | variable (default) | in dtorch |
|---|---|---|
| ``get_comm_timeout_second`` | ``DTORCH_COMM_TIMEOUT_SECOND`` | ``config.collective_timeout_s`` |
| ``get_grpc_timeout_second`` | ``DTORCH_GRPC_TIMEOUT_SECOND`` | ``config.heartbeat_timeout_s`` |
| ``get_zmq_timeout_second`` | ``DTORCH_ZMQ_TIMEOUT_SECOND`` (3) | read, not used |
| ``get_dtensor_in_same_device`` | ``DTORCH_DTENSOR_IN_SAME_DEVICE`` (False) | read, not used |
| ``get_num_gpu_when_enable_dtensor_in_same_device`` | the same name (8) | read, not used |
| ``get_per_device_per_process`` | ``DTORCH_PER_DEVICE_PER_PROCESS`` (False) | read, not used |
| ``get_validate_kernel_input_output`` | ``DTORCH_VALIDATE_KERNEL_INPUT_OUTPUT`` (False) | unused |

The two timeouts dtorch has are knobs of ``dtorch.config``, read from the environment when dtorch
is imported (DTorch's variable counts where dtorch's own, ``DTORCH_COLLECTIVE_TIMEOUT`` or
``DTORCH_HEARTBEAT_TIMEOUT``, is not set) and changed for a scope by ``config.Context``; the
getters report the value in force. The others are read from the environment at each call, and
each getter's doc says what dtorch does instead. As in DTorch, a timeout <= 0 is refused
(``ValueError``; DTorch aborts), and so is a flag that is not one.

>>> from dtorch.global_option import GlobalOption
>>> from dtorch import config
>>> with config.Context(collective_timeout_s=30.0):
...     GlobalOption.get_comm_timeout_second()
30.0
"""

from __future__ import annotations

import os

from . import config

TRUE, FALSE = config.TRUE, config.FALSE


def _positive(what: str, value: float) -> float:
    if not value > 0:
        raise ValueError(f"dtorch.config.{what} is {value}: a timeout must be > 0 seconds")
    return value


def env_flag(name: str, environ=os.environ) -> bool:
    """A yes/no variable, as DTorch reads it (``1`` or ``true``; here any case, and ``yes``
    and ``on`` too); unset or empty is False, a value that is no flag ``ValueError``."""
    raw = environ.get(name, "").strip().lower()
    if raw in TRUE:
        return True
    if raw in FALSE:
        return False
    raise ValueError(f"{name}={environ[name]!r} is not a flag: use 1/true or 0/false")


def env_count(name: str, default: int, environ=os.environ) -> int:
    """A positive integer variable (``default`` when unset or empty)."""
    raw = environ.get(name, "").strip()
    if raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if value < 1:
        raise ValueError(f"{name}={raw!r}: must be at least 1")
    return value


class GlobalOption:
    """DTorch's global options (static getters; see the module doc for what each maps to)."""

    @staticmethod
    def get_comm_timeout_second() -> float:
        """The deadline of one collective (and of a process group's rendezvous), in seconds:
        ``config.collective_timeout_s``. Past it the collective raises at its call site.
        ``DTORCH_COMM_TIMEOUT_SECOND`` sets it where ``DTORCH_COLLECTIVE_TIMEOUT`` is not set;
        the default is 120 s (DTorch's: 600)."""
        return _positive("collective_timeout_s", config.collective_timeout_s)

    @staticmethod
    def get_grpc_timeout_second() -> float:
        """The silence after which a runtime process is declared dead, in seconds:
        ``config.heartbeat_timeout_s``. dtorch has no gRPC; its heartbeats (every
        ``config.heartbeat_interval_s``, on a thread of their own) play the part of DTorch's
        gRPC heartbeats, so ``DTORCH_GRPC_TIMEOUT_SECOND`` sets this where
        ``DTORCH_HEARTBEAT_TIMEOUT`` is not set. Default 3 s, as in DTorch."""
        return _positive("heartbeat_timeout_s", config.heartbeat_timeout_s)

    @staticmethod
    def get_zmq_timeout_second() -> float:
        """``DTORCH_ZMQ_TIMEOUT_SECOND`` (default 3), which dtorch reads but does not use: no
        ZeroMQ message of dtorch's ever times out (none is dropped; a batch waits in its queue)
        and a peer that stops answering is found by the heartbeats instead
        (``get_grpc_timeout_second``)."""
        return config.seconds_from_env("DTORCH_ZMQ_TIMEOUT_SECOND", os.environ, 3.0)

    @staticmethod
    def get_dtensor_in_same_device() -> bool:
        """``DTORCH_DTENSOR_IN_SAME_DEVICE``, which dtorch reads but does not act on: it does not
        map many GPU ids onto one GPU. To run N devices on one machine, use a CPU mesh
        (``DeviceMesh("cpu", range(N))``): CPU device ids are logical, each device runs on host
        processes of its own threads, and collectives are real (gloo). A ``cuda`` mesh must
        name GPUs of this machine."""
        return env_flag("DTORCH_DTENSOR_IN_SAME_DEVICE")

    @staticmethod
    def get_num_gpu_when_enable_dtensor_in_same_device() -> int:
        """``DTORCH_NUM_GPU_WHEN_ENABLE_DTENSOR_IN_SAME_DEVICE`` (default 8), read but not used
        (see ``get_dtensor_in_same_device``)."""
        return env_count("DTORCH_NUM_GPU_WHEN_ENABLE_DTENSOR_IN_SAME_DEVICE", 8)

    @staticmethod
    def get_per_device_per_process() -> bool:
        """``DTORCH_PER_DEVICE_PER_PROCESS``, read but changing nothing: dtorch always runs
        each GPU in a host process of its own, and CPU devices on ``config.cpu_hosts`` host
        processes (device d in process d % cpu_hosts, each device on threads of its own), all
        apart from the user's process, so no device shares the user's GIL."""
        return env_flag("DTORCH_PER_DEVICE_PER_PROCESS")

    @staticmethod
    def get_validate_kernel_input_output() -> bool:
        """``DTORCH_VALIDATE_KERNEL_INPUT_OUTPUT``, read but not used: dtorch has no such
        mode. What it always checks: every call's arguments, shapes, dtypes and placements on
        the client before anything is sent, and the results of user kernels (``local_map``,
        ``register_op``) against the shapes and dtypes their metadata promised."""
        return env_flag("DTORCH_VALIDATE_KERNEL_INPUT_OUTPUT")
