"""Placements: how one mesh dimension lays a logical tensor out over its devices.

- ``Shard(dim)``: tensor dim ``dim`` is split like ``numpy.array_split`` (sizes differ by at most
  one, larger chunks first) over the devices of that mesh dimension.
- ``Shard(dim, sub_split=(n0, n1, ...))``: a *sub-split* shard. Tensor dim ``dim`` is cut into
  consecutive segments of sizes ``n0, n1, ...``; each segment is split as a plain Shard would
  split it, and every device holds its chunk of every segment, in segment order. It is what
  ``cat`` of tensors sharded along the joined dim gives: each device's block is its blocks of the
  inputs, joined, so the join needs no communication (torch's ``_StridedShard`` is the same
  idea). Every mesh dim that shards one tensor dim carries the same sub-split.
- ``Replicate()``: every device holds the whole value.
- ``Partial(op)``: every device holds a contribution; the value is their reduction (sum, max,
  min or avg).

Placements are small frozen values with round-tripping ``repr`` and short ``str`` (``S(0)``,
``R``, ``P``). ``Placement("S1")``, DTorch's constructor, builds one from DTorch's strings
(``"R"``, ``"P"``, ``"S<dim>"``). The sharding math that every role needs (local shapes,
offsets, and the pieces a sub-split block is made of) lives here too, because it is pure and
shared by the client, the controller and the hosts. ``normalize_layout`` is the one place where
a layout is checked against its tensor and mesh (``spec.intern_spec`` calls it for every spec):
a Shard on a mesh dim of one device holds the whole dim, so it is read back as ``Replicate()``.

>>> Placement("S-1"), Placement("P").is_partial()
(Shard(dim=-1), True)
"""

from __future__ import annotations

import operator
import re
from collections.abc import Mapping
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


class _PlacementType(type):
    """Makes ``Placement("S1")`` return a Shard (DTorch's string constructor) while Shard,
    Replicate and Partial stay plain frozen dataclasses: ``Placement.__new__`` alone could not,
    as Python would then call the subclass's ``__init__`` with the string. ``Placement()``
    stays the bare base, which every op refuses as a placement."""

    def __call__(cls, *args, **kwargs):
        if cls is Placement and (args or kwargs):
            return parse_placement(*args, **kwargs)
        return super().__call__(*args, **kwargs)


class _ConcretePlacementType(_PlacementType):
    """The type of Shard, Replicate and Partial: they build as any class does, at C speed
    (placements are built on every op call)."""

    __call__ = type.__call__


class Placement(metaclass=_PlacementType):
    """How one mesh dim lays a tensor out; ``Placement("R" | "P" | "S<dim>")`` builds one.

    The predicates and getters are DTorch's. A sub-split Shard (``Shard(dim, sub_split=...)``,
    made by ``cat`` along a sharded dim) answers ``has_sub_split_coordinates()`` True, and
    ``get_sub_split_coordinates()`` gives its segment sizes; ``is_shard(dim)`` is True for it as
    for a plain Shard, while ``==`` tells the two apart (they lay out different elements).
    """

    __slots__ = ()

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self) -> bool:
        return False

    def get_shard_index(self) -> int:
        """The tensor dim a Shard splits."""
        raise ValueError(f"{self!r} is not a Shard, so it has no shard index; check "
                         f"is_shard() first")

    def has_sub_split_coordinates(self) -> bool:
        return False

    def get_sub_split_coordinates(self):
        """The segment sizes of a sub-split Shard (``Shard.sub_split``), None for any other."""
        return None


_SHARD_STRING = re.compile(r"S(-?[0-9]+)")


def parse_placement(placement: str) -> Placement:
    """The placement DTorch writes as ``placement``: ``"R"`` (Replicate), ``"P"`` (a sum
    Partial) or ``"S<dim>"`` (a Shard; a negative dim counts from the tensor's last).

    >>> parse_placement("S1"), parse_placement("R")
    (Shard(dim=1), Replicate())
    """
    if not isinstance(placement, str):
        raise TypeError(f"Placement(placement) takes a str such as 'R', 'P' or 'S0', got "
                        f"{placement!r}; for other placements use Shard(dim), Replicate() or "
                        f"Partial(reduce_op)")
    shard = _SHARD_STRING.fullmatch(placement)
    if shard:
        return Shard(int(shard[1]))
    if placement in ("R", "P"):
        return Replicate() if placement == "R" else Partial()
    raise ValueError(f"Placement({placement!r}): the placement strings are 'R' (Replicate), "
                     f"'P' (Partial sum) and 'S<dim>' (Shard, e.g. 'S0' or 'S-1')")


@dataclass(frozen=True, slots=True)
class Shard(Placement, metaclass=_ConcretePlacementType):
    """``Shard(dim)``, or with ``sub_split`` the segment sizes of a sub-split shard (see the
    module docstring). Empty segments hold nothing on any device and are dropped; one segment
    is a plain Shard.

    >>> Shard(2, sub_split=[512, 0, 128]), str(Shard(2, (512, 128))), Shard(0, (6,))
    (Shard(dim=2, sub_split=(512, 128)), 'S(2)[512,128]', Shard(dim=0))
    """

    dim: int
    sub_split: tuple | None = None

    def __post_init__(self):
        # checked here, in every role: a dim that is not an int would only fail when the
        # controller decodes the placement, and take the runtime down with it
        object.__setattr__(self, "dim", as_int(self.dim, "Shard(dim): dim"))
        if self.sub_split is not None:
            object.__setattr__(self, "sub_split", _segments(self.sub_split))

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def get_shard_index(self) -> int:
        return self.dim

    def has_sub_split_coordinates(self) -> bool:
        return self.sub_split is not None

    def get_sub_split_coordinates(self):
        return self.sub_split

    def __repr__(self) -> str:
        if self.sub_split is None:
            return f"Shard(dim={self.dim})"
        return f"Shard(dim={self.dim}, sub_split={self.sub_split})"

    def __str__(self) -> str:
        if self.sub_split is None:
            return f"S({self.dim})"
        return f"S({self.dim})[{','.join(map(str, self.sub_split))}]"


def _segments(sizes) -> tuple | None:
    """``Shard.sub_split`` as stored: a tuple of positive ints, None for at most one segment."""
    if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__iter__"):
        raise TypeError(f"Shard(dim, sub_split): sub_split must be a sequence of segment sizes "
                        f"(ints), e.g. (512, 128), got {sizes!r}")
    sizes = tuple(as_int(n, "Shard(dim, sub_split): a segment size") for n in sizes)
    if any(n < 0 for n in sizes):
        raise ValueError(f"Shard(dim, sub_split={sizes}): segment sizes must not be negative")
    sizes = tuple(n for n in sizes if n)
    return sizes if len(sizes) > 1 else None


def plain(p: Placement) -> Placement:
    """``p`` without its sub-split: the plain Shard of the same dim, else ``p`` itself."""
    return Shard(p.dim) if isinstance(p, Shard) and p.sub_split is not None else p


@dataclass(frozen=True, slots=True)
class Replicate(Placement, metaclass=_ConcretePlacementType):
    def is_replicate(self) -> bool:
        return True

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True, slots=True)
class Partial(Placement, metaclass=_ConcretePlacementType):
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
            p = Shard(d, p.sub_split)
        out.append(p)
    return tuple(out)


def normalize_layout(shape: tuple, mesh_shape: tuple, placements: tuple) -> tuple:
    """``placements`` as a tensor of ``shape`` on a mesh of ``mesh_shape`` holds them: a Shard
    on a mesh dim of one device is ``Replicate()`` (that device holds the whole dim, as
    DTorch reads it too). Refuses sub-splits that do not describe the tensor: segments that do
    not add up to the dim, or mesh dims that shard one dim with different sub-splits.
    ``spec.intern_spec`` calls it for every spec it makes, so a factory, ``from_torch``, a
    redistribute and every operator's result pass it.

    >>> normalize_layout((4, 6), (2, 1), (Shard(0), Shard(1)))
    (Shard(dim=0), Replicate())
    """
    out = tuple(Replicate() if isinstance(p, Shard) and n == 1 else p
                for p, n in zip(placements, mesh_shape))
    splits: dict = {}
    for i, p in enumerate(out):
        if not isinstance(p, Shard):
            continue
        if p.sub_split is not None and sum(p.sub_split) != shape[p.dim]:
            raise ValueError(f"{p!r} on mesh dim {i}: its segments add up to {sum(p.sub_split)}, "
                             f"but tensor dim {p.dim} has {shape[p.dim]} elements; give segment "
                             f"sizes that add up to the dim")
        first = splits.setdefault(p.dim, (i, p))
        if first[1] != p:
            raise ValueError(f"mesh dims {first[0]} and {i} both shard tensor dim {p.dim}, as "
                             f"{first[1]} and {p}: the mesh dims that shard one dim must all "
                             f"carry the same sub-split (or none); e.g. placements="
                             f"{[first[1] if q == p else q for q in out]!r}")
    return out


# reductions a dtype lacks: torch has no max or min of complex numbers, and torch's collectives
# no average of integers or bools (gloo has none; a sum then an integer division would overflow
# the dtype before dividing, and truncate)
_NO_REDUCTION = {"complex": ("max", "min"), "integer": ("avg",)}


def check_partials(placements, dtype: str) -> None:
    """Refuses a Partial whose reduction a tensor of ``dtype`` (a name: ``"complex64"``) lacks.
    ``spec.intern_spec`` calls it for every spec it makes, so every path that would lay a
    tensor out so (a factory, ``from_torch``, a redistribute, an operator's rule) raises at the
    call, before anything is sent.

    >>> check_partials((Partial("avg"),), "int32")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: Partial(reduce_op='avg') cannot hold an int32 tensor: ... use Partial('sum') ...
    """
    kind = ("complex" if dtype.startswith("complex") else
            "integer" if dtype.startswith(("int", "uint")) or dtype == "bool" else dtype)
    for p in placements:
        if isinstance(p, Partial) and p.reduce_op in _NO_REDUCTION.get(kind, ()):
            article = "an" if dtype[0] in "aeiou" else "a"
            if kind == "integer":
                raise ValueError(f"{p!r} cannot hold {article} {dtype} tensor: torch's "
                                 f"collectives have no average of {dtype} values; use "
                                 f"Partial('sum') or a floating dtype")
            raise ValueError(f"{p!r} cannot hold {article} {dtype} tensor: there is no "
                             f"{p.reduce_op} of {kind} values; use Replicate() or "
                             f"Partial('sum')")


# -- placements given per mesh dim by name: redistribute_by_dict ---------------------------------

DEFAULT_PLACEMENT_MODES = ("raise_error", "replicate", "keep")


def get_placements_from_dict(device_mesh, placements_dict, original_placements=None,
                             default_placement_mode: str = "raise_error", *,
                             convert_shard_size_one_to_replicate: bool = True,
                             shape=None) -> list:
    """The placements, one per dim of ``device_mesh``, that ``placements_dict`` asks for.

    The keys are all mesh dim names or all mesh dim indices. Keys the mesh lacks are ignored,
    so one dict can serve every mesh of a model (``{"tp": Shard(0), "pp": Replicate()}`` on a
    mesh with no "pp"). A dim missing from the dict gets, by ``default_placement_mode``:
    ``"raise_error"`` a KeyError, ``"replicate"`` Replicate(), ``"keep"`` its entry of
    ``original_placements`` (the tensor's current ones). A one-device mesh gets all
    Replicate(). With ``shape`` (the tensor's) and ``convert_shard_size_one_to_replicate``, a
    Shard of a size-1 tensor dim becomes Replicate(), as it holds the same values.

    The positional order is DTorch's. ``Tensor.redistribute_by_dict`` should treat an empty
    dict as none (keep the placements) before it calls this; here None or an empty dict leaves
    every dim missing.

    >>> from dtorch.mesh import DeviceMesh
    >>> mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=["dp", "tp"])
    >>> get_placements_from_dict(mesh, {"tp": Shard(0), "pp": Shard(1)}, None, "replicate")
    [Replicate(), Shard(dim=0)]
    """
    if default_placement_mode not in DEFAULT_PLACEMENT_MODES:
        raise ValueError(f"default_placement_mode must be one of {DEFAULT_PLACEMENT_MODES}, "
                         f"got {default_placement_mode!r}")
    if not device_mesh.is_distributed:
        return [Replicate()] * device_mesh.ndim
    placements_dict = {} if placements_dict is None else placements_dict
    _check_placements_dict(placements_dict)
    if default_placement_mode == "keep":
        _check_original_placements(original_placements, device_mesh.ndim)
    keys = _mesh_dim_keys(device_mesh, placements_dict)
    out = [_placement_of_dim(device_mesh, placements_dict, key, i, original_placements,
                             default_placement_mode) for i, key in enumerate(keys)]
    if convert_shard_size_one_to_replicate and shape is not None:
        out = [Replicate() if _shards_size_one(p, tuple(shape)) else p for p in out]
    return out


def _check_placements_dict(placements_dict) -> None:
    if not isinstance(placements_dict, Mapping):
        raise TypeError(f"placements_dict must be a dict from mesh dim names or indices to "
                        f"placements, e.g. {{'tp': Shard(0)}}, got {placements_dict!r}")
    bad = [k for k, p in placements_dict.items() if not isinstance(p, Placement)]
    if bad:
        raise TypeError(f"placements_dict maps mesh dims to placements, but its entry "
                        f"{bad[0]!r} is {placements_dict[bad[0]]!r}; use Shard(dim), "
                        f"Replicate(), Partial() or Placement('S0')")


def _check_original_placements(original_placements, ndim: int) -> None:
    if original_placements is None or len(original_placements) != ndim:
        raise ValueError(f"default_placement_mode='keep' needs original_placements with one "
                         f"placement per mesh dim ({ndim}), got {original_placements!r}")


def _mesh_dim_keys(device_mesh, placements_dict) -> list:
    """The key of each mesh dim in ``placements_dict``: its name when the keys are names, else
    its index (an empty dict names them as the mesh does, for the error message)."""
    keys = list(placements_dict)
    if keys and all(isinstance(k, str) for k in keys):
        if not device_mesh.dim_names:
            raise ValueError(f"Key of placements_dict is dim_name but device_mesh not have "
                             f"dim_name: {placements_dict} on {device_mesh!r}; name the mesh "
                             f"dims (mesh_dim_names=...) or key the dict by mesh dim index")
        return device_mesh.dim_names
    if not all(is_int(k) for k in keys):
        raise TypeError(f"the keys of placements_dict must be all mesh dim names (str) or all "
                        f"mesh dim indices (int), got {keys}")
    indices = list(range(device_mesh.ndim))
    return indices if keys else device_mesh.dim_names or indices


def _placement_of_dim(device_mesh, placements_dict, key, index, original_placements, mode):
    if key in placements_dict:
        return placements_dict[key]
    if mode == "replicate":
        return Replicate()
    if mode == "keep":
        return original_placements[index]
    if isinstance(key, str):
        what, mesh_dims = "Dimension name key", f"device_mesh.dim_names: {device_mesh.dim_names}"
    else:
        what, mesh_dims = "Index key", f"device_mesh.ndim: {device_mesh.ndim}"
    raise KeyError(f"{what}: {key} not in placements_dict. Invalid placements_dict: "
                   f"{placements_dict}, {mesh_dims}; give every mesh dim a placement or pass "
                   f"default_placement_mode='replicate' or 'keep'")


def _shards_size_one(placement: Placement, shape: tuple) -> bool:
    return (isinstance(placement, Shard) and -len(shape) <= placement.dim < len(shape)
            and shape[placement.dim] == 1)


def placements_str(placements) -> str:
    return "".join(str(p) for p in placements)


# -- wire codec: placements travel as short strings ("S0", "R", "Psum") ---------------------------


def encode_placement(p: Placement) -> str:
    """``"S0"``, ``"S2:512,128"`` (a sub-split), ``"R"``, ``"Psum"``."""
    if isinstance(p, Shard):
        if p.sub_split is None:
            return f"S{p.dim}"
        return f"S{p.dim}:{','.join(map(str, p.sub_split))}"
    if isinstance(p, Partial):
        return f"P{p.reduce_op}"
    return "R"


@lru_cache(maxsize=None)
def decode_placement(s: str) -> Placement:
    if s[0] == "S":
        dim, _, segments = s[1:].partition(":")
        return Shard(int(dim), tuple(map(int, segments.split(","))) if segments else None)
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
def local_pieces(shape: tuple, mesh_shape: tuple, placements: tuple, coord: tuple) -> tuple:
    """Per tensor dim, the ``(offset, length)`` ranges of the whole tensor that the block at
    mesh ``coord`` holds, in the order the block holds them: one range for a whole or plainly
    sharded dim, one per non-empty segment for a sub-split one.

    Mesh dims shard in order: a tensor dim sharded by mesh dims 0 and 1 is split over mesh dim 0
    first, and each of those chunks again over mesh dim 1 (each segment so, for a sub-split).

    >>> local_pieces((10, 3), (2,), (Shard(0, (6, 4)),), (1,))
    (((3, 3), (8, 2)), ((0, 3),))
    """
    cuts: dict = {}
    splits: dict = {}
    for i, p in enumerate(placements):
        if isinstance(p, Shard):
            cuts.setdefault(p.dim, []).append((mesh_shape[i], coord[i]))
            splits[p.dim] = p.sub_split
    return tuple(_dim_pieces(n, splits.get(d), cuts.get(d, ())) for d, n in enumerate(shape))


def _dim_pieces(size: int, sub_split, cuts) -> tuple:
    pieces, start = [], 0
    for segment in sub_split or (size,):
        offset, length = 0, segment
        for parts, index in cuts:
            first, length = chunk_range(length, parts, index)
            offset += first
        pieces.append((start + offset, length))
        start += segment
    return tuple(pieces) if sub_split is None else tuple(p for p in pieces if p[1])


@lru_cache(maxsize=65536)
def local_region(shape: tuple, mesh_shape: tuple, placements: tuple, coord: tuple) -> tuple:
    """(local_shape, offsets) of the block held at mesh ``coord`` (see ``local_pieces``). A
    sub-split dim's block is no one range, so its offset is None: a kernel that reads offsets
    must take ``local_pieces`` to hold a sub-split (and otherwise fails, never guesses)."""
    pieces = local_pieces(shape, mesh_shape, placements, coord)
    return (tuple(sum(n for _, n in dim) for dim in pieces),
            tuple(dim[0][0] if len(dim) == 1 else None for dim in pieces))


def join_order(blocks_pieces) -> list:
    """How blocks join along one dim into the block their pieces together make: ``blocks_
    pieces[b]`` are block b's ``(offset, length)`` ranges, in its order; the result is
    ``[(b, start within block b, length)]`` in the order of the ranges' offsets (the joined
    block's own order, as every block holds its pieces in the whole tensor's order).

    >>> join_order([((0, 2), (6, 1)), ((2, 2), (7, 1))])
    [(0, 0, 2), (1, 0, 2), (0, 2, 1), (1, 2, 1)]
    """
    found = []
    for b, pieces in enumerate(blocks_pieces):
        start = 0
        for offset, length in pieces:
            if length:
                found.append((offset, b, start, length))
            start += length
    return [(b, start, length) for _, b, start, length in sorted(found)]


def select_order(have, want) -> list:
    """The ``(start, length)`` ranges, within a block that holds the pieces ``have``, of the
    pieces ``want`` (each inside one of ``have``'s), in ``want``'s order: cutting a device's
    block out of a larger block.

    >>> select_order(((0, 4), (10, 4)), ((2, 2), (12, 2)))
    [(2, 2), (6, 2)]
    """
    out = []
    for offset, length in want:
        start = 0
        for first, n in have:
            if first <= offset and offset + length <= first + n:
                out.append((start + offset - first, length))
                break
            start += n
        else:
            raise ValueError(f"piece {(offset, length)} lies in none of {have}")
    return out


def local_shape(shape, mesh_shape, placements, coord) -> tuple:
    return local_region(tuple(shape), tuple(mesh_shape), tuple(placements), tuple(coord))[0]
