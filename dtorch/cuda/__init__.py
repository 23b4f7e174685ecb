"""DTorch's ``dtorch.cuda``: NVTX ranges ordered with the operators (``dtorch.cuda.nvtx``), and
the device-side kernels of torch.cuda's calls: NVTX (``nvtx_kernels.py``) and memory figures
(``memory_kernels.py``, for ``Graph.get_memory_stats``), which hosts import without ``nvtx``.

>>> import dtorch.cuda
>>> dtorch.cuda.is_available() in (True, False)
True
"""

from __future__ import annotations

import importlib

import torch


def is_available() -> bool:
    """Whether this machine has a CUDA GPU for a ``cuda`` mesh (``torch.cuda.is_available``)."""
    return torch.cuda.is_available()


def device_count() -> int:
    """The GPUs a ``cuda`` mesh may name on this machine (``torch.cuda.device_count``)."""
    return torch.cuda.device_count()


def __getattr__(name: str):
    """``dtorch.cuda.nvtx``, loaded on first use: it uses ``dtorch.graph``, which uses this
    package's memory kernels, so importing it here would go round."""
    if name == "nvtx":
        return importlib.import_module(".nvtx", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
