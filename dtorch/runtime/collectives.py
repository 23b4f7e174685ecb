"""Kernels of the redistribute steps (``redistribute.py`` plans them), on local blocks.

Each takes ``(ctx, block, mesh_dim)``. Collectives go through torch.distributed process groups
(gloo on CPU, NCCL on CUDA); uneven shards are padded to the largest chunk for the collective
and cut back after, since collectives need equal sizes on every rank.

Two dtypes travel in another form (``wire``, ``widen``; public, for every kernel that runs a
collective of its own, ``buckets.py``'s among them): gloo has no complex types, so a complex
buffer goes as its real view (``view_as_real``: the same memory, a trailing dim of 2); and a
low-precision sum (bfloat16, float16) is reduced in float32 and rounded once, as torch's own
reductions accumulate, instead of rounding at every hop of the collective.
"""

from __future__ import annotations

import math

import torch
from torch._C._distributed_c10d import (
    AllreduceOptions,
    AllToAllOptions,
    BroadcastOptions,
    ReduceOp,
    ReduceScatterOptions,
)

from ..blocks import cut_pieces, join
from ..placement import chunk_range, chunk_sizes
from ..spec import coordinate_of, device_at

REDUCE = {"sum": ReduceOp.SUM, "avg": ReduceOp.SUM, "max": ReduceOp.MAX, "min": ReduceOp.MIN}
LOW_PRECISION = (torch.bfloat16, torch.float16)


def wire(t: torch.Tensor) -> torch.Tensor:
    """The buffer a collective sends: a complex tensor as its real view (same memory)."""
    return torch.view_as_real(t) if t.is_complex() else t


def widen(op: str, t: torch.Tensor) -> torch.Tensor:
    """What a reduction adds up: a low-precision sum in float32 (rounded once, after). Max and
    min pick an element, which no precision changes."""
    return t.float() if op in ("sum", "avg") and t.dtype in LOW_PRECISION else t


def _pad(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    if t.shape[dim] == size:
        return t.contiguous()
    shape = list(t.shape)
    shape[dim] = size - t.shape[dim]
    return torch.cat([t, t.new_zeros(shape)], dim).contiguous()


def all_gather(ctx, x, mesh_dim):
    """S(d) -> R over one mesh dim."""
    d = ctx.in_specs[0].placements[mesh_dim].dim
    pg, _ = ctx.group(mesh_dim)
    if ctx.in_specs[0].placements[mesh_dim].sub_split is not None:
        return _all_gather_pieces(ctx, x, mesh_dim, pg)
    sizes = chunk_sizes(ctx.out_local_shape[d], pg.size())
    padded = _pad(x, d, sizes[0])
    if sizes[0] == sizes[-1] > 0 and all(n == 1 for n in x.shape[:d]):
        # even chunks of the outermost dim are contiguous slices of the result: gather into
        # them directly, saving a full copy
        out = x.new_empty(ctx.out_local_shape)
        pg.allgather([[wire(o) for o in out.split(sizes[0], d)]], [wire(padded)]).wait()
        return out
    outs = [torch.empty_like(padded) for _ in sizes]
    pg.allgather([[wire(o) for o in outs]], [wire(padded)]).wait()
    return torch.cat([o.narrow(d, 0, n) for o, n in zip(outs, sizes)], d)


def _all_gather_pieces(ctx, x, mesh_dim, pg):
    """A sub-split S(d) -> R: the members' blocks (padded to the largest), joined by the
    positions of their pieces."""
    spec = ctx.in_specs[0]
    d = spec.placements[mesh_dim].dim
    coords = [ctx.coord[:mesh_dim] + (j,) + ctx.coord[mesh_dim + 1:] for j in range(pg.size())]
    pieces = [spec.local_pieces(c)[d] for c in coords]
    sizes = [sum(n for _, n in p) for p in pieces]
    padded = _pad(x, d, max(sizes))
    outs = [torch.empty_like(padded) for _ in sizes]
    pg.allgather([[wire(o) for o in outs]], [wire(padded)]).wait()
    return join([o.narrow(d, 0, n) for o, n in zip(outs, sizes)], d, pieces)


def all_reduce(ctx, x, mesh_dim):
    """P -> R over one mesh dim."""
    op = ctx.in_specs[0].placements[mesh_dim].reduce_op
    pg, _ = ctx.group(mesh_dim)
    out = widen(op, x)
    out = out.clone(memory_format=torch.contiguous_format) if out is x else out.contiguous()
    opts = AllreduceOptions()
    opts.reduceOp = REDUCE[op]
    nans = _nan_mask(op, out)
    if nans is not None:
        nan_opts = AllreduceOptions()
        nan_opts.reduceOp = ReduceOp.MAX
        pg.allreduce([nans], nan_opts).wait()
    pg.allreduce([wire(out)], opts).wait()
    _restore_nans(out, nans)
    if op == "avg":
        _divide(out, pg.size())
    return out.to(x.dtype)


def _divide(t: torch.Tensor, n: int) -> None:
    """An average's sum over the group size, in place (gloo has no average; an average is of
    floating or complex values only: ``placement.check_partials``)."""
    t.div_(n)


def _nan_mask(op: str, t: torch.Tensor):
    """Gloo's max and min drop NaN (every comparison with NaN is false) where torch propagates
    it: the NaN positions travel in a byte mask of their own, reduced with MAX alongside."""
    if op in ("max", "min") and t.is_floating_point():
        return torch.isnan(t).to(torch.uint8)
    return None


def _restore_nans(t: torch.Tensor, nans) -> None:
    if nans is not None:
        t.masked_fill_(nans.bool(), float("nan"))


def reduce_scatter(ctx, x, mesh_dim):
    """P -> S(d) over one mesh dim: reduce, each device keeping its chunk."""
    op = ctx.in_specs[0].placements[mesh_dim].reduce_op
    d = ctx.out_specs[0].placements[mesh_dim].dim
    pg, rank = ctx.group(mesh_dim)
    sizes = chunk_sizes(x.shape[d], pg.size())
    chunks = [_pad(c, d, sizes[0]) for c in torch.split(widen(op, x), sizes, d)]
    out = torch.empty_like(chunks[0])
    opts = ReduceScatterOptions()
    opts.reduceOp = REDUCE[op]
    nan_chunks = [_nan_mask(op, c) for c in chunks]
    if nan_chunks[0] is not None:
        nans = torch.empty_like(nan_chunks[0])
        nan_opts = ReduceScatterOptions()
        nan_opts.reduceOp = ReduceOp.MAX
        pg.reduce_scatter([nans], [nan_chunks], nan_opts).wait()
    pg.reduce_scatter([wire(out)], [[wire(c) for c in chunks]], opts).wait()
    if nan_chunks[0] is not None:
        _restore_nans(out, nans)
    out = out.narrow(d, 0, sizes[rank]).contiguous()
    if op == "avg":
        _divide(out, pg.size())
    return out.to(x.dtype)


def all_to_all(ctx, x, mesh_dim):
    """S(d) -> S(e) over one mesh dim: chunk j of dim e goes to device j, the received chunks
    join along d."""
    d = ctx.in_specs[0].placements[mesh_dim].dim
    e = ctx.out_specs[0].placements[mesh_dim].dim
    pg, rank = ctx.group(mesh_dim)
    n = pg.size()
    d_sizes = chunk_sizes(ctx.out_local_shape[d], n)
    e_sizes = chunk_sizes(x.shape[e], n)
    if e == 0 and len(set(e_sizes)) == 1 and x.shape[d] == d_sizes[0]:
        send = x.contiguous().view(n, e_sizes[0], *x.shape[1:])  # the chunks, as they lie
    else:
        send = torch.stack([_pad(_pad(c, d, d_sizes[0]), e, e_sizes[0])
                            for c in torch.split(x, e_sizes, e)])
    recv = torch.empty_like(send)
    pg.alltoall_base(wire(recv), wire(send), [], [], AllToAllOptions()).wait()
    if d == 0 and len(set(d_sizes)) == 1 and e_sizes[rank] == e_sizes[0]:
        return recv.view(n * d_sizes[0], *recv.shape[2:])  # the result, as it arrived
    return torch.cat([recv[j].narrow(d, 0, d_sizes[j]).narrow(e, 0, e_sizes[rank])
                      for j in range(n)], d)


def chunk(ctx, x, mesh_dim):
    """R -> S(d): keep this device's chunk (a copy, so the result owns its memory)."""
    src, dst = ctx.in_specs[0], ctx.out_specs[0]
    d = dst.placements[mesh_dim].dim
    if dst.placements[mesh_dim].sub_split is not None:  # its piece of every segment
        return cut_pieces(x, d, src.local_pieces(ctx.coord)[d],
                          dst.local_pieces(ctx.out_coord)[d]).clone()
    offset, length = chunk_range(x.shape[d], dst.mesh.shape[mesh_dim], ctx.out_coord[mesh_dim])
    return x.narrow(d, offset, length).clone()


def partition(ctx, x, mesh_dim):
    """R -> P: coordinate 0 keeps the value, the others the identity of the reduction."""
    p = ctx.out_specs[0].placements[mesh_dim]
    if p.reduce_op == "sum" and ctx.out_coord[mesh_dim] != 0:
        return torch.zeros_like(x)
    return x.clone()


def _identity(op: str, dtype: torch.dtype):
    """The value that leaves a reduction unchanged: what a device holds outside its chunk."""
    if op == "sum":
        return 0
    if dtype.is_floating_point:
        return -math.inf if op == "max" else math.inf
    if dtype == torch.bool:  # max is "any", min is "all"
        return op == "min"
    return torch.iinfo(dtype).min if op == "max" else torch.iinfo(dtype).max


def pad_partial(ctx, x, mesh_dim):
    """S(d) -> P(op) for sum, max, min: the chunk in its place, the identity of op around it
    (the reduction over the devices is then the whole)."""
    d = ctx.in_specs[0].placements[mesh_dim].dim
    op = ctx.out_specs[0].placements[mesh_dim].reduce_op
    out = torch.full(ctx.out_local_shape, _identity(op, x.dtype), dtype=x.dtype, device=x.device)
    offset, length = chunk_range(ctx.out_local_shape[d], ctx.out_specs[0].mesh.shape[mesh_dim],
                                 ctx.out_coord[mesh_dim])
    out.narrow(d, offset, length).copy_(x)
    return out


def move(ctx, x, mesh_dim):
    """Between meshes of different shapes (Replicate on both): source device 0 broadcasts the
    whole value to the target mesh. (Between meshes of one shape, the host runs ``hop``.)"""
    src, dst = ctx.in_specs[0], ctx.out_specs[0]
    me, out = ctx.device.index, None
    root, receivers = src.mesh.devices[0], dst.mesh.devices
    members = tuple(sorted({root, *receivers}))
    if me not in members:
        return ()
    if members == (me,):
        return x.clone()
    if me == root:
        buf = x.contiguous()
    else:
        buf = torch.empty(dst.shape, dtype=getattr(torch, dst.dtype),
                          device=ctx.device.torch_device)
    opts = BroadcastOptions()
    opts.rootRank = members.index(root)
    ctx.device.group(members).broadcast([wire(buf)], opts).wait()
    if me in receivers:
        out = buf.clone() if me == root else buf
    return () if out is None else out  # a device only of the source mesh keeps no block


def is_hop(src, dst) -> bool:
    """A move between meshes of one shape (a pipeline stage hop) runs as ``hop``."""
    return src.mesh.shape == dst.mesh.shape


_BLOCK, _FAILURE = 0, 1  # the tags of a hop's two messages


def hop(ctx, x, failure: int = 0):
    """A move between meshes of one shape, point-to-point: the device at coordinate c of the
    source sends its block to the device at c of the target, on the two-member group of the
    pair. Returns ``(block, failure of its sender)``: ``()`` for a device only of the source
    mesh, which keeps no block; a failure is the site of the sender's failed input plus one,
    or 0 (``failure`` is this device's, sent along).

    The failure travels in-band, a one-element message ahead of the block (on the CPU group of
    the pair, so that reading it never waits for a GPU), so a hop needs no agreement among the
    devices of both meshes (``failures.run_collective``'s all-reduce, a round trip through every
    member): a received block depends on its sender's input alone, and the receiver learns of
    it in the one direction the data goes.

    A device of both meshes at different coordinates (a shifted mesh) both sends and receives:
    everything is posted before anything is waited for, so no cycle of devices can deadlock.
    The pair groups a device needs are created in sorted order, one global order, so their
    rendezvous cannot deadlock either."""
    src, dst = ctx.in_specs[0], ctx.out_specs[0]
    me = ctx.device.index
    send_to = recv_from = None
    if me in src.mesh.devices:
        send_to = device_at(dst.mesh, coordinate_of(src.mesh, me))
    if me in dst.mesh.devices:
        coord = coordinate_of(dst.mesh, me)
        recv_from = device_at(src.mesh, coord)
    if send_to == me:  # the same device at the same coordinate: a local copy
        return x.clone(), failure
    groups = {}
    for peer in sorted(p for p in (send_to, recv_from) if p is not None):
        pair = (me, peer) if me < peer else (peer, me)
        groups[peer] = (ctx.device.group(pair), ctx.device.cpu_group(pair), pair.index(peer))
    works, out, sender = [], (), None
    if recv_from is not None:
        out = torch.empty(dst.local_region(coord)[0], dtype=getattr(torch, dst.dtype),
                          device=ctx.device.torch_device)
        sender = torch.zeros(1, dtype=torch.int64)
        pg, cpu_pg, rank = groups[recv_from]
        works += [cpu_pg.recv([sender], rank, _FAILURE), pg.recv([wire(out)], rank, _BLOCK)]
    if send_to is not None:
        pg, cpu_pg, rank = groups[send_to]
        flag = torch.tensor([failure], dtype=torch.int64)
        block = x.contiguous()  # both held until their sends complete
        works += [cpu_pg.send([flag], rank, _FAILURE), pg.send([wire(block)], rank, _BLOCK)]
    for w in works:
        w.wait()
    return out, 0 if sender is None else int(sender)


def copy(ctx, x, mesh_dim):
    return x.clone()


STEP_KERNELS = {
    "all_gather": all_gather, "all_reduce": all_reduce, "reduce_scatter": reduce_scatter,
    "all_to_all": all_to_all, "chunk": chunk, "partition": partition,
    "pad_partial": pad_partial, "move": move, "copy": copy,
}
