"""The operator registry and its entries, by family. Importing this registers every operator."""

from . import activation, creation, elementwise, linalg, reduction, shape  # noqa: F401
from . import conversion  # noqa: F401,E402
from . import extension, indexing, nn  # noqa: F401,E402  (indexing, nn ops, user ops)
from . import system  # noqa: F401,E402  (NVTX ranges and marks)
from . import memory  # noqa: F401,E402  (Graph.get_memory_stats, empty_cache)
from . import checkpoint  # noqa: F401,E402  (safetensors block reads and writes)
from . import vocab  # noqa: F401,E402  (vocabulary-parallel embedding)
from . import attention  # noqa: F401,E402  (attention, context parallelism)
from . import moe  # noqa: F401,E402  (mixture-of-experts dispatch and experts)
from . import optim  # noqa: F401,E402  (optimizer updates)
from . import coalesced  # noqa: F401,E402  (one all-reduce of a gradient bucket)
from .registry import REGISTRY, OpDef, lookup, register  # noqa: F401
