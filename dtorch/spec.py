"""TensorSpec: the metadata of a distributed tensor (global shape, dtype, mesh, placements).

Specs are interned: one object per distinct value (in any thread), so rule caches hash them by
identity and the wire carries a small integer id. This module imports no torch, because the controller does not
need it; dtypes travel and are stored by name (``"float32"``).
"""

from __future__ import annotations

import threading

from .placement import (Partial, Replicate, Shard, check_partials, local_pieces, local_region,
                        normalize_layout, placements_str)


class MeshInfo:
    """What the controller and hosts know of a mesh: the client's DeviceMesh has the same fields."""

    __slots__ = ("device_type", "shape", "devices", "wire_id")

    def __init__(self, device_type: str, shape, devices, wire_id=None):
        self.device_type, self.shape, self.devices = device_type, tuple(shape), tuple(devices)
        self.wire_id = wire_id

    def __repr__(self) -> str:
        return f"MeshInfo({self.device_type!r}, {self.shape}, {self.devices})"


def coordinate_of(mesh, device: int) -> tuple:
    index, coord = mesh.devices.index(device), []
    for s in reversed(mesh.shape):
        index, c = divmod(index, s)
        coord.append(c)
    return tuple(reversed(coord))


def device_at(mesh, coord) -> int:
    index = 0
    for s, c in zip(mesh.shape, coord):
        index = index * s + c
    return mesh.devices[index]


def group_devices(mesh, mesh_dim: int, coord) -> tuple:
    """The devices along ``mesh_dim`` through ``coord``: the members of one process group."""
    c = list(coord)
    out = []
    for i in range(mesh.shape[mesh_dim]):
        c[mesh_dim] = i
        out.append(device_at(mesh, c))
    return tuple(out)


def span_devices(mesh, mesh_dims, coord) -> tuple:
    """The devices of the sub-mesh over ``mesh_dims`` through ``coord`` (sorted): the peers of
    a kernel whose collectives run along several mesh dims. Along one dim: its group, in rank
    order."""
    if len(mesh_dims) == 1:
        return group_devices(mesh, mesh_dims[0], coord)
    out = {device_at(mesh, coord)}
    for d in mesh_dims:
        out |= {x for c in out for x in group_devices(mesh, d, coordinate_of(mesh, c))}
    return tuple(sorted(out))


class TensorSpec:
    __slots__ = ("shape", "dtype", "mesh", "placements", "wire_id", "__weakref__")

    def __init__(self, shape, dtype: str, mesh, placements, wire_id=None):
        self.shape, self.dtype, self.mesh = tuple(shape), dtype, mesh
        self.placements, self.wire_id = tuple(placements), wire_id

    def local_region(self, coord) -> tuple:
        return local_region(self.shape, self.mesh.shape, self.placements, tuple(coord))

    def local_pieces(self, coord) -> tuple:
        return local_pieces(self.shape, self.mesh.shape, self.placements, tuple(coord))

    def with_placements(self, placements) -> TensorSpec:
        return intern_spec(self.shape, self.dtype, self.mesh, placements)

    @property
    def has_partial(self) -> bool:
        return any(isinstance(p, Partial) for p in self.placements)

    def __repr__(self) -> str:
        return (
            f"TensorSpec({list(self.shape)}, {self.dtype}, devices={list(self.mesh.devices)}, "
            f"{placements_str(self.placements)})"
        )


_SPECS: dict = {}
_NEW_SPEC = threading.Lock()  # two threads making one spec get the same object


def intern_spec(shape, dtype: str, mesh, placements) -> TensorSpec:
    """The one TensorSpec with these fields (created on first use, after ``check_partials``
    and ``normalize_layout``: so every layout made anywhere has passed the one rule of which
    Partials a dtype can hold, and reads a Shard on a mesh dim of one device as Replicate)."""
    key = (tuple(shape), dtype, mesh, tuple(placements))
    spec = _SPECS.get(key)
    if spec is None:
        check_partials(key[3], dtype)
        placements = normalize_layout(key[0], mesh.shape, key[3])
        if placements != key[3]:  # the same spec as its normal form, under both keys
            spec = intern_spec(key[0], dtype, mesh, placements)
            _SPECS[key] = spec
            return spec
        with _NEW_SPEC:
            spec = _SPECS.get(key)
            if spec is None:
                spec = _SPECS[key] = TensorSpec(*key)
    return spec


__all__ = ["MeshInfo", "TensorSpec", "intern_spec", "Shard", "Replicate", "Partial"]
