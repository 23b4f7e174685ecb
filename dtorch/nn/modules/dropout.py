"""Dropout and the small shape modules (``Flatten``, ``Unflatten``), with torch's constructors,
attributes and ``extra_repr``.

``Dropout`` honours ``train()``/``eval()`` as torch's: it drops in training mode and is the
identity in eval mode (a new module's mode, as DTorch's: ``dtorch.nn.Module``). DTorch's is an identity always and refuses
``p = 1``; here ``p`` may be anything in [0, 1], as torch's. The values dropped come from
dtorch's seed (``dtorch.manual_seed``), each device drawing its own block, so they differ from
torch's for the same seed (docs/ops.md, ``dropout``).

>>> import dtorch
>>> drop = dtorch.nn.Dropout(0.5)
>>> drop(dtorch.ones(2)).to_torch()
tensor([1., 1.])
>>> sorted(set(drop.train()(dtorch.ones(8)).to_torch().tolist()) - {0.0}), drop
([2.0], Dropout(p=0.5, inplace=False))
"""

from __future__ import annotations

import torch

import dtorch

from .. import functional as F
from .module import Module

__all__ = ["Dropout", "Flatten", "Unflatten"]


class Dropout(Module, torch.nn.Dropout):
    """torch's ``Dropout(p=0.5, inplace=False)``: ``ValueError`` for ``p`` outside [0, 1]."""

    def forward(self, input):
        return F.dropout(input, self.p, self.training, self.inplace)


class Flatten(Module, torch.nn.Flatten):
    """torch's ``Flatten(start_dim=1, end_dim=-1)``: ``dtorch.flatten``'s placements (a sharded
    batch dim before ``start_dim`` stays sharded)."""

    def forward(self, input):
        return dtorch.flatten(input, self.start_dim, self.end_dim)


class Unflatten(Module, torch.nn.Unflatten):
    """torch's ``Unflatten(dim, unflattened_size)`` (``dtorch.unflatten``)."""

    def forward(self, input):
        return dtorch.unflatten(input, self.dim, self.unflattened_size)
