"""DTorch's ``dtorch.cuda``: NVTX ranges ordered with the operators (``dtorch.cuda.nvtx``).

>>> import dtorch.cuda
>>> dtorch.cuda.is_available() in (True, False)
True
"""

from __future__ import annotations

import torch

from . import nvtx  # noqa: F401


def is_available() -> bool:
    """Whether this machine has a CUDA GPU for a ``cuda`` mesh (``torch.cuda.is_available``)."""
    return torch.cuda.is_available()


def device_count() -> int:
    """The GPUs a ``cuda`` mesh may name on this machine (``torch.cuda.device_count``)."""
    return torch.cuda.device_count()
