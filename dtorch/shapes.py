"""Shape fronts that need Python before dispatch: ``chunk`` is ``split`` with torch's sizes
(its own name belongs to a redistribute step on the wire)."""

from __future__ import annotations

from .client.dispatch import call_op
from .tensor import Tensor


def chunk(input: Tensor, chunks: int, dim: int = 0) -> tuple:
    """``torch.chunk``: pieces of ``ceil(n / chunks)`` along ``dim`` (fewer when they run out);
    a dim sharded on the input must be Replicate, as for ``split``.

    >>> import dtorch
    >>> [tuple(c.shape) for c in dtorch.arange(5).chunk(2)]
    [(3,), (2,)]
    """
    if input.dim() == 0:
        raise RuntimeError("chunk expects at least a 1-dimensional tensor")
    if chunks <= 0:
        raise RuntimeError(f"chunk expects `chunks` to be greater than 0, got: {chunks}")
    n = input.shape[dim]
    # torch keeps the count of chunks of an empty dim (split would give one)
    sizes = [0] * chunks if n == 0 else -(-n // chunks)
    out = call_op("split", (input,), (sizes, dim))
    return out if isinstance(out, tuple) else (out,)


FUNCTIONS = METHODS = {"chunk": chunk}
