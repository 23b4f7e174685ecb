"""dtorch's modules, one family per file (DTorch's ``dtorch.nn.modules``)."""

from .container import Identity, ModuleDict, ModuleList, Sequential  # noqa: F401
from .module import Module  # noqa: F401
from .activation import *  # noqa: F401,F403
from .conv import *  # noqa: F401,F403
from .dropout import *  # noqa: F401,F403
from .norm import *  # noqa: F401,F403
from .pooling import *  # noqa: F401,F403
from .linear import *  # noqa: F401,F403
from .embedding import *  # noqa: F401,F403
from .moe import *  # noqa: F401,F403
