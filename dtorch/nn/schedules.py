"""Pipeline schedules for training: torch's ``ScheduleGPipe``, ``Schedule1F1B`` and
``ScheduleInterleaved1F1B`` over stages on stage meshes, driven from the one program.

A schedule runs each micro-batch forward through the stages and, with a ``loss_fn``, backward
through them again, and accumulates the parameters' gradients (divided by the number of
micro-batches, torch's ``scale_grads=True``). Each stage's input is a boundary: the previous
stage's output detached, a leaf that requires grad, so that a stage's backward stops there and
hands its gradient to the previous stage's backward, which the schedule runs as its own step.
The schedule is a list of actions per device (``F`` or ``B`` of a stage and a micro-batch); the
program issues them in an order whose projection on each device is that device's list, and
since a stage's kernels queue on its own devices' streams in issue order, each device runs its
list:

- GPipe: every forward, then every backward (latest micro-batch first). A stage holds the
  activations of all ``m`` micro-batches before its first backward.
- 1F1B: stage ``s`` of ``p`` runs ``p - s - 1`` forwards (warm-up), then alternates one forward
  and one backward, then the remaining backwards. A stage holds at most ``p - s`` micro-batches'
  activations (the backward of one frees them), whatever ``m``; the bubble is GPipe's,
  ``(p - 1) / (m + p - 1)`` of the step.
- Interleaved 1F1B: each device holds ``v`` stages (virtual stages, round-robin over the
  stage meshes) and runs Megatron's order (``actions_interleaved_1f1b``); the bubble falls to
  ``(p - 1) / (v m + p - 1)``, for ``v`` times the hops.

Issue order: a round takes, for each device in turn, its next action when what it needs was
issued (a forward needs the previous stage's forward of that micro-batch; a backward the next
stage's backward of it, or, on the last stage, its own forward). The gradients of a data-parallel
stage are reduced once a step: the stage's gradient sync is off (``autograd/grad_sync.py``) from
the step's start to its last backward, which reduces the sum of every micro-batch's.

>>> import dtorch, torch
>>> mesh = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["pp"])
>>> s0, s1 = mesh.unbind("pp")
>>> stages = [dtorch.nn.Linear(4, 4, device_mesh=s0), dtorch.nn.Linear(4, 1, device_mesh=s1)]
>>> schedule = dtorch.nn.Schedule1F1B(stages, 4, loss_fn=lambda y, t: ((y - t) ** 2).mean())
>>> losses = []
>>> out = schedule.step(dtorch.ones((8, 4), device_mesh=s0),
...                     target=dtorch.zeros((8, 1), device_mesh=s1), losses=losses)
>>> len(losses), stages[0].weight.grad is not None
(4, True)
"""

from __future__ import annotations

import torch

from ..autograd import grad_sync
from .pipeline import hop, join_microbatches, split_microbatches, stage_mesh

__all__ = ["ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "actions_gpipe",
           "actions_1f1b", "actions_interleaved_1f1b", "issue_order"]


def actions_gpipe(stages: int, microbatches: int) -> list:
    """Each device's actions ``(stage, kind, micro-batch)``, one stage a device: ``F`` of
    every micro-batch, then ``B`` of each, latest first."""
    m = range(microbatches)
    return [[(s, "F", i) for i in m] + [(s, "B", i) for i in reversed(m)]
            for s in range(stages)]


def actions_1f1b(stages: int, microbatches: int) -> list:
    """Each device's actions under 1F1B, one stage a device (see the module doc)."""
    return actions_interleaved_1f1b(stages, microbatches, 1)


def actions_interleaved_1f1b(devices: int, microbatches: int, chunks: int) -> list:
    """Each device's actions under interleaved 1F1B (Megatron's): device ``d`` holds the
    stages ``d, d + p, ...`` (``chunks`` of them); its forwards take micro-batches in groups
    of ``p`` through its chunks in order, its backwards through them in reverse, after
    ``2 (p - d - 1) + (chunks - 1) p`` warm-up forwards. With one chunk, 1F1B."""
    p, m, v = devices, microbatches, chunks
    if v > 1 and m % p:
        raise ValueError(f"interleaved 1F1B: {m} micro-batches do not divide into groups of "
                         f"the {p} devices; use a multiple of {p}")
    total = m * v

    def nth(k: int, forward: bool) -> tuple:
        chunk = (k // p) % v
        return (chunk if forward else v - 1 - chunk), (k // (p * v)) * p + k % p

    out = []
    for d in range(p):
        warm = min(total, (p - d - 1) * (2 if v > 1 else 1) + (v - 1) * p)
        acts = []
        for kind, k in [("F", k) for k in range(warm)] + [
                x for k in range(total - warm) for x in (("F", warm + k), ("B", k))] + [
                ("B", k) for k in range(total - warm, total)]:
            chunk, i = nth(k, kind == "F")
            acts.append((chunk * p + d, kind, i))
        out.append(acts)
    return out


def issue_order(actions: list) -> list:
    """Every device's actions (``actions[d]``: ``(stage, kind, micro-batch)``) in one order
    that keeps each device's and issues an action only after what it needs (see the module
    doc)."""
    last = max(st for acts in actions for st, _, _ in acts)
    done, order, at = set(), [], [0] * len(actions)
    while any(at[d] < len(acts) for d, acts in enumerate(actions)):
        progressed = False
        for d, acts in enumerate(actions):
            if at[d] == len(acts):
                continue
            st, kind, i = acts[at[d]]
            need = (st - 1, "F", i) if kind == "F" else (
                (st + 1, "B", i) if st < last else (st, "F", i))
            if kind == "F" and st == 0 or need in done:
                order.append(acts[at[d]])
                done.add(acts[at[d]])
                at[d] += 1
                progressed = True
        if not progressed:
            raise ValueError(f"pipeline schedule: the actions {actions} wait on each other")
    return order


class _Schedule:
    """A schedule over ``stages`` (callables on stage meshes: modules, or ``(callable, mesh)``
    pairs, as ``pipeline`` takes) with ``n_microbatches`` micro-batches along dim 0."""

    actions = staticmethod(actions_gpipe)

    def __init__(self, stages, n_microbatches: int, loss_fn=None, scale_grads: bool = True):
        if n_microbatches < 1:
            raise ValueError(f"pipeline schedule: n_microbatches must be >= 1, got "
                             f"{n_microbatches}")
        self.runs = [(s[0] if isinstance(s, tuple) else s, stage_mesh(s)) for s in stages]
        if not self.runs:
            raise ValueError("pipeline schedule: no stages")
        self.n_microbatches, self.loss_fn, self.scale_grads = n_microbatches, loss_fn, scale_grads

    def step(self, x, target=None, losses: list | None = None):
        """Runs the micro-batches of ``x`` (and of ``target``, for ``loss_fn``) through the
        stages: the forwards, and with a ``loss_fn`` the backwards, whose gradients accumulate
        in the parameters' ``.grad``. Returns the last stage's output, joined; ``losses`` (a
        list) receives each micro-batch's loss."""
        m, runs = self.n_microbatches, self.runs
        xs, n = split_microbatches(hop(x, runs[0][1]), m) if m > 1 else ((x,), 1)
        if len(xs) != m:
            raise ValueError(f"pipeline schedule: a batch of {x.shape[0]} does not split into "
                             f"{m} micro-batches")
        training = self.loss_fn is not None and torch.is_grad_enabled()
        if self.loss_fn is not None and target is None:
            raise ValueError("pipeline schedule: a loss_fn needs a target")
        ts = None
        if training:
            ts, _ = split_microbatches(hop(target, runs[-1][1]), m) if m > 1 else ((target,), 1)
        p = len(runs)
        acts = self._actions(p, m) if training else [
            [(s, "F", i) for i in range(m)] for s in range(p)]
        results, step_losses = self._issue(issue_order(acts), xs, ts, training)
        if training and losses is not None:
            losses.extend(loss.detach() for loss in step_losses)
        return join_microbatches(results, n) if m > 1 else results[0]

    def _actions(self, stages: int, microbatches: int) -> list:
        return self.actions(stages, microbatches)

    def _issue(self, order, xs, ts, training: bool) -> tuple:
        """Issues the actions ``order`` (``issue_order``'s) on the micro-batches ``xs``
        (targets ``ts``): the last stage's outputs and the micro-batches' losses."""
        runs, m = self.runs, len(xs)
        p = len(runs)
        inputs, outputs, results, step_losses = {}, {}, [None] * m, [None] * m
        params = [list(fn.parameters()) if hasattr(fn, "parameters") else [] for fn, _ in runs]
        # each stage's gradient sync is off until its last backward, which reduces the sum
        unsynced = set(range(p)) if training else set()
        for s in unsynced:
            grad_sync.set_sync(params[s], False)
        try:
            last_backward = {s: i for s, kind, i in order if kind == "B"}
            for s, kind, i in order:
                fn, mesh = runs[s]
                if kind == "F":
                    h = xs[i] if s == 0 else outputs[(s - 1, i)]
                    if training and s > 0:  # the boundary: the backward of stage s stops here
                        h = h.detach().requires_grad_(h.requires_grad)
                        inputs[(s, i)] = h
                    out = fn(hop(h, mesh))
                    if s == p - 1:
                        results[i] = out.detach() if training else out
                        if training:
                            step_losses[i] = loss = self.loss_fn(out, ts[i])
                            out = loss / m if self.scale_grads else loss
                    outputs[(s, i)] = out
                    continue
                # the stage's output (its tape) goes with its backward, and what it kept
                root = outputs.pop((s, i))
                grad = None if s == p - 1 else inputs.pop((s + 1, i)).grad
                if i == last_backward[s]:  # this backward reduces the stage's sum
                    grad_sync.set_sync(params[s], True)
                    unsynced.discard(s)
                if root.requires_grad and (grad is not None or s == p - 1):
                    root.backward(grad)
        finally:
            for s in unsynced:
                grad_sync.set_sync(params[s], True)
        return results, step_losses


class ScheduleGPipe(_Schedule):
    """torch's ``ScheduleGPipe``: every micro-batch's forward, then every backward."""

    actions = staticmethod(actions_gpipe)


class Schedule1F1B(_Schedule):
    """torch's ``Schedule1F1B``: warm-up forwards, then one forward and one backward in turn."""

    actions = staticmethod(actions_1f1b)


class ScheduleInterleaved1F1B(_Schedule):
    """torch's ``ScheduleInterleaved1F1B``: ``stages`` are virtual stages laid round-robin on
    the ``p`` stage meshes (stage ``k`` on the mesh of stage ``k % p``), each device holding
    ``len(stages) / p`` of them (``actions_interleaved_1f1b``). The bubble falls to
    ``(p - 1) / (v m + p - 1)`` of the step, for more hops; ``m`` must be a multiple of ``p``."""

    def __init__(self, stages, n_microbatches: int, loss_fn=None, scale_grads: bool = True):
        super().__init__(stages, n_microbatches, loss_fn, scale_grads)
        meshes = [mesh for _, mesh in self.runs]
        p = len(set(meshes))
        if len(meshes) % p or any(meshes[k] != meshes[k % p] for k in range(len(meshes))):
            raise ValueError(f"ScheduleInterleaved1F1B: the stages must lie round-robin on the "
                             f"stage meshes (stage k on the mesh of stage k % p); their meshes "
                             f"repeat with no period: {meshes}")
        self.devices, self.chunks = p, len(meshes) // p

    def _actions(self, stages: int, microbatches: int) -> list:
        return actions_interleaved_1f1b(self.devices, microbatches, self.chunks)
