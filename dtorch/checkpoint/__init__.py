"""Checkpoints without a full copy anywhere: ``load_checkpoint`` reads safetensors files (one,
a sharded HF directory, or ``save_checkpoint``'s) with each device reading only its own blocks,
into any layout; ``save_checkpoint`` has each device write its own blocks plus an index.
This is resharding on load, as torch's distributed checkpoint offers: save on TP=2, load on
TP=4 or on one device.

>>> import dtorch, tempfile
>>> from dtorch.checkpoint import load_checkpoint, save_checkpoint
>>> class M(dtorch.nn.Module):
...     def __init__(self, mesh, placements):
...         super().__init__()
...         self.w = dtorch.nn.Parameter(dtorch.zeros(5, 3, device_mesh=mesh,
...                                                   placements=placements))
>>> tp2 = M(dtorch.DeviceMesh("cpu", [0, 1]), [dtorch.Shard(0)])
>>> _ = tp2.w.copy_(dtorch.arange(15.0).reshape(5, 3))
>>> directory = tempfile.mkdtemp()
>>> _ = save_checkpoint(tp2, directory)
>>> one = M(dtorch.DeviceMesh("cpu", [0]), [dtorch.Replicate()])
>>> load_checkpoint(one, directory)
<All keys matched successfully>
>>> one.w.to_torch()[4]
tensor([12., 13., 14.])
"""

import importlib

__all__ = ["load_checkpoint", "save_checkpoint"]


def __getattr__(name: str):
    """The user's functions, loaded on first use: a host imports this package for its kernels
    (``kernels.py``) only, and the functions' modules use ``dtorch.nn``, which is the client's."""
    if name in __all__:
        return getattr(importlib.import_module(f".{name.partition('_')[0]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
