"""dtorch: one single-threaded PyTorch-style program driving many devices.

Every tensor is a distributed tensor (a DeviceMesh and one placement per mesh dim). The user's
thread only builds symbols and sends compact records; a controller process keeps the graph and
dispatches it; host processes run torch kernels and torch.distributed collectives.

Importing this module is the client role: it installs every operator's front (``dtorch.add``,
``Tensor.add``, ``dtorch.nn.functional.relu``) from the registry (``client/frontend.install``)
and starts nothing; the runtime starts at the first operator. Its names follow DTorch's
(``docs/api.md``) and torch's.

>>> import dtorch
>>> mesh = dtorch.DeviceMesh("cpu", [0, 1])
>>> x = dtorch.ones((4, 3), device_mesh=mesh, placements=[dtorch.Shard(0)])
>>> (x * 2).sum(dim=1).to_torch()
tensor([6., 6., 6., 6.])
"""

import sys

import torch as _torch

from . import config, kernels, ops  # noqa: F401  (kernels registers every kernel)
from . import autograd, cuda, distributed_spec, global_option, graph, memory_stats, type  # noqa: F401
from . import compiled_op  # noqa: F401
from .autograd import enable_grad, inference_mode, no_grad, set_grad_enabled  # noqa: F401
from .client import frontend as _frontend
from .client.receiving import RuntimeFailed
from .client.session import shutdown
from .cluster.main_node import MainNode
from .future import TensorFuture
from .global_option import GlobalOption
from .graph import Graph, GraphOption, VoidFutureCollect, default_graph, get_default_device_mesh
from .memory_stats import MemoryStat, MemoryStats
from .mesh import DeviceMesh, assign_layers_to_stages, init_device_mesh
from .ops.conversion import parser_tensor_to_function_arg as _parse_to_arguments
from .ops.creation import manual_seed
from .ops.random_fill import get_rng_state, set_rng_state
from .client.user_ops import register_op
from .ops.extension import local_map
from .placement import Partial, Placement, Replicate, Shard
from .step_replay import ReplayedStep, replayed_step
from .tensor import TYPED, Tensor, get_data_type_tensor
from . import tensor as _tensor_module
from .type import OperatorFormat, PaddingType, PoolingKind, SdpaOption

# torch's dtypes and the types DTorch re-exports are torch's: dtorch.float32 is torch.float32
for _name, _value in vars(_torch).items():
    if isinstance(_value, _torch.dtype):
        globals()[_name] = _value
dtype, finfo, iinfo, device, Generator, Size = (_torch.dtype, _torch.finfo, _torch.iinfo,
                                                _torch.device, _torch.Generator, _torch.Size)
globals().update({name: getattr(_tensor_module, name) for name in TYPED})

from . import nn  # noqa: E402
from . import amp, optim  # noqa: E402,F401
from . import profiler  # noqa: E402,F401
from .checkpoint import load_checkpoint, save_checkpoint  # noqa: E402,F401
from . import elastic  # noqa: E402,F401

_frontend.install(sys.modules[__name__], nn.functional, Tensor, {
    **autograd.TENSOR_METHODS,
    "parser_tensor_to_function_arg": staticmethod(_parse_to_arguments)})


def sync(compiles: bool = False) -> None:
    """Waits for every operator issued so far (``default_graph.sync()``); ``compiles=True``
    also for the kernel fusions they started (see ``Graph.sync``)."""
    default_graph.sync(compiles)


__version__ = "0.1.0"
