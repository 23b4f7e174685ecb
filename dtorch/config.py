"""The runtime's knobs, in one place. Each reads an environment variable at import and can be
changed for a scope with ``with dtorch.config.override(debug=1): ...``.

- debug (DTORCH_DEBUG): 1 logs each batch the controller dispatches, 2 also every kernel;
  ``graph`` writes each batch's graph (below) to ``./dtorch-graphs``.
- graph_dir (DTORCH_GRAPH_DIR): where the controller writes each batch's LogicalGraph after the
  passes, as Graphviz DOT (``controller/dot.py``; ``dtorch.profiler.graph`` sets it for a
  block); None: nowhere.
- cpu_hosts (DTORCH_CPU_HOSTS): host processes serving CPU devices (device d runs in host
  d % cpu_hosts, on threads of its own); default: the number of cores, at most 8. Each host
  gives torch an equal share of the cores as intra-op threads, or ``OMP_NUM_THREADS`` where
  that is set (read by torch, as in any torch program).
- flush_records: records buffered before the client sends a batch.
- flush_delay_s: how long the first record of a batch may wait for company.
- bind_host (DTORCH_BIND_HOST): the address every socket binds to (zmq, gloo, the rendezvous
  store); loopback by default. Children started later inherit the value in force.
- shutdown_timeout_s: how long a stopping process waits for its children before killing them.
- heartbeat_interval_s: how often every runtime process tells its parent it is alive (from a
  thread of its own, not the kernel queue).
- heartbeat_timeout_s (DTORCH_HEARTBEAT_TIMEOUT): silence after which a parent declares a child
  dead (a stopped, deadlocked or vanished process), kills it and fails the runtime.
- collective_timeout_s (DTORCH_COLLECTIVE_TIMEOUT): deadline of one collective (and of a process
  group's rendezvous); past it the collective raises, naming the op and its call site.
- machine_devices: on a machine of a cluster (its node agent and hosts), the global ids its
  devices have, as (first, count); None on one machine, where every id is this machine's.
- max_inflight_ops (DTORCH_MAX_INFLIGHT_OPS): records the client may have sent but not yet seen
  executed; past it the user's thread blocks, so memory stays flat however far ahead a program
  runs.
- replay (DTORCH_REPLAY): the controller lowers a repeating run of records once and replays it
  (``controller/replay.py``); 0 lowers every record through the passes.
- fusion (DTORCH_FUSION): a host compiles the elementwise stretches of a program it has replayed
  ``fusion_after`` times in a row with the same scalars, in the background, and swaps the fused
  code in once it is ready (``runtime/fusion.py``); 0 never compiles.
- fusion_after (DTORCH_FUSION_AFTER), fusion_after_s (DTORCH_FUSION_AFTER_S): a program is
  hot once it has been replayed that many times in a row with the same scalars and its runs
  have taken that many seconds on the device. A compile costs seconds of a host's CPU, so only
  a program that has already cost as much is likely to repay it.
- cuda_graphs (DTORCH_CUDA_GRAPHS): on a GPU, a hot program (above) is also captured whole as
  a CUDA graph and launched as one (``runtime/cuda_graphs.py``); 0 never captures.
- fusion_cache_dir (DTORCH_FUSION_CACHE): where the compiled code is cached on disk (inductor's
  cache), so a later program with the same stretches does not compile them again.
- read_split_min (DTORCH_READ_SPLIT_MIN): the fewest bytes each thread of a split checkpoint
  read gets: a host splits a read of at least twice this over its torch threads
  (``checkpoint/kernels.py``; copying from the page cache is memory-bound, one thread does not
  saturate it). 8 MiB by default.
- bucket_bytes (DTORCH_BUCKET_BYTES): the bytes of tensors on their way to one layout (the
  backward's gradients into ``.grad``, ZeRO's updated chunks back into the parameters) that
  fill a bucket, which then goes at once as one coalesced collective (``buckets.py``):
  small tensors share one collective's latency, and a full bucket's collective runs while the
  work after it computes. Read by the client as each tensor joins a bucket. 4 MiB by default.

DTorch's variables (``dtorch.GlobalOption``) set two of these where dtorch's own variable is not
set: DTORCH_COMM_TIMEOUT_SECOND the collective deadline, DTORCH_GRPC_TIMEOUT_SECOND (DTorch's
heartbeats travel over gRPC) the heartbeat timeout. As in DTorch, a timeout <= 0 is refused.
"""

from __future__ import annotations

import contextlib
import math
import os

_debug = os.environ.get("DTORCH_DEBUG", "0")
debug = int(_debug) if _debug.isdigit() else 0
graph_dir = os.environ.get("DTORCH_GRAPH_DIR") or ("dtorch-graphs" if _debug == "graph" else None)
cpu_hosts = int(os.environ.get("DTORCH_CPU_HOSTS", "0")) or min(os.cpu_count() or 1, 8)
flush_records = 4096
flush_delay_s = 0.0005
bind_host = os.environ.get("DTORCH_BIND_HOST", "127.0.0.1")
shutdown_timeout_s = 5.0
heartbeat_interval_s = 0.25
heartbeat_timeout_s = float(os.environ.get("DTORCH_HEARTBEAT_TIMEOUT", "3"))
collective_timeout_s = float(os.environ.get("DTORCH_COLLECTIVE_TIMEOUT", "120"))
max_inflight_ops = int(os.environ.get("DTORCH_MAX_INFLIGHT_OPS", "200000"))
replay = os.environ.get("DTORCH_REPLAY", "1") != "0"
fusion = os.environ.get("DTORCH_FUSION", "1") != "0"
fusion_after = int(os.environ.get("DTORCH_FUSION_AFTER", "256"))
fusion_after_s = float(os.environ.get("DTORCH_FUSION_AFTER_S", "2"))
cuda_graphs = os.environ.get("DTORCH_CUDA_GRAPHS", "1") != "0"
fusion_cache_dir = os.environ.get("DTORCH_FUSION_CACHE") or os.path.join(
    os.path.expanduser("~"), ".cache", "dtorch", "inductor")
read_split_min = int(os.environ.get("DTORCH_READ_SPLIT_MIN", str(8 << 20)))
bucket_bytes = int(os.environ.get("DTORCH_BUCKET_BYTES", str(4 << 20)))
machine_devices = None


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


# knob -> (dtorch's variable, DTorch's): DTorch's counts where dtorch's is not set
DTORCH_NAMES = {
    "collective_timeout_s": ("DTORCH_COLLECTIVE_TIMEOUT", "DTORCH_COMM_TIMEOUT_SECOND"),
    "heartbeat_timeout_s": ("DTORCH_HEARTBEAT_TIMEOUT", "DTORCH_GRPC_TIMEOUT_SECOND"),
}


def from_dtorch_names(environ) -> dict:
    """The knobs that DTorch's variables in ``environ`` set (see ``DTORCH_NAMES``)."""
    return {knob: seconds_from_env(theirs, environ)
            for knob, (ours, theirs) in DTORCH_NAMES.items()
            if ours not in environ and environ.get(theirs, "") != ""}


globals().update(from_dtorch_names(os.environ))


@contextlib.contextmanager
def override(**values):
    """Temporarily sets knobs: ``with override(debug=2): ...``."""
    g = globals()
    unknown = [k for k in values if k not in g or k.startswith("_")]
    if unknown:
        raise AttributeError(f"unknown dtorch config knobs: {unknown}")
    old = {k: g[k] for k in values}
    g.update(values)
    try:
        yield
    finally:
        g.update(old)
