"""dtorch.nn: modules whose parameters are distributed tensors, and the functional ops.

A model written once runs on one device or any mesh: layers take torch's constructor arguments
plus ``device=``, ``dtype=`` and ``device_mesh=`` (default: the graph's, which
``Graph.device_mesh_guard`` sets), and ``load_state_dict`` puts every value in its parameter's
layout.
"""

from ..autograd.checkpoint import checkpoint  # noqa: F401  (torch.utils.checkpoint's)
from . import functional, init, utils  # noqa: F401
from .fsdp import fully_shard  # noqa: F401
from .init import init_empty  # noqa: F401
from .modules import *  # noqa: F401,F403
from .modules import Identity, Module, ModuleDict, ModuleList, Sequential  # noqa: F401
from .parallelize import (ColwiseParallel, RowwiseParallel, SequenceParallel,  # noqa: F401
                          parallelize)
from .parameter import Buffer, Parameter  # noqa: F401
from .pipeline import pipeline  # noqa: F401
from .schedules import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B  # noqa: F401
