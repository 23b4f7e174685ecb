"""``dtorch.nn.init``: torch's ``torch.nn.init`` on dtorch tensors, and ``init_empty``.

torch's init functions only read a tensor's shape and call its in-place methods (``uniform_``,
``normal_``, ``fill_``, ``zero_``, ``erfinv_``, ``mul_``, ``add_``, ``clamp_``) under
``torch.no_grad()``, and dtorch tensors have those methods, so these are torch's own functions:
the same arithmetic, and torch's values for the same ``torch.Generator`` in every layout (each
device draws the whole tensor and keeps its block: ``ops/random_fill.py``).

Inside ``init_empty()`` (or torch's ``with torch.device("meta"):``) each function returns its
tensor untouched: a model's own initialization leaves the parameters made there without values
(and a tensor made outside keeps the values it has). ``trunc_normal_`` is written here: torch's (2.13's rejection sampler) calls ``torch.where`` and
``Tensor.any``, so it is the same algorithm on dtorch's operators, with the same draws (torch's
values for the same generator); it reads one flag a round, so it waits for the devices.

>>> import dtorch, math, torch
>>> w = dtorch.empty((8, 4), device_mesh=dtorch.DeviceMesh("cpu", [0, 1]),
...                  placements=[dtorch.Shard(0)])
>>> ref = torch.empty(8, 4)
>>> _ = dtorch.nn.init.kaiming_uniform_(w, a=math.sqrt(5), generator=torch.Generator().manual_seed(1))
>>> _ = torch.nn.init.kaiming_uniform_(ref, a=math.sqrt(5), generator=torch.Generator().manual_seed(1))
>>> torch.equal(w.to_torch(), ref)
True
"""

import functools
import math
import warnings

import torch
from torch.nn import init as _torch_init

import dtorch

from ..ops.random_fill import deferring, init_empty  # noqa: F401
from ..placement import Replicate


def _torchs(fn):
    """torch's init function ``fn``, which does nothing inside ``init_empty`` (checked here, as
    torch's meta device context is not seen inside its own handler, where torch's function
    runs)."""

    @functools.wraps(fn)
    def init(tensor, *args, **kwargs):
        return tensor if deferring() else fn(tensor, *args, **kwargs)

    return init


(uniform_, normal_, constant_, ones_, zeros_, xavier_uniform_, xavier_normal_, kaiming_uniform_,
 kaiming_normal_) = (_torchs(getattr(_torch_init, name)) for name in (
    "uniform_", "normal_", "constant_", "ones_", "zeros_", "xavier_uniform_", "xavier_normal_",
    "kaiming_uniform_", "kaiming_normal_"))
calculate_gain = _torch_init.calculate_gain
_calculate_fan_in_and_fan_out = _torch_init._calculate_fan_in_and_fan_out
_calculate_correct_fan = _torch_init._calculate_correct_fan


def trunc_normal_(tensor, mean: float = 0.0, std: float = 1.0, a: float = -2.0, b: float = 2.0,
                  generator=None):
    """torch's ``trunc_normal_``: values from N(mean, std) redrawn until they fall in [a, b]
    (where that holds more than 30% of the mass), else drawn uniform in [a, b] and accepted by
    the normal's density. Nothing is drawn inside ``init_empty``."""
    if deferring():
        return tensor
    if mean < a - 2 * std or mean > b + 2 * std:
        warnings.warn("mean is more than 2 std from [a, b] in nn.init.trunc_normal_. The "
                      "distribution of values may be incorrect.", stacklevel=2)
    whole = [Replicate() if p.is_partial() else p for p in tensor.placements]
    if whole != list(tensor.placements):  # drawn where comparisons are defined, then copied
        with torch.no_grad():
            return tensor.copy_(trunc_normal_(dtorch.empty_like(tensor, placements=whole), mean,
                                              std, a, b, generator))
    with torch.no_grad():
        p = _norm_cdf((b - mean) / std) - _norm_cdf((a - mean) / std)
        if p > 0.3:
            lo, hi = (torch.tensor(v, dtype=tensor.dtype).item() for v in (a, b))
            result = tensor.normal_(mean, std, generator=generator)
            while True:
                mask = (result < lo) | (result > hi)
                if not mask.any().item():
                    break
                result = dtorch.where(mask, dtorch.empty_like(result).normal_(
                    mean, std, generator=generator), result)
            if result is not tensor:
                tensor.copy_(result)
            return tensor
        log_peak = -0.5 * ((max(a, min(mean, b)) - mean) / std) ** 2
        tensor.uniform_(a, b, generator=generator)
        pending = _rejected(tensor, dtorch.empty_like(tensor), mean, std, log_peak, generator)
        result = tensor
        while pending.any().item():
            candidates = dtorch.empty_like(tensor).uniform_(a, b, generator=generator)
            result = dtorch.where(pending, candidates, result)
            pending = dtorch.where(pending, _rejected(candidates, dtorch.empty_like(tensor),
                                                      mean, std, log_peak, generator), pending)
        if result is not tensor:
            tensor.copy_(result)
        return tensor


def _norm_cdf(x: float) -> float:
    return (1.0 + math.erf(x / math.sqrt(2.0))) / 2.0


def _rejected(candidates, accept, mean, std, log_peak, generator):
    """Where a uniform draw's log exceeds the normal's log density at ``candidates`` (relative
    to its peak): torch's test, with its draws in its order."""
    log_pdf = ((candidates - mean) / std).pow(2) * -0.5 - log_peak
    return accept.uniform_(generator=generator).log().gt(log_pdf)


def _unsupported(name: str):
    def init(tensor, *args, **kwargs):
        raise NotImplementedError(
            f"dtorch.nn.init.{name} is not supported on dtorch tensors yet; initialize the "
            f"values with torch.nn.init.{name} on a torch tensor and copy_ them in "
            f"(tensor.copy_(dtorch.from_torch(t)) lays them out as the tensor is)")

    init.__name__ = init.__qualname__ = name
    return init


eye_, dirac_, orthogonal_, sparse_ = (_unsupported(n)
                                      for n in ("eye_", "dirac_", "orthogonal_", "sparse_"))
