"""Expert parallelism: ``moe_experts``, the dispatch, expert MLPs and combine of a
mixture-of-experts layer as one operator (``dtorch.nn.functional.moe_experts``).

Why one operator. The tokens an expert receives depend on the router's values, so the buffers
between dispatch and combine have data-dependent shapes, while the client must know every
tensor's global shape when it issues an op. Splitting the layer at those buffers would need the
client to read the per-expert token counts (one round trip per MoE layer, which drains the
pipeline the client runs ahead of) and a receive layout padded to the largest device's count.
Here the data-dependent part lives inside one host kernel whose operands and result have known
shapes: ``input [T, d]`` in, ``[T, d]`` out. The kernel exchanges the counts itself (a small
all-to-all of ``[ep, experts per device]`` int64), sends each token to its experts' devices with
``all_to_all_single`` of variable split sizes (gloo's ``alltoallv``), runs the local experts, sends
the rows back along the reverse splits and sums each token's k rows weighted. No sync, no
padding, no dropped tokens (dropless: no capacity factor).

Operands: ``input [T, d]``; ``indices [T, k]`` (int64 expert ids) and ``weights [T, k]`` (gate
values, any float dtype: multiplied in ``input``'s dtype) from the router; the experts stacked as
Mixtral's SwiGLU MLP ``y = w2 (silu(w1 x) * (w3 x))``: ``w1, w3 [E, f, d]``, ``w2 [E, d, f]``.

Placements, per mesh dim:

| mesh dim | experts ``w1, w3, w2`` | tokens ``input, indices, weights`` | result |
|---|---|---|---|
| expert parallel (at most one) | ``S(0), S(0), S(0)`` | ``S(0)`` (all-to-all dispatch) | ``S(0)`` |
| | | ``R`` (each device its experts' share) | ``P`` |
| tensor parallel in the experts | ``S(1), S(1), S(2)`` (the hidden ``f``) | ``R`` | ``S(1)``, |
| | | | or ``P`` (no dispatch) |
| data parallel, or none | ``R`` | ``S(0)`` | ``S(0)`` |
| | | ``R`` | ``R`` |

The number of experts must divide over the expert-parallel dim (equal blocks: a device's experts
are ``rank * E/ep ...``). Under tensor parallelism every tp rank routes the same tokens and
computes its slice of ``f``; SwiGLU is elementwise in ``f``, so each rank's rows are a Partial
sum over tp. Without a dispatch the combine (linear) keeps that Partial, reduced after as for a
row-parallel MLP. With one, the tp ranks of an ep coordinate would send the same rows tp times
over ep; instead each sends its block of the ``d`` columns (uneven blocks too), the receivers
all-gather the columns over tp before the experts and reduce-scatter the Partial rows over tp
after, each sending its block back: the ep exchange carries ``1/tp`` of the bytes, the extra
traffic stays on tp, and the result is ``S(1)`` on tp. Those tp collectives pad to the largest
row count over tp (one int all-reduce), so a rank whose input failed, which routes its stand-in
zeros differently, still meets its peers. An expert id outside ``[0, E)`` is left out of the
exchange (the peers still take part) and raises ``IndexError`` on its device afterwards.

>>> import dtorch, torch
>>> mesh = dtorch.DeviceMesh("cpu", [0, 1], mesh_dim_names=["ep"])
>>> E, d, f = 4, 3, 5
>>> w1, w3, w2 = torch.randn(E, f, d), torch.randn(E, f, d), torch.randn(E, d, f)
>>> x, idx = torch.randn(6, d), torch.tensor([[0], [3], [3], [1], [2], [3]])
>>> put = lambda t, p: dtorch.from_torch(t, device_mesh=mesh, placements=[p])
>>> y = dtorch.nn.functional.moe_experts(
...     put(x, dtorch.Shard(0)), put(idx, dtorch.Shard(0)), put(torch.ones(6, 1), dtorch.Shard(0)),
...     put(w1, dtorch.Shard(0)), put(w3, dtorch.Shard(0)), put(w2, dtorch.Shard(0)))
>>> ref = torch.stack([w2[e] @ (torch.nn.functional.silu(w1[e] @ t) * (w3[e] @ t))
...                    for t, e in zip(x, idx[:, 0])])
>>> y.placements, torch.allclose(y.to_torch(), ref, atol=1e-5)
([Shard(dim=0)], True)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._C._distributed_c10d import (
    AllreduceOptions,
    AllToAllOptions,
    ReduceOp,
    ReduceScatterOptions,
)

from ..placement import Partial, Replicate, Shard, chunk_sizes
from ..spec import group_devices
from .exchange import exchange
from .registry import COMM, OpDef, register
from .rules import Placed

R = Replicate()
_EXPERTS_EP = (Shard(0), Shard(0), Shard(0))
_EXPERTS_TP = (Shard(1), Shard(1), Shard(2))
_EXPERTS_R = (R, R, R)
_NAMES = ("input", "indices", "weights", "w1", "w3", "w2")


def _row(placements) -> str:
    return ", ".join(map(str, placements))


def expert_dim(placements) -> int | None:
    """The mesh dim the experts are sharded over (``w1`` is ``S(0)`` there), or None."""
    return next((i for i, p in enumerate(placements) if p == Shard(0)), None)


def hidden_dim(placements) -> int | None:
    """The mesh dim the experts' hidden ``f`` is sharded over (``w1`` is ``S(1)``), or None."""
    return next((i for i, p in enumerate(placements) if p == Shard(1)), None)


def _fix(specs, i: int, tokens, experts) -> str:
    todo = []
    for name, spec, want in zip(_NAMES, specs, (*tokens, *experts)):
        if spec.placements[i] != want:
            fix = list(spec.placements)
            fix[i] = want
            todo.append(f"{name} = {name}.redistribute(placements={fix!r})")
    return "; ".join(todo)


def moe_rule(call) -> Placed:
    """The table in the module docstring, one mesh dim at a time (the rows differ by what the
    experts are on a dim, so the generic ``expand`` does not fit)."""
    specs = call.tensors
    if len(specs) != 6:
        raise TypeError("dtorch.moe_experts: every operand must be a dtorch.Tensor")
    mesh = call.mesh
    if any(s.mesh != mesh for s in specs):
        raise ValueError("dtorch.moe_experts: every operand must be on the same device mesh")
    out, ep, tp = [], None, None
    S0 = Shard(0)
    # tokens dispatched over ep: a tp dim then splits the exchanged rows by columns (S(1))
    split = any(tuple(s.placements[i] for s in specs) == (S0,) * 6
                for i in range(len(mesh.shape)))
    for i in range(len(mesh.shape)):
        tokens = tuple(s.placements[i] for s in specs[:3])
        experts = tuple(s.placements[i] for s in specs[3:])
        where = f"mesh dim {i}"
        if experts == _EXPERTS_EP:
            if ep is not None:
                raise ValueError(f"dtorch.moe_experts: the experts are sharded over mesh dims "
                                 f"{ep} and {i}; shard them (S(0)) over one mesh dim only")
            ep = i
            n_experts = specs[3].shape[0]
            if n_experts % mesh.shape[i]:
                raise ValueError(f"dtorch.moe_experts: {n_experts} experts do not divide over "
                                 f"the {mesh.shape[i]} devices of expert-parallel mesh dim {i}; "
                                 f"use a multiple of {mesh.shape[i]} experts")
            if tokens == (S0,) * 3:
                out.append(S0)
                continue
            if tokens == (R,) * 3:
                out.append(Partial())
                continue
            want = (S0,) * 3
        elif experts == _EXPERTS_TP:
            if tp is not None:
                raise ValueError(f"dtorch.moe_experts: the experts' hidden dim is sharded over "
                                 f"mesh dims {tp} and {i}; shard it over one mesh dim only")
            tp = i
            if tokens == (R,) * 3:
                out.append(Shard(1) if split else Partial())
                continue
            want = (R,) * 3
        elif experts == _EXPERTS_R:
            if tokens in ((S0,) * 3, (R,) * 3):
                out.append(tokens[0])
                continue
            want = (S0,) * 3 if S0 in tokens else (R,) * 3
        else:
            raise ValueError(
                f"dtorch.moe_experts: on {where} the experts (w1, w3, w2) are "
                f"({_row(experts)}); expected (S(0), S(0), S(0)) for expert "
                f"parallelism, (S(1), S(1), S(2)) for tensor parallelism in the experts, or "
                f"Replicate; e.g. {_fix(specs, i, tokens, _EXPERTS_R)}")
        raise ValueError(
            f"dtorch.moe_experts: on {where} the tokens (input, indices, weights) are "
            f"({_row(tokens)}) with the experts ({_row(experts)}); "
            f"expected ({_row(want)}); add {_fix(specs, i, want, experts)}")
    return Placed((tuple(out),))


def moe_meta(input, indices, weights, w1, w3, w2):
    """Shapes and dtypes, refused with a clear message; the result is ``input``'s."""
    def bad(msg):
        raise ValueError(f"dtorch.moe_experts: {msg}")

    if input.dim() != 2:
        bad(f"input must be [tokens, hidden], got shape {tuple(input.shape)}")
    T, d = input.shape
    if w1.dim() != 3 or w3.shape != w1.shape:
        bad(f"w1 and w3 must be [experts, ffn, hidden] alike, got {tuple(w1.shape)} and "
            f"{tuple(w3.shape)}")
    E, f, d1 = w1.shape
    if d1 != d:
        bad(f"w1 is [experts, ffn, hidden] = {tuple(w1.shape)}, but the input's hidden size "
            f"is {d}")
    if tuple(w2.shape) != (E, d, f):
        bad(f"w2 must be [experts, hidden, ffn] = {(E, d, f)}, got {tuple(w2.shape)}")
    if indices.dim() != 2 or indices.shape[0] != T:
        bad(f"indices must be [tokens, k] = [{T}, k], got {tuple(indices.shape)}")
    if indices.dtype not in (torch.int64, torch.int32):
        bad(f"indices must be int64 or int32 expert ids, got {indices.dtype}")
    if tuple(weights.shape) != tuple(indices.shape):
        bad(f"weights must have the indices' shape {tuple(indices.shape)}, got "
            f"{tuple(weights.shape)}")
    if not weights.is_floating_point():
        bad(f"weights must be floating point, got {weights.dtype}")
    if not (input.is_floating_point() and w1.dtype == w3.dtype == w2.dtype == input.dtype):
        bad(f"input and experts must share one floating dtype, got {input.dtype}, "
            f"{w1.dtype}, {w3.dtype}, {w2.dtype}")
    return torch.empty((T, d), dtype=input.dtype, device="meta")


def _dims(in_specs) -> tuple:
    """(ep, tp, dispatched): the expert and hidden mesh dims (or None), and whether the tokens
    are dispatched over ep."""
    x, w1 = in_specs[0], in_specs[3]
    ep, tp = expert_dim(w1.placements), hidden_dim(w1.placements)
    return ep, tp, ep is not None and x.placements[ep] == Shard(0)


def moe_comm_dims(in_specs, **static) -> tuple:
    """The expert-parallel dim when tokens are dispatched over it, and then the tp dim too (the
    rows travel split by columns); none otherwise."""
    ep, tp, dispatched = _dims(in_specs)
    if not dispatched:
        return ()
    return (ep,) if tp is None else (ep, tp)


def _most_rows(pg, n: int) -> int:
    """The largest row count over the tp group. The tp ranks of one ep coordinate route the
    same tokens, so they receive the same rows; only a rank whose input failed (it takes part
    with zeros) differs, and padding to the largest keeps the collectives well-formed then (its
    peers poison their results with it)."""
    t = torch.tensor([n], dtype=torch.int64)
    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.MAX
    pg.allreduce([t], opts).wait()
    return int(t)


def _gather_columns(pg, rows, sizes, most):
    """Each tp rank's column block ``[n, sizes[rank]]`` of the same rows -> the whole rows."""
    padded = _pad(rows, most, sizes[0])
    parts = [torch.empty_like(padded) for _ in sizes]
    pg.allgather([parts], [padded]).wait()
    return torch.cat([p[:rows.shape[0], :w] for p, w in zip(parts, sizes)], 1)


def _reduce_scatter_columns(pg, rows, sizes, rank, most):
    """Partial sums ``[n, d]`` over tp -> this rank's column block of the sum (a low-precision
    sum in float32, rounded once, as ``runtime/collectives.py`` reduces)."""
    wide = rows.float() if rows.dtype in (torch.bfloat16, torch.float16) else rows
    blocks = [_pad(b, most, sizes[0]) for b in wide.split(list(sizes), 1)]
    out = torch.empty_like(blocks[0])
    opts = ReduceScatterOptions()
    opts.reduceOp = ReduceOp.SUM
    pg.reduce_scatter([out], [blocks], opts).wait()
    return out[:rows.shape[0], :sizes[rank]].to(rows.dtype)


def _all_to_all(pg, rows, out_splits: list, in_splits: list):
    """Rows ``[sum(in_splits), w]`` sent ``in_splits[j]`` to rank j; ``out_splits[j]`` arrive
    from rank j."""
    recv = rows.new_empty((sum(out_splits), rows.shape[1]))
    pg.alltoall_base(recv, rows.contiguous(), out_splits, in_splits, AllToAllOptions()).wait()
    return recv


def _pad(t, rows: int, cols: int):
    """``t [n, w]`` zero-padded to ``[rows, cols]`` (contiguous)."""
    if tuple(t.shape) == (rows, cols):
        return t.contiguous()
    out = t.new_zeros((rows, cols))
    out[:t.shape[0], :t.shape[1]] = t
    return out


def _swiglu(x, w1, w3, w2):
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


def _moe_experts(ctx, input, indices, weights, w1, w3, w2):
    """This device's block: route its tokens' (token, expert) pairs to the experts' devices,
    run its experts on what it receives, send the rows back and combine."""
    n_experts = ctx.in_specs[3].shape[0]
    ep, tp, dispatched = _dims(ctx.in_specs)
    n_local = w1.shape[0]
    first = 0 if ep is None else ctx.coord[ep] * n_local
    tokens, k = indices.shape
    expert = indices.reshape(-1).long()
    token = torch.arange(tokens, device=input.device).repeat_interleave(k)
    gate = weights.reshape(-1)
    invalid = (expert < 0) | (expert >= n_experts)
    lo, hi = (0, n_experts) if dispatched else (first, first + n_local)
    # pairs this device does not send (local mode: other devices' experts) sort past the end
    skip = invalid | (expert < lo) | (expert >= hi)
    key = torch.where(skip, n_experts, expert)
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=n_experts + 1)[:n_experts]
    order = order[:int(counts.sum())]
    send = input.index_select(0, token[order])
    if dispatched:
        pg, _ = ctx.group(ep)
        n = pg.size()
        send_counts = counts.view(n, n_local).contiguous()
        recv_counts = torch.empty_like(send_counts)
        pg.alltoall_base(recv_counts, send_counts, [], [], AllToAllOptions()).wait()
        in_splits = send_counts.sum(1).tolist()
        out_splits = recv_counts.sum(1).tolist()
        if tp is not None:  # every tp rank sends the same rows: each its block of columns
            tpg, tp_rank = ctx.group(tp)
            widths = chunk_sizes(input.shape[1], tpg.size())
            start = sum(widths[:tp_rank])
            send = send[:, start:start + widths[tp_rank]].contiguous()
        recv = exchange(send, lambda t: _all_to_all(pg, t, out_splits, in_splits),
                        lambda g: _all_to_all(pg, g, in_splits, out_splits))
        if tp is not None:
            most = _most_rows(ctx.device.cpu_group(group_devices(ctx.in_specs[0].mesh, tp,
                                                                 ctx.coord)), recv.shape[0])
            if most:
                recv = exchange(recv, lambda t: _gather_columns(tpg, t, widths, most),
                                lambda g: _reduce_scatter_columns(tpg, g, widths, tp_rank, most))
            else:  # no rows anywhere over tp: whole rows of none (still in the graph)
                recv = F.pad(recv, (start, input.shape[1] - start - recv.shape[1]))
        # received: by source device, then by local expert; regroup by expert
        local = torch.arange(n_local, device=input.device).repeat(n)
        local = local.repeat_interleave(recv_counts.reshape(-1))
        per_expert = recv_counts.sum(0).tolist()
    else:
        recv = send
        local = key[order] - first
        per_expert = counts[first:first + n_local].tolist()
    regroup = torch.argsort(local, stable=True)
    grouped = recv.index_select(0, regroup)
    # every expert runs, on no rows too: the autograd graph then has the same collectives on
    # every device (a device that received nothing still meets its peers in the backward)
    done = torch.cat([_swiglu(part, w1[e], w3[e], w2[e])
                      for e, part in enumerate(grouped.split(per_expert))])
    back = torch.empty_like(done).index_copy(0, regroup, done)
    if dispatched:
        width = input.shape[1]
        if tp is not None:  # sum the tp ranks' partial rows, each keeping its columns
            width = widths[tp_rank]
            back = exchange(
                back, lambda t: _reduce_scatter_columns(tpg, t, widths, tp_rank, most),
                lambda g: _gather_columns(tpg, g, widths, most)) if most else back[:, :width]
        result = exchange(back, lambda t: _all_to_all(pg, t, in_splits, out_splits),
                          lambda g: _all_to_all(pg, g, out_splits, in_splits))
    else:
        result = back
    out = input.new_zeros((tokens, result.shape[1])).index_add(
        0, token[order], result * gate[order].to(input.dtype).unsqueeze(1))
    if bool(invalid.any()):  # after the collectives: the peers never wait for this device
        bad = int(expert[invalid][0])
        raise IndexError(f"expert index {bad} is out of range: the indices must be in "
                         f"[0, {n_experts})")
    return out


register(OpDef("moe_experts",
               "moe_experts(input: Tensor, indices: Tensor, weights: Tensor, w1: Tensor, "
               "w3: Tensor, w2: Tensor)",
               _moe_experts, moe_rule, meta=moe_meta, uses_context=True, flags=COMM,
               comm_dims=moe_comm_dims, comm_grad=True, functional=True, function=False))
