"""DeviceMesh: an N-D array of device ids with optional dimension names.

In dtorch a mesh is only a set of devices: the runtime creates and caches the process groups that
collectives over its dimensions need, so users never build one.

>>> import dtorch
>>> mesh = dtorch.DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=["dp", "tp"])
>>> mesh.shape, mesh["tp"].devices
((2, 2), (0, 1))
"""

from __future__ import annotations

import itertools

import torch

from . import spec
from .placement import as_int

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


def _check_cuda_devices(devices) -> None:
    """CUDA device ids name this machine's GPUs (the hosts run here); CPU ids are logical."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    missing = [d for d in devices if d >= n]
    if missing:
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
        raise ValueError(f"mesh_dim_names {names} must name each of the {ndim} mesh dims once")
    return names


class DeviceMesh:
    __slots__ = ("device_type", "mesh", "dim_names", "shape", "devices", "_key", "_hash", "wire_id")

    def __init__(self, device_type: str, mesh=None, *, mesh_dim_names=None):
        if device_type not in DEVICE_TYPES:
            raise ValueError(f"device_type must be one of {DEVICE_TYPES}, got {device_type!r}")
        flat, shape = _device_ids([0] if mesh is None else mesh)
        ids = torch.tensor(flat, dtype=torch.long).reshape(shape)
        if ids.ndim == 0:
            ids = ids.reshape(1)
        flat = tuple(ids.flatten().tolist())
        if ids.numel() == 0:
            raise ValueError("a DeviceMesh needs at least one device")
        if len(set(flat)) != len(flat) or min(flat) < 0:
            raise ValueError(f"device ids must be distinct and non-negative, got {list(flat)}")
        if device_type == "cuda":
            _check_cuda_devices(flat)
        names = _dim_names(mesh_dim_names, ids.ndim)
        self.device_type = device_type
        self.mesh = ids
        self.dim_names = names
        self.shape = tuple(ids.shape)
        self.devices = flat
        self._key = (device_type, self.shape, flat, names)
        self._hash = hash(self._key)
        self.wire_id = None  # set by the client session when first sent

    # -- shape --------------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def mesh_dim_names(self):
        return self.dim_names

    def size(self, mesh_dim: int | None = None) -> int:
        return len(self.devices) if mesh_dim is None else self.shape[mesh_dim]

    def coordinates(self):
        """Every mesh coordinate, in the order of ``devices``."""
        return itertools.product(*(range(s) for s in self.shape))

    def coordinate_of(self, device: int) -> tuple:
        """The mesh coordinate of ``device``."""
        return spec.coordinate_of(self, device)

    # -- sub-meshes ---------------------------------------------------------------------------
    def _dim_index(self, dim) -> int:
        if isinstance(dim, str):
            if not self.dim_names or dim not in self.dim_names:
                raise KeyError(f"mesh has no dimension named {dim!r} (names: {self.dim_names})")
            return self.dim_names.index(dim)
        dim = as_int(dim, "a mesh dim (or its name)")
        if not -self.ndim <= dim < self.ndim:
            raise IndexError(f"mesh dim {dim} out of range for a {self.ndim}-D mesh")
        return dim % self.ndim

    def __getitem__(self, dims) -> DeviceMesh:
        """The sub-mesh over the named dims, at coordinate 0 of the others (see ``unbind``)."""
        dims = tuple(dims) if isinstance(dims, (list, tuple)) else (dims,)
        keep = [self._dim_index(d) for d in dims]
        index = tuple(slice(None) if i in keep else 0 for i in range(self.ndim))
        # indexing keeps the dims in mesh order; permute them into the order asked for
        sub = self.mesh[index].permute(*[sorted(keep).index(k) for k in keep])
        names = None if self.dim_names is None else [self.dim_names[i] for i in keep]
        return DeviceMesh(self.device_type, sub, mesh_dim_names=names)

    def unbind(self, dims) -> list:
        """All sub-meshes obtained by fixing the coordinates of ``dims``, in row-major order."""
        dims = tuple(dims) if isinstance(dims, (list, tuple)) else (dims,)
        drop = sorted(self._dim_index(d) for d in dims)
        keep = [i for i in range(self.ndim) if i not in drop]
        names = None if self.dim_names is None else [self.dim_names[i] for i in keep]
        moved = self.mesh.permute(*drop, *keep).reshape(-1, *[self.shape[i] for i in keep])
        return [DeviceMesh(self.device_type, m, mesh_dim_names=names) for m in moved]

    # -- identity -----------------------------------------------------------------------------
    def __eq__(self, other) -> bool:
        return isinstance(other, DeviceMesh) and self._key == other._key

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        names = "" if self.dim_names is None else f", mesh_dim_names={list(self.dim_names)}"
        return f"DeviceMesh({self.device_type!r}, {self.mesh.tolist()}{names})"


def init_device_mesh(device_type: str, mesh_shape, *, mesh_dim_names=None) -> DeviceMesh:
    """A mesh of devices ``0 .. prod(mesh_shape)-1`` laid out row-major.

    >>> init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")).devices
    (0, 1, 2, 3)
    """
    shape = (mesh_shape,) if not isinstance(mesh_shape, (list, tuple)) else tuple(mesh_shape)
    shape = tuple(as_int(s, "init_device_mesh: mesh_shape entry") for s in shape)
    if not shape or min(shape) < 1:
        raise ValueError(f"init_device_mesh: mesh_shape must be positive sizes, got {mesh_shape}")
    n = 1
    for s in shape:
        n *= s
    ids = torch.arange(n).reshape(shape)
    return DeviceMesh(device_type, ids, mesh_dim_names=mesh_dim_names)
