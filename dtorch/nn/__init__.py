"""dtorch.nn: neural-network building blocks on distributed tensors."""

from . import functional  # noqa: F401
