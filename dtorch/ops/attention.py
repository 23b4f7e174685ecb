"""Attention (``dtorch.nn.functional.scaled_dot_product_attention``) and its context parallelism.

query (..., Hq, L, E), key (..., Hk, S, E), value (..., Hk, S, Ev) -> (..., Hq, L, Ev); the mask
broadcasts to (..., Hq, L, S). Each (batch, head) pair attends on its own, so the leading dims
shard alike and every device runs torch's own attention on its block.

A sequence sharded on a mesh dim that ``SdpaOption`` names for context parallelism (CP) is the
one case where attention communicates, inside one kernel on the communication stream
(``_context_parallel_attention``), and the output keeps the query's placements:

- **Ulysses** (``ulysess_cp``): an all-to-all turns the sequence blocks into head blocks, so each
  device attends over the whole sequence for ``1/n`` of the heads, and a second all-to-all turns
  them back. With GQA the key/value heads are sharded too when they divide by ``n`` (query head
  block r reads key head block r), else repeated first.
- **Ring** (``ring_cp``): each device keeps its query block while the key/value blocks travel
  around the ring by point-to-point send/recv, the next hop posted before the current block is
  computed so they overlap. Blocks combine with an online softmax (log-sum-exp), so a device
  holds three key/value blocks at a time (its own, the current, the arriving), never the whole
  sequence. Causal: members r and n - 1 - r swap the second halves of their query blocks first
  (and the outputs back after), so every member has the same work.
- Both: Ulysses over its dim, the ring over the other, on what Ulysses gathered.

Causal masking works on global positions: a device knows, from the specs, which sequence range
every block holds (``array_split`` blocks, uneven ones too; with Ulysses a device holds the ranges
of its group's blocks, contiguous or not). Keys before every query of a range are attended
whole, keys after all of them are skipped, and the overlap is torch's top-left causal triangle.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
from torch._C._distributed_c10d import AllToAllOptions

from ..placement import Replicate, Shard, chunk_sizes
from ..type import ULYSSES_CP, SdpaOption
from .exchange import exchange
from .registry import COMM, OpDef, issue, register
from .rules import LINEAR_PARTIALS, Placed, expand

R = Replicate()


# -- placement rules ------------------------------------------------------------------------------


def attention_rule(call) -> Placed:
    """A leading dim sharded alike in every operand of its full size (one that broadcasts it
    stays Replicate) shards the output there. With GQA (Hk < Hq), query head h reads key head
    h // (Hq / Hk): the query heads may shard with key and value heads Replicate (each device
    picks its heads' keys, ``_kv_heads``), or with them sharded too where every device's block of
    key heads is the one its query heads read. The output is linear in value: a Partial value
    with the rest Replicate gives a Partial."""
    placed = expand(call, _rows(call))
    _check_head_blocks(call)
    return placed


def _rows(call) -> list:
    out = call.outs[0][0]
    shapes = [s.shape for s in call.tensors]
    gqa = shapes[1][-3:-2] != shapes[0][-3:-2]
    rows = []
    for d in range(len(out) - 2):
        ins = [_along(shape, d, out) for shape in shapes]
        if gqa and d == len(out) - 3:
            kv = Shard(len(shapes[1]) - 3)
            if all(p is not None for p in (ins[0], *ins[3:])):
                rows.append(((Shard(d),), (ins[0], kv, kv, *ins[3:])))
            ins[1] = ins[2] = R
        if all(ins) and any(p != R for p in ins):  # None: a size neither full nor 1
            rows.append(((Shard(d),), tuple(ins)))
    for p in LINEAR_PARTIALS:
        rows.append(((p,), tuple(p if k == 2 else R for k in range(len(shapes)))))
    return rows


def _along(shape, d, out):
    """An operand's placement when the output's dim ``d`` is sharded: Shard of its matching dim,
    Replicate where it broadcasts (missing or size 1), None where it can do neither."""
    di = d - (len(out) - len(shape))
    if di >= 0 and shape[di] == out[d]:
        return Shard(di)
    return R if di < 0 or shape[di] == 1 else None


def _check_head_blocks(call) -> None:
    """Sharded GQA key heads must be, on every device, the block its query heads read."""
    q, k = call.tensors[:2]
    if len(q.shape) < 3 or not any(p == Shard(len(k.shape) - 3) for p in k.placements):
        return
    group = q.shape[-3] // k.shape[-3]
    for coord in itertools.product(*map(range, call.mesh.shape)):
        (qs, qo), (ks, ko) = (_heads(s.local_region(coord)) for s in (q, k))
        if qo != ko * group or qs != ks * group:
            kv = [R if p == Shard(len(k.shape) - 3) else p for p in k.placements]
            raise ValueError(
                f"dtorch.{call.op.name}: the key/value head blocks ({k.shape[-3]} heads) do not "
                f"line up with the query head blocks ({q.shape[-3]} heads) they serve: the mesh "
                f"dims that shard heads must divide both counts. Replicate the key/value heads, "
                f"e.g. key = key.redistribute(placements={kv!r}) (and value alike)")


def _heads(region) -> tuple:
    """(count, first) of the heads dim (-3) of a ``local_region``."""
    shape, offsets = region
    return shape[-3], offsets[-3]


def cp_attention_rule(call) -> Placed:
    """``attention_rule`` plus the sequence: ``S(seq)`` in query, key and value on the CP dims
    (and only there) gives the query's ``S(seq)``."""
    q, k, v = call.tensors
    cp = {call.static["ulysses_dim"], call.static["ring_dim"]} - {None}
    seq = Shard(len(q.shape) - 2), Shard(len(k.shape) - 2), Shard(len(v.shape) - 2)
    for i in range(len(call.mesh.shape)):
        if ((q.placements[i], k.placements[i], v.placements[i]) == seq) != (i in cp):
            raise ValueError(f"dtorch.scaled_dot_product_attention: query, key and value must be "
                             f"sharded along the sequence exactly on the context-parallel mesh "
                             f"dims {sorted(cp)}; mesh dim {i} is not")
    placed = expand(call, _rows(call) + [((seq[0],), seq)])
    _check_head_blocks(call)
    return placed


# -- kernels --------------------------------------------------------------------------------------


def _kv_heads(ctx, query, key, value):
    """The key and value heads this device's query heads read, so that local query head h reads
    local key head h // (hq / hk) as torch's GQA does (globally head h reads h // (Hq / Hk)):
    the device's own block when it is that, else the block narrowed, else one key head per
    query head."""
    q_spec, k_spec = ctx.in_specs[0], ctx.in_specs[1]
    if query.dim() < 3 or key.dim() < 3:
        return key, value
    group = q_spec.shape[-3] // k_spec.shape[-3]
    (qs, qo), (ks, ko) = (_heads(s.local_region(ctx.coord)) for s in (q_spec, k_spec))
    if qo == ko * group and qs == ks * group:
        return key, value
    if qo % group == 0 and qs % group == 0:
        return key.narrow(-3, qo // group - ko, qs // group), value.narrow(-3, qo // group - ko,
                                                                          qs // group)
    heads = torch.arange(qo, qo + qs, device=key.device) // group - ko
    return key.index_select(-3, heads), value.index_select(-3, heads)


def _attention(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *,
               scale=None, enable_gqa=False):
    """torch's own, on this device's heads (``_kv_heads``)."""
    if enable_gqa:
        key, value = _kv_heads(ctx, query, key, value)
    return F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal,
                                          scale=scale, enable_gqa=enable_gqa)


def _refuse_dropout(dropout_p) -> None:
    if dropout_p > 0:
        raise NotImplementedError("dtorch.scaled_dot_product_attention: dropout_p > 0 is not "
                                  "supported yet; apply dtorch.nn.functional.dropout to the "
                                  "attention weights of an explicit softmax(q @ k.T) @ v")


def _attention_meta(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *,
                    scale=None, enable_gqa=False):
    _refuse_dropout(dropout_p)
    # torch's meta kernel refuses a mask with is_causal, which its CPU kernel combines (a mask
    # and the causal triangle): the shapes are the same either way
    causal = is_causal and attn_mask is None
    return F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, causal,
                                          scale=scale, enable_gqa=enable_gqa)


def _cp_attention(ctx, query, key, value, is_causal=False, scale=None, enable_gqa=False,
                  ulysses_dim=None, ring_dim=None):
    """This device's query block attended over the whole sequence: the Ulysses exchange (heads
    for sequence) over ``ulysses_dim``, the ring over ``ring_dim``, the exchange back."""
    q_spec, k_spec = ctx.in_specs[0], ctx.in_specs[1]
    coord = tuple(ctx.coord)
    key, value = _kv_heads(ctx, query, key, value)
    scale = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
    if ulysses_dim is not None:
        ulysses, _ = ctx.group(ulysses_dim)
        n = ulysses.size()
        if key.shape[-3] % n:  # key heads that do not shard like the query's: one per query head
            key = key.repeat_interleave(query.shape[-3] // key.shape[-3], -3)
            value = value.repeat_interleave(query.shape[-3] // value.shape[-3], -3)
        q_lens = [length for _, length in _pieces(q_spec, coord, ulysses_dim)]
        k_lens = [length for _, length in _pieces(k_spec, coord, ulysses_dim)]
        query = _all_to_all(ulysses, query, -3, [query.shape[-3] // n] * n, -2, q_lens)
        key = _all_to_all(ulysses, key, -3, [key.shape[-3] // n] * n, -2, k_lens)
        value = _all_to_all(ulysses, value, -3, [value.shape[-3] // n] * n, -2, k_lens)
    if ring_dim is None:  # a ring of one
        out = ring_attention(None, 0, query, key, value, [_pieces(q_spec, coord, ulysses_dim)],
                             [_pieces(k_spec, coord, ulysses_dim)], is_causal, scale)
    else:
        pg, rank = ctx.group(ring_dim)
        members = [coord[:ring_dim] + (i,) + coord[ring_dim + 1:] for i in range(pg.size())]
        out = ring_attention(pg, rank, query, key, value,
                             [_pieces(q_spec, c, ulysses_dim) for c in members],
                             [_pieces(k_spec, c, ulysses_dim) for c in members], is_causal, scale)
    if ulysses_dim is not None:
        out = _all_to_all(ulysses, out, -2, q_lens, -3, [out.shape[-3]] * n)
    return out


def _pieces(spec, coord: tuple, ulysses_dim) -> list:
    """(first position, length) along the sequence of each piece a device holds, in order: its
    own block, or with Ulysses its group's blocks, gathered in rank order."""
    seq = len(spec.shape) - 2
    coords = [coord] if ulysses_dim is None else [
        coord[:ulysses_dim] + (j,) + coord[ulysses_dim + 1:]
        for j in range(spec.mesh.shape[ulysses_dim])]
    pieces = []
    for c in coords:
        shape, offsets = spec.local_region(c)
        pieces.append((offsets[seq], shape[seq]))
    return pieces


def _all_to_all(pg, x, split_dim: int, split_sizes: list, cat_dim: int, cat_sizes: list):
    """Chunk j of ``x`` along ``split_dim`` goes to rank j; rank j's chunk is ``cat_sizes[j]``
    long along ``cat_dim``, and the received chunks join there. Its gradient goes back by the
    same exchange with the two dims swapped."""
    return exchange(x, lambda t: _send_chunks(pg, t, split_dim, split_sizes, cat_dim, cat_sizes),
                    lambda g: _send_chunks(pg, g, cat_dim, cat_sizes, split_dim, split_sizes))


def _send_chunks(pg, x, split_dim: int, split_sizes: list, cat_dim: int, cat_sizes: list):
    """``_all_to_all``'s exchange. gloo and NCCL move equal chunks: each is padded to the
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
    ``k_blocks[i]`` are member i's pieces (``_pieces``); ``pg`` None is a ring of one. With
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


def _cp_meta(query, key, value, is_causal=False, scale=None, enable_gqa=False, ulysses_dim=None,
             ring_dim=None):
    return F.scaled_dot_product_attention(query, key, value, None, 0.0, is_causal, scale=scale,
                                          enable_gqa=enable_gqa)


def _cp_comm_dims(in_specs, ulysses_dim=None, ring_dim=None, **static) -> tuple:
    return tuple(d for d in (ulysses_dim, ring_dim) if d is not None)


# -- the front ------------------------------------------------------------------------------------


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False, sdpa_option=None):
    """``torch.nn.functional.scaled_dot_product_attention``, with DTorch's ``sdpa_option``
    (``SdpaOption``: the mesh dims of context parallelism). A query sharded along its sequence
    (``Shard(ndim - 2)``) on a mesh dim the option names (``"ulysess_cp"``, also spelled
    ``"ulysses_cp"``, ``"ring_cp"``, or an index; a dim of one device is none) runs context
    parallelism there: key and value must be sharded alike there, and there is no ``attn_mask``
    (``is_causal`` masks by global position). The output has the query's placements.

    >>> import dtorch, torch
    >>> mesh = dtorch.DeviceMesh("cpu", [0, 1], mesh_dim_names=["ring_cp"])
    >>> q = torch.randn(1, 2, 7, 4, generator=torch.Generator().manual_seed(0))
    >>> x = dtorch.from_torch(q, device_mesh=mesh, placements=[dtorch.Shard(2)])
    >>> F = dtorch.nn.functional
    >>> y = F.scaled_dot_product_attention(x, x, x, is_causal=True)
    >>> want = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    >>> y.placements, torch.allclose(y.to_torch(), want, atol=1e-6)
    ([Shard(dim=2)], True)
    """
    option = SdpaOption() if sdpa_option is None else sdpa_option
    option.check_valid()
    ulysses = _cp_dim(query, option.ulysess_cp_dim)
    ring = _cp_dim(query, option.ring_cp_dim)
    if ulysses is None and ring is None:
        return issue("scaled_dot_product_attention", (query, key, value, attn_mask),
                     (dropout_p, is_causal, scale, enable_gqa))
    if ulysses == ring:
        raise ValueError(f"dtorch.scaled_dot_product_attention: sdpa_option names mesh dim "
                         f"{ring} for both Ulysses and Ring context parallelism; name two dims, "
                         f"or set one of them None")
    _check_cp(query, key, value, attn_mask, dropout_p, ulysses, ring)
    return issue("_context_parallel_attention", (query, key, value),
                 (is_causal, scale, enable_gqa, ulysses, ring))


def _cp_dim(query, dim):
    """The mesh dim an SdpaOption field names when CP runs there: the mesh has it (a name or an
    index), of more than one device, and the query's sequence is sharded on it."""
    mesh = query.device_mesh
    if dim is None or isinstance(dim, int):
        i = None if dim is None or not -mesh.ndim <= dim < mesh.ndim else dim % mesh.ndim
    else:
        names = list(mesh.dim_names or ())
        spellings = (dim, ULYSSES_CP, "ulysses_cp") if dim in (ULYSSES_CP, "ulysses_cp") \
            else (dim,)
        i = next((names.index(n) for n in spellings if n in names), None)
    if i is None or mesh.shape[i] == 1 or query.placements[i] != Shard(query.ndim - 2):
        return None
    return i


def _check_cp(query, key, value, attn_mask, dropout_p, ulysses, ring) -> None:
    """What context parallelism needs, refused at the call with the fix."""
    _refuse_dropout(dropout_p)
    mesh = query.device_mesh
    cp = [d for d in (ulysses, ring) if d is not None]
    dims = ", ".join(f"{d} ({(mesh.dim_names or [None] * mesh.ndim)[d]!r})" for d in cp)
    whole = [R if i in cp else p for i, p in enumerate(query.placements)]
    where = f"the query's sequence is sharded on the context-parallel mesh dim(s) {dims}"
    if attn_mask is not None:
        raise ValueError(f"dtorch.scaled_dot_product_attention: {where}, which takes no "
                         f"attn_mask (each device would need the mask's columns for the whole "
                         f"sequence); pass is_causal=True for a causal mask, or make the "
                         f"sequence whole first: query = query.redistribute(placements="
                         f"{whole!r}) (and key, value alike)")
    if query.ndim < 3:
        raise ValueError(f"dtorch.scaled_dot_product_attention: {where}, which needs a heads "
                         f"dim: (..., heads, sequence, embedding), got {query.ndim} dims")
    if key.device_mesh != mesh or value.device_mesh != mesh:
        raise ValueError(f"dtorch.scaled_dot_product_attention: {where}; key and value must be "
                         f"on the query's mesh")
    for name, t in (("key", key), ("value", value)):
        seq = Shard(t.ndim - 2)
        if any(t.placements[d] != seq for d in cp):
            fix = [seq if i in cp else p for i, p in enumerate(t.placements)]
            raise ValueError(f"dtorch.scaled_dot_product_attention: {where}, so query, key and "
                             f"value must all be sharded along their sequence there; {name} "
                             f"is {list(t.placements)}. E.g. {name} = {name}.redistribute("
                             f"placements={fix!r})")
    for name, t in (("query", query), ("key", key), ("value", value)):
        other = [i for i, p in enumerate(t.placements) if p == Shard(t.ndim - 2) and i not in cp]
        if other:
            fix = [R if i in other else p for i, p in enumerate(t.placements)]
            raise ValueError(f"dtorch.scaled_dot_product_attention: {where}; {name}'s sequence "
                             f"is also sharded on mesh dim(s) {other}, which sdpa_option does "
                             f"not name. E.g. {name} = {name}.redistribute(placements={fix!r})")
    if ulysses is not None:
        n, heads = mesh.shape[ulysses], {query.shape[-3]}
        for i, p in enumerate(query.placements):  # the heads each device holds
            if p == Shard(query.ndim - 3):
                heads = {c for h in heads for c in chunk_sizes(h, mesh.shape[i])}
        if any(h % n for h in heads):
            local = "" if heads == {query.shape[-3]} else \
                f" (a device holds {sorted(heads)} of them after the mesh dims that shard heads)"
            raise ValueError(f"attention heads({query.shape[-3]}, {key.shape[-3]}) cannot be "
                             f"divided evenly by ulysess_cp_size({n}){local}")


# the option names mesh dims: a front (DTorch's raw op ``_scaled_dot_product_attention`` too)
register(OpDef("scaled_dot_product_attention",
               "scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor, "
               "attn_mask: Tensor = None, dropout_p=0.0, is_causal=False, *, scale=None, "
               "enable_gqa=False)", _attention, attention_rule, meta=_attention_meta,
               uses_context=True, functional=True, function=False,
               front=scaled_dot_product_attention))
register(OpDef("_scaled_dot_product_attention",
               "_scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor, "
               "attn_mask: Tensor = None, dropout_p=0.0, is_causal=False, scale=None, "
               "enable_gqa=False, sdpa_option=None)", None, None,
               front=scaled_dot_product_attention, function=False, functional=True))
# what the front issues for a sequence sharded on CP dims; one kernel on the communication
# stream, whose failures its CP groups agree on
register(OpDef("_context_parallel_attention",
               "_context_parallel_attention(query: Tensor, key: Tensor, value: Tensor, "
               "is_causal=False, scale=None, enable_gqa=False, ulysses_dim=None, ring_dim=None)",
               _cp_attention, cp_attention_rule, meta=_cp_meta, uses_context=True, flags=COMM,
               comm_dims=_cp_comm_dims, comm_grad=True, function=False))
