"""dtorch: one single-threaded PyTorch-style program driving many devices.

Every tensor is a distributed tensor (a DeviceMesh and one placement per mesh dim). The user's
thread only builds symbols and sends compact records; a controller process keeps the graph and
dispatches it; host processes run torch kernels and torch.distributed collectives.

>>> import dtorch
>>> mesh = dtorch.DeviceMesh("cpu", [0, 1])
>>> x = dtorch.ones((4, 3), device_mesh=mesh, placements=[dtorch.Shard(0)])
>>> (x * 2).sum(dim=1).to_torch()
tensor([6., 6., 6., 6.])
"""

import sys

import torch as _torch

from . import config, ops  # noqa: F401  (ops registers every operator)
from .client import frontend as _frontend
from .client.graph import Graph, default_graph
from .client.session import shutdown
from .factories import (
    arange,
    empty,
    empty_like,
    from_torch,
    full_like,
    manual_seed,
    ones,
    ones_like,
    rand,
    rand_like,
    randint,
    randint_like,
    randn,
    randn_like,
    randperm,
    tensor,
    zeros,
    zeros_like,
)
from .future import TensorFuture
from .mesh import DeviceMesh, init_device_mesh
from .placement import Partial, Placement, Replicate, Shard
from .tensor import Tensor

# torch's dtypes are dtorch's: dtorch.float32 is torch.float32
for _name, _value in vars(_torch).items():
    if isinstance(_value, _torch.dtype):
        globals()[_name] = _value

from . import nn  # noqa: E402

_frontend.install(sys.modules[__name__], nn.functional, Tensor)

# torch.max(input, other) and torch.min: the elementwise forms (ops/reduction.py)
from .ops.reduction import with_elementwise as _with_elementwise  # noqa: E402

for _name, _elementwise in (("max", "maximum"), ("min", "minimum")):
    globals()[_name] = _front = _with_elementwise(globals()[_name], _elementwise)
    setattr(Tensor, _name, _front)

# indexing fronts and the extension point (dtorch/indexing.py, dtorch/extension.py)
from .extension import local_map, register_op  # noqa: E402
from .indexing import getitem as _getitem, nonzero, setitem as _setitem, unique  # noqa: E402

Tensor.__getitem__, Tensor.__setitem__ = _getitem, _setitem
Tensor.nonzero, Tensor.unique = nonzero, unique

# conversion fronts (dtorch/conversions.py)
from . import conversions as _conversions  # noqa: E402

globals().update(_conversions.FUNCTIONS)
for _name, _fn in _conversions.METHODS.items():
    setattr(Tensor, _name, _fn)


def sync() -> None:
    """Waits for every operator issued so far (``default_graph.sync()``)."""
    default_graph.sync()


__version__ = "0.1.0"
