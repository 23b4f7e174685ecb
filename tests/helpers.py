"""Comparing dtorch programs with plain torch across meshes and placements."""

from __future__ import annotations

import itertools

import torch

import dtorch
from dtorch import Partial, Replicate, Shard


def placement_choices(tensor_ndim: int, partial: bool = True) -> list:
    """Every single-mesh-dim placement for a tensor of ``tensor_ndim`` dims."""
    out = [Replicate()] + [Shard(d) for d in range(tensor_ndim)]
    return out + [Partial()] if partial else out


def all_placements(mesh_ndim: int, tensor_ndim: int, partial: bool = True) -> list:
    return [list(p) for p in itertools.product(placement_choices(tensor_ndim, partial),
                                              repeat=mesh_ndim)]


def distribute(t: torch.Tensor, mesh, placements) -> dtorch.Tensor:
    return dtorch.from_torch(t, device_mesh=mesh, placements=placements)


def assert_close(actual, expected: torch.Tensor, exact: bool = False) -> None:
    """``actual`` (a dtorch.Tensor or torch.Tensor) equals ``expected``: bit for bit when
    ``exact`` (one device), else allclose; dtype and shape always match."""
    value = actual.to_torch() if isinstance(actual, dtorch.Tensor) else actual
    if isinstance(actual, dtorch.Tensor):
        assert tuple(actual.shape) == tuple(expected.shape), (actual.shape, expected.shape)
        assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert value.shape == expected.shape, (value.shape, expected.shape)
    assert value.dtype == expected.dtype, (value.dtype, expected.dtype)
    if exact:
        assert torch.equal(value, expected), (value, expected)
    else:
        torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-5)
