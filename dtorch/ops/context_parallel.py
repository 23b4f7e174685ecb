"""The exchanges of context-parallel attention (``ops/attention.py``'s ``_cp_attention``):
Ulysses' all-to-all of sequence blocks for head blocks, and the ring that passes key/value
blocks from member to member.

- **Ulysses**: ``all_to_all`` turns the sequence blocks into head blocks, so each device attends
  over the whole sequence for ``1/n`` of the heads, and a second one turns them back.
- **Ring** (``ring_attention``): each device keeps its query block while the key/value blocks
  travel around the ring by point-to-point send/recv, the next hop posted before the current
  block is computed so they overlap. Blocks combine with an online softmax (log-sum-exp), so a
  device holds three key/value blocks at a time (its own, the current, the arriving), never the
  whole sequence. Causal: members r and n - 1 - r swap the second halves of their query blocks
  first (and the outputs back after), so every member has the same work (``zigzag``).

Both differentiate through their collectives (``ops/exchange.py``): the ring's backward runs the
ring again, carrying the key/value gradients home.
"""

from __future__ import annotations

import math

import torch
from torch._C._distributed_c10d import AllToAllOptions

from .exchange import exchange


def sequence_pieces(spec, coord: tuple, ulysses_dim) -> list:
    """(first position, length) along the sequence of each piece a device holds, in order: its
    own block, or with Ulysses its group's blocks, gathered in rank order. A block is one piece,
    or one per segment of a sub-split sequence."""
    return [piece for member in member_pieces(spec, coord, ulysses_dim) for piece in member]


def member_pieces(spec, coord: tuple, ulysses_dim) -> list:
    """The sequence pieces of each block ``sequence_pieces`` joins: this device's, or those of
    its Ulysses group's members in rank order."""
    seq = len(spec.shape) - 2
    coords = [coord] if ulysses_dim is None else [
        coord[:ulysses_dim] + (j,) + coord[ulysses_dim + 1:]
        for j in range(spec.mesh.shape[ulysses_dim])]
    return [spec.local_pieces(c)[seq] for c in coords]


def all_to_all(pg, x, split_dim: int, split_sizes: list, cat_dim: int, cat_sizes: list):
    """Chunk j of ``x`` along ``split_dim`` goes to rank j; rank j's chunk is ``cat_sizes[j]``
    long along ``cat_dim``, and the received chunks join there. Its gradient goes back by the
    same exchange with the two dims swapped."""
    return exchange(x, lambda t: _send_chunks(pg, t, split_dim, split_sizes, cat_dim, cat_sizes),
                    lambda g: _send_chunks(pg, g, cat_dim, cat_sizes, split_dim, split_sizes))


def _send_chunks(pg, x, split_dim: int, split_sizes: list, cat_dim: int, cat_sizes: list):
    """``all_to_all``'s exchange. gloo and NCCL move equal chunks: each is padded to the
    largest and cut back."""
    n, rank = pg.size(), pg.rank()
    if max(cat_sizes) == 0 or max(split_sizes) == 0:  # every rank sees the same sizes
        shape = list(x.shape)
        shape[split_dim], shape[cat_dim] = split_sizes[rank], sum(cat_sizes)
        return x.new_empty(shape)
    send = torch.stack([_pad(_pad(c, split_dim, max(split_sizes)), cat_dim, max(cat_sizes))
                        for c in x.split(split_sizes, split_dim)])
    recv = torch.empty_like(send)
    pg.alltoall_base(recv, send, [], [], AllToAllOptions()).wait()
    return torch.cat([recv[j].narrow(split_dim, 0, split_sizes[rank]).narrow(cat_dim, 0,
                                                                             cat_sizes[j])
                      for j in range(n)], cat_dim)


def _pad(t, dim: int, size: int):
    if t.shape[dim] == size:
        return t
    shape = list(t.shape)
    shape[dim] = size - t.shape[dim]
    return torch.cat([t, t.new_zeros(shape)], dim)


def ring_attention(pg, rank: int, query, key, value, q_blocks: list, k_blocks: list,
                   is_causal: bool, scale: float):
    """This ring member's query block over every member's key/value block; ``q_blocks[i]`` and
    ``k_blocks[i]`` are member i's pieces (``sequence_pieces``); ``pg`` None is a ring of one. With
    causal masking a block's work grows with its positions, so members r and n - 1 - r first
    swap the second halves of their query blocks (each then holds an early and a late half:
    the same work, zigzag's balance) and swap the outputs back at the end; key and value
    blocks stay as they are. Differentiable (``_Ring``, ``_swap``)."""
    peer = (1 if pg is None else pg.size()) - 1 - rank
    if not is_causal or peer == rank:
        return _Ring.apply(query, key, value, pg, rank, q_blocks[rank], k_blocks, is_causal,
                           scale)
    keep, pieces, sent, received = zigzag(q_blocks, rank)
    query = torch.cat([query.narrow(-2, 0, keep), _swap(
        pg, rank, peer, query.narrow(-2, keep, query.shape[-2] - keep), received, sent)], -2)
    out = _Ring.apply(query, key, value, pg, rank, pieces, k_blocks, is_causal, scale)
    return torch.cat([out.narrow(-2, 0, keep), _swap(
        pg, rank, peer, out.narrow(-2, keep, out.shape[-2] - keep), sent, received)], -2)


def zigzag(q_blocks: list, rank: int) -> tuple:
    """The balanced layout of ring member ``rank``'s queries: (how many of its own positions
    it keeps, the pieces it then holds, the pieces it sends to member n - 1 - rank, the pieces
    it receives from it): its own block's first half and the peer's second half."""
    peer = len(q_blocks) - 1 - rank
    keep = sum(length for _, length in q_blocks[rank]) // 2
    own, sent = _cut(q_blocks[rank], keep)
    _, received = _cut(q_blocks[peer], sum(length for _, length in q_blocks[peer]) // 2)
    return keep, own + received, sent, received


def _cut(pieces: list, first: int) -> tuple:
    """``pieces`` split after their first ``first`` positions: (those, the rest)."""
    head, tail = [], []
    for start, length in pieces:
        take = max(0, min(length, first))
        first -= take
        if take:
            head.append((start, take))
        if length > take:
            tail.append((start + take, length - take))
    return head, tail


def _swap(pg, rank: int, peer: int, send, recv_pieces: list, send_pieces: list):
    """Sends ``send`` (``send_pieces``) to ``peer`` and returns what it sends back
    (``recv_pieces`` long along the sequence); the gradient swaps back."""
    length = sum(n for _, n in recv_pieces)
    return exchange(send, lambda t: _swap_blocks(pg, rank, peer, t, length),
                    lambda g: _swap_blocks(pg, rank, peer, g, send.shape[-2]))


def _swap_blocks(pg, rank: int, peer: int, send, length: int):
    """``_swap``'s exchange; the lower rank sends first, as in ``_hop``."""
    recv = send.new_empty((*send.shape[:-2], length, send.shape[-1]))
    works = []
    for sending in (True, False) if rank < peer else (False, True):
        if sending and send.numel():
            works.append(pg.send([send.contiguous()], peer, 0))
        elif not sending and recv.numel():
            works.append(pg.recv([recv], peer, 0))
    for work in works:
        work.wait()
    return recv


class _Ring(torch.autograd.Function):
    """The ring of ``ring_attention`` without the zigzag swaps: ``(query, key, value, pg, rank,
    query pieces, every member's key pieces, is_causal, scale) -> output``. The backward runs
    the ring again (``_ring_backward``): no device holds more than its own blocks and the
    travelling ones, in the forward or the backward."""

    @staticmethod
    def forward(ctx, query, key, value, pg, rank, pieces, k_blocks, is_causal, scale):
        softmax = OnlineSoftmax(query, pieces, is_causal, scale)
        _ring(pg, rank, key, value, k_blocks, softmax)
        out = softmax.result()
        ctx.save_for_backward(query, key, value, out, softmax.lse)
        ctx.ring = pg, rank, pieces, k_blocks, is_causal, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        return (*_ring_backward(*ctx.ring, *ctx.saved_tensors, grad.contiguous()),
                None, None, None, None, None, None)


def _ring(pg, rank: int, key, value, blocks: list, softmax) -> None:
    """Adds every ring member's key/value block to ``softmax``: at step s this device holds
    rank (rank - s)'s block, sends it on to rank + 1 and receives the next from rank - 1. The
    hop is posted before the block is computed, so a device holds its own block, the one it
    computes on and the one arriving: three blocks, whatever the ring's size."""
    n = 1 if pg is None else pg.size()
    current = key, value
    for step in range(n):
        src = (rank - step) % n
        if step < n - 1:
            incoming = _arriving(current, blocks[(src - 1) % n])
            hops = _hop(pg, rank, current, incoming)
        softmax.add(*current, blocks[src])
        if step < n - 1:
            for work in hops:
                work.wait()
            current = incoming


def _ring_backward(pg, rank: int, pieces: list, blocks: list, is_causal: bool, scale: float,
                   query, key, value, out, lse, grad) -> tuple:
    """The gradients of (query, key, value) of ``_Ring``: the key/value blocks go round the
    ring again, as in the forward, each followed by its gradient so far: at step s this
    device adds its queries' share to block (rank - s)'s gradient and passes it on to
    rank + 1 with the block, so after n steps every block's gradient returns, whole, to its
    owner. Each block pair's share is torch's flash-attention backward of that pair with the
    whole row's output and log-sum-exp (``_block_backward``)."""
    n = 1 if pg is None else pg.size()
    acc = lse.dtype
    d_query = torch.zeros_like(query, dtype=acc)
    current = key, value
    d_current = torch.zeros_like(key, dtype=acc), torch.zeros_like(value, dtype=acc)
    for step in range(n):
        src = (rank - step) % n
        if step < n - 1:
            incoming = _arriving(current, blocks[(src - 1) % n])
            hops = _hop(pg, rank, current, incoming)
        for (qo, ql, ko, kl, causal) in _pairs(pieces, blocks[src], is_causal):
            rows = slice(qo, qo + ql)
            dq, dk, dv = _block_backward(
                query[..., rows, :], current[0].narrow(-2, ko, kl),
                current[1].narrow(-2, ko, kl), out[..., rows, :], lse[..., rows],
                grad[..., rows, :], scale, causal)
            d_query[..., rows, :] += dq
            d_current[0].narrow(-2, ko, kl).add_(dk)
            d_current[1].narrow(-2, ko, kl).add_(dv)
        if n > 1:  # the block's gradient follows it: to rank + 1, the next from rank - 1
            for work in hops if step < n - 1 else ():
                work.wait()
            owner = (src - 1) % n if step < n - 1 else rank
            arriving = _arriving(d_current, blocks[owner])
            for work in _hop(pg, rank, d_current, arriving, first_tag=2):
                work.wait()
            d_current = arriving
            if step < n - 1:
                current = incoming
    return (d_query.to(query.dtype), d_current[0].to(key.dtype),
            d_current[1].to(value.dtype))


def _arriving(blocks: tuple, pieces: list) -> tuple:
    """Empty tensors like ``blocks`` for a block of ``pieces`` along the sequence."""
    length = sum(size for _, size in pieces)
    return tuple(t.new_empty((*t.shape[:-2], length, t.shape[-1])) for t in blocks)


def _hop(pg, rank: int, sends: tuple, recvs: tuple, first_tag: int = 0) -> list:
    """Posts this device's sends to rank + 1 and receives from rank - 1: even ranks send first,
    odd ranks receive first, so a backend whose point-to-point calls between two ranks run in
    order (NCCL) never waits in a cycle. An empty block travels as nothing (both ends know)."""
    n, works = pg.size(), []
    for sending in (True, False) if rank % 2 == 0 else (False, True):
        for tag, (send, recv) in enumerate(zip(sends, recvs), first_tag):
            if sending and send.numel():
                works.append(pg.send([send.contiguous()], (rank + 1) % n, tag))
            elif not sending and recv.numel():
                works.append(pg.recv([recv], (rank - 1) % n, tag))
    return works


class OnlineSoftmax:
    """Attention of a query block over key blocks added one at a time: per query row the output
    so far and the log-sum-exp of its scores, in float32 (float64 for float64); a new block's
    output is weighted in by ``exp(lse_block - lse)``, which is softmax over all keys seen."""

    def __init__(self, query, pieces: list, is_causal: bool, scale: float):
        self.query, self.pieces, self.causal, self.scale = query, pieces, is_causal, scale
        self.acc = torch.float64 if query.dtype == torch.float64 else torch.float32
        self.out = None
        self.lse = query.new_full(query.shape[:-1], -math.inf, dtype=self.acc)

    def add(self, key, value, key_pieces: list) -> None:
        if self.out is None:
            self.out = self.query.new_zeros((*self.query.shape[:-1], value.shape[-1]),
                                            dtype=self.acc)
        for qo, ql, ko, kl, causal in _pairs(self.pieces, key_pieces, self.causal):
            self._merge(qo, ql, *_block(self.query.narrow(-2, qo, ql), key.narrow(-2, ko, kl),
                                        value.narrow(-2, ko, kl), self.scale, causal))

    def _merge(self, start: int, length: int, out, lse) -> None:
        old_out, old_lse = self.out.narrow(-2, start, length), self.lse.narrow(-1, start, length)
        new = torch.logaddexp(old_lse, lse)  # a row's first block: old_lse is -inf, weight 0
        old_out.mul_(torch.exp(old_lse - new).unsqueeze(-1))
        out = out.to(self.acc)  # the block kernel's own result: scaled in place
        old_out.add_(out.mul_(torch.exp(lse - new).unsqueeze(-1)))
        old_lse.copy_(new)

    def result(self):
        return self.out.to(self.query.dtype)


def _pairs(q_pieces: list, k_pieces: list, causal: bool):
    """The (query offset, length, key offset, length, causal) of every part of a query block
    (``q_pieces``) that attends to a key block (``k_pieces``), offsets within the blocks."""
    q_start = 0
    for q_piece in q_pieces:
        k_start = 0
        for k_piece in k_pieces:
            for qo, ql, ko, kl, part_causal in _visible(q_piece, k_piece, causal):
                yield q_start + qo, ql, k_start + ko, kl, part_causal
            k_start += k_piece[1]
        q_start += q_piece[1]


def _visible(q: tuple, k: tuple, causal: bool) -> list:
    """The parts of query positions ``[a, a + lq)`` over key positions ``[b, b + lk)`` that
    attend, as (query offset, query length, key offset, key length, causal) within the two
    pieces: without causal masking the whole; with it, the keys before every query (whole)
    and the keys from the first query that sees them on (torch's top-left causal triangle;
    every query row there sees its first key). Keys after the last query: nothing."""
    (a, lq), (b, lk) = q, k
    if lq == 0 or lk == 0:
        return []
    if not causal:
        return [(0, lq, 0, lk, False)]
    first = max(a, b)
    parts = [(0, lq, 0, min(a, b + lk) - b, False)] if b < a else []
    end = min(b + lk, a + lq)
    if end > first:
        parts.append((first - a, a + lq - first, first - b, end - first, True))
    return parts


def _block(q, k, v, scale: float, causal: bool):
    """(output, log-sum-exp) of one query block over one key block, causal top-left. On CPU
    torch's flash kernel (O(L) memory) where the value's embedding is the query's; else (and
    on CUDA) float32 scores, float64 for float64 (the block's (L / ring)^2 of them)."""
    if k.shape[-3] != q.shape[-3]:  # GQA: the block kernels take one key head per query head
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], -3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], -3)
    if q.device.type == "cpu" and q.shape[-1] == v.shape[-1]:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    scores = q.to(acc) @ k.to(acc).transpose(-2, -1) * scale
    if causal:
        rows, cols = (torch.arange(n, device=q.device) for n in scores.shape[-2:])
        scores = scores.masked_fill(cols > rows.unsqueeze(-1), -math.inf)
    lse = scores.logsumexp(-1)
    return torch.softmax(scores, -1) @ v.to(acc), lse


def _block_backward(q, k, v, out, lse, grad, scale: float, causal: bool) -> tuple:
    """The gradients of (q, k, v) of one block pair, as ``_block`` computed it, given the
    whole rows' output and log-sum-exp: the scores' softmax over every key is
    ``exp(s - lse)``, so each pair's share is computed on its own and the shares add up."""
    group = q.shape[-3] // k.shape[-3]
    if group > 1:
        k, v = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
    if q.device.type == "cpu" and q.shape[-1] == v.shape[-1]:  # as _block: torch's flash
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(),
            lse.to(q.dtype if q.dtype == torch.float64 else torch.float32).contiguous(), 0.0,
            causal, scale=scale)
    else:
        acc = lse.dtype
        q, k, v, out, grad = (t.to(acc) for t in (q, k, v, out, grad))
        scores = q @ k.transpose(-2, -1) * scale
        if causal:
            rows, cols = (torch.arange(n, device=q.device) for n in scores.shape[-2:])
            scores = scores.masked_fill(cols > rows.unsqueeze(-1), -math.inf)
        p = torch.exp(scores - lse.unsqueeze(-1))
        dv = p.transpose(-2, -1) @ grad
        ds = p * (grad @ v.transpose(-2, -1) - (grad * out).sum(-1, keepdim=True))
        dq, dk = ds @ k * scale, ds.transpose(-2, -1) @ q * scale
    if group > 1:
        dk, dv = (d.unflatten(-3, (-1, group)).sum(-3) for d in (dk, dv))
    return dq, dk, dv
