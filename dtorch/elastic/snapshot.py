"""A training state's snapshot: the devices' tensors in a ``save_checkpoint`` directory (each
device writes its own blocks, asynchronously, beside the next step), everything else (an
optimizer's step counts and param groups, a scheduler's state) copied in the client's memory.
Restoring it onto another mesh is ``load_checkpoint``'s resharding: each tensor is made in its
new layout and every device reads its own blocks.

The state is a dict of named objects, as ``build(mesh)`` returns it:
- a module: its ``state_dict``'s dtorch tensors (parameters and buffers) into the files, its
  torch tensors (buffers the client keeps) copied;
- a dtorch optimizer: its state tensors into the files (each made, on restore, in the layout the
  new optimizer updates its parameter in: ``update_layout``); the rest of its ``state_dict``
  copied;
- anything else with ``state_dict``/``load_state_dict`` (an LR scheduler): copied.
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import torch

from ..checkpoint import load_checkpoint, save_checkpoint
from ..optim.optimizer import Optimizer
from ..tensor import Tensor


class Placeholder(NamedTuple):
    """Where a state dict held a dtorch tensor: its key in the files, shape and dtype."""

    key: str
    shape: tuple
    dtype: torch.dtype


class Snapshot(NamedTuple):
    """One snapshot: ``step`` steps done; ``kept`` the client's part of each object's state
    (dtorch tensors replaced by ``Placeholder``); ``future`` the files' save (None: written);
    ``rng`` the states of dtorch's seed stream and torch's default generator, so that steps
    re-run from it draw what they drew (dropout)."""

    step: int
    kept: dict
    future: object
    rng: tuple


def take(state: dict, step: int, directory: str) -> Snapshot:
    """Issues a snapshot of ``state`` as it is now (the devices copy their tensors at once,
    then write them while the program goes on)."""
    import dtorch

    tensors, kept = {}, {}
    for name, obj in state.items():
        if isinstance(obj, torch.nn.Module):  # (a torch buffer of it is the client's)
            kept[name] = {}
            for key, t in obj.state_dict(keep_vars=True).items():
                if isinstance(t, Tensor):
                    tensors[f"{name}/{key}"] = t
                else:
                    kept[name][key] = t.detach().clone()
        elif isinstance(obj, Optimizer):
            kept[name] = _replace_tensors(obj.state_dict(), f"{name}/", tensors)
        elif hasattr(obj, "state_dict"):
            kept[name] = obj.state_dict()
            if _holds_dtorch(kept[name]):
                raise TypeError(f"dtorch.elastic: the state's {name!r} ({type(obj).__name__}) "
                                f"holds dtorch tensors; only modules and dtorch optimizers may")
            kept[name] = copy.deepcopy(kept[name])
        else:
            raise TypeError(f"dtorch.elastic: the state's {name!r} is a {type(obj).__name__}; "
                            f"build(mesh) returns modules, dtorch optimizers and objects with "
                            f"state_dict()/load_state_dict()")
    future = save_checkpoint(tensors, directory, async_=True)
    return Snapshot(step, kept, future, (dtorch.get_rng_state(), torch.get_rng_state()))


def restore(state: dict, snapshot: Snapshot, directory: str) -> None:
    """Loads ``snapshot`` (its files committed in ``directory``) into ``state``, a fresh
    ``build(mesh)`` on any mesh, and the random states it kept."""
    import dtorch

    targets, optimizers = {}, []
    for name, obj in state.items():
        kept = snapshot.kept[name]
        if isinstance(obj, torch.nn.Module):
            for key, t in obj.state_dict(keep_vars=True).items():
                if isinstance(t, Tensor):
                    targets[f"{name}/{key}"] = t
                else:
                    with torch.no_grad():
                        t.copy_(kept[key])
        elif isinstance(obj, Optimizer):
            optimizers.append((obj, kept, _state_targets(obj, kept, targets)))
        else:
            obj.load_state_dict(copy.deepcopy(kept))
    load_checkpoint(targets, directory)
    for obj, kept, made in optimizers:
        obj.load_state_dict(_put_tensors(kept, made))
    dtorch.set_rng_state(snapshot.rng[0])  # (after build, whose draws came from them too)
    torch.set_rng_state(snapshot.rng[1])


def _replace_tensors(value, prefix: str, tensors: dict):
    """A deep copy of ``value`` with each dtorch tensor moved into ``tensors`` (at its path)
    and replaced by its Placeholder."""
    if isinstance(value, Tensor):
        key = prefix.rstrip("/")
        tensors[key] = value
        return Placeholder(key, tuple(value.shape), value.dtype)
    if isinstance(value, dict):
        return {k: _replace_tensors(v, f"{prefix}{k}/", tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_replace_tensors(v, f"{prefix}{k}/", tensors)
                           for k, v in enumerate(value))
    return copy.deepcopy(value)


def _state_targets(opt: Optimizer, kept: dict, targets: dict) -> dict:
    """Empty tensors for an optimizer's saved state, each in the layout ``opt`` updates its
    parameter in (the load fills them); key -> tensor, also added to ``targets``."""
    import dtorch

    params = [p for group in opt.param_groups for p in group["params"]]
    made = {}
    for index, values in kept["state"].items():
        p = params[index]
        for value in values.values():
            if isinstance(value, Placeholder):
                made[value.key] = targets[value.key] = dtorch.empty(
                    value.shape, dtype=value.dtype, device_mesh=p.device_mesh,
                    placements=opt.update_layout(p))
    return made


def _put_tensors(value, made: dict):
    """``value`` with each Placeholder replaced by its loaded tensor."""
    if isinstance(value, Placeholder):
        return made[value.key]
    if isinstance(value, dict):
        return {k: _put_tensors(v, made) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_put_tensors(v, made) for v in value)
    return copy.deepcopy(value)


def _holds_dtorch(value) -> bool:
    if isinstance(value, Tensor):
        return True
    if isinstance(value, dict):
        return any(_holds_dtorch(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_dtorch(v) for v in value)
    return False
