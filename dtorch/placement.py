"""Placements: how one mesh dimension lays a logical tensor out over its devices.

- ``Shard(dim)``: tensor dim ``dim`` is split like ``numpy.array_split`` (sizes differ by at most
  one, larger chunks first) over the devices of that mesh dimension.
- ``Replicate()``: every device holds the whole value.
- ``Partial(op)``: every device holds a contribution; the value is their reduction (sum, max,
  min or avg).

Placements are small frozen values with round-tripping ``repr`` and short ``str`` (``S(0)``,
``R``, ``P``). The sharding math that every role needs (local shapes and offsets) lives here too,
because it is pure and shared by the client, the controller and the hosts.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from functools import lru_cache

REDUCE_OPS = ("sum", "max", "min", "avg")


def is_int(value) -> bool:
    """Whether ``value`` may stand for an int: anything with ``__index__`` (NumPy ints, 0-dim
    integer tensors), as for torch, but not a bool: ``True`` as a dim, size or device id is a
    slip, and torch refuses it as a dim or a size."""
    return not isinstance(value, bool) and hasattr(type(value), "__index__")


def as_int(value, what: str) -> int:
    """``value`` as a Python int (see ``is_int``), or torch's TypeError naming ``what``.

    >>> as_int(3, "dim")
    3
    >>> as_int(True, "Shard(dim): dim")
    Traceback (most recent call last):
    TypeError: Shard(dim): dim must be int, not bool
    """
    if not is_int(value):
        raise TypeError(f"{what} must be int, not {type(value).__name__}")
    return operator.index(value)


class Placement:
    __slots__ = ()

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self) -> bool:
        return False


@dataclass(frozen=True, slots=True)
class Shard(Placement):
    dim: int

    def __post_init__(self):
        # checked here, in every role: a dim that is not an int would only fail when the
        # controller decodes the placement, and take the runtime down with it
        object.__setattr__(self, "dim", as_int(self.dim, "Shard(dim): dim"))

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, slots=True)
class Replicate(Placement):
    def is_replicate(self) -> bool:
        return True

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True, slots=True)
class Partial(Placement):
    reduce_op: str = "sum"

    def __post_init__(self):
        if not isinstance(self.reduce_op, str):
            raise TypeError(f"Partial(reduce_op): reduce_op must be one of {REDUCE_OPS}, "
                            f"not {type(self.reduce_op).__name__}")
        if self.reduce_op not in REDUCE_OPS:
            raise ValueError(f"Partial reduce_op must be one of {REDUCE_OPS}, got {self.reduce_op!r}")

    def is_partial(self) -> bool:
        return True

    def __str__(self) -> str:
        return "P" if self.reduce_op == "sum" else f"P({self.reduce_op})"


def normalize_placements(placements, mesh_ndim: int, tensor_ndim: int) -> tuple:
    """Checks user placements and returns them as a tuple with non-negative shard dims."""
    if placements is None:
        return (Replicate(),) * mesh_ndim
    if not isinstance(placements, (list, tuple)):
        raise TypeError(
            f"placements must be a list or tuple with one placement per mesh dim, got "
            f"{placements!r}; e.g. placements=[{placements!r}] on a 1-D mesh"
        )
    placements = tuple(placements)
    if len(placements) != mesh_ndim:
        raise ValueError(
            f"got {len(placements)} placements for a {mesh_ndim}-D device mesh: give one per mesh dim"
        )
    out = []
    for p in placements:
        if not isinstance(p, (Shard, Replicate, Partial)):
            raise TypeError(f"placements must be Shard, Replicate or Partial, got {p!r}")
        if isinstance(p, Shard):
            d = p.dim + tensor_ndim if p.dim < 0 else p.dim
            if not 0 <= d < tensor_ndim:
                raise IndexError(f"{p!r} is out of range for a tensor of {tensor_ndim} dims")
            p = Shard(d)
        out.append(p)
    return tuple(out)


# reductions a dtype lacks: torch has no max or min of complex numbers, and no mean of bools
_NO_REDUCTION = {"complex": ("max", "min"), "bool": ("avg",)}


def check_partials(placements, dtype: str) -> None:
    """Refuses a Partial whose reduction a tensor of ``dtype`` (a name: ``"complex64"``) lacks,
    at the call: the devices would fail (or, for bools, average into floats)."""
    kind = "complex" if dtype.startswith("complex") else dtype
    for p in placements:
        if isinstance(p, Partial) and p.reduce_op in _NO_REDUCTION.get(kind, ()):
            raise ValueError(f"{p!r} cannot hold a {dtype} tensor: there is no {p.reduce_op} of "
                             f"{kind} values; use Replicate() or Partial('sum')")


def placements_str(placements) -> str:
    return "".join(str(p) for p in placements)


# -- wire codec: placements travel as short strings ("S0", "R", "Psum") ---------------------------


def encode_placement(p: Placement) -> str:
    if isinstance(p, Shard):
        return f"S{p.dim}"
    if isinstance(p, Partial):
        return f"P{p.reduce_op}"
    return "R"


@lru_cache(maxsize=None)
def decode_placement(s: str) -> Placement:
    if s[0] == "S":
        return Shard(int(s[1:]))
    if s[0] == "P":
        return Partial(s[1:])
    return Replicate()


# -- sharding math --------------------------------------------------------------------------------


def chunk_sizes(size: int, parts: int) -> tuple:
    """Sizes of ``numpy.array_split(range(size), parts)``: larger chunks first."""
    q, r = divmod(size, parts)
    return tuple(q + 1 if i < r else q for i in range(parts))


def chunk_range(size: int, parts: int, index: int) -> tuple:
    """(offset, length) of chunk ``index`` of ``size`` split into ``parts``."""
    q, r = divmod(size, parts)
    return index * q + min(index, r), q + (1 if index < r else 0)


@lru_cache(maxsize=65536)
def local_region(shape: tuple, mesh_shape: tuple, placements: tuple, coord: tuple) -> tuple:
    """(local_shape, offsets) of the block held at mesh ``coord``.

    Mesh dims shard in order: a tensor dim sharded by mesh dims 0 and 1 is split over mesh dim 0
    first, and each of those chunks again over mesh dim 1.
    """
    sizes, offsets = list(shape), [0] * len(shape)
    for i, p in enumerate(placements):
        if isinstance(p, Shard):
            off, n = chunk_range(sizes[p.dim], mesh_shape[i], coord[i])
            offsets[p.dim] += off
            sizes[p.dim] = n
    return tuple(sizes), tuple(offsets)


def local_shape(shape, mesh_shape, placements, coord) -> tuple:
    return local_region(tuple(shape), tuple(mesh_shape), tuple(placements), tuple(coord))[0]
