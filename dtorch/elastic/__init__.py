"""Elastic training: a lost host or machine costs a step, not the run.

``Elastic`` runs the program's training step and keeps what a loss would take: after each step
(every ``snapshot_every``) a snapshot of the state, written by the devices beside the next step
(``snapshot.py``), and the batches issued since the last snapshot was committed. When a host or
a machine dies (the runtime fails with ``dtorch.RuntimeFailed`` naming the lost devices), it
drops the step, picks the new mesh (``policy.py``: a spare takes the lost device's place, else
the data-parallel dim shrinks), starts the runtime again on it, builds the state there
(``build(mesh)``), loads the snapshot in the new layouts, replays the steps since it from their
kept batches, and runs the step again. Each global batch is split afresh over the new
data-parallel size, so every step sees the same data and the loss curve equals an
uninterrupted run's.

>>> import dtorch, torch
>>> def build(mesh):
...     model = dtorch.nn.Linear(4, 1, device_mesh=mesh)
...     return {"model": model, "optim": dtorch.optim.SGD(model.parameters(), lr=0.1)}
>>> def train_step(state, x, y):
...     loss = ((state["model"](x) - y) ** 2).mean()
...     loss.backward()
...     state["optim"].step()
...     state["optim"].zero_grad()
...     return loss
>>> with dtorch.elastic.Elastic(build, (2,), ["dp"]) as run:
...     for _ in range(3):
...         loss = run.step(train_step, torch.ones(8, 4), torch.zeros(8, 1))
>>> run.steps
3
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import tempfile
import time
from typing import Callable, NamedTuple

import torch

from .. import profiler
from . import snapshot as snapshots
from .policy import Layout, Unrecoverable, fit, grow, remesh

__all__ = ["Elastic", "ElasticEvent", "Unrecoverable"]
log = logging.getLogger("dtorch.elastic")


class ElasticEvent(NamedTuple):
    """What a loss or a recovery did, as ``on_event`` and the log get it.

    ``kind``: ``"lost"`` (a host or machine died during step ``step + 1``), ``"recovered"``
    (the run goes on: state restored from the snapshot of step ``restored``, ``replayed`` steps
    re-run from their kept batches, in ``seconds`` from the loss) or ``"grown"`` (devices came
    back and the data-parallel dim grew at a step boundary)."""

    kind: str
    step: int
    lost_devices: tuple
    devices: tuple  # the mesh's devices from now on
    mesh_shape: tuple
    seconds: float
    restored: int | None
    replayed: int
    message: str


class Elastic:
    """A training run that survives lost devices.

    ``build(mesh)`` makes the state on a mesh: a dict of named modules, dtorch optimizers and
    objects with ``state_dict``/``load_state_dict`` (an LR scheduler); it is called at the
    start and after each loss, on the new mesh. ``step(fn, *batch)`` runs one training step
    ``fn(state, *batch)``, which returns the loss (a dtorch scalar); each torch tensor of
    ``batch`` is the global batch, handed to ``fn`` sharded on ``dp_dim`` (and replicated on
    the other dims). ``step`` returns the loss as a float.

    The mesh starts on ``devices`` (default ``0 .. n-1``; ``"cluster"``: the first of
    ``dtorch.cluster.devices()``, renumbered in each new runtime as the machines left join it,
    waiting up to ``rejoin_timeout_s``) shaped ``mesh_shape`` with ``mesh_dim_names``. After
    a loss, each lost device of the mesh is replaced by one of ``spare_devices``; with none
    left, ``shrink`` drops its data-parallel slice, and further slices until dp divides the
    global batch's rows (those devices become spares); else, over a cluster, the run waits
    up to ``rejoin_timeout_s`` for machines to join again and goes on on the same mesh shape
    (``shrink=False`` always waits there: a lost machine is waited for, not dropped); else
    the run stops with ``Unrecoverable`` (the last completed step's state stays in its ``snapshot``
    directory). ``snapshot_every``: steps between snapshots (a loss re-runs at most that many
    steps). ``directory``: where snapshots go (default: a fresh directory in ``/dev/shm``,
    memory that outlives the processes; a machine's loss needs storage the other machines
    read). ``on_event``: called with each ``ElasticEvent``. ``regrow``: at each step boundary while
    the data-parallel dim is below its start, add devices ``dtorch.cluster.devices()`` lists
    that the run does not use (machines that joined again), then spares, up to a dp that
    divides the batch's rows. ``max_losses``: losses after which a further one is not
    recovered.
    """

    def __init__(self, build: Callable, mesh_shape, mesh_dim_names=("dp",), *,
                 device_type: str = "cpu", devices=None, spare_devices=(), dp_dim: str = "dp",
                 shrink: bool = True, snapshot_every: int = 1, directory: str | None = None,
                 on_event: Callable | None = None, regrow: bool = False, max_losses: int = 16,
                 rejoin_timeout_s: float = 120.0):
        shape, names = tuple(mesh_shape), tuple(mesh_dim_names)
        if len(shape) != len(names):
            raise ValueError(f"Elastic: mesh_shape {shape} and mesh_dim_names {names} differ "
                             f"in length")
        self.cluster = devices == "cluster"  # ids from the cluster, renumbered each runtime
        if self.cluster:
            devices = _cluster_ids(math.prod(shape), timeout=0)
        devices = list(range(math.prod(shape)) if devices is None else devices)
        if len(devices) != math.prod(shape):
            raise ValueError(f"Elastic: {len(devices)} devices do not fill a mesh of shape "
                             f"{shape}")
        if snapshot_every < 1:
            raise ValueError(f"Elastic: snapshot_every must be >= 1, got {snapshot_every}")
        self.build, self.device_type, self.names = build, device_type, names
        self.dp_axis = names.index(dp_dim) if dp_dim in names else None
        self.layout = Layout(_nest(devices, shape), tuple(spare_devices))
        self.start_dp = shape[self.dp_axis] if self.dp_axis is not None else None
        self.shrink, self.snapshot_every, self.on_event = shrink, snapshot_every, on_event
        self.regrow, self.max_losses, self.losses = regrow, max_losses, 0
        self.rejoin_timeout_s = rejoin_timeout_s
        self._own_directory = directory is None
        self.directory = directory or tempfile.mkdtemp(
            prefix="dtorch-elastic-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        self.steps = 0  # steps completed
        self.events: list = []
        self._kept: list = []  # (step number, fn, batch) since the committed snapshot
        self._committed = self._pending = None
        self._lost_at = None  # when the loss being recovered was seen (None: running)
        self._lost: tuple = ()
        self._start()

    # -- the public loop ----------------------------------------------------------------------
    @property
    def mesh(self):
        return self._mesh

    @property
    def state(self) -> dict:
        return self._state

    @property
    def recovering(self) -> bool:
        """A loss was seen and the run is not yet going again."""
        return self._lost_at is not None

    def step(self, fn: Callable, *batch) -> float:
        """Runs ``fn(state, *batch)`` (the batch placed on the mesh) and returns its loss; a
        loss of devices during it is recovered from and the step run again."""
        self._kept.append((self.steps + 1, fn, batch))
        while True:
            try:
                if self._lost_at is not None:
                    self._recover()
                loss = self._run(fn, batch)
                self._after_step(self.steps + 1)
                break
            except _runtime_failed() as e:
                self._on_loss(e)
        self.steps += 1
        return loss

    def close(self) -> None:
        """Waits for the snapshot being written, and removes the snapshots' directory if this
        run made it."""
        if self._pending is not None:
            with contextlib.suppress(Exception):
                self._pending.future.result()
        if self._own_directory:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> Elastic:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- steps and snapshots ------------------------------------------------------------------
    def _start(self) -> None:
        import dtorch

        if self.cluster and self._lost_at is not None:  # a new runtime numbers anew
            ids = _cluster_ids(len(self.layout.devices), timeout=self.rejoin_timeout_s)
            new = dict(zip(sorted(self.layout.devices), ids))
            self.layout = Layout(_nest([new[d] for d in self.layout.devices],
                                       self.layout.shape), ())
        self._mesh = dtorch.DeviceMesh(self.device_type, self.layout.grid,
                                       mesh_dim_names=list(self.names))
        profiler.resume()  # a trace recorded across a loss goes on in the new runtime
        self._state = self.build(self._mesh)
        if not isinstance(self._state, dict):
            raise TypeError(f"Elastic: build(mesh) must return a dict of named state, got "
                            f"{type(self._state).__name__}")
        if self._committed is None:  # the first snapshot: step 0, written before step 1
            self._pending = snapshots.take(self._state, 0, self.directory)
            self._settle(wait=True)

    def _run(self, fn: Callable, batch: tuple) -> float:
        import dtorch

        placements = [dtorch.Shard(0) if k == self.dp_axis else dtorch.Replicate()
                      for k in range(len(self.names))]
        placed = [dtorch.from_torch(b, self._mesh, placements) if _is_torch(b) else b
                  for b in batch]
        loss = fn(self._state, *placed)
        return float(loss.item()) if isinstance(loss, dtorch.Tensor) else loss

    def _after_step(self, done: int) -> None:
        """A snapshot every ``snapshot_every`` steps (the one before it committed first), and
        room for devices that came back."""
        self._settle(wait=False)
        if done % self.snapshot_every == 0:
            self._settle(wait=True)
            self._pending = snapshots.take(self._state, done, self.directory)
        if self.regrow and self.dp_axis is not None and self._dp() < self.start_dp:
            self._grow(done)

    def _settle(self, wait: bool) -> None:
        """The pending snapshot, once its files are committed (``wait``: waits for them),
        becomes the one a loss restores; the batches before it are dropped."""
        pending = self._pending
        if pending is None or not (wait or pending.future.done()):
            return
        pending.future.result()  # its error (a death: RuntimeFailed) is the step's
        self._committed, self._pending = pending, None
        self._kept = [k for k in self._kept if k[0] > pending.step]

    def _rows(self) -> int | None:
        """The global batch's rows of the step being run (what a dp size must divide)."""
        batch = self._kept[-1][2] if self._kept else ()
        return next((b.shape[0] for b in batch if _is_torch(b) and b.dim()), None)

    def _dp(self) -> int:
        return self.layout.shape[self.dp_axis]

    # -- losses and recovery ------------------------------------------------------------------
    def _on_loss(self, error) -> None:
        """The runtime failed: which devices went, the new layout, and the runtime stopped (its
        survivors with it). Raises what cannot be recovered."""
        import dtorch

        lost = tuple(error.lost_devices)
        if not lost:  # not a death (the controller's failure, a shutdown): not ours to mend
            raise error
        if self._lost_at is None:
            self._lost_at, self._lost = time.monotonic(), ()
        self._lost += lost
        self.losses += 1
        if self._pending is not None and self._pending.future.exception() is None:
            self._settle(wait=True)  # (exception() waits: the dead runtime fails it at once)
        self._pending = None
        dtorch.shutdown()
        if self.losses > self.max_losses:
            raise self._unrecoverable(f"{self.losses} losses, more than max_losses="
                                      f"{self.max_losses}: {error}") from error
        message = str(error)
        try:
            self.layout = fit(remesh(self.layout, lost, self.dp_axis, self.shrink),
                              self.dp_axis, self._rows())
        except Unrecoverable as e:
            if not self.cluster:
                raise self._unrecoverable(f"{e}: {error}") from error
            # a cluster's machine may come back: the mesh keeps its shape, on the devices of
            # the machines that join the next runtime (``_start`` waits rejoin_timeout_s)
            message = (f"{e}: waiting up to {self.rejoin_timeout_s:.0f} s for the machines to "
                       f"join again; {error}")
        self._emit("lost", lost, 0.0, None, 0, message)

    def _unrecoverable(self, why: str) -> Unrecoverable:
        step = self._committed.step if self._committed else None
        return Unrecoverable(f"dtorch.elastic: {why}; the state of step {step} is in the "
                             f"snapshot at {self.directory} (dtorch.load_checkpoint reads it on "
                             f"any mesh)", self.directory, step)

    def _recover(self) -> None:
        """Starts the runtime on the new layout, restores the committed snapshot into a fresh
        state and replays the steps since it (all but the one being run)."""
        try:
            self._start()
        except Unrecoverable as e:  # the machines did not come back
            raise self._unrecoverable(str(e).removeprefix("dtorch.elastic: ")) from e
        snapshots.restore(self._state, self._committed, self.directory)
        replay = self._kept[:-1]
        for _, fn, batch in replay:
            self._run(fn, batch)
        seconds = time.monotonic() - self._lost_at
        self._lost_at = None
        self._emit("recovered", self._lost, seconds, self._committed.step, len(replay),
                   f"restored step {self._committed.step}, replayed {len(replay)} steps")

    def _grow(self, done: int) -> None:
        """Adds data-parallel slices of devices that joined (``regrow``), at this boundary:
        the state moves through a snapshot of this step, as after a loss."""
        import dtorch

        available = [d.id for d in dtorch.cluster.devices()]
        grown = grow(self.layout, self.start_dp, self.dp_axis, available, self._rows())
        if grown.devices == self.layout.devices:
            return
        began = time.monotonic()
        self._settle(wait=True)
        if self._committed.step != done:
            self._pending = snapshots.take(self._state, done, self.directory)
            self._settle(wait=True)
        self.layout = grown
        self._state = None
        self._start()
        snapshots.restore(self._state, self._committed, self.directory)
        self._emit("grown", (), time.monotonic() - began, done, 0,
                   f"data-parallel size back to {self._dp()}")

    def _emit(self, kind: str, lost: tuple, seconds: float, restored, replayed: int,
              message: str) -> None:
        event = ElasticEvent(kind, self.steps, tuple(lost), self.layout.devices, self.layout.shape,
                      seconds, restored, replayed, message)
        self.events.append(event)
        now = time.time_ns()
        profiler.record(f"dtorch.elastic: {kind} at step {self.steps + 1}: {message[:200]}",
                        now - int(seconds * 1e9), now)
        log.warning("dtorch.elastic: %s at step %d (lost %s): mesh %s on devices %s%s; %s",
                    kind, self.steps + 1, list(lost), event.mesh_shape, list(event.devices),
                    f", in {seconds:.2f} s" if kind != "lost" else "", message)
        if self.on_event is not None:
            self.on_event(event)


def _cluster_ids(n: int, timeout: float) -> list:
    """The first ``n`` device ids of the cluster (waiting up to ``timeout`` seconds for the
    machines that survive to join this runtime)."""
    import dtorch

    deadline = time.monotonic() + timeout
    while True:
        ids = sorted(d.id for d in dtorch.cluster.devices())
        if len(ids) >= n:
            return ids[:n]
        if time.monotonic() >= deadline:
            raise Unrecoverable(f"dtorch.elastic: the cluster has {len(ids)} devices, the mesh "
                                f"needs {n} (the machines left did not join within "
                                f"{timeout:.0f} s)")
        wait = max(0.0, min(1.0, deadline - time.monotonic()))
        dtorch.MainNode.wait_cluster_ready(dtorch.MainNode.num_node_in_cluster() + 1, wait)


def _runtime_failed():
    import dtorch

    return dtorch.RuntimeFailed


def _is_torch(x) -> bool:
    import dtorch

    return isinstance(x, torch.Tensor) and not isinstance(x, dtorch.Tensor)


def _nest(devices: list, shape: tuple):
    if len(shape) == 1:
        return list(devices)
    step = len(devices) // shape[0]
    return [_nest(devices[k * step:(k + 1) * step], shape[1:]) for k in range(shape[0])]
