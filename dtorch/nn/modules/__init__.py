"""dtorch's modules, one family per file (DTorch's ``dtorch.nn.modules``)."""

from .container import Identity, ModuleDict, ModuleList, Sequential  # noqa: F401
from .module import Module  # noqa: F401
