"""Optimizers for dtorch parameters: ``SGD``, ``Adam`` and ``AdamW`` with torch's signatures,
param groups and ``state_dict`` format, subclassing ``torch.optim.Optimizer`` so that
``torch.optim.lr_scheduler`` drives them.

Their state (momentum buffers, moments) is dtorch tensors laid out like their parameters, and
each step issues one update call per param group and mesh (``optim/kernels.py``: torch's own
foreach, fused or, with ``foreach=False``, single-tensor arithmetic on each device's list of
blocks, one call per parameter) plus the copies into parameters updated elsewhere (ZeRO,
master weights); nothing waits.

>>> import dtorch, torch
>>> mesh = dtorch.DeviceMesh("cpu", [0, 1])
>>> w = dtorch.nn.Parameter(dtorch.ones(4, device_mesh=mesh, placements=[dtorch.Shard(0)]))
>>> opt = dtorch.optim.SGD([w], lr=0.5)
>>> (w * w).sum().backward()
>>> opt.step(); opt.zero_grad()
>>> w.to_torch()
tensor([0., 0., 0., 0.])
"""

import importlib

__all__ = ["Optimizer", "SGD", "Adam", "AdamW"]


def __getattr__(name: str):
    """The optimizers, loaded on first use: a host imports this package for its kernels
    (``kernels.py``) only, and ``optimizer.py`` uses ``dtorch.nn``, which is the client's."""
    if name in __all__:
        return getattr(importlib.import_module(".optimizer", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
