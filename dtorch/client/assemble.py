"""Joining the blocks of a distributed tensor into its full value on the client.

Hosts send the block of every device whose coordinate is 0 on the Replicate mesh dims. Mesh dims
are undone from the last to the first (the reverse of the order they shard in): a Shard dim
concatenates its blocks, a Partial dim reduces them, so nested layouts such as ``[S(0), S(0)]``
or ``[S(0), P]`` come out right. A sub-split Shard joins its blocks' pieces in the order of
their positions (``blocks.join``).
"""

from __future__ import annotations

import torch

from ..blocks import join
from ..placement import Partial, Replicate, Shard, local_pieces


def piece_count(spec) -> int:
    n = 1
    for size, p in zip(spec.mesh.shape, spec.placements):
        if not p.is_replicate():
            n *= size
    return n


# Sums of these are taken in float32 and rounded once, as torch and the collectives do.
LOW_PRECISION = (torch.float16, torch.bfloat16)


def _reduce(op: str, blocks):
    if op in ("sum", "avg"):
        dtype = blocks[0].dtype
        out = blocks[0].to(torch.float32 if dtype in LOW_PRECISION else dtype, copy=True)
        for b in blocks[1:]:
            out += b
        if op == "avg":  # of floating or complex values only (``placement.check_partials``)
            out /= len(blocks)
        return out.to(dtype)
    fn = torch.maximum if op == "max" else torch.minimum
    out = blocks[0]
    for b in blocks[1:]:
        out = fn(out, b)
    return out


def assemble(spec, pieces: dict) -> torch.Tensor:
    """Full value from ``{coord: block}``."""
    blocks = dict(pieces)
    for i in reversed(range(len(spec.mesh.shape))):
        p = spec.placements[i]
        groups: dict = {}
        for coord, block in blocks.items():
            groups.setdefault(coord[:i] + coord[i + 1:], []).append((coord[i], block))
        merged = {}
        for rest, members in groups.items():
            members = [b for _, b in sorted(members, key=lambda m: m[0])]
            if isinstance(p, Shard) and p.sub_split is not None:
                value = join(members, p.dim, _member_pieces(spec, i, rest))
            elif isinstance(p, Shard):
                value = torch.cat(members, dim=p.dim)
            elif isinstance(p, Partial):
                value = _reduce(p.reduce_op, members)
            else:
                value = members[0]
            merged[rest[:i] + (0,) + rest[i:]] = value
        blocks = merged
    (value,) = blocks.values()
    return value


def _member_pieces(spec, mesh_dim: int, rest: tuple) -> list:
    """The pieces along the sharded dim of each member's block while ``mesh_dim`` is joined (the
    later mesh dims are joined already: Replicate)."""
    n = len(spec.mesh.shape)
    placements = spec.placements[:mesh_dim + 1] + (Replicate(),) * (n - mesh_dim - 1)
    dim = spec.placements[mesh_dim].dim
    return [local_pieces(spec.shape, spec.mesh.shape, placements,
                         rest[:mesh_dim] + (j,) + rest[mesh_dim:])[dim]
            for j in range(spec.mesh.shape[mesh_dim])]
