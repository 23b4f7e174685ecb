"""Gradient buckets and their coalesced collectives: several tensors changed in layout by one
collective of their blocks, flattened and joined, so that many small tensors pay one collective's
latency, as torch's DDP buckets and ZeRO's flat buffers do. ``Buckets`` gathers them: the backward's gradients on their
way into ``.grad`` (``autograd/tape.py``), the optimizer's updated chunks on their way back
into the parameters (``optim/optimizer.py``).

- ``all_reduce_coalesced``: Partial(sum) on ``mesh_dims`` to Replicate there (data-parallel
  gradients), by one all-reduce. Its gradient is the same all-reduce.
- ``reduce_scatter_coalesced``: Partial(sum) on ``mesh_dim`` to Shard there, tensor k along its
  dim ``dims[k]`` (ZeRO-2/3's gradients), by one reduce-scatter. Its gradient is an all-gather.
- ``all_gather_coalesced``: Shard on ``mesh_dim`` to Replicate there (ZeRO-1/2's updated
  chunks), by one all-gather. Its gradient is a reduce-scatter.

A scatter or gather buffer holds, for each member of the group in rank order, its chunks of
every block (chunks as ``Shard`` cuts them, uneven ones too), each member's stretch padded to the
longest; a sharded dim must be one no other mesh dim shards (the chunks of a chunk would not be
in ``Shard``'s order). The operands share a mesh and a dtype; their other placements stay as they
are, a tensor-parallel weight's Shard among them: the blocks joined are each device's own, and
the members of one group (which differ only in their coordinate along the reduced dims) hold
blocks of one shape. A reduction's results are views into the one reduced buffer (as torch's
``gradient_as_bucket_view``); a low-precision sum is reduced in float32 and rounded once, as
every dtorch reduction. All three differentiate through their collectives
(``ops/exchange.py``).

>>> import dtorch, torch
>>> mesh = dtorch.DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=["dp", "tp"])
>>> P, S0 = dtorch.Partial(), dtorch.Shard(0)
>>> a = dtorch.from_torch(torch.ones(4, 3), device_mesh=mesh, placements=[P, S0])
>>> b = dtorch.from_torch(torch.ones(5), device_mesh=mesh, placements=[P, dtorch.Replicate()])
>>> whole_a, whole_b = dtorch.buckets.all_reduce_coalesced([a, b], mesh_dims=(0,))
>>> whole_a.placements, bool(whole_a.to_torch().eq(1).all()), whole_b.placements
([Replicate(), Shard(dim=0)], True, [Replicate(), Replicate()])
>>> part_a, part_b = dtorch.buckets.reduce_scatter_coalesced([a, b], 0, (1, 0))
>>> part_a.placements, bool(part_a.to_torch().eq(1).all()), part_b.placements
([Shard(dim=1), Shard(dim=0)], True, [Shard(dim=0), Replicate()])
>>> again_a, again_b = dtorch.buckets.all_gather_coalesced([part_a, part_b], 0)
>>> again_a.placements, bool(again_a.to_torch().eq(1).all()), again_b.placements
([Replicate(), Shard(dim=0)], True, [Replicate(), Replicate()])
"""

from __future__ import annotations

import math

import torch
from torch._C._distributed_c10d import AllreduceOptions, ReduceOp, ReduceScatterOptions

from . import config
from .ops.exchange import exchange
from .ops.registry import COMM, OpDef, issue, register
from .ops.rules import Placed
from .placement import Partial, Replicate, Shard, chunk_sizes
from .runtime.collectives import widen, wire

SUM, R = Partial("sum"), Replicate()


def all_reduce_coalesced(tensors, mesh_dims) -> tuple:
    """The ``tensors`` (Partial(sum) on ``mesh_dims``) reduced there by one all-reduce."""
    return issue("all_reduce_coalesced", tuple(tensors), (tuple(mesh_dims),))


def _one_dtype(call) -> None:
    """The blocks are joined in one buffer, so the tensors share a dtype."""
    dtypes = {t.dtype for t in call.tensors}
    if len(dtypes) > 1:
        raise TypeError(f"{call.op.name}: every tensor must have one dtype, got "
                        f"{sorted(dtypes)}; bucket them by dtype")


def _misplaced(call, k: int, t, expected: str) -> ValueError:
    return ValueError(f"{call.op.name}: every tensor must be on one mesh and {expected}; "
                      f"tensor {k} is {list(t.placements)}")


def coalesced_rule(call) -> Placed:
    _one_dtype(call)
    dims = call.static["mesh_dims"]
    outs = []
    for k, t in enumerate(call.tensors):
        if t.mesh != call.mesh or any(t.placements[d] != SUM for d in dims):
            raise _misplaced(call, k, t, f"Partial(sum) on mesh dims {list(dims)}")
        outs.append(tuple(R if i in dims else p for i, p in enumerate(t.placements)))
    return Placed(tuple(outs))


def _all_reduce_coalesced(ctx, *blocks, mesh_dims):
    groups = [ctx.group(d)[0] for d in mesh_dims]
    flat = torch.cat([widen("sum", b).reshape(-1) for b in blocks])  # a buffer of its own
    flat = exchange(flat, lambda t: _sum(groups, t), lambda g: _sum(groups, g.clone()))
    flat = flat.to(blocks[0].dtype)
    return tuple(piece.view(b.shape)
                 for piece, b in zip(flat.split([b.numel() for b in blocks]), blocks))


def _sum(groups, flat):
    """``flat`` summed over each group, in place."""
    if flat.numel():  # every member of a group holds as many elements
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM
        for pg in groups:
            pg.allreduce([wire(flat)], opts).wait()
    return flat


def _meta(*blocks, **static):
    return tuple(torch.empty_like(b) for b in blocks)


register(OpDef("all_reduce_coalesced", "all_reduce_coalesced(tensors: TensorList, mesh_dims)",
               _all_reduce_coalesced, coalesced_rule, meta=_meta, uses_context=True,
               flags=COMM, comm_dims=lambda in_specs, mesh_dims: tuple(mesh_dims),
               comm_grad=True, function=False))


def reduce_scatter_coalesced(tensors, mesh_dim: int, dims) -> tuple:
    """The ``tensors`` (Partial(sum) on ``mesh_dim``) summed there by one reduce-scatter,
    tensor k then sharded along its dim ``dims[k]``."""
    return issue("reduce_scatter_coalesced", tuple(tensors), (mesh_dim, tuple(dims)))


def all_gather_coalesced(tensors, mesh_dim: int) -> tuple:
    """The ``tensors`` (each Shard on ``mesh_dim``) made Replicate there by one all-gather."""
    return issue("all_gather_coalesced", tuple(tensors), (mesh_dim,))


def _check_sharded_dim(call, k: int, t, d: int) -> None:
    """Chunks of a chunk would not be in ``Shard``'s order."""
    if not 0 <= d < len(t.shape) or any(p == Shard(d) for i, p in enumerate(t.placements)
                                        if i != call.static["mesh_dim"]):
        raise ValueError(f"{call.op.name}: tensor {k} ({list(t.placements)}, {len(t.shape)} "
                         f"dims) cannot be sharded on mesh dim {call.static['mesh_dim']} along "
                         f"dim {d}: it must be a dim no other mesh dim shards")


def scattered_rule(call) -> Placed:
    _one_dtype(call)
    mesh_dim, dims = call.static["mesh_dim"], call.static["dims"]
    if len(dims) != len(call.tensors):
        raise ValueError(f"reduce_scatter_coalesced: {len(call.tensors)} tensors but "
                         f"{len(dims)} dims to shard them along")
    outs = []
    for k, (t, d) in enumerate(zip(call.tensors, dims)):
        if t.mesh != call.mesh or t.placements[mesh_dim] != SUM:
            raise _misplaced(call, k, t, f"Partial(sum) on mesh dim {mesh_dim}")
        _check_sharded_dim(call, k, t, d)
        outs.append(tuple(Shard(d) if i == mesh_dim else p for i, p in enumerate(t.placements)))
    return Placed(tuple(outs))


def gathered_rule(call) -> Placed:
    _one_dtype(call)
    mesh_dim = call.static["mesh_dim"]
    outs = []
    for k, t in enumerate(call.tensors):
        p = t.placements[mesh_dim]
        if t.mesh != call.mesh or not p.is_shard() or p.has_sub_split_coordinates():
            # (a sub-split one gathers through redistribute, which joins its pieces)
            raise _misplaced(call, k, t, f"a plain (not sub-split) Shard on mesh dim {mesh_dim}")
        _check_sharded_dim(call, k, t, t.placements[mesh_dim].dim)
        outs.append(tuple(R if i == mesh_dim else p for i, p in enumerate(t.placements)))
    return Placed(tuple(outs))


def _reduce_scatter_rows(pg, rows):
    """``rows`` ([member, n]) summed over the group; this member's row of the sum."""
    out = rows.new_empty(rows.shape[1])
    if out.numel():
        opts = ReduceScatterOptions()
        opts.reduceOp = ReduceOp.SUM
        pg.reduce_scatter([wire(out)], [[wire(r) for r in rows.unbind(0)]], opts).wait()
    return out


def _all_gather_rows(pg, row):
    """Every member's ``row``, stacked in rank order ([member, n])."""
    out = row.new_empty(pg.size(), row.numel())
    if out.numel():
        pg.allgather([[wire(r) for r in out.unbind(0)]], [wire(row)]).wait()
    return out


def _stretches(shapes, dims, n: int) -> list:
    """For each member of an ``n``-member group, the shapes of its chunks of blocks of
    ``shapes``, each cut along its dim of ``dims`` as ``Shard`` cuts it."""
    cuts = [chunk_sizes(shape[d], n) for shape, d in zip(shapes, dims)]
    return [[(*shape[:d], sizes[r], *shape[d + 1:]) for shape, d, sizes in zip(shapes, dims, cuts)]
            for r in range(n)]


def _padded(flat, length: int):
    return torch.nn.functional.pad(flat, (0, length - flat.numel()))


def _reduce_scatter_coalesced(ctx, *blocks, mesh_dim, dims):
    pg, rank = ctx.group(mesh_dim)
    members = _stretches([b.shape for b in blocks], dims, pg.size())
    longest = max(sum(math.prod(s) for s in shapes) for shapes in members)
    chunks = [torch.split(widen("sum", b), [s[d] for s in shapes], d)
              for b, d, shapes in zip(blocks, dims, zip(*members))]
    rows = torch.stack([_padded(torch.cat([c[r].reshape(-1) for c in chunks]), longest)
                        for r in range(pg.size())])  # a buffer of its own
    mine = exchange(rows, lambda t: _reduce_scatter_rows(pg, t),
                    lambda g: _all_gather_rows(pg, g)).to(blocks[0].dtype)
    sizes = [math.prod(s) for s in members[rank]]
    return tuple(piece.view(shape) for piece, shape in
                 zip(mine[:sum(sizes)].split(sizes), members[rank]))


def _all_gather_coalesced(ctx, *blocks, mesh_dim):
    pg, _ = ctx.group(mesh_dim)
    dims = [spec.placements[mesh_dim].dim for spec in ctx.in_specs]
    wholes = [spec.local_region(ctx.out_coord)[0] for spec in ctx.out_specs]
    members = _stretches(wholes, dims, pg.size())
    longest = max(sum(math.prod(s) for s in shapes) for shapes in members)
    mine = _padded(torch.cat([b.reshape(-1) for b in blocks]), longest)
    rows = exchange(mine, lambda t: _all_gather_rows(pg, t),
                    lambda g: _reduce_scatter_rows(pg, g))
    pieces = []  # per member, its chunk of every block
    for row, shapes in zip(rows.unbind(0), members):
        sizes = [math.prod(s) for s in shapes]
        pieces.append([p.view(s) for p, s in zip(row[:sum(sizes)].split(sizes), shapes)])
    return tuple(torch.cat(chunks, d) for chunks, d in zip(zip(*pieces), dims))


register(OpDef("reduce_scatter_coalesced",
               "reduce_scatter_coalesced(tensors: TensorList, mesh_dim, dims)",
               _reduce_scatter_coalesced, scattered_rule, meta=_meta,
               uses_context=True, flags=COMM,
               comm_dims=lambda in_specs, mesh_dim, dims: (mesh_dim,),
               comm_grad=True, function=False))
register(OpDef("all_gather_coalesced", "all_gather_coalesced(tensors: TensorList, mesh_dim)",
               _all_gather_coalesced, gathered_rule, meta=_meta,
               uses_context=True, flags=COMM,
               comm_dims=lambda in_specs, mesh_dim: (mesh_dim,),
               comm_grad=True, function=False))


# -- buckets ----------------------------------------------------------------------------------


def coalescing(src, dst):
    """How ``src`` becomes ``dst`` (one mesh) by a collective that coalesces, every other
    placement the same: ``("all_reduce", mesh dims)`` where Partial(sum) becomes Replicate;
    ``("reduce_scatter", (mesh dim,))`` where Partial(sum) becomes Shard on one mesh dim;
    ``("all_gather", (mesh dim,))`` where Shard becomes Replicate on one; the sharded tensor
    dim one no other mesh dim shards. None otherwise."""
    if src.mesh != dst.mesh or src.placements == dst.placements:
        return None
    changed = tuple(i for i, (a, b) in enumerate(zip(src.placements, dst.placements)) if a != b)
    before = [src.placements[i] for i in changed]
    after = [dst.placements[i] for i in changed]
    if all(a == SUM and b.is_replicate() for a, b in zip(before, after)):
        return "all_reduce", changed
    if len(changed) != 1:
        return None
    (a,), (b,) = before, after
    kind, sharded = (("reduce_scatter", b) if a == SUM and b.is_shard() else
                     ("all_gather", a) if a.is_shard() and b.is_replicate() else (None, None))
    others = [p for i, p in enumerate(src.placements) if i != changed[0]]
    if kind is None or Shard(sharded.dim) in others:
        return None
    return kind, changed


class Buckets:
    """Tensors on their way to new layouts, each then handed to ``deliver(owner, tensor)``.
    Those whose change ``coalescing`` names wait in a bucket per (mesh, dtype, change) and go
    as one coalesced collective once the bucket holds ``config.bucket_bytes`` (the tensors'
    whole sizes) or ``flush`` is called, so the collective of a full bucket runs on the
    communication stream while the work issued after it computes. A bucket never holds more
    (a tensor that would overfill it sends it first, then starts the next; one larger than a
    bucket goes alone): tensors of one bucket's size go in one collective, a byte more in two.
    The others are redistributed and delivered at once."""

    def __init__(self, deliver):
        self.deliver = deliver
        self.open: dict = {}  # key -> [(owner, tensor, target spec)], bytes

    def add(self, owner, t, target) -> None:
        how = coalescing(t._spec, target)
        if how is None:
            return self.deliver(owner, laid_out(t, target))
        key, limit = (target.mesh, target.dtype, how), config.bucket_bytes
        entries, size = self.open.get(key, ([], 0))
        nbytes = t.numel() * t.dtype.itemsize
        if entries and size + nbytes > limit:  # t would overfill the bucket: it goes first
            self._send(how, entries)
            entries, size = [], 0
        entries.append((owner, t, target))
        size += nbytes
        if size >= limit:
            self.open.pop(key, None)
            self._send(how, entries)
        else:
            self.open[key] = (entries, size)

    def flush(self) -> None:
        for (_, _, how), (entries, _) in self.open.items():
            self._send(how, entries)
        self.open = {}

    def _send(self, how, entries) -> None:
        if len(entries) == 1:
            owner, t, target = entries[0]
            return self.deliver(owner, laid_out(t, target))
        kind, mesh_dims = how
        tensors = [t for _, t, _ in entries]
        if kind == "all_reduce":
            outs = all_reduce_coalesced(tensors, mesh_dims)
        elif kind == "reduce_scatter":
            dims = [target.placements[mesh_dims[0]].dim for _, _, target in entries]
            outs = reduce_scatter_coalesced(tensors, mesh_dims[0], dims)
        else:
            outs = all_gather_coalesced(tensors, mesh_dims[0])
        for (owner, _, _), out in zip(entries, outs):
            self.deliver(owner, out)


def laid_out(t, spec):
    """``t`` laid out as ``spec`` (its mesh and placements): ``t`` itself when it already is."""
    if t._spec.mesh == spec.mesh and t._spec.placements == spec.placements:
        return t
    return t.redistribute(device_mesh=spec.mesh, placements=list(spec.placements))
