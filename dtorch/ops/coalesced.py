"""``all_reduce_coalesced``: several tensors made whole on some mesh dims by one all-reduce of
their blocks, flattened and joined: a bucket of gradients (``autograd/tape.Buckets``).

Many small gradients then pay one collective's latency, as torch's DDP buckets do. The operands
share a mesh and each is Partial(sum) on every dim of ``mesh_dims``; their other placements stay
as they are, a tensor-parallel weight's Shard among them: the blocks joined are each device's
own, and the members of one all-reduce group (which differ only in their coordinate along the
reduced dims) hold blocks of one shape. The results are views into the one reduced buffer (as
torch's ``gradient_as_bucket_view``), laid out as the operands with Replicate on ``mesh_dims``.
A low-precision sum is reduced in float32 and rounded once, as every dtorch reduction. Its
gradient is the same all-reduce of the results' gradients (``ops/exchange.py``).

>>> import dtorch, torch
>>> mesh = dtorch.DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=["dp", "tp"])
>>> P, S0 = dtorch.Partial(), dtorch.Shard(0)
>>> a = dtorch.from_torch(torch.ones(4, 3), device_mesh=mesh, placements=[P, S0])
>>> b = dtorch.from_torch(torch.ones(5), device_mesh=mesh, placements=[P, dtorch.Replicate()])
>>> whole_a, whole_b = dtorch.ops.coalesced.all_reduce_coalesced([a, b], mesh_dims=(0,))
>>> whole_a.placements, bool(whole_a.to_torch().eq(1).all()), whole_b.placements
([Replicate(), Shard(dim=0)], True, [Replicate(), Replicate()])
"""

from __future__ import annotations

import torch
from torch._C._distributed_c10d import AllreduceOptions, ReduceOp

from ..placement import Partial, Replicate
from ..runtime.collectives import _widen, _wire
from .exchange import exchange
from .registry import COMM, OpDef, issue, register
from .rules import Placed

SUM, R = Partial("sum"), Replicate()


def all_reduce_coalesced(tensors, mesh_dims) -> tuple:
    """The ``tensors`` (Partial(sum) on ``mesh_dims``) reduced there by one all-reduce."""
    return issue("all_reduce_coalesced", tuple(tensors), (tuple(mesh_dims),))


def coalesced_rule(call) -> Placed:
    dims = call.static["mesh_dims"]
    outs = []
    for k, t in enumerate(call.tensors):
        if t.mesh != call.mesh or any(t.placements[d] != SUM for d in dims):
            raise ValueError(f"all_reduce_coalesced: every tensor must be on one mesh and "
                             f"Partial(sum) on mesh dims {list(dims)}; tensor {k} is "
                             f"{list(t.placements)}")
        outs.append(tuple(R if i in dims else p for i, p in enumerate(t.placements)))
    return Placed(tuple(outs))


def _all_reduce_coalesced(ctx, *blocks, mesh_dims):
    groups = [ctx.group(d)[0] for d in mesh_dims]
    flat = torch.cat([_widen("sum", b).reshape(-1) for b in blocks])  # a buffer of its own
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
            pg.allreduce([_wire(flat)], opts).wait()
    return flat


def _meta(*blocks, mesh_dims):
    return tuple(torch.empty_like(b) for b in blocks)


register(OpDef("all_reduce_coalesced", "all_reduce_coalesced(tensors: TensorList, mesh_dims)",
               _all_reduce_coalesced, coalesced_rule, meta=_meta, uses_context=True,
               flags=COMM, comm_dims=lambda in_specs, mesh_dims: tuple(mesh_dims),
               comm_grad=True, function=False))
