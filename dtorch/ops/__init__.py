"""torch's operators on distributed tensors, by family, and the registry every entry goes in.
Importing this registers them; the kernels of other subsystems register from their own packages
(``dtorch/kernels.py`` lists every module a host imports for its kernels)."""

from . import activation, creation, elementwise, linalg, reduction, shape  # noqa: F401
from . import conversion  # noqa: F401,E402
from . import random_fill  # noqa: F401,E402  (uniform_, normal_; tensors made without values)
from . import new_tensors  # noqa: F401,E402  (Tensor.new_ones, new_zeros, new_full, ...)
from . import extension, indexing, nn  # noqa: F401,E402  (indexing, nn ops, user ops)
from . import vocab  # noqa: F401,E402  (vocabulary-parallel embedding)
from . import attention  # noqa: F401,E402  (attention, context parallelism)
from . import moe  # noqa: F401,E402  (mixture-of-experts dispatch and experts)

from .registry import REGISTRY, OpDef, lookup, register  # noqa: F401
