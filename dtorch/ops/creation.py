"""Creation operators: every factory takes ``dtype=, device_mesh=, placements=`` and makes each
device's block of the tensor where it lives.

Host kernels build the block of the Replicate value that the device holds (``ctx.region``), then
``ctx.partition`` turns it into the device's contribution on Partial mesh dims (device 0 keeps the
value, the others hold the reduction's identity), so every factory works with every placement.
Random factories draw the whole tensor from one seeded generator on each device and keep their
block: values are torch's exactly, for a given seed or a given ``torch.Generator``.
"""

from __future__ import annotations

import torch

from ..placement import normalize_placements
from .registry import OpDef, register
from .rules import Placed

# Static args the client consumes itself (the mesh and placements are in the output spec).
CLIENT_ONLY = ("device_mesh", "placements")
LAYOUT = "dtype=None, device_mesh=None, placements=None"


def creation_rule(call) -> Placed:
    shape = call.outs[0][0]
    return Placed((normalize_placements(call.static.get("placements"), len(call.mesh.shape),
                                        len(shape)),))


def size_arg(size) -> tuple:
    """``f(2, 3)``, ``f((2, 3))`` and ``f([2, 3])`` all mean the size (2, 3)."""
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = size[0]
    return tuple(int(s) for s in size)


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


# their fronts (factories.py) also take the size as ``size=``, as torch's do
for _name in ("zeros", "ones", "empty"):
    register(OpDef(_name, f"{_name}(*size, {LAYOUT})", factory(getattr(torch, _name)),
                   creation_rule, meta=_meta_like(getattr(torch, _name)), uses_context=True,
                   function=False))
register(OpDef("full", f"full(size, fill_value, *, {LAYOUT})", _full_kernel, creation_rule,
               meta=lambda size, fill_value, dtype: torch.full(size, fill_value, dtype=dtype,
                                                               device="meta"),
               uses_context=True))
for _name in ("rand", "randn"):
    register(OpDef(_name, f"{_name}(seed: Tensor, *size, {LAYOUT})",
                   random_kernel(getattr(torch, _name)), creation_rule,
                   meta=_meta_like(getattr(torch, _name)), uses_context=True, function=False))
register(OpDef("randint", f"randint(seed: Tensor, low, high, size, *, {LAYOUT})",
               random_kernel(torch.randint), creation_rule,
               meta=lambda seed, low, high, size, dtype: torch.empty(size, dtype=dtype,
                                                                     device="meta"),
               uses_context=True, function=False))
register(OpDef("arange", f"arange(start, end, step, *, {LAYOUT})", _arange, creation_rule,
               meta=lambda start, end, step, dtype: torch.arange(start, end, step, dtype=dtype,
                                                                 device="meta"),
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
               meta=lambda start, end, steps, dtype: torch.linspace(start, end, steps,
                                                                    dtype=dtype, device="meta"),
               uses_context=True))
register(OpDef("logspace", f"logspace(start, end, steps, base=10.0, *, {LAYOUT})",
               _spaced(torch.logspace), creation_rule,
               meta=lambda start, end, steps, base, dtype: torch.logspace(
                   start, end, steps, base, dtype=dtype, device="meta"),
               uses_context=True))
register(OpDef("randperm", f"randperm(seed: Tensor, n, *, {LAYOUT})",
               random_kernel(torch.randperm), creation_rule,
               meta=lambda seed, n, dtype: torch.empty(n, dtype=dtype, device="meta"),
               uses_context=True, function=False))
