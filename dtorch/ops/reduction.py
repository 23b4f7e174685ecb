"""Reductions over dims: sum, mean, amax, amin.

Over a dim that is not sharded a reduction is local. Over a sharded dim each device reduces its
shard, which makes the result a Partial, and these ops then reduce across devices on their own
(the documented automatic redistribute: ``Partial -> Replicate``), as a torch user expects
``x.sum()`` to give the sum. A Partial input passes through when the reduction matches it:
sum and mean are linear (Partial sum/avg), amax of Partial(max) is a Partial(max).
"""

from __future__ import annotations

import torch

from ..placement import Partial, Replicate, Shard
from .registry import OpDef, register
from .rules import Placed, placement_error

# op name -> (Partial made by reducing a sharded dim, Partials that pass through)
REDUCTIONS = {
    "sum": ("sum", ("sum", "avg")),
    "mean": ("sum", ("sum", "avg")),
    "amax": ("max", ("max",)),
    "amin": ("min", ("min",)),
}


def reduced_dims(dim, ndim: int) -> tuple:
    if dim is None or dim == () or dim == []:
        return tuple(range(ndim))
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    return tuple(sorted(d % ndim if ndim else 0 for d in dims))


def reduction_rule(call) -> Placed:
    (spec,) = call.tensors
    made, passes = REDUCTIONS[call.op.name]
    dims = reduced_dims(call.static.get("dim"), len(spec.shape))
    keepdim = call.static.get("keepdim", False)
    outs, post, bad = [], [], []
    for i, p in enumerate(spec.placements):
        if isinstance(p, Shard) and p.dim in dims:
            outs.append(Partial(made))
            post.append(Replicate())
        elif isinstance(p, Shard):
            outs.append(Shard(p.dim if keepdim else p.dim - sum(d < p.dim for d in dims)))
            post.append(outs[-1])
        elif isinstance(p, Partial) and p.reduce_op not in passes:
            bad.append((i, (p,)))
        else:
            outs.append(p)
            post.append(p)
    if bad:
        rows = {(Replicate(),): None, (Shard(0),): None, (Partial(passes[0]),): None}
        raise placement_error(call, rows, bad)
    outs, post = tuple(outs), tuple(post)
    return Placed((outs,), (), (post if post != outs else None,))


def _mean(ctx, input, dim=None, keepdim=False, dtype=None):
    """Mean of the shard's contribution: local sum over the global count, so that the Partial sum
    over devices is the mean even for uneven shards (a plain local mean would weigh shards
    equally). Unsharded (or sharded over one device), it is torch.mean itself, bit for bit."""
    (spec,) = ctx.in_specs
    dims = reduced_dims(dim, len(spec.shape))
    if not any(isinstance(p, Shard) and p.dim in dims and n > 1
               for p, n in zip(spec.placements, spec.mesh.shape)):
        return torch.mean(input, dim=dim, keepdim=keepdim, dtype=dtype)
    count = 1
    for d in dims:
        count *= spec.shape[d]
    return torch.sum(input, dim=dims, keepdim=keepdim, dtype=dtype).div_(count)


register(OpDef("sum", "sum(input: Tensor, dim=None, keepdim=False, *, dtype=None)", torch.sum,
               reduction_rule, methods=("sum",)))
register(OpDef("mean", "mean(input: Tensor, dim=None, keepdim=False, *, dtype=None)", _mean,
               reduction_rule, methods=("mean",), uses_context=True,
               meta=torch.mean))


def _lowest(dtype: torch.dtype):
    if dtype == torch.bool:
        return False
    return -float("inf") if dtype.is_floating_point or dtype.is_complex else torch.iinfo(dtype).min


def _highest(dtype: torch.dtype):
    if dtype == torch.bool:
        return True
    return float("inf") if dtype.is_floating_point or dtype.is_complex else torch.iinfo(dtype).max


def _extremum(fn, identity):
    """amax/amin of a block. An uneven shard may be empty along a reduced dim (torch refuses to
    reduce that); its contribution to the Partial(max/min) is then the reduction's identity."""

    def kernel(input, dim=None, keepdim=False):
        dims = reduced_dims(dim, input.dim())
        if any(input.shape[d] == 0 for d in dims):
            shape = [1 if d in dims else n for d, n in enumerate(input.shape)]
            out = torch.full(shape, identity(input.dtype), dtype=input.dtype, device=input.device)
            return out if keepdim else out.squeeze(dims)
        # torch.amax/amin spell "all dims" as dim=(), not None
        return fn(input, () if dim is None else dim, keepdim)

    return kernel


for _name, _identity in (("amax", _lowest), ("amin", _highest)):
    register(OpDef(_name, f"{_name}(input: Tensor, dim=None, keepdim=False)",
                   _extremum(getattr(torch, _name), _identity), reduction_rule,
                   methods=(_name,)))
