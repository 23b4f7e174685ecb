"""Attention (``dtorch.nn.functional.scaled_dot_product_attention``) and its context parallelism.

query (..., Hq, L, E), key (..., Hk, S, E), value (..., Hk, S, Ev) -> (..., Hq, L, Ev); the mask
broadcasts to (..., Hq, L, S). Each (batch, head) pair attends on its own, so the leading dims
shard alike and every device runs torch's own attention on its block.

A sequence sharded on a mesh dim that ``SdpaOption`` names for context parallelism (CP) is the
one case where attention communicates, inside one kernel on the communication stream
(``_context_parallel_attention``; its exchanges are ``ops/context_parallel.py``'s), and the
output keeps the query's placements:

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

from ..placement import Replicate, Shard, chunk_sizes
from ..type import ULYSSES_CP, SdpaOption
from .context_parallel import all_to_all, member_pieces, ring_attention, sequence_pieces
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
    rows = _rows(call)
    for i in range(len(call.mesh.shape)):
        ins = q.placements[i], k.placements[i], v.placements[i]
        if all(p.is_shard(len(s.shape) - 2) for p, s in zip(ins, call.tensors)) != (i in cp):
            raise ValueError(f"dtorch.scaled_dot_product_attention: query, key and value must be "
                             f"sharded along the sequence exactly on the context-parallel mesh "
                             f"dims {sorted(cp)}; mesh dim {i} is not")
        if i in cp:  # the kernel reads every block's positions, sub-split ones too
            rows.append(((ins[0],), ins))
    placed = expand(call, rows)
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
        q_lens = [sum(n for _, n in m) for m in member_pieces(q_spec, coord, ulysses_dim)]
        k_lens = [sum(n for _, n in m) for m in member_pieces(k_spec, coord, ulysses_dim)]
        query = all_to_all(ulysses, query, -3, [query.shape[-3] // n] * n, -2, q_lens)
        key = all_to_all(ulysses, key, -3, [key.shape[-3] // n] * n, -2, k_lens)
        value = all_to_all(ulysses, value, -3, [value.shape[-3] // n] * n, -2, k_lens)
    if ring_dim is None:  # a ring of one
        out = ring_attention(None, 0, query, key, value, [sequence_pieces(q_spec, coord, ulysses_dim)],
                             [sequence_pieces(k_spec, coord, ulysses_dim)], is_causal, scale)
    else:
        pg, rank = ctx.group(ring_dim)
        members = [coord[:ring_dim] + (i,) + coord[ring_dim + 1:] for i in range(pg.size())]
        out = ring_attention(pg, rank, query, key, value,
                             [sequence_pieces(q_spec, c, ulysses_dim) for c in members],
                             [sequence_pieces(k_spec, c, ulysses_dim) for c in members], is_causal, scale)
    if ulysses_dim is not None:
        out = all_to_all(ulysses, out, -2, q_lens, -3, [out.shape[-3]] * n)
    return out


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
        return issue("scaled_dot_product_attention",
                     (query, key, value, _mask_like_query(query, attn_mask)),
                     (dropout_p, is_causal, scale, enable_gqa))
    if ulysses == ring:
        raise ValueError(f"dtorch.scaled_dot_product_attention: sdpa_option names mesh dim "
                         f"{ring} for both Ulysses and Ring context parallelism; name two dims, "
                         f"or set one of them None")
    _check_cp(query, key, value, attn_mask, dropout_p, ulysses, ring)
    return issue("_context_parallel_attention", (query, key, value),
                 (is_causal, scale, enable_gqa, ulysses, ring))


def _mask_like_query(query, mask):
    """``mask`` chunked like ``query`` on each mesh dim where the query's batch or heads are
    sharded and the mask, Replicate there, has that dim whole (T5's position bias has every
    head, and an unported model builds it replicated): each device's block of the mask, a local
    chunk with no communication. The one layout attention changes on its own: a mask is an
    operand of the query's shape, not a choice of the program's."""
    if mask is None or not hasattr(mask, "placements"):
        return mask
    placements, lead = list(mask.placements), query.ndim - mask.ndim
    for i, p in enumerate(query.placements):
        d = p.dim - lead if isinstance(p, Shard) and p.dim < query.ndim - 2 else -1
        if d >= 0 and placements[i] == R and mask.shape[d] == query.shape[p.dim] > 1:
            placements[i] = Shard(d)
    return mask if placements == list(mask.placements) else mask.redistribute(
        placements=placements)


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
    if i is None or mesh.shape[i] == 1 or not query.placements[i].is_shard(query.ndim - 2):
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
        if not all(t.placements[d].is_shard(seq.dim) for d in cp):
            fix = [seq if i in cp else p for i, p in enumerate(t.placements)]
            raise ValueError(f"dtorch.scaled_dot_product_attention: {where}, so query, key and "
                             f"value must all be sharded along their sequence there; {name} "
                             f"is {list(t.placements)}. E.g. {name} = {name}.redistribute("
                             f"placements={fix!r})")
    for name, t in (("query", query), ("key", key), ("value", value)):
        other = [i for i, p in enumerate(t.placements) if p.is_shard(t.ndim - 2) and i not in cp]
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
               comm_dims=_cp_comm_dims, comm_grad=True, function=False, sub_splits=True))
