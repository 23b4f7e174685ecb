"""DeviceMesh: an N-D array of device ids with optional dimension names.

In dtorch a mesh is only a set of devices: the runtime creates and caches the process groups that
collectives over its dimensions need, so users never build one. The class speaks both torch's
DeviceMesh API (``mesh_dim_names``, ``size``, ``get_coordinate``, ``mesh["tp"]``) and DTorch's
(``dim_names``, ``dim_name_index``, ``unbind``, ``first_device``); ``dtorch.distributed_spec``
re-exports it under DTorch's import path.

>>> import dtorch
>>> mesh = dtorch.DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=["dp", "tp"])
>>> mesh.shape, mesh["tp"].devices
((2, 2), (0, 1))
>>> [m.devices for m in mesh.unbind("tp")]
[(0, 2), (1, 3)]
"""

from __future__ import annotations

import itertools
import math

import torch

from . import spec
from .placement import as_int, chunk_sizes

DEVICE_TYPES = ("cpu", "cuda")


def _device_ids(mesh) -> tuple:
    """(flat ids, shape) of ``mesh``: ints nested in lists, tuples or ranges, or an integer
    tensor or array. Anything else is refused rather than rounded (``0.5`` is not device 0), and
    the nesting must be rectangular."""
    if hasattr(mesh, "tolist") and not isinstance(mesh, (list, tuple)):  # a tensor or an array
        mesh = mesh.tolist()
    if not isinstance(mesh, (list, tuple, range)):
        return [as_int(mesh, f"DeviceMesh: device id {mesh!r}")], ()
    parts = [_device_ids(m) for m in mesh]
    shapes = {shape for _, shape in parts}
    if len(shapes) > 1:
        raise ValueError(f"DeviceMesh: every row of a mesh must have the same shape, got rows of "
                         f"shapes {sorted(shapes)} in {mesh!r}")
    return [i for flat, _ in parts for i in flat], (len(parts), *(shapes.pop() if shapes else ()))


class DeviceType(str):
    """A mesh's device kind: a str, as torch's ``DeviceMesh.device_type`` is (``"cpu"``,
    ``"cuda"``), that also equals the ``torch.device`` of its kind without an index, which is
    what DTorch's ``device_type`` is and what its programs compare it with
    (``mesh.device_type == torch.device("cpu")``)."""

    __slots__ = ()

    def __eq__(self, other):
        if isinstance(other, torch.device):
            return other.index is None and other.type == str(self)
        return str.__eq__(self, other)

    def __ne__(self, other):
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = str.__hash__


def _parse_device(device) -> tuple:
    """(kind, index or None) of a device given as torch does (``"cuda"``, ``"cpu:3"``,
    ``torch.device("cuda", 1)``), restricted to the kinds dtorch runs on."""
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"DeviceMesh: the device type must be a str or torch.device such as "
                        f"'cpu' or 'cuda:1', or a DeviceMesh to copy, got {device!r}")
    try:
        device = torch.device(device)
    except RuntimeError:  # torch's message lists device kinds dtorch does not run on
        device = None
    if device is None or device.type not in DEVICE_TYPES:
        raise ValueError(f"device_type must be one of {DEVICE_TYPES} (optionally with an index, "
                         f"'cuda:1'), got {device!r}")
    return DeviceType(device.type), device.index


def _cuda_device_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def absent_devices(mesh: DeviceMesh) -> list:
    """The ids of ``mesh`` this machine lacks: CPU ids are logical (none is absent, and torch's
    CUDA is not asked); CUDA ids name this machine's GPUs, ``0 .. device_count() - 1``."""
    if mesh.device_type == "cpu":
        return []
    n = _cuda_device_count()
    return [d for d in mesh.devices if d >= n]


def check_devices_present(mesh: DeviceMesh) -> None:
    """Raises unless this machine has every device of ``mesh``: what the first operator on a
    mesh checks. Making a mesh is metadata only, so a program can build a CUDA mesh and ask
    ``Graph.satisfy`` before it uses one."""
    missing = absent_devices(mesh)
    if missing:
        n = _cuda_device_count()
        fix = f"use ids 0..{n - 1}" if n else "use DeviceMesh('cpu', ...)"
        raise RuntimeError(f"DeviceMesh('cuda', ...): this machine has {n} CUDA devices, so "
                           f"devices {missing} do not exist; {fix}")


def _dim_names(names, ndim: int):
    """``mesh_dim_names`` as a tuple of distinct strings, one per mesh dim (or None)."""
    if names is None:
        return None
    if isinstance(names, str) or not isinstance(names, (list, tuple)):
        raise TypeError(f"mesh_dim_names must be a list or tuple of str, one per mesh dim, got "
                        f"{names!r}")
    names = tuple(names)
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise TypeError(f"mesh_dim_names must be strings, got {bad[0]!r} in {list(names)}")
    if len(names) != ndim or len(set(names)) != len(names):
        raise ValueError(f"Invalid dim_names: {list(names)}; a {ndim}-D mesh needs {ndim} "
                         f"distinct names, one per mesh dim")
    return names


def _mesh_args(device_type, mesh, mesh_dim_names) -> tuple:
    """(kind, ids, names) of any constructor form: a DeviceMesh to copy, a bare device (one
    device: ``"cpu:3"`` is device 3, ``"cuda"`` device 0), or a device type and ids."""
    if isinstance(device_type, DeviceMesh):
        if mesh is not None or mesh_dim_names is not None:
            raise TypeError("DeviceMesh(other_mesh) copies a mesh and takes no ids or names; "
                            "for new ones use DeviceMesh(other.device_type, ids, "
                            "mesh_dim_names=...)")
        return device_type.device_type, device_type._ids, device_type._names
    kind, index = _parse_device(device_type)
    if mesh is None:
        return kind, [0 if index is None else index], mesh_dim_names
    if index is not None:
        raise ValueError(f"DeviceMesh({device_type!r}, mesh): give the device index either in "
                         f"the device ({device_type!r} alone) or in the ids, not both; e.g. "
                         f"DeviceMesh({kind!r}, {[index]})")
    return kind, mesh, mesh_dim_names


class DeviceMesh:
    """An N-D array of distinct device ids of one kind, with optional names for its dims.

    ``DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=["dp", "tp"])`` lays four devices out
    as a 2x2 mesh; ``DeviceMesh("cuda:1")`` is the one-device mesh of GPU 1, and
    ``DeviceMesh(other)`` copies ``other``. Meshes are equal when their kind, ids, shape and
    names are, and they are hashable (DTorch's are not).

    ``device_type`` is the kind as a str (``"cpu"``, ``"cuda"``), as torch's DeviceMesh has it,
    which also equals ``torch.device("cpu")`` (``DeviceType``): DTorch's is a ``torch.device``,
    and its programs compare it with one.

    >>> DeviceMesh("cpu:3")
    DeviceMesh('cpu', dim_name: [], shape: (1,), data: [3])
    >>> DeviceMesh("cpu", [[0, 1], [2, 3]], ["dp", "tp"]).dim_name_index("tp")
    1
    """

    __slots__ = ("device_type", "_ids", "_names", "shape", "devices", "_key", "_hash", "wire_id")

    def __init__(self, device_type, mesh=None, mesh_dim_names=None):
        device_type, mesh, mesh_dim_names = _mesh_args(device_type, mesh, mesh_dim_names)
        flat, shape = _device_ids(mesh)
        ids = torch.tensor(flat, dtype=torch.long).reshape(shape)
        if ids.ndim == 0:
            ids = ids.reshape(1)
        flat = tuple(ids.flatten().tolist())
        if ids.numel() == 0:
            raise ValueError("a DeviceMesh needs at least one device")
        if len(set(flat)) != len(flat) or min(flat) < 0:
            raise ValueError(f"device ids must be distinct and non-negative, got {list(flat)}")
        names = _dim_names(mesh_dim_names, ids.ndim)
        self.device_type = device_type
        self._ids = ids
        self._names = names
        self.shape = tuple(ids.shape)
        self.devices = flat
        self._key = (device_type, self.shape, flat, names)
        self._hash = hash(self._key)
        self.wire_id = None  # set by the client session when first sent

    # -- shape and names ----------------------------------------------------------------------
    @property
    def mesh(self) -> torch.Tensor:
        """The ids as an int64 CPU tensor (a copy: a mesh is a value, and its hash must hold)."""
        return self._ids.clone()

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def is_distributed(self) -> bool:
        """Whether the mesh has more than one device (a (1, 1) mesh does not)."""
        return len(self.devices) > 1

    @property
    def mesh_dim_names(self):
        """torch's form of the names: a tuple, or None for an unnamed mesh."""
        return self._names

    @property
    def dim_names(self) -> list:
        """DTorch's form of the names: a list, empty for an unnamed mesh."""
        return list(self._names or ())

    def has_dim_name(self, name: str) -> bool:
        return self._names is not None and name in self._names

    def dim_name_index(self, name: str, default_value=None):
        """The index of the mesh dim called ``name``, or ``default_value`` if there is none:
        layers ask for optional dims (``"tp"``, ``"ring_cp"``) this way."""
        return self._names.index(name) if self.has_dim_name(name) else default_value

    def check_all_dim_names_in_set(self, names) -> None:
        """Raises ValueError unless every dim of the mesh has a name in ``names``: the check a
        layer makes that it knows how to use each mesh dim."""
        if self.is_distributed and self._names is None:
            raise ValueError("DeviceMesh is distributed but dim_names is empty, please set "
                             "dim_names when initializing DeviceMesh")
        unknown = [n for n in self.dim_names if n not in set(names)]
        if unknown:
            raise ValueError(f"DeviceMesh has dims {unknown} that are not in {sorted(names)}; "
                             f"name the mesh dims from that set")

    def size(self, mesh_dim: int | None = None) -> int:
        return len(self.devices) if mesh_dim is None else self.shape[mesh_dim]

    # -- devices and coordinates --------------------------------------------------------------
    def coordinates(self):
        """Every mesh coordinate, in the order of ``devices``."""
        return itertools.product(*(range(s) for s in self.shape))

    def coordinate_of(self, device: int) -> tuple:
        """The mesh coordinate of ``device``."""
        return spec.coordinate_of(self, device)

    def get_coordinate(self, device_id=None) -> list | None:
        """torch's ``get_coordinate``: the coordinate of ``device_id``, or None if it is not in
        the mesh. A single controller drives every device, so there is no current rank to
        default to; without an id only a one-device mesh has an answer.

        >>> init_device_mesh("cpu", (2, 2)).get_coordinate(2)
        [1, 0]
        """
        if device_id is None:
            if self.is_distributed:
                raise ValueError(f"get_coordinate(): one program drives all {self.size()} "
                                 f"devices of {self!r}, so there is no current device; pass "
                                 f"one, e.g. mesh.get_coordinate({self.devices[0]})")
            device_id = self.devices[0]
        device_id = as_int(device_id, "get_coordinate(device_id): device_id")
        return list(self.coordinate_of(device_id)) if device_id in self.devices else None

    def first_device(self) -> torch.device:
        """The torch device of the first id, as DTorch gives it: CPU id 0 is plain ``cpu``."""
        kind, first = self.device_type, self.devices[0]
        return torch.device(kind) if kind == "cpu" and first == 0 else torch.device(kind, first)

    def to_device(self) -> torch.device:
        """The torch device of a one-device mesh."""
        if self.is_distributed:
            raise ValueError(f"to_device() needs a one-device mesh, got {self!r}; use "
                             f"first_device() for its first device")
        return self.first_device()

    # -- sub-meshes ---------------------------------------------------------------------------
    def _dim_index(self, dim) -> int:
        if isinstance(dim, str):
            if not self.has_dim_name(dim):
                raise KeyError(f"mesh has no dimension named {dim!r} (names: {self._names})")
            return self._names.index(dim)
        dim = as_int(dim, "a mesh dim (or its name)")
        if not -self.ndim <= dim < self.ndim:
            raise IndexError(f"mesh dim {dim} out of range for a {self.ndim}-D mesh")
        return dim % self.ndim

    def _sub_mesh(self, ids: torch.Tensor, dims) -> DeviceMesh:
        """The mesh of ``ids``, whose dims are this mesh's ``dims``, keeping their names."""
        names = None if self._names is None or not dims else [self._names[i] for i in dims]
        return DeviceMesh(self.device_type, ids, mesh_dim_names=names)

    def __getitem__(self, dims) -> DeviceMesh:
        """The sub-mesh over the named dims, at coordinate 0 of the others (see ``unbind``)."""
        dims = tuple(dims) if isinstance(dims, (list, tuple)) else (dims,)
        keep = [self._dim_index(d) for d in dims]
        index = tuple(slice(None) if i in keep else 0 for i in range(self.ndim))
        # indexing keeps the dims in mesh order; permute them into the order asked for
        sub = self._ids[index].permute(*[sorted(keep).index(k) for k in keep])
        return self._sub_mesh(sub, keep)

    def unbind(self, dims) -> list:
        """The sub-meshes left by removing ``dims`` (names, ints or a list of them), as DTorch
        orders them: the highest removed dim varies slowest. Names the mesh lacks are ignored,
        so a layer can unbind ``"pp"`` whether or not the mesh has one; if no dim is left to
        remove, the result is ``[self]``.

        >>> mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=["dp", "tp", "pp"])
        >>> [m.mesh.tolist() for m in mesh.unbind("pp")]
        [[[0, 2], [4, 6]], [[1, 3], [5, 7]]]
        """
        dims = dims if isinstance(dims, (list, tuple)) else [dims]
        named = [d for d in dims if not isinstance(d, str) or self.has_dim_name(d)]
        drop = sorted({self._dim_index(d) for d in named}, reverse=True)
        if not drop:
            return [self]
        keep = [i for i in range(self.ndim) if i not in drop]
        moved = self._ids.permute(*drop, *keep).reshape(-1, *[self.shape[i] for i in keep])
        return [self._sub_mesh(m, keep) for m in moved]

    # -- identity -----------------------------------------------------------------------------
    def __eq__(self, other) -> bool:
        return isinstance(other, DeviceMesh) and self._key == other._key

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return (f"DeviceMesh({self.device_type!r}, dim_name: {self.dim_names}, "
                f"shape: {self.shape}, data: {self._ids.tolist()})")


def _mesh_shape(mesh_shape) -> tuple:
    """``mesh_shape`` as DTorch reads it: an int is one dim, None entries are dropped, and no
    dims at all is one device."""
    shape = (mesh_shape,) if not isinstance(mesh_shape, (list, tuple)) else tuple(mesh_shape)
    shape = tuple(as_int(s, "init_device_mesh: mesh_shape entry") for s in shape if s is not None)
    if shape and min(shape) < 1:
        raise ValueError(f"init_device_mesh: mesh_shape must be positive sizes, got {mesh_shape}")
    return shape or (1,)


def init_device_mesh(device_type, mesh_shape, mesh_dim_names=None) -> DeviceMesh:
    """A mesh of devices ``0 .. prod(mesh_shape)-1`` laid out row-major. ``mesh_dim_names``
    may be given by keyword (torch) or third (DTorch).

    >>> init_device_mesh("cpu", (2, None, 2), mesh_dim_names=("dp", "tp")).devices
    (0, 1, 2, 3)
    """
    shape = _mesh_shape(mesh_shape)
    ids = torch.arange(math.prod(shape)).reshape(shape)
    return DeviceMesh(device_type, ids, mesh_dim_names=mesh_dim_names)


def assign_layers_to_stages(num_layers: int, num_stages: int) -> list:
    """The pipeline stage of each of ``num_layers`` layers, spread as evenly as possible over
    ``num_stages`` stages, earlier stages taking the extra layers (as ``Shard`` splits a dim).

    >>> assign_layers_to_stages(5, 2)
    [0, 0, 0, 1, 1]
    """
    num_layers = as_int(num_layers, "assign_layers_to_stages: num_layers")
    num_stages = as_int(num_stages, "assign_layers_to_stages: num_stages")
    if num_stages <= 0 or num_layers < 0:
        raise ValueError(f"assign_layers_to_stages: need num_stages > 0 and num_layers >= 0, "
                         f"got num_layers={num_layers}, num_stages={num_stages}")
    sizes = chunk_sizes(num_layers, num_stages)
    return [stage for stage, n in enumerate(sizes) for _ in range(n)]
