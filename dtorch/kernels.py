"""Every module whose import registers kernels: what a host imports before it runs a call, and
the client before it installs the fronts, so both hold the same registry.

torch's operators (``ops/``) and the kernels each subsystem keeps in its own package, all
registered through ``ops.registry.register`` as a user's ``dtorch.register_op`` is. A new
subsystem with kernels adds its module here. None of them imports the client, so a host that
boots the bare package loads no client module (``tests/test_layout.py``).
"""

from . import buckets, ops  # noqa: F401  (a gradient bucket's one collective; torch's operators)
from .checkpoint import kernels as checkpoint_kernels  # noqa: F401  (safetensors blocks)
from .cuda import memory_kernels, nvtx_kernels  # noqa: F401  (memory figures, NVTX)
from .optim import kernels as optim_kernels  # noqa: F401  (optimizer updates)
