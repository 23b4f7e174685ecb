"""Creation operators: every factory takes ``dtype=, device_mesh=, placements=`` and makes each
device's block of the tensor where it lives.

Host kernels build the block of the Replicate value that the device holds (``ctx.region``), then
``ctx.partition`` turns it into the device's contribution on Partial mesh dims (device 0 keeps the
value, the others hold the reduction's identity), so every factory works with every placement.
Random factories draw the whole tensor from one seeded generator on each device and keep their
block: values are torch's exactly, for a given seed or a given ``torch.Generator``.
"""

from __future__ import annotations

import math
import operator

import torch

from ..placement import check_partials, is_int, normalize_placements
from .registry import OpDef, register
from .rules import Placed

# Static args the client consumes itself (the mesh and placements are in the output spec).
CLIENT_ONLY = ("device_mesh", "placements")
LAYOUT = "dtype=None, device_mesh=None, placements=None"


def creation_rule(call) -> Placed:
    shape, dtype = call.outs[0]
    placements = normalize_placements(call.static.get("placements"), len(call.mesh.shape),
                                      len(shape))
    check_partials(placements, str(dtype)[6:])
    return Placed((placements,))


SEQUENCES = (tuple, list, torch.Size)


def size_arg(size) -> tuple:
    """``f(2, 3)``, ``f((2, 3))`` and ``f([2, 3])`` all mean the size (2, 3). The entries stay
    as given, for torch's metadata rule to check (2.5 is an error, not a 2)."""
    if len(size) == 1 and isinstance(size[0], SEQUENCES):
        size = size[0]
    return tuple(size)


# the Python types torch reads as dtypes (``zeros(3, dtype=float)`` is float64)
PY_DTYPES = {bool: torch.bool, int: torch.int64, float: torch.float64, complex: torch.complex128}


def check_dtype(op: str, dtype) -> None:
    """torch's TypeError for a dtype that is not one (a Python type such as ``float`` is one)."""
    if not (dtype is None or isinstance(dtype, torch.dtype)
            or isinstance(dtype, type) and dtype in PY_DTYPES):
        raise TypeError(f"{op}(): argument 'dtype' must be torch.dtype, not "
                        f"{type(dtype).__name__}")


def check_size(op: str, sizes: tuple, keyword=None, dtype=None) -> tuple:
    """A factory's size as a tuple of ints, with torch's checks and words: ``TypeError`` for
    what is not a tuple of ints (or a ``dtype`` that is no dtype), then ``RuntimeError`` for a
    negative size. ``sizes`` are the positional sizes (``zeros(2, 3)``, or one sequence:
    ``zeros((2, 3))``), ``keyword`` the size given as one argument (``size=``), which must be a
    sequence; as in torch, not both.

    >>> check_size("zeros", (2, 3)), check_size("zeros", ([2, 3],))
    ((2, 3), (2, 3))
    >>> check_size("zeros", (2.5,))
    Traceback (most recent call last):
    TypeError: zeros(): argument 'size' (position 1) must be tuple of ints, not float
    """
    arg = f"{op}(): argument 'size'"
    if not sizes and keyword is None:
        raise TypeError(f'{op}() missing 1 required positional arguments: "size"')
    if keyword is not None:
        if sizes:
            raise TypeError(f"{op}() got multiple values for argument 'size'")
        if not isinstance(keyword, SEQUENCES):
            raise TypeError(f"{arg} must be tuple of ints, not {type(keyword).__name__}")
        sizes = tuple(keyword)
    elif len(sizes) == 1 and isinstance(sizes[0], SEQUENCES):
        sizes = tuple(sizes[0])
    elif len(sizes) == 1 and not is_int(sizes[0]):
        raise TypeError(f"{arg} (position 1) must be tuple of ints, not {type(sizes[0]).__name__}")
    for pos, n in enumerate(sizes):
        # as torch, which reads a bool after the first entry as 0 or 1 (not as the first: that
        # one picks the overload)
        if not (is_int(n) or pos and isinstance(n, bool)):
            raise TypeError(f"{arg} (position 1) must be tuple of ints, but found element of "
                            f"type {type(n).__name__} at pos {pos}")
    sizes = tuple(operator.index(n) for n in sizes)
    check_dtype(op, dtype)  # torch parses every argument before it looks at a value
    negative = [n for n in sizes if n < 0]
    if negative:
        raise RuntimeError(f"Trying to create tensor with negative dimension {negative[0]}: "
                           f"{list(sizes)}")
    return sizes


def _block(ctx, full: torch.Tensor) -> torch.Tensor:
    """This device's block of a full tensor."""
    index = tuple(slice(o, o + n) for o, n in zip(ctx.out_offsets, ctx.out_local_shape))
    return full[index].clone() if full.dim() else full.clone()


def factory(make):
    """Kernel for factories whose blocks are made directly: ``make(shape, dtype)``."""
    return lambda ctx, *, size, dtype: ctx.partition(make(ctx.out_local_shape, dtype=dtype))


def _full_kernel(ctx, *, size, fill_value, dtype):
    return ctx.partition(torch.full(ctx.out_local_shape, fill_value, dtype=dtype))


def _generator(seed) -> torch.Generator:
    g = torch.Generator()
    if isinstance(seed, bytes):  # the state of the user's torch.Generator
        g.set_state(torch.frombuffer(bytearray(seed), dtype=torch.uint8))
    else:
        g.manual_seed(seed)
    return g


def random_kernel(draw):
    """Kernel for random factories: the whole tensor from the seed, this device's block of it."""

    def kernel(ctx, seed, **static):
        return ctx.partition(_block(ctx, draw(generator=_generator(seed), **static)))

    return kernel


def _arange(ctx, *, start, end, step, dtype):
    return ctx.partition(_block(ctx, torch.arange(start, end, step, dtype=dtype)))


def _from_data(ctx, data, *, size, dtype):
    if not data:  # a tensor with no elements
        return ctx.partition(torch.empty(ctx.out_local_shape, dtype=dtype))
    full = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(size)
    return ctx.partition(_block(ctx, full))


def _meta_like(fn):
    return lambda *operands, size, dtype, **_: fn(size, dtype=dtype, device="meta")


def checked(probe, meta):
    """``meta``, then ``probe``: torch's CPU kernel on a tiny input, for the checks meta kernels
    skip (the dtype is supported, the values fit it). Without it ``arange(5, dtype=torch.bool)``
    or ``randint(5, 3, (2,))`` would pass here and fail on every device; with it they raise at
    the user's line, in torch's words and types. torch parses the arguments first (the meta's
    TypeError is torch's); where the meta kernel refuses a value, the CPU kernel may refuse it
    with another type (``randn`` of int64), so the probe speaks first. It runs on a cache miss
    only, like every metadata rule."""

    def rule(*operands, **static):
        try:
            out = meta(*operands, **static)
        except TypeError:
            raise
        except Exception:  # noqa: BLE001 - the CPU kernel's own error, where it has one
            probe(**static)
            raise
        probe(**static)
        return out

    return rule


# the probes of ``checked``, by the static args of each entry
PROBES = {
    "full": lambda size, fill_value, dtype: torch.full((), fill_value, dtype=dtype),
    # (one element, or none where the tensor has none: torch draws nothing then, nor checks)
    "rand": lambda size, dtype: torch.rand(min(math.prod(size), 1), dtype=dtype),
    "randn": lambda size, dtype: torch.randn(min(math.prod(size), 1), dtype=dtype),
    "randint": lambda low, high, size, dtype: torch.randint(low, high, (0,), dtype=dtype),
    "arange": lambda start, end, step, dtype: torch.arange(0, 1, dtype=dtype),
    # (at most 2 steps: one is fine for every dtype, but a bool linspace of 2 is not)
    "linspace": lambda start, end, steps, dtype: torch.linspace(start, end, min(steps, 2),
                                                                dtype=dtype),
    "logspace": lambda start, end, steps, base, dtype: torch.logspace(start, end, min(steps, 2),
                                                                      base, dtype=dtype),
    # the dtype is supported and holds the largest value (randperm's n is an int by now)
    "randperm": lambda n, dtype: (torch.randperm(0, dtype=dtype),
                                  torch.full((), max(n - 1, 0), dtype=dtype)),
}


# their fronts (factories.py) also take the size as ``size=``, as torch's do
for _name in ("zeros", "ones", "empty"):
    register(OpDef(_name, f"{_name}(*size, {LAYOUT})", factory(getattr(torch, _name)),
                   creation_rule, meta=_meta_like(getattr(torch, _name)), uses_context=True,
                   function=False))
register(OpDef("full", f"full(size, fill_value, *, {LAYOUT})", _full_kernel, creation_rule,
               meta=checked(PROBES["full"], lambda size, fill_value, dtype: torch.full(
                   size, fill_value, dtype=dtype, device="meta")),
               uses_context=True))
# (the meta kernels of rand and randn refuse an integer dtype even for no elements, where torch
# draws nothing and checks nothing: the probe makes the checks, the meta gives the shape)
for _name in ("rand", "randn"):
    register(OpDef(_name, f"{_name}(seed: Tensor, *size, {LAYOUT})",
                   random_kernel(getattr(torch, _name)), creation_rule,
                   meta=checked(PROBES[_name], _meta_like(torch.empty)),
                   uses_context=True, function=False))
register(OpDef("randint", f"randint(seed: Tensor, low, high, size, *, {LAYOUT})",
               random_kernel(torch.randint), creation_rule,
               meta=checked(PROBES["randint"], lambda seed, low, high, size, dtype: torch.randint(
                   low, high, size, dtype=dtype, device="meta")),
               uses_context=True, function=False))
register(OpDef("arange", f"arange(start, end, step, *, {LAYOUT})", _arange, creation_rule,
               meta=checked(PROBES["arange"], lambda start, end, step, dtype: torch.arange(
                   start, end, step, dtype=dtype, device="meta")),
               uses_context=True, function=False))
register(OpDef("from_data", f"from_data(data: Tensor, size, *, {LAYOUT})", _from_data,
               creation_rule,
               meta=lambda data, size, dtype: torch.empty(size, dtype=dtype, device="meta"),
               uses_context=True, function=False))


# -- identity and spaced values -------------------------------------------------------------------


def out_dtype(ctx) -> torch.dtype:
    """The result's dtype as the client resolved it (a host's default dtype may differ)."""
    return getattr(torch, ctx.out_specs[0].dtype)


def _eye(ctx, *, n, m, dtype):
    """The block at rows r0.., cols c0.. of the identity: ones where row == col."""
    (rows, cols), (r0, c0) = ctx.out_local_shape, ctx.out_offsets
    ones = torch.arange(r0, r0 + rows).unsqueeze(1) == torch.arange(c0, c0 + cols)
    return ctx.partition(ones.to(out_dtype(ctx)))


def _spaced(fn):
    """linspace/logspace: the whole range (torch's own rounding), this device's block of it."""
    return lambda ctx, *, dtype, **static: ctx.partition(
        _block(ctx, fn(**static, dtype=out_dtype(ctx))))


register(OpDef("eye", f"eye(n, m=None, *, {LAYOUT})", _eye, creation_rule,
               meta=lambda n, m=None, dtype=None: torch.eye(n, n if m is None else m,
                                                            dtype=dtype, device="meta"),
               uses_context=True))
register(OpDef("linspace", f"linspace(start, end, steps, *, {LAYOUT})", _spaced(torch.linspace),
               creation_rule,
               meta=checked(PROBES["linspace"], lambda start, end, steps, dtype: torch.linspace(
                   start, end, steps, dtype=dtype, device="meta")),
               uses_context=True))
register(OpDef("logspace", f"logspace(start, end, steps, base=10.0, *, {LAYOUT})",
               _spaced(torch.logspace), creation_rule,
               meta=checked(PROBES["logspace"],
                            lambda start, end, steps, base, dtype: torch.logspace(
                                start, end, steps, base, dtype=dtype, device="meta")),
               uses_context=True))
register(OpDef("randperm", f"randperm(seed: Tensor, n, *, {LAYOUT})",
               random_kernel(torch.randperm), creation_rule,
               meta=checked(PROBES["randperm"], lambda seed, n, dtype: torch.randperm(
                   n, dtype=dtype, device="meta")),
               uses_context=True, function=False))
