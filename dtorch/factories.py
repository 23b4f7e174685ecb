"""Factories whose arguments need more than a signature: random draws, ranges, and tensors made
from torch data. Each is a thin front over one registry entry in ``ops/creation.py``.

>>> import dtorch, torch
>>> mesh = dtorch.DeviceMesh("cpu", [0, 1])
>>> g = torch.Generator().manual_seed(0)
>>> x = dtorch.rand((4, 3), generator=g, device_mesh=mesh, placements=[dtorch.Shard(0)])
>>> torch.equal(x.to_torch(), torch.rand((4, 3), generator=torch.Generator().manual_seed(0)))
True
"""

from __future__ import annotations

import random

import torch

from .client.dispatch import call_op, check_layout, check_tensor
from .ops.creation import check_dtype, check_size
from .placement import as_int

_seeds = random.Random(0)


def manual_seed(seed: int) -> None:
    """Seeds dtorch's default generator (used by random factories given no ``generator``)."""
    _seeds.seed(seed)


def _seed(name, generator, draw, size, dtype, **kw):
    """The seed operand: a fresh 63-bit seed, or the user's generator state, which is advanced
    here exactly as torch would (by drawing the same tensor), so later draws match torch too.
    (Fronts check the layout first: a call that fails must leave the generator as it was.)"""
    if generator is None:
        return _seeds.getrandbits(63)
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"{name}(): argument 'generator' must be torch.Generator, not "
                        f"{type(generator).__name__}")
    state = bytes(generator.get_state().numpy())
    draw(size, generator=generator, dtype=dtype, **kw)
    return state


def _constant(name: str):
    def factory(*sizes, size=None, dtype=None, device_mesh=None, placements=None):
        shape = check_size(name, sizes, size, dtype)
        return call_op(name, (), (shape, dtype, device_mesh, placements))

    factory.__name__ = factory.__qualname__ = name
    factory.__doc__ = f"``torch.{name}``: each device makes its block; ``size=`` works too."
    return factory


zeros, ones, empty = _constant("zeros"), _constant("ones"), _constant("empty")


def rand(*size, generator=None, dtype=None, device_mesh=None, placements=None):
    """Uniform [0, 1) values, as ``torch.rand``; equal to torch's for the same generator."""
    size = check_size("rand", size, dtype=dtype)
    check_layout("rand", device_mesh, placements, len(size))
    seed = _seed("rand", generator, torch.rand, size, dtype)
    return call_op("rand", (seed,), (size, dtype, device_mesh, placements))


def randn(*size, generator=None, dtype=None, device_mesh=None, placements=None):
    """Standard normal values, as ``torch.randn``; equal to torch's for the same generator."""
    size = check_size("randn", size, dtype=dtype)
    check_layout("randn", device_mesh, placements, len(size))
    seed = _seed("randn", generator, torch.randn, size, dtype)
    return call_op("randn", (seed,), (size, dtype, device_mesh, placements))


def randint(low, high=None, size=None, *, generator=None, dtype=torch.int64, device_mesh=None,
            placements=None):
    """``randint(high, size)``, ``randint(high, size=size)`` or ``randint(low, high, size)``,
    as torch."""
    if size is None:
        low, high, size = 0, low, high
    elif high is None:
        low, high = 0, low
    low = as_int(low, "randint(): argument 'low'")
    high = as_int(high, "randint(): argument 'high'")
    size = check_size("randint", (), size, dtype)
    check_layout("randint", device_mesh, placements, len(size))
    seed = _seed("randint", generator, lambda sz, **kw: torch.randint(low, high, sz, **kw), size,
                 dtype)
    return call_op("randint", (seed,), (low, high, size, dtype, device_mesh, placements))


def randperm(n, *, generator=None, dtype=torch.int64, device_mesh=None, placements=None):
    """A random permutation of ``range(n)``, as ``torch.randperm``; equal to torch's for the
    same generator."""
    n = as_int(n, "randperm(): argument 'n' (position 1)")
    check_dtype("randperm", dtype)
    check_layout("randperm", device_mesh, placements, 1)
    seed = _seed("randperm", generator, torch.randperm, n, dtype)
    return call_op("randperm", (seed,), (n, dtype, device_mesh, placements))


def arange(start, end=None, step=1, *, dtype=None, device_mesh=None, placements=None):
    """``arange(end)`` or ``arange(start, end, step)``, as torch."""
    if end is None:
        start, end = 0, start
    return call_op("arange", (), (start, end, step, dtype, device_mesh, placements))


def from_torch(tensor: torch.Tensor, device_mesh=None, placements=None):
    """A distributed tensor whose logical value is ``tensor`` (each device keeps its block;
    on a Partial mesh dim device 0 holds the value and the others zeros).

    >>> import dtorch, torch
    >>> t = torch.arange(6.).reshape(2, 3)
    >>> mesh = dtorch.DeviceMesh("cpu", [0, 1])
    >>> torch.equal(dtorch.from_torch(t, mesh, [dtorch.Partial()]).to_torch(), t)
    True
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"from_torch expects a torch.Tensor, got {type(tensor).__name__}")
    data = tensor.detach().to("cpu").contiguous()
    raw = data.view(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b""
    return call_op("from_data", (raw,), (tuple(data.shape), data.dtype, device_mesh, placements))


def tensor(data, *, dtype=None, device_mesh=None, placements=None):
    """``torch.tensor(data, dtype=dtype)`` laid out on ``device_mesh``."""
    return from_torch(torch.tensor(data, dtype=dtype), device_mesh, placements)


def _like(name, input, dtype, device_mesh, placements):
    check_tensor(name, input, "input")
    spec = input._spec
    return (
        tuple(spec.shape),
        input.dtype if dtype is None else dtype,
        spec.mesh if device_mesh is None else device_mesh,
        spec.placements if placements is None and device_mesh is None else placements,
    )


def zeros_like(input, *, dtype=None, device_mesh=None, placements=None):
    return call_op("zeros", (), _like("zeros_like", input, dtype, device_mesh, placements))


def ones_like(input, *, dtype=None, device_mesh=None, placements=None):
    return call_op("ones", (), _like("ones_like", input, dtype, device_mesh, placements))


def empty_like(input, *, dtype=None, device_mesh=None, placements=None):
    return call_op("empty", (), _like("empty_like", input, dtype, device_mesh, placements))


def full_like(input, fill_value, *, dtype=None, device_mesh=None, placements=None):
    size, dtype, mesh, placements = _like("full_like", input, dtype, device_mesh, placements)
    return call_op("full", (), (size, fill_value, dtype, mesh, placements))


def rand_like(input, *, generator=None, dtype=None, device_mesh=None, placements=None):
    size, dtype, mesh, placements = _like("rand_like", input, dtype, device_mesh, placements)
    return rand(size, generator=generator, dtype=dtype, device_mesh=mesh, placements=placements)


def randn_like(input, *, generator=None, dtype=None, device_mesh=None, placements=None):
    size, dtype, mesh, placements = _like("randn_like", input, dtype, device_mesh, placements)
    return randn(size, generator=generator, dtype=dtype, device_mesh=mesh, placements=placements)


def randint_like(input, low=0, high=None, *, generator=None, dtype=None, device_mesh=None,
                 placements=None):
    """``randint_like(input, high)`` or ``randint_like(input, low, high)``, as torch (the
    input's dtype unless ``dtype=``)."""
    if high is None:
        low, high = 0, low
    size, dtype, mesh, placements = _like("randint_like", input, dtype, device_mesh, placements)
    return randint(low, high, size, generator=generator, dtype=dtype, device_mesh=mesh,
                   placements=placements)
