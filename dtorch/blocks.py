"""Cutting a device's block out of a larger block, and joining blocks into a larger one, along the
ranges ``placement.local_pieces`` computes: torch's side of the sharding math, shared by the
factories (a block of a whole tensor), the redistribute kernels, checkpoints and the client's
``to_torch``. A plainly sharded dim is one range, so it is one ``narrow`` or one ``cat``; a
sub-split dim is several, taken and put in the order the block holds them.
"""

from __future__ import annotations

import torch

from .placement import join_order, select_order


def cut(t: torch.Tensor, dim: int, ranges) -> torch.Tensor:
    """The ``(start, length)`` ranges of ``t`` along ``dim``, joined in order (a view when it is
    one range)."""
    if len(ranges) == 1:
        return t.narrow(dim, *ranges[0])
    if not ranges:
        return t.narrow(dim, 0, 0)
    return torch.cat([t.narrow(dim, start, length) for start, length in ranges], dim)


def cut_pieces(t: torch.Tensor, dim: int, have, want) -> torch.Tensor:
    """From ``t``, which holds the pieces ``have`` along ``dim``, the pieces ``want``."""
    return cut(t, dim, select_order(have, want))


def block_of(full: torch.Tensor, pieces) -> torch.Tensor:
    """The block of a whole tensor that ``pieces`` (``local_pieces``: per dim, its ranges)
    name."""
    for d, ranges in enumerate(pieces):
        if ranges != ((0, full.shape[d]),):
            full = cut(full, d, ranges)
    return full


def join(blocks, dim: int, blocks_pieces) -> torch.Tensor:
    """``blocks`` joined along ``dim`` into the block their pieces together make
    (``placement.join_order``)."""
    order = join_order(blocks_pieces)
    if not order:
        return blocks[0].narrow(dim, 0, 0)
    return torch.cat([blocks[b].narrow(dim, start, length) for b, start, length in order], dim)
