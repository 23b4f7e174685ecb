"""Reductions over dims (sum, mean, prod, amax, amin, max, min, argmax, argmin, any, all, std,
var, norm, logsumexp) and scans along a dim (cumsum, cumprod).

Over a dim that is not sharded a reduction is local. Over a sharded dim it depends on the algebra:
where the reduction of the whole is a reduction of the shards' results (sum, max, any, ...), each
device reduces its shard, which makes the result a Partial, and the op then reduces across devices
on its own (the documented automatic redistribute: ``Partial -> Replicate``), as a torch user
expects ``x.sum()`` to give the sum. Where it is not (prod, std, argmax, cumsum, ...), the reduced
dim must be whole: a ``ValueError`` names the ``redistribute()`` to add. A Partial input passes
through when the reduction commutes with it (sum of a Partial sum, amax of a Partial max).
"""

from __future__ import annotations

import math

import torch

from ..placement import Partial, Replicate, Shard
from .registry import OpDef, issue, register
from .rules import Placed, exact_cast, placement_error

LINEAR = ("sum", "avg")  # f(sum_i x_i) = sum_i f(x_i), and so for their average
INF = math.inf


def _indexed(op: str):
    """max/min: without dim it is amax/amin (a max of maxes); with dim the indices are positions
    in the local block, so the reduced dim must be whole."""
    return lambda static: (op, (op,)) if static.get("dim") is None else (None, ())


# the norms that are a reduction of the shards' norms: the largest (smallest) |x| of the whole is
# the largest (smallest) of the shards', and the count of non-zeros is the sum of the counts
NORM_PARTIALS = {INF: "max", -INF: "min", 0: "sum"}

# op name -> (the Partial a sharded reduced dim makes, then reduced across devices, or None when
# the reduced dim must be whole; the Partials that pass through), or a function of the static args
# that gives them
REDUCTIONS = {
    "sum": ("sum", LINEAR),  # the sum of the shards' sums
    "mean": ("sum", LINEAR),  # each shard's sum over the global count (see _mean)
    "amax": ("max", ("max",)),  # max(max_i x_i) = max_i max(x_i)
    "amin": ("min", ("min",)),
    "max": _indexed("max"),
    "min": _indexed("min"),
    "any": ("max", ()),  # any of anys: max over 0/1 (bool or uint8)
    "all": ("min", ()),  # all of alls: min over 0/1
    "norm": lambda static: (NORM_PARTIALS.get(static.get("p")), ()),
    # a product of shards' products would need a Partial(prod); the spread of a whole is not a
    # sum of spreads; an index is a position in the local block; a log of sums is not a sum of logs
    "prod": (None, ()),
    "std": (None, ()),
    "var": (None, ()),
    "argmax": (None, ()),
    "argmin": (None, ()),
    "logsumexp": (None, ()),
    # scans (the output keeps the input's shape): a running total needs the totals of the shards
    # before it, so the scanned dim must be whole; cumsum is linear, so a Partial sum passes
    "cumsum": (None, LINEAR),
    "cumprod": (None, ()),
}


def reduced_dims(dim, ndim: int) -> tuple:
    # std(x, True): torch's unbiased flag in dim's place means every dim
    if dim is None or dim == () or dim == [] or isinstance(dim, bool):
        return tuple(range(ndim))
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    return tuple(sorted(d % ndim if ndim else 0 for d in dims))


def linear_cast(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether converting each contribution of a Partial sum converts the sum: integers into a
    wider integer, or a cast that converts every value exactly (``rules.exact_cast``); not from
    bool (a bool sum saturates), from floating to integer (truncation), nor narrowing floats
    (each contribution would be rounded before the sum)."""
    if dst.is_floating_point or dst.is_complex:
        return exact_cast(src, dst)
    return src != torch.bool and not (src.is_floating_point or src.is_complex)


def partials_of(call, spec) -> tuple:
    entry = REDUCTIONS[call.op.name]
    made, passes = entry(call.static) if callable(entry) else entry
    if not linear_cast(getattr(torch, spec.dtype), call.outs[0][1]):
        passes = tuple(p for p in passes if p not in LINEAR)
    return made, tuple(Partial(p) for p in passes)


def reduction_rule(call) -> Placed:
    """One row per mesh dim: a kept dim's Shard stays (renumbered when the reduced dims go), a
    reduced dim's Shard makes ``made`` (reduced after) or raises, a Partial passes or raises. A
    Shard over a mesh dim of one device is the whole dim."""
    (spec,) = call.tensors
    made, passes = partials_of(call, spec)
    dims = reduced_dims(call.static.get("dim"), len(spec.shape))
    keepdim = len(call.outs[0][0]) == len(spec.shape)  # keepdim=True, or a scan
    outs, post, bad = [], [], []
    for i, (p, n) in enumerate(zip(spec.placements, call.mesh.shape)):
        if isinstance(p, Shard) and p.dim in dims and (n == 1 or made):
            outs.append(Replicate() if n == 1 else Partial(made))
            post.append(Replicate())
        elif isinstance(p, Shard) and p.dim not in dims:
            outs.append(Shard(p.dim if keepdim else p.dim - sum(d < p.dim for d in dims),
                              p.sub_split))
            post.append(outs[-1])
        elif isinstance(p, Shard) or isinstance(p, Partial) and p not in passes:
            bad.append((i, (p,)))
        else:
            outs.append(p)
            post.append(p)
    if bad:
        raise placement_error(call, accepted(spec, dims, made, passes), bad)
    outs, post = tuple(outs), tuple(post)
    n = len(call.outs)  # max/min with dim: values and indices are laid out alike
    reduced = post != outs
    return Placed((outs,) * n, (), (post if reduced else None,) * n,
                  accumulate=torch.float32 if reduced and accumulates(call) else None)


LOW_PRECISION = (torch.bfloat16, torch.float16)


def accumulates(call) -> bool:
    """A low-precision sum (or mean) over devices is computed as torch computes one sum: in
    float32, rounded once. Each device sums its block in float32 (the kernel's ``dtype``), the
    all-reduce adds those in float32, and only then is the value cast to its dtype; rounding each
    device's sum first lands further from the exact value than torch (about 1.4x here)."""
    return call.op.name in ("sum", "mean") and call.outs[0][1] in LOW_PRECISION


def accepted(spec, dims, made, passes) -> dict:
    """The one-mesh-dim rows a reduction takes, for its error message."""
    rows = [Replicate()] + [Shard(d) for d in range(len(spec.shape)) if made or d not in dims]
    return {(p,): None for p in rows + list(passes)}


# -- kernels --------------------------------------------------------------------------------------


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


def _lowest(dtype: torch.dtype):
    if dtype == torch.bool:
        return False
    return -INF if dtype.is_floating_point or dtype.is_complex else torch.iinfo(dtype).min


def _highest(dtype: torch.dtype):
    if dtype == torch.bool:
        return True
    return INF if dtype.is_floating_point or dtype.is_complex else torch.iinfo(dtype).max


def _empty_block(input, dims) -> bool:
    return any(input.shape[d] == 0 for d in dims)


def _identity_block(input, dims, keepdim, value, dtype=None):
    """What an uneven shard that is empty along a reduced dim contributes to a Partial max/min
    (torch refuses to reduce it): the reduction's identity."""
    shape = [1 if d in dims else n for d, n in enumerate(input.shape)]
    out = torch.full(shape, value, dtype=dtype or input.dtype, device=input.device)
    return out if keepdim else out.squeeze(dims)


def _extremum(fn, identity):
    """amax/amin of a block, the identity for an empty one."""

    def kernel(input, dim=None, keepdim=False):
        dims = reduced_dims(dim, input.dim())
        if _empty_block(input, dims):
            return _identity_block(input, dims, keepdim, identity(input.dtype))
        # torch.amax/amin spell "all dims" as dim=(), not None
        return fn(input, () if dim is None else dim, keepdim)

    return kernel


def _with_indices(fn, extremum):
    """max/min: with dim, torch's (values, indices); without, the extremum of every element."""

    def kernel(input, dim=None, keepdim=False):
        return extremum(input) if dim is None else fn(input, dim, keepdim)

    return kernel


def checked(fn):
    """Meta kernels skip some of torch's checks (std of integers, max of an empty tensor): the
    metadata rule also runs torch on a small real CPU tensor of the input's rank and dtype (an
    empty input: the real empty tensor, which is free), so torch raises its own error."""

    def meta(input, *args, **static):
        small = (2,) * input.dim() if input.numel() else input.shape
        fn(torch.ones(small, dtype=input.dtype), *args, **static)
        return fn(input, *args, **static)

    return meta


def _prod(input, dim=None, keepdim=False, *, dtype=None):
    # torch.prod has no dim=None: the all-dims form takes no dim and no keepdim
    if dim is None and not keepdim:
        return torch.prod(input, dtype=dtype)
    return torch.prod(input, dim, keepdim, dtype=dtype)


def _spread(fn):
    """std/var with torch's two spellings: ``unbiased`` (positional, legacy) or ``correction``."""

    def kernel(input, dim=None, unbiased=None, keepdim=False, *, correction=None):
        if isinstance(dim, bool):  # std(x, True): the unbiased flag in dim's place
            dim, unbiased = None, dim
        if unbiased is not None:
            return fn(input, dim, unbiased=unbiased, keepdim=keepdim)
        return fn(input, dim, correction=correction, keepdim=keepdim)

    return kernel


def _torch_norm(input, p="fro", dim=None, keepdim=False, dtype=None):
    return torch.norm(input, p, dim, keepdim, dtype=dtype)


def _norm(input, p="fro", dim=None, keepdim=False, dtype=None):
    """torch.norm; an empty block's contribution to the max (min) of |x| is 0 (inf)."""
    dims = reduced_dims(dim, input.dim())
    if p in (INF, -INF) and _empty_block(input, dims):
        dtype = dtype or torch.norm(input.new_zeros(()), p).dtype
        return _identity_block(input, dims, keepdim, 0 if p > 0 else INF, dtype)
    return _torch_norm(input, p, dim, keepdim, dtype)


SIGNATURE = "(input: Tensor, dim=None, keepdim=False, *, dtype=None)"

register(OpDef("sum", "sum" + SIGNATURE, torch.sum, reduction_rule, methods=("sum",),
               meta=checked(torch.sum)))
register(OpDef("mean", "mean" + SIGNATURE, _mean, reduction_rule, methods=("mean",),
               uses_context=True, meta=checked(torch.mean)))
register(OpDef("prod", "prod" + SIGNATURE, _prod, reduction_rule, methods=("prod",),
               meta=checked(_prod)))

for _name, _identity in (("amax", _lowest), ("amin", _highest)):
    _fn = getattr(torch, _name)
    register(OpDef(_name, f"{_name}(input: Tensor, dim=None, keepdim=False)",
                   _extremum(_fn, _identity), reduction_rule, methods=(_name,),
                   meta=checked(lambda input, dim=None, keepdim=False, _fn=_fn:
                                _fn(input, () if dim is None else dim, keepdim))))


def extremum_front(name: str, elementwise: str):
    """torch.max/min, which are also torch.maximum/minimum when a tensor comes in ``dim``'s
    place (or as ``other=``): the front picks the form by the argument's type, as torch's
    overloads do; a dim (int, sequence, None) is the reduction, with dim torch's named tuple
    (.values, .indices).

    >>> import dtorch
    >>> x = dtorch.arange(6, device_mesh=dtorch.DeviceMesh("cpu", [0, 1]))
    >>> dtorch.max(x).item(), dtorch.min(x, 5 - x).tolist()
    (5, [0, 1, 2, 2, 1, 0])
    """
    returns = getattr(torch.return_types, name)

    def front(input, dim=None, keepdim=False, *, other=None):
        if other is None and (dim is None or isinstance(dim, (int, tuple, list))):
            out = issue(name, (input,), (dim, keepdim))
            return returns(out) if isinstance(out, tuple) else out
        given = [a for a in (dim, other) if a is not None]
        if keepdim or len(given) != 1 or isinstance(given[0], (bool, int, float, complex)):
            raise TypeError(f"{name}() received an invalid combination of arguments; expected "
                            f"(input, dim=None, keepdim=False) or (input, other: Tensor)")
        return issue(elementwise, (input, given[0]), ())

    front.__name__ = front.__qualname__ = name
    front.__doc__ = f"``torch.{name}``: the reduction, or ``torch.{elementwise}`` given a tensor."
    return front


for _name, _identity, _elementwise in (("max", _lowest, "maximum"),
                                       ("min", _highest, "minimum")):
    _fn = getattr(torch, _name)
    register(OpDef(_name, f"{_name}(input: Tensor, dim=None, keepdim=False)",
                   _with_indices(_fn, _extremum(getattr(torch, "a" + _name), _identity)),
                   reduction_rule, methods=(_name,), meta=checked(_with_indices(_fn, _fn)),
                   front=extremum_front(_name, _elementwise)))


for _name in ("argmax", "argmin", "any", "all", "logsumexp", "cumsum", "cumprod"):
    _fn = getattr(torch, _name)
    _sig = {"logsumexp": "dim, keepdim=False", "cumsum": "dim, *, dtype=None",
            "cumprod": "dim, *, dtype=None"}.get(_name, "dim=None, keepdim=False")
    register(OpDef(_name, f"{_name}(input: Tensor, {_sig})", _fn, reduction_rule,
                   methods=(_name,), meta=checked(_fn)))

for _name in ("std", "var"):
    _fn = _spread(getattr(torch, _name))
    register(OpDef(_name, f"{_name}(input: Tensor, dim=None, unbiased=None, keepdim=False, *, "
                          f"correction=None)", _fn, reduction_rule, methods=(_name,),
                   meta=checked(_fn)))

register(OpDef("norm", "norm(input: Tensor, p='fro', dim=None, keepdim=False, dtype=None)", _norm,
               reduction_rule, methods=("norm",), meta=checked(_torch_norm)))
