"""``dtorch.amp.GradScaler``: loss scaling for float16 training, with torch's API and rules
(float32 parameters, the compute cast to float16, as torch requires: it refuses to unscale
float16 gradients).

The scale lives on the client (a Python float). ``step`` reads one flag per step (whether any
gradient, on any mesh, holds an inf or NaN after unscaling), which is the one sync loss scaling
needs: it decides whether the optimizer steps and how the scale changes.

>>> import dtorch, torch
>>> mesh = dtorch.DeviceMesh("cpu", [0, 1])
>>> w = dtorch.nn.Parameter(dtorch.ones(4, device_mesh=mesh, placements=[dtorch.Shard(0)]))
>>> opt, scaler = dtorch.optim.SGD([w], lr=0.5), GradScaler(init_scale=1024.0)
>>> scaler.scale((w * w).sum()).backward()
>>> scaler.step(opt); scaler.update()
>>> w.to_torch(), scaler.get_scale()
(tensor([0., 0., 0., 0.]), 1024.0)
"""

from __future__ import annotations

import torch

from ..nn.utils import replicated
from ..tensor import Tensor

__all__ = ["GradScaler"]


class GradScaler:
    """torch's ``GradScaler``: ``scale(loss)``, ``unscale_(optimizer)``, ``step(optimizer)``,
    ``update(new_scale=None)``, ``get_scale()``, ``state_dict()``/``load_state_dict()``."""

    def __init__(self, device: str = "cpu", init_scale: float = 2.0 ** 16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True):
        if growth_factor <= 1.0 or not 0.0 < backoff_factor < 1.0:
            raise ValueError("GradScaler: need growth_factor > 1 and 0 < backoff_factor < 1")
        self._scale, self._enabled = float(init_scale), bool(enabled)
        self._growth_factor, self._backoff_factor = float(growth_factor), float(backoff_factor)
        self._growth_interval, self._growth_tracker = int(growth_interval), 0
        self._unscaled: dict = {}  # id(optimizer) -> its found-inf flag (a dtorch 0-dim tensor)
        self._found_inf = None

    def is_enabled(self) -> bool:
        return self._enabled

    def get_scale(self) -> float:
        return self._scale if self._enabled else 1.0

    def scale(self, outputs):
        """``outputs`` (a tensor or nested lists/tuples of them) times the scale."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        return outputs * self._scale

    @torch.no_grad()
    def unscale_(self, optimizer) -> None:
        """Divides the optimizer's gradients by the scale, in place (once per step)."""
        if not self._enabled:
            return
        if id(optimizer) in self._unscaled:
            raise RuntimeError("unscale_() has already been called on this optimizer since "
                               "the last update().")
        grads = [p.grad for group in optimizer.param_groups for p in group["params"]
                 if p.grad is not None]
        if any(g.dtype == torch.float16 for g in grads):  # torch's rule: unscaling loses them
            raise ValueError("Attempting to unscale FP16 gradients.")
        inverse = 1.0 / self._scale
        bad = None
        for g in grads:
            g.mul_(inverse)
            count = replicated((~g.isfinite()).sum(), grads[0].device_mesh)
            bad = count if bad is None else bad + count
        self._unscaled[id(optimizer)] = bad

    def step(self, optimizer, *args, **kwargs):
        """Unscales (if ``unscale_`` was not called), then runs ``optimizer.step`` unless a
        gradient holds an inf or NaN (the one read of the step)."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if id(optimizer) not in self._unscaled:
            self.unscale_(optimizer)
        bad = self._unscaled[id(optimizer)]
        found = bad is not None and int(bad.item()) > 0
        self._found_inf = bool(self._found_inf) or found
        return None if found else optimizer.step(*args, **kwargs)

    def update(self, new_scale=None) -> None:
        """The next scale: ``new_scale`` if given; else backed off after an inf or NaN, grown
        after ``growth_interval`` clean steps in a row (torch's rule)."""
        if not self._enabled:
            return
        if new_scale is not None:
            self._scale = float(new_scale.item() if isinstance(new_scale, (Tensor, torch.Tensor))
                                else new_scale)
        elif self._found_inf:
            self._scale *= self._backoff_factor
            self._growth_tracker = 0
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self._growth_interval:
                self._scale *= self._growth_factor
                self._growth_tracker = 0
        self._unscaled, self._found_inf = {}, None

    def state_dict(self) -> dict:
        if not self._enabled:
            return {}
        return {"scale": self._scale, "growth_factor": self._growth_factor,
                "backoff_factor": self._backoff_factor, "growth_interval": self._growth_interval,
                "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, state: dict) -> None:
        self._scale = float(state["scale"])
        self._growth_factor = float(state["growth_factor"])
        self._backoff_factor = float(state["backoff_factor"])
        self._growth_interval = int(state["growth_interval"])
        self._growth_tracker = int(state["_growth_tracker"])
