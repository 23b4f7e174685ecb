"""Comparing dtorch programs with plain torch across meshes and placements.

A test builds torch operands with ``sample``, lays them out with ``distribute`` over a
``layout_fixture`` (the ``one``, ``mesh1``, ``mesh2`` and ``mesh3`` meshes of conftest.py), runs
the same function on both with ``check_like_torch`` (or ``torch_expected`` where dtorch may
refuse a layout first) and compares with ``assert_close``.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, settings

import dtorch
from dtorch import Partial, Replicate, Shard
from dtorch.placement import placements_str


def fixture_settings(max_examples: int) -> settings:
    """Hypothesis settings for a ``@given`` test that also takes pytest fixtures (the meshes,
    ``layout``): they hold no per-example state, so the function-scoped-fixture health check is
    off; no deadline, as an example may start the runtime or plan a new redistribute."""
    return settings(max_examples=max_examples, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


def placement_choices(tensor_ndim: int, partial: bool = True) -> list:
    """Every single-mesh-dim placement for a tensor of ``tensor_ndim`` dims."""
    out = [Replicate()] + [Shard(d) for d in range(tensor_ndim)]
    return out + [Partial()] if partial else out


def all_placements(mesh_ndim: int, tensor_ndim: int, partial: bool = True) -> list:
    return [list(p) for p in itertools.product(placement_choices(tensor_ndim, partial),
                                              repeat=mesh_ndim)]


def aligned_placements(placements, out_shape, shape) -> list:
    """Placements of an operand of ``shape`` broadcast to ``out_shape`` that follow the output's
    shards (Replicate where it broadcasts)."""
    off = len(out_shape) - len(shape)
    out = []
    for p in placements:
        d = p.dim - off if p.is_shard() else -1
        out.append(Shard(d) if d >= 0 and shape[d] == out_shape[p.dim] else Replicate())
    return out


def layout_id(layout) -> str:
    """A test id for a (mesh fixture name, placements) row: ``mesh2-S(0)S(1)``."""
    return f"{layout[0]}-{placements_str(layout[1])}"


def layout_fixture(layouts: list):
    """A ``layout`` fixture over ``layouts``, rows of (mesh fixture name, placements). Each test
    gets (mesh, placements as a list, exact): exact (bit-identical to torch) on ``one``, the
    one-device mesh. Use as ``layout = layout_fixture(LAYOUTS)`` in a test module."""

    @pytest.fixture(params=layouts, ids=layout_id)
    def layout(request):
        name, placements = request.param
        return request.getfixturevalue(name), list(placements), name == "one"

    return layout


def lib(x):
    """dtorch for a dtorch tensor, torch for a torch one: ``lib(x).cat(...)`` runs on both."""
    return dtorch if isinstance(x, dtorch.Tensor) else torch


def sample(shape, dtype=torch.float32, seed=0, positive=False) -> torch.Tensor:
    """A seeded torch tensor: normal floats, ints in [-5, 5], random bools. ``positive`` (for
    logs, roots and divisors) gives floats >= 0.5, ints in [1, 5] and all-True bools."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(1 if positive else 0, 2, shape, generator=g).bool()
    if not dtype.is_floating_point:
        return torch.randint(1 if positive else -5, 6, shape, generator=g, dtype=dtype)
    t = torch.randn(shape, generator=g, dtype=dtype)
    return t.abs() + 0.5 if positive else t


def distribute(t: torch.Tensor, mesh, placements) -> dtorch.Tensor:
    return dtorch.from_torch(t, device_mesh=mesh, placements=placements)


def assert_close(actual, expected, exact: bool = False, equal_nan: bool = False) -> None:
    """``actual`` (a dtorch.Tensor or torch.Tensor) equals ``expected``: bit for bit when
    ``exact`` (one device), else allclose for floats and equal for integers and bools; dtype and
    shape always match. A tuple ``expected`` (``split``, ``max(dim)``) needs a tuple of as many
    outputs, compared one by one. ``equal_nan``: NaN where torch has NaN passes."""
    if isinstance(expected, tuple):
        assert isinstance(actual, tuple) and len(actual) == len(expected), (actual, expected)
        for a, e in zip(actual, expected):
            assert_close(a, e, exact, equal_nan)
        return
    value = actual.to_torch() if isinstance(actual, dtorch.Tensor) else actual
    if isinstance(actual, dtorch.Tensor):
        assert tuple(actual.shape) == tuple(expected.shape), (actual.shape, expected.shape)
        assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert value.shape == expected.shape, (value.shape, expected.shape)
    assert value.dtype == expected.dtype, (value.dtype, expected.dtype)
    if exact and not equal_nan:
        assert torch.equal(value, expected), (value, expected)
        return
    # distributed float kernels may differ from one-device ones in the last bit (vectorized
    # tails, another summation order); integers and bools have no rounding to forgive
    inexact = expected.is_floating_point() or expected.is_complex()
    tol = 1e-5 if inexact and not exact else 0
    torch.testing.assert_close(value, expected, rtol=tol, atol=tol, equal_nan=equal_nan)


TORCH_RAISED = object()  # what torch_expected returns when torch raised


def torch_expected(fn, ts, xs):
    """``fn(*ts)`` on the torch operands ``ts``. Where torch raises, asserts that ``fn(*xs)`` on
    the dtorch operands ``xs`` raises the same exception type, at the call, and returns
    ``TORCH_RAISED``."""
    try:
        return fn(*ts)
    except Exception as e:  # noqa: BLE001 - whatever torch raises, dtorch must raise too
        with pytest.raises(type(e)):
            fn(*xs)
        return TORCH_RAISED


def check_like_torch(fn, xs, ts, exact: bool = False, equal_nan: bool = False) -> None:
    """``fn`` on dtorch operands ``xs`` gives ``fn`` on torch operands ``ts`` (``assert_close``),
    or raises torch's exception type at the call."""
    expected = torch_expected(fn, ts, xs)
    if expected is not TORCH_RAISED:
        assert_close(fn(*xs), expected, exact, equal_nan)
