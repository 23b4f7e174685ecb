"""Shape operators: views, reshapes, permutations, expansions, joins and splits, flips, rolls,
pads and triangles.

Sharding follows the dims: a permutation moves ``Shard(d)`` with its dim. A reshape keeps a shard
only where the local reshape is the global one cut the same way: the sharded dim must be the
outermost non-unit dim of its group of merged/split dims, and, unless that group is a plain 1:1
dim, its size and the output dim's size must be divisible by the number of shards (otherwise the
local blocks would not be ``array_split`` chunks of the output). Anything else raises, naming the
redistribute to add, instead of giving silently wrong values. None of them combines elements, so
every Partial passes (sum, avg, max and min alike).

Ops that move or copy elements along some dims only (flip, roll, narrow, split, pad, repeat...)
are the op on the local block along every other dim, so those keep their shards; a sharded dim
they act on would need other devices' elements, or cut the result unlike ``array_split``, so it
must be Replicate (the error names the redistribute).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..placement import Placement, Replicate, Shard, is_int, normalize_placements, placements_str
from .creation import size_arg
from .segments import cut_segments, sub_split_of, torch_split_sizes
from .registry import VIEW, OpDef, issue, register
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
            # a sub-split passes only to an output dim that is the same dim (same size)
            if p.dim not in dim_map or p.sub_split and a[p.dim] != b[dim_map[p.dim]]:
                bad.append((i, (p,)))
                continue
            p = Shard(dim_map[p.dim], p.sub_split)
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


def relabel_rule(call) -> Placed:
    """``x.view(placements)``, DTorch's relabel: the blocks stay where they are and are read
    under ``placements``, which the user asserts describe them (no data moves, nothing is
    checked but that every device's block has the shape the new placements give it)."""
    (spec,) = call.tensors
    placements = normalize_placements(call.static["placements"], call.mesh.ndim, len(spec.shape))
    new = spec.with_placements(placements)
    for coord in call.mesh.coordinates():
        old_shape, new_shape = spec.local_region(coord)[0], new.local_region(coord)[0]
        if old_shape != new_shape:
            raise ValueError(
                f"dtorch.view: placements {placements_str(placements)} do not describe the blocks "
                f"of placements {placements_str(spec.placements)} (device at {list(coord)} holds "
                f"{list(old_shape)}, which would be {list(new_shape)}); to move the data, use "
                f"x.redistribute(placements={list(placements)!r})")
    return Placed((placements,))


register(OpDef("relabel", "relabel(input: Tensor, placements)",
               lambda input: input.view(input.shape), relabel_rule, function=False, flags=VIEW,
               sub_splits=True,  # DTorch's way to read a sub-split's blocks as plain ones
               meta=lambda input: input))


def view(input, *shape, size=None):
    """``x.view(*shape)`` (or ``view(size=shape)``) as torch, or DTorch's
    ``x.view(placements)``: a sequence of placements relabels the blocks (see
    ``relabel_rule``)."""
    if size is not None:
        if shape:
            raise TypeError("view() got multiple values for argument 'size'")
        shape = (size,)
    if len(shape) == 1 and isinstance(shape[0], (list, tuple)) and shape[0] and all(
            isinstance(p, Placement) for p in shape[0]):
        return issue("relabel", (input,), (tuple(shape[0]),))
    return issue("view", (input,), (size_arg(shape),))


SHAPE_ARGS = "input: Tensor, *shape"
for _name in ("reshape", "view"):
    register(OpDef(_name, f"{_name}({SHAPE_ARGS})", _local_reshape(getattr(torch.Tensor, _name)),
                   reshape_rule, methods=(_name,), function=_name == "reshape", flags=VIEW,
                   uses_context=True, front=view if _name == "view" else None,
                   meta=lambda input, shape, _m=_name: getattr(input, _m)(shape)))
register(OpDef("flatten", "flatten(input: Tensor, start_dim=0, end_dim=-1)", torch.flatten,
               reshape_rule, methods=("flatten",), flags=VIEW))
register(OpDef("unsqueeze", "unsqueeze(input: Tensor, dim)", torch.unsqueeze, reshape_rule,
               methods=("unsqueeze",), flags=VIEW))
register(OpDef("squeeze", "squeeze(input: Tensor, dim=None)", _squeeze, reshape_rule,
               methods=("squeeze",), flags=VIEW, uses_context=True,
               meta=lambda input, dim=None: input.squeeze() if dim is None else input.squeeze(dim)))
register(OpDef("transpose", "transpose(input: Tensor, dim0, dim1)", torch.transpose,
               permute_rule(_transpose_perm), methods=("transpose",), flags=VIEW,
               aliases=("swapaxes", "swapdims")))
register(OpDef("permute", "permute(input: Tensor, *dims)", torch.permute,
               permute_rule(lambda ndim, dims: [d % ndim for d in dims]), methods=("permute",),
               flags=VIEW))
register(OpDef("t", "t(input: Tensor)", torch.t,
               permute_rule(lambda ndim: list(range(ndim))[::-1]), methods=("t",), flags=VIEW))


def _dims(dims) -> list:
    return [dims] if isinstance(dims, int) else list(dims)


def _movedim_perm(ndim, source, destination) -> list:
    """The input dim of each output dim: ``source`` dims land at ``destination``, the others
    keep their order."""
    n = max(ndim, 1)
    perm = [None] * ndim
    src = [d % n for d in _dims(source)]
    for s, d in zip(src, _dims(destination)):
        perm[d % n] = s
    rest = iter(d for d in range(ndim) if d not in src)
    return [p if p is not None else next(rest) for p in perm]


register(OpDef("movedim", "movedim(input: Tensor, source, destination)", torch.movedim,
               permute_rule(_movedim_perm), methods=("movedim",), flags=VIEW,
               aliases=("moveaxis",)))
register(OpDef("unflatten", "unflatten(input: Tensor, dim, sizes)",
               lambda ctx, input, dim, sizes: input.reshape(ctx.out_local_shape), reshape_rule,
               meta=torch.unflatten, methods=("unflatten",), flags=VIEW, uses_context=True))


# -- expand: broadcasting a size-1 dim ------------------------------------------------------------


def expand_rule(call) -> Placed:
    """A dim that keeps its size is copied as it is, so its shard passes; a new or broadcast
    (size-1) dim holds the same values all along, so it comes out Replicate, and a sharded
    size-1 dim being broadcast must be Replicate first (one device holds the element). Copies
    combine nothing: every Partial passes. ``expand_as`` reads only its other operand's shape."""
    spec = call.tensors[0]
    out = call.outs[0][0]
    off = len(out) - len(spec.shape)
    rows = [((Shard(d + off),), (Shard(d),)) for d, n in enumerate(spec.shape) if n == out[d + off]]
    rows += [((p,), (p,)) for p in ALL_PARTIALS]
    return expand(call._replace(inputs=call.inputs[:1]), rows)


def _expand_local(ctx, input, *_, **__):
    return input.expand(ctx.out_local_shape)


register(OpDef("expand", "expand(input: Tensor, *size)", _expand_local, expand_rule,
               meta=lambda input, size: input.expand(size), methods=("expand",), function=False,
               flags=VIEW, uses_context=True))
register(OpDef("expand_as", "expand_as(input: Tensor, other: Tensor)", _expand_local,
               expand_rule, meta=torch.Tensor.expand_as, methods=("expand_as",), function=False,
               flags=VIEW, uses_context=True))


# -- ops that act along some dims only ------------------------------------------------------------


def moving_rule(along, renumber=None, partials=lambda **static: ALL_PARTIALS):
    """For ops that move or copy elements only along the dims ``along(ndim, **static)``: every
    other dim keeps its shard (output dim ``renumber(d, ndim, **static)``); the dims acted on
    must be Replicate. ``partials(**static)`` are the Partials that pass (copies: all)."""

    def rule(call) -> Placed:
        ndim = len(call.tensors[0].shape)
        acted = {d % ndim for d in along(ndim, **call.static)} if ndim else set()
        n_out = len(call.outs)
        rows = [
            ((Shard(renumber(d, ndim, **call.static) if renumber else d),) * n_out, (Shard(d),))
            for d in range(ndim)
            if d not in acted
        ]
        rows += [((p,) * n_out, (p,)) for p in partials(**call.static)]
        return expand(call, rows)

    return rule


def _parts(fn):
    """A multi-output kernel: one result travels as a tensor, not a 1-tuple."""

    def kernel(*args, **kwargs):
        parts = fn(*args, **kwargs)
        return parts[0] if len(parts) == 1 else parts

    return kernel


def _as_tuple(result) -> tuple:
    return result if isinstance(result, tuple) else (result,)


def _at(dim_name):
    return lambda ndim, **static: [static.get(dim_name, 0)]


def _all_dims_if_none(dim_name):
    return lambda ndim, **static: (range(ndim) if static.get(dim_name) is None
                                   else _dims(static[dim_name]))


# flip, roll and narrow move elements across a dim (and the result's shards would not be the
# input's array_split blocks): only that dim must be Replicate. A roll without dims flattens.
# (dims as torch takes them: flip(x, (0, 1)), x.flip(0, 1) or x.flip(0))
register(OpDef("flip", "flip(input: Tensor, *dims)",
               lambda input, dims: torch.flip(input, _dims(dims)),
               moving_rule(lambda ndim, dims: _dims(dims)), methods=("flip",)))
register(OpDef("roll", "roll(input: Tensor, shifts, dims=None)", torch.roll,
               moving_rule(_all_dims_if_none("dims")), methods=("roll",)))
register(OpDef("narrow", "narrow(input: Tensor, dim, start, length)", torch.narrow,
               moving_rule(_at("dim")), methods=("narrow",), flags=VIEW))
# split, chunk and unbind cut one dim into several results: along any other dim each piece's
# block is the local block's piece (the cut dim is whole on every device, so each device cuts it
# into as many pieces, of torch's sizes). unbind removes its dim, renumbering the ones after it.
def split(tensor, split_size_or_sections, dim=0):
    """``torch.split``; along a sub-split dim, parts that line up with its segments are cut
    locally (``ops/segments.py``)."""
    if is_int(dim) and tensor.ndim and sub_split_of(tensor, dim % tensor.ndim):
        try:
            sizes = torch_split_sizes(tensor.shape, dim, split_size_or_sections)
        except (RuntimeError, TypeError, ValueError):
            sizes = None  # torch's own error, from the operator below
        parts = sizes and cut_segments(tensor, dim, sizes)
        if parts:
            return parts
    return _as_tuple(issue("split", (tensor,), (split_size_or_sections, dim)))


register(OpDef("split", "split(tensor: Tensor, split_size_or_sections, dim=0)",
               _parts(torch.split), moving_rule(_at("dim")), meta=torch.split,
               methods=("split",), flags=VIEW, result=_as_tuple, front=split))


def chunk(input, chunks=None, dim=0, *, chunk=None):
    """``torch.chunk``, and DTorch's ``chunk(input, chunk, dim)`` (the count named ``chunk``);
    ``dim`` defaults to 0 in every form (DTorch's function has no default).

    >>> import dtorch
    >>> x = dtorch.ones((5, 4), device_mesh=dtorch.DeviceMesh("cpu", [0, 1]),
    ...                 placements=[dtorch.Shard(0)])
    >>> [c.shape[1] for c in dtorch.chunk(x, chunk=3, dim=1)], len(x.chunk(chunks=2, dim=1))
    ([2, 2], 2)
    """
    if chunks is not None and chunk is not None:
        raise TypeError("chunk() got 'chunks' and 'chunk', two names of one parameter")
    chunks = chunk if chunks is None else chunks
    if chunks is None:
        raise TypeError("chunk() missing required argument 'chunks' (pos 1)")
    if is_int(chunks) and is_int(dim) and chunks > 0 and sub_split_of(input, dim % input.ndim):
        parts = cut_segments(input, dim, torch_split_sizes(input.shape, dim, chunks, True))
        if parts is not None:
            return parts
    return _as_tuple(issue("chunk", (input,), (chunks, dim)))


register(OpDef("chunk", "chunk(input: Tensor, chunks, dim=0)", _parts(torch.chunk),
               moving_rule(_at("dim")), meta=torch.chunk, methods=("chunk",), flags=VIEW,
               result=_as_tuple, front=chunk))
register(OpDef("unbind", "unbind(input: Tensor, dim=0)", _parts(torch.unbind),
               moving_rule(_at("dim"), lambda d, ndim, dim=0: d - (d > dim % ndim)),
               meta=torch.unbind, methods=("unbind",), flags=VIEW, result=_as_tuple))


# repeat and tile copy the whole of each repeated dim after itself: a local copy of a shard
# would interleave the blocks, so a repeated dim must be Replicate; a dim repeated once stays.
def _reps(ndim, reps) -> tuple:
    """Repeats per output dim, as tile pads them: at least one per input dim."""
    return (1,) * (ndim - len(reps)) + tuple(reps)


def _repeated(ndim, reps) -> list:
    reps = _reps(ndim, reps)
    return [d for d in range(ndim) if reps[d + len(reps) - ndim] != 1]


def _after_new_dims(d, ndim, reps) -> int:
    return d + len(_reps(ndim, reps)) - ndim


register(OpDef("repeat", "repeat(input: Tensor, *repeats)",
               lambda input, repeats: input.repeat(repeats),
               moving_rule(lambda ndim, repeats: _repeated(ndim, repeats),
                           lambda d, ndim, repeats: _after_new_dims(d, ndim, repeats)),
               methods=("repeat",), function=False))
register(OpDef("tile", "tile(input: Tensor, dims)", torch.tile,
               moving_rule(lambda ndim, dims: _repeated(ndim, _dims(dims)),
                           lambda d, ndim, dims: _after_new_dims(d, ndim, _dims(dims))),
               methods=("tile",)))


def _repeat_interleave_meta(input, repeats, dim=None, *, output_size=None):
    if not isinstance(repeats, int):  # a tensor of repeats: the shape would depend on values
        raise NotImplementedError("dtorch.repeat_interleave: repeats must be an int")
    return torch.repeat_interleave(input, repeats, dim, output_size=output_size)


# each element is repeated in place: a sharded dim's repeated blocks are not array_split blocks
# of the result when uneven; without a dim it flattens first
register(OpDef("repeat_interleave",
               "repeat_interleave(input: Tensor, repeats, dim=None, *, output_size=None)",
               torch.repeat_interleave, moving_rule(_all_dims_if_none("dim")),
               meta=_repeat_interleave_meta, methods=("repeat_interleave",)))


def _pad_partials(pad, mode="constant", value=None) -> tuple:
    """Reflect, replicate and circular padding copy elements; a constant is the same on every
    device, which a max, min or avg reduces to itself, and a sum only when it is 0."""
    if mode == "constant" and value:
        return tuple(p for p in ALL_PARTIALS if p.reduce_op != "sum")
    return ALL_PARTIALS


def _pad_meta(input, pad, mode="constant", value=None):
    """F.pad on meta tensors checks shapes; torch's dtype checks of the non-constant modes (no
    reflect of bool) run first, as torch's CPU kernels raise them, on a small real tensor whose
    padded dims fit the pads."""
    if mode != "constant" and input.dim() > len(pad) // 2:
        fit = 2 * max(map(abs, pad), default=0) + 2
        probe = [1] * input.dim()
        for d in _padded(input.dim(), pad):
            probe[d] = fit
        F.pad(torch.zeros(probe, dtype=input.dtype), pad, mode, value)
    return F.pad(input, pad, mode, value)


def _pad(ctx, input, pad, mode="constant", value=None):
    if 0 in ctx.out_local_shape:  # an empty block (torch refuses to reflect one)
        return input.new_empty(ctx.out_local_shape)
    return F.pad(input, pad, mode, value)


def _padded(ndim, pad, **_) -> list:
    """The dims ``pad`` changes: pairs (before, after) from the last dim back."""
    return [ndim - 1 - i for i in range(len(pad) // 2) if pad[2 * i] or pad[2 * i + 1]]


# the padded (or cropped) dims must be Replicate, the others are local
register(OpDef("pad", "pad(input: Tensor, pad, mode='constant', value=None)", _pad,
               moving_rule(_padded,
                           partials=_pad_partials),
               meta=_pad_meta, function=False, functional=True, uses_context=True))


def _triangle(fn):
    """tril/triu of a block: element (i, j) of the block is (i + row offset, j + col offset) of
    the tensor, so the diagonal moves by the difference of the offsets."""

    def kernel(ctx, input, diagonal=0):
        rows, cols = ctx.out_offsets[-2:]
        return fn(input, diagonal + rows - cols)

    return kernel


# every dim may stay sharded (the offsets are the shard's); zeroing an element is the same on
# every device, which every reduction keeps zero: all Partials pass
for _name in ("tril", "triu"):
    register(OpDef(_name, f"{_name}(input: Tensor, diagonal=0)", _triangle(getattr(torch, _name)),
                   moving_rule(lambda ndim, **_: ()), meta=getattr(torch, _name),
                   methods=(_name,), uses_context=True, positional=True))


def cat_rule(call) -> Placed:
    """Inputs share a placement; a shard of a dim other than the joined one stays (stack inserts
    a dim, shifting the ones after it). Joining combines no elements, so equal Partials pass.
    Inputs all sharded along the joined dim give a sub-split Shard: each device joins its
    blocks of the inputs, which are its pieces of the inputs' segments (an input is one segment
    or, sub-split itself, its own), with no communication."""
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
    if not stacking:
        segments = sum((_segments(s, dim) for s in specs), ())
        for i in range(len(call.mesh.shape)):
            ins = tuple(s.placements[i] for s in specs)
            if all(p.is_shard(dim) for p in ins):
                rows.append(((Shard(dim, segments),), ins))
    return expand(call, rows)


def _segments(spec, dim: int) -> tuple:
    """The segments of ``spec``'s dim ``dim``: its sub-split's, or the whole dim."""
    split = next((p.sub_split for p in spec.placements if p.is_shard(dim)), None)
    return split or (spec.shape[dim],)


register(OpDef("cat", "cat(tensors: TensorList, dim=0)", lambda *ts, dim=0: torch.cat(ts, dim),
               cat_rule, aliases=("concat", "concatenate"), sub_splits=True))
register(OpDef("stack", "stack(tensors: TensorList, dim=0)",
               lambda *ts, dim=0: torch.stack(ts, dim), cat_rule))
