"""Cutting a device's block out of a larger block, and joining blocks into a larger one, along the
ranges ``placement.local_pieces`` computes: torch's side of the sharding math, shared by the
factories (a block of a whole tensor), the redistribute kernels, checkpoints and the client's
``to_torch``. A plainly sharded dim is one range, so it is one ``narrow`` or one ``cat``; a
sub-split dim is several, taken and put in the order the block holds them.
"""

from __future__ import annotations

import math
import mmap

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


SCRATCH_BYTES = 1 << 20  # a whole tensor drawn for a block of it is mapped apart from here up


def block_of_whole(shape, dtype, pieces, fill, out=None) -> torch.Tensor:
    """The block ``pieces`` names of a whole tensor (``shape``, ``dtype``) that ``fill(t)``
    writes into ``t`` (a random draw: its values depend on the whole shape, so the whole is
    drawn to keep a block); copied into ``out`` when given. A whole tensor of a MiB or more that
    is not the block itself is drawn into an anonymous mapping that goes back to the system as
    the block is taken: from malloc, a host that keeps freed blocks
    (``runtime/cpu_memory.py``) would keep it, several times a model's share when its layers
    are initialized one by one."""
    nbytes = math.prod(shape) * dtype.itemsize
    whole_is_block = all(ranges == ((0, n),) for ranges, n in zip(pieces, shape))
    if whole_is_block and out is not None and out.device.type == "cpu":
        return fill(out)  # (a CUDA block takes the CPU draw: the generator is a CPU one)
    if whole_is_block or nbytes < SCRATCH_BYTES:
        whole = torch.empty(shape, dtype=dtype)
    else:  # (unmapped once nothing refers to the tensor on it)
        whole = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype,
                                 count=math.prod(shape)).view(shape)
    fill(whole)
    block = block_of(whole, pieces)
    if out is not None:
        return out.copy_(block)
    return block if whole_is_block else block.clone()


def join(blocks, dim: int, blocks_pieces) -> torch.Tensor:
    """``blocks`` joined along ``dim`` into the block their pieces together make
    (``placement.join_order``)."""
    order = join_order(blocks_pieces)
    if not order:
        return blocks[0].narrow(dim, 0, 0)
    return torch.cat([blocks[b].narrow(dim, start, length) for b, start, length in order], dim)
