"""The operator registry and its entries, by family. Importing this registers every operator."""

from . import creation, elementwise, linalg, reduction, shape  # noqa: F401
from .registry import REGISTRY, OpDef, lookup, register  # noqa: F401
