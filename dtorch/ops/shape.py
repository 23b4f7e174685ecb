"""Shape operators: views, reshapes, permutations, cat and stack.

Sharding follows the dims: a permutation moves ``Shard(d)`` with its dim. A reshape keeps a shard
only where the local reshape is the global one cut the same way: the sharded dim must be the
outermost non-unit dim of its group of merged/split dims, and, unless that group is a plain 1:1
dim, its size and the output dim's size must be divisible by the number of shards (otherwise the
local blocks would not be ``array_split`` chunks of the output). Anything else raises, naming the
redistribute to add, instead of giving silently wrong values. None of them combines elements, so
every Partial passes (sum, avg, max and min alike).
"""

from __future__ import annotations

import torch

from ..placement import Replicate, Shard
from .registry import VIEW, OpDef, register
from .rules import ALL_PARTIALS, Placed, expand, placement_error

R = Replicate()


def view_groups(a, b) -> list:
    """Consecutive groups (dims of a, dims of b) with equal products, e.g. (2,3,4)->(6,4):
    [([0,1],[0]), ([2],[1])]."""
    groups, i, j = [], 0, 0
    while i < len(a) or j < len(b):
        ga, gb, pa, pb = [], [], 1, 1
        if i < len(a):
            ga.append(i), (pa := pa * a[i])
            i += 1
        if j < len(b):
            gb.append(j), (pb := pb * b[j])
            j += 1
        while pa != pb and (i < len(a) or j < len(b)):
            if (pa < pb and i < len(a)) or j >= len(b):
                ga.append(i)
                pa *= a[i]
                i += 1
            else:
                gb.append(j)
                pb *= b[j]
                j += 1
        groups.append((ga, gb))
    return groups


def reshape_rule(call) -> Placed:
    (spec,) = call.tensors
    a, b = spec.shape, call.outs[0][0]
    shards = {}  # tensor dim -> number of shards over all mesh dims
    for i, p in enumerate(spec.placements):
        if isinstance(p, Shard):
            shards[p.dim] = shards.get(p.dim, 1) * call.mesh.shape[i]
    dim_map = {}
    for ga, gb in view_groups(a, b):
        big_a = [d for d in ga if a[d] != 1]
        big_b = [d for d in gb if b[d] != 1]
        if not big_a or not big_b:
            continue
        da, db = big_a[0], big_b[0]
        one_to_one = len(big_a) == 1 and len(big_b) == 1
        n = shards.get(da, 1)
        if one_to_one or (a[da] % n == 0 and b[db] % n == 0):
            dim_map[da] = db
    outs, bad = [], []
    for i, p in enumerate(spec.placements):
        if isinstance(p, Shard):
            if p.dim not in dim_map:
                bad.append((i, (p,)))
                continue
            p = Shard(dim_map[p.dim])
        outs.append(p)
    if bad:
        raise placement_error(call, {(R,): None}, bad)
    return Placed((tuple(outs),))


def permute_rule(perm_of):
    """``perm_of(ndim, **static)`` gives the input dim of each output dim."""

    def rule(call) -> Placed:
        (spec,) = call.tensors
        perm = perm_of(len(spec.shape), **call.static)
        rows = [((Shard(j),), (Shard(d),)) for j, d in enumerate(perm)]
        rows += [((p,), (p,)) for p in ALL_PARTIALS]
        return expand(call, rows)

    return rule


def _transpose_perm(ndim, dim0, dim1):
    perm = list(range(ndim))
    perm[dim0 % ndim], perm[dim1 % ndim] = perm[dim1 % ndim], perm[dim0 % ndim]
    return perm


def _local_reshape(method):
    return lambda ctx, input, shape: method(input, ctx.out_local_shape)


def _squeeze(ctx, input, dim=None):
    """Squeezes the dims that have size 1 globally (a shard may have size 1 where the global dim
    does not, so a plain local squeeze() would be wrong)."""
    shape = ctx.in_specs[0].shape
    dims = range(len(shape)) if dim is None else [dim] if isinstance(dim, int) else dim
    return input.squeeze(tuple(d % len(shape) for d in dims if shape[d] == 1))


SHAPE_ARGS = "input: Tensor, *shape"
for _name in ("reshape", "view"):
    register(OpDef(_name, f"{_name}({SHAPE_ARGS})", _local_reshape(getattr(torch.Tensor, _name)),
                   reshape_rule, methods=(_name,), function=_name == "reshape", flags=VIEW,
                   uses_context=True,
                   meta=lambda input, shape, _m=_name: getattr(input, _m)(shape)))
register(OpDef("flatten", "flatten(input: Tensor, start_dim=0, end_dim=-1)", torch.flatten,
               reshape_rule, methods=("flatten",), flags=VIEW))
register(OpDef("unsqueeze", "unsqueeze(input: Tensor, dim)", torch.unsqueeze, reshape_rule,
               methods=("unsqueeze",), flags=VIEW))
register(OpDef("squeeze", "squeeze(input: Tensor, dim=None)", _squeeze, reshape_rule,
               methods=("squeeze",), flags=VIEW, uses_context=True,
               meta=lambda input, dim=None: input.squeeze() if dim is None else input.squeeze(dim)))
register(OpDef("transpose", "transpose(input: Tensor, dim0, dim1)", torch.transpose,
               permute_rule(_transpose_perm), methods=("transpose",), flags=VIEW))
register(OpDef("permute", "permute(input: Tensor, *dims)", torch.permute,
               permute_rule(lambda ndim, dims: [d % ndim for d in dims]), methods=("permute",),
               flags=VIEW))
register(OpDef("t", "t(input: Tensor)", torch.t,
               permute_rule(lambda ndim: list(range(ndim))[::-1]), methods=("t",), flags=VIEW))


def cat_rule(call) -> Placed:
    """Inputs share a placement; a shard of a dim other than the joined one stays (stack inserts
    a dim, shifting the ones after it). Joining combines no elements, so equal Partials pass."""
    specs = call.tensors
    ndim = len(specs[0].shape)
    dim = call.static.get("dim", 0)
    stacking = call.op.name == "stack"
    dim = dim % (ndim + 1 if stacking else ndim)
    rows = []
    for d in range(ndim):
        if stacking or d != dim:
            out = d + 1 if stacking and d >= dim else d
            rows.append(((Shard(out),), (Shard(d),) * len(specs)))
    rows += [((p,), (p,) * len(specs)) for p in ALL_PARTIALS]
    return expand(call, rows)


register(OpDef("cat", "cat(tensors: TensorList, dim=0)", lambda *ts, dim=0: torch.cat(ts, dim),
               cat_rule))
register(OpDef("stack", "stack(tensors: TensorList, dim=0)",
               lambda *ts, dim=0: torch.stack(ts, dim), cat_rule))
