"""Where a run goes after a loss: the new mesh's devices, from the old ones, the devices lost,
the spares and whether the data-parallel dim may shrink. Pure data in, data out (no runtime),
so each rule is tested on its own (``tests/test_elastic_policy.py``).

The rules, in order, for each lost device of the mesh:
1. a spare takes its place (the mesh keeps its shape: the same coordinates, the same layouts);
2. else, with ``shrink``, the data-parallel slice that holds it leaves the mesh (dp - 1; a tp
   group is whole or gone, since its members hold different shards of every layer);
3. else the loss cannot be recovered: ``Unrecoverable`` names what was missing.
A lost spare just leaves the pool; a lost device the mesh does not use changes nothing.
Then (``fit``) the data-parallel dim shrinks further until it divides the global batch's rows,
which stay as they were (each step's batch, hence the loss curve, is the uninterrupted run's,
and each dp slice gets an equal share); the slices it drops wait as spares for the next loss.
"""

from __future__ import annotations

import math
from typing import NamedTuple


class Unrecoverable(RuntimeError):
    """No policy can go on after a loss (no spare, and no data-parallel copy to drop to). The
    last committed snapshot is in ``snapshot`` (a ``save_checkpoint`` directory, loadable on
    any mesh with ``load_checkpoint``), ``step`` steps in (None: none yet): the last completed
    step's, or the one before it when the loss came while that step's was being written."""

    def __init__(self, message: str, snapshot: str | None = None, step: int | None = None):
        super().__init__(message)
        self.snapshot, self.step = snapshot, step


class Layout(NamedTuple):
    """A mesh as the policy sees it: the device ids as nested lists (row-major) and the
    spares left."""

    grid: list
    spares: tuple

    @property
    def devices(self) -> tuple:
        return tuple(_flatten(self.grid))

    @property
    def shape(self) -> tuple:
        shape, level = [], self.grid
        while isinstance(level, list):
            shape.append(len(level))
            level = level[0]
        return tuple(shape)


def remesh(layout: Layout, lost, dp_axis: int | None, shrink: bool) -> Layout:
    """The layout after losing ``lost`` (device ids): spares first, then dp shrinks (along
    ``dp_axis`` of the grid; None: the mesh has no data-parallel dim)."""
    lost = set(lost)
    spares = [d for d in layout.spares if d not in lost]
    grid = _map(layout.grid, lambda d: d)  # a copy
    for d in [d for d in layout.devices if d in lost]:
        if spares:
            grid = _map(grid, lambda x, d=d, s=spares[0]: s if x == d else x)
            spares.pop(0)
            continue
        if not shrink or dp_axis is None:
            why = ("shrinking the data-parallel dim is off (shrink=False)" if shrink is False
                   else "the mesh has no data-parallel dim to shrink")
            raise Unrecoverable(f"device {d} was lost, no spare device is left, and {why}")
        grid = _drop(grid, dp_axis, d)
        if grid is None:
            raise Unrecoverable(f"device {d} was lost, no spare device is left, and its "
                                f"data-parallel slice was the last one")
    return Layout(grid, tuple(spares))


def fit(layout: Layout, dp_axis: int | None, rows: int | None) -> Layout:
    """``layout`` with its last data-parallel slices moved to the spares until dp divides
    ``rows`` (the global batch's; None: no batch to divide)."""
    if dp_axis is None or not rows:
        return layout
    grid, spares = layout.grid, list(layout.spares)
    while rows % (dp := Layout(grid, ()).shape[dp_axis]):
        kept = _drop_index(grid, dp_axis, dp - 1)
        spares += [d for d in _flatten(grid) if d not in set(_flatten(kept))]
        grid = kept
    return Layout(grid, tuple(spares))


def grow(layout: Layout, target_dp: int, dp_axis: int, available, rows: int | None = None
         ) -> Layout:
    """``layout`` with data-parallel slices added, at a step boundary, when devices came back:
    to the largest dp up to ``target_dp`` that the devices allow and that divides ``rows``
    (the global batch's), taking devices that joined (``available`` ones not in the mesh) before
    the spares."""
    in_mesh, spares = set(layout.devices), list(layout.spares)
    free = [d for d in available if d not in in_mesh and d not in spares] + spares
    shape = layout.shape
    per_slice = math.prod(shape) // shape[dp_axis]
    sizes = [n for n in range(shape[dp_axis] + 1, target_dp + 1)
             if (n - shape[dp_axis]) * per_slice <= len(free) and not (rows and rows % n)]
    if not sizes:
        return layout
    grid = layout.grid
    for _ in range(max(sizes) - shape[dp_axis]):
        new, free = free[:per_slice], free[per_slice:]
        grid = _append(grid, dp_axis, new, Layout(grid, ()).shape)
    return Layout(grid, tuple(d for d in spares if d in free))


def _flatten(grid):
    for x in grid:
        if isinstance(x, list):
            yield from _flatten(x)
        else:
            yield x


def _map(grid, f):
    return [_map(x, f) if isinstance(x, list) else f(x) for x in grid]


def _drop(grid, axis: int, device: int):
    """``grid`` without the slice along ``axis`` that holds ``device`` (None: none left); every
    row drops the same index, so the mesh stays a box."""
    kept = _drop_index(grid, axis, _index_along(grid, axis, device))
    return kept if Layout(kept, ()).devices else None


def _index_along(grid, axis: int, device: int) -> int:
    for x in grid:
        if device in set(_flatten([x])):
            if axis == 0:
                return grid.index(x)
            return _index_along(x, axis - 1, device)
    raise ValueError(device)


def _drop_index(grid, axis: int, index: int):
    if axis == 0:
        return [x for k, x in enumerate(grid) if k != index]
    return [_drop_index(x, axis - 1, index) for x in grid]


def _append(grid, axis: int, devices: list, shape: tuple):
    """``grid`` with one more slice along ``axis``, filled row-major from ``devices``."""
    rest = shape[:axis] + shape[axis + 1:]
    block = _reshape(list(devices), rest)  # the new slice, as nested lists of the other dims
    if axis == 0:
        return grid + [block] if rest else grid + devices
    return [_append(x, axis - 1, _flatten_list(b), shape[1:]) for x, b in zip(grid, block)]


def _flatten_list(x):
    return list(_flatten(x)) if isinstance(x, list) else [x]


def _reshape(flat: list, shape: tuple):
    if not shape:
        return flat[0]
    if len(shape) == 1:
        return flat[:shape[0]]
    step = len(flat) // shape[0]
    return [_reshape(flat[k * step:(k + 1) * step], shape[1:]) for k in range(shape[0])]
