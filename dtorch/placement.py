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

from dataclasses import dataclass
from functools import lru_cache

REDUCE_OPS = ("sum", "max", "min", "avg")


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
    placements = tuple(placements)
    if len(placements) != mesh_ndim:
        raise ValueError(
            f"got {len(placements)} placements for a {mesh_ndim}-D device mesh: give one per mesh dim"
        )
    out = []
    for p in placements:
        if not isinstance(p, Placement):
            raise TypeError(f"placements must be Shard, Replicate or Partial, got {p!r}")
        if isinstance(p, Shard):
            d = p.dim + tensor_ndim if p.dim < 0 else p.dim
            if not 0 <= d < tensor_ndim:
                raise IndexError(f"{p!r} is out of range for a tensor of {tensor_ndim} dims")
            p = Shard(d)
        out.append(p)
    return tuple(out)


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
