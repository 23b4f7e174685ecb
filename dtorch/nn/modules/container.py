"""Containers: torch's ``Sequential``, ``ModuleList``, ``ModuleDict`` and ``Identity`` as dtorch
Modules (a call runs the dtorch pipeline and torch's hooks), with torch's behaviour otherwise.

>>> import dtorch
>>> seq = dtorch.nn.Sequential(dtorch.nn.Identity(), dtorch.nn.Identity())
>>> seq(dtorch.ones(2)).to_torch()
tensor([1., 1.])
"""

from __future__ import annotations

import torch

from .module import Module


class Sequential(Module, torch.nn.Sequential):
    pass


class ModuleList(Module, torch.nn.ModuleList):
    pass


class ModuleDict(Module, torch.nn.ModuleDict):
    pass


class Identity(Module, torch.nn.Identity):
    pass
