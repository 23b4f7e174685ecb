"""Placement rules: which input placements an operator takes and what it produces.

Rules are written for ONE mesh dimension as rows ``(outputs, inputs)`` of placements, one per
tensor operand, and expanded here: every mesh dim is matched on its own, the all-Replicate row is
always present, and a miss raises a ``ValueError`` that names the ``redistribute()`` to add.

The few automatic redistributions are declared by the rule, not special-cased by the client:
``auto_chunk`` rows let a Replicate input be chunked locally to the Shard a row asks for (cheap:
no communication), and reductions ask for their Partial outputs to be reduced (``post``).

Sub-split Shards (``Shard(d, sub_split=...)``, what ``cat`` along a sharded dim makes) match the
rows written for plain Shards: a row that shards a dim alike in its inputs and outputs treats
each position of the dim on its own (an elementwise op, a contraction, a move of other dims), so
it holds for any assignment of positions to devices, and the sub-split passes to the outputs
(``_carry_sub_split``). It must then be the same sub-split in every sharded operand, of the
same extent in every output: a reshape that merges the dim, or a plain Shard beside a sub-split
one, finds no row. ``check_sub_splits`` holds every rule to that: a sub-split never silently
becomes a plain Shard (the elements would be read in the wrong places).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..placement import REDUCE_OPS, Partial, Replicate, Shard, placements_str, plain

R = Replicate()
LINEAR_PARTIALS = (Partial("sum"), Partial("avg"))  # f(sum x_i) = sum f(x_i) holds for both
# copies and movements (clone, views, permutations, cat) never combine elements, so they commute
# with every elementwise reduction, max and min included
ALL_PARTIALS = tuple(Partial(op) for op in REDUCE_OPS)


def exact_cast(src, dst) -> bool:
    """Whether every value of torch dtype ``src`` converts to floating (or complex) ``dst``
    exactly, so that a Partial sum may pass the cast: converting each contribution and adding
    in ``dst`` is then converting the sum (up to the rounding of one sum, which ``dst`` holds at
    least as well). A narrowing cast (float32 to bfloat16, int64 to float32) would round every
    contribution before the sum; where they cancel, that is far from the rounded sum. Nor from
    bool: a bool sum saturates (True + True is True)."""
    if src == dst:
        return True
    if src == torch.bool or not (dst.is_floating_point or dst.is_complex) or (
            src.is_complex and not dst.is_complex):
        return False
    out = torch.finfo(dst)
    if src.is_floating_point or src.is_complex:
        inp = torch.finfo(src)
        return inp.eps >= out.eps and inp.max <= out.max and inp.tiny >= out.tiny
    info = torch.iinfo(src)
    return info.bits - (info.min < 0) <= _precision(out)


def _precision(info) -> int:
    """Significand bits of a float type, the implicit one included (bfloat16: 8)."""
    return round(-math.log2(info.eps)) + 1


class Call(NamedTuple):
    """What a rule sees of one call: operand specs (a Python type for a scalar), static args by
    name, and the outputs' (shape, dtype) from the metadata rule."""

    op: object
    inputs: tuple
    static: dict
    outs: list
    mesh: object

    @property
    def tensors(self) -> tuple:
        return tuple(s for s in self.inputs if not isinstance(s, type))

    @property
    def has_scalar(self) -> bool:
        return any(isinstance(s, type) for s in self.inputs)


class Placed(NamedTuple):
    outs: tuple  # placements of each output (a tuple per output)
    pre: tuple = ()  # per tensor operand: target placements to redistribute to first, or None
    post: tuple = ()  # per output: placements to redistribute the result to, or None
    # the dtype the kernel computes its outputs in and ``post`` reduces them in, before they are
    # cast to the call's own dtype (a low-precision sum over devices: float32, rounded once)
    accumulate: torch.dtype | None = None


# -- expansion ------------------------------------------------------------------------------------


def expand(call: Call, rows, *, auto_chunk: bool = False) -> Placed:
    """Matches each mesh dim's input placements against ``rows`` (one-mesh-dim rules)."""
    specs = call.tensors
    n_out = len(call.outs)
    table = {}
    for outs, ins in list(rows) + [((R,) * n_out, (R,) * len(specs))]:
        table.setdefault(tuple(ins), tuple(outs))
    outs = [[] for _ in range(n_out)]
    pre = [list(s.placements) for s in specs]
    missing = []
    for i in range(len(call.mesh.shape)):
        ins = tuple(s.placements[i] for s in specs)
        got = table.get(ins)
        if got is None and auto_chunk:
            ins, got = _auto_chunk(table, ins)
        if got is None and not call.op.positional and any(_sub_split(p) for p in ins):
            ins, got = _carry_sub_split(call, table, ins, auto_chunk)
        if got is None:
            missing.append((i, ins))
            continue
        for k, p in enumerate(got):
            outs[k].append(p)
        for k, p in enumerate(ins):
            pre[k][i] = p
    if missing:
        raise placement_error(call, table, missing)
    pre = tuple(None if tuple(p) == s.placements else tuple(p) for p, s in zip(pre, specs))
    return Placed(tuple(tuple(o) for o in outs), pre if any(pre) else ())


def _auto_chunk(table, ins):
    """A row reachable by chunking Replicate inputs locally (the only automatic redistribute of
    elementwise ops: it needs no communication)."""
    for row_ins, row_outs in table.items():
        if all(a == b or (a == R and isinstance(b, Shard)) for a, b in zip(ins, row_ins)):
            return row_ins, row_outs
    return ins, None


def _sub_split(p):
    return p.sub_split if isinstance(p, Shard) else None


def _carry_sub_split(call, table, ins, auto_chunk):
    """The row a mesh dim's sub-split inputs match as plain Shards, with the sub-split put back
    on its sharded inputs (a Replicate one chunked to it) and outputs; None where the row does
    not keep the dim (see the module docstring)."""
    splits = {_sub_split(p) for p in ins} - {None}
    if len(splits) > 1:
        return ins, None
    (split,) = splits
    extent = sum(split)
    plain_ins = tuple(map(plain, ins))
    row_ins, got = plain_ins, table.get(plain_ins)
    if got is None and auto_chunk:
        row_ins, got = _auto_chunk(table, plain_ins)
    if got is None:
        return ins, None
    sharded = [(p, q, s) for p, q, s in zip(ins, row_ins, call.tensors) if isinstance(q, Shard)]
    if any((_sub_split(p) != split and p != R) or s.shape[q.dim] != extent
           for p, q, s in sharded):
        return ins, None  # a plain Shard beside the sub-split, or a dim of another extent
    shapes = [shape for shape, _ in call.outs]
    if any(isinstance(q, Shard) and shape[q.dim] != extent for q, shape in zip(got, shapes)):
        return ins, None
    return (tuple(_with_split(q, split) for q in row_ins),
            tuple(_with_split(q, split) for q in got))


def _with_split(p, split):
    return Shard(p.dim, split) if isinstance(p, Shard) else p


def check_sub_splits(call: Call, placed: Placed) -> None:
    """Refuses a rule result that loses a sub-split: on a mesh dim where an operand is a
    sub-split Shard, every Shard output must carry that sub-split. (Ops whose rules make and
    cut sub-splits themselves, ``OpDef.sub_splits``, are not checked.)"""
    specs = call.tensors
    pre = placed.pre or (None,) * len(specs)
    for i in range(len(call.mesh.shape)):
        ins = [(p or s.placements)[i] for p, s in zip(pre, specs)]
        splits = {_sub_split(p) for p in ins} - {None}
        if not splits:
            continue
        outs = [o[i] for o in placed.outs]
        if all(_sub_split(o) in splits for o in outs if isinstance(o, Shard)):
            continue
        names = operand_names(call)
        got = ", ".join(f"{n}={p}" for n, p in zip(names, ins))
        todo = "; ".join(
            f"{n} = {n}.redistribute(placements={[plain(q) for q in s.placements]!r})"
            for n, s, p in zip(names, specs, ins) if _sub_split(p))
        raise ValueError(
            f"dtorch.{call.op.name}: mesh dim {i} holds a sub-split Shard ({got}), whose "
            f"elements this operator cannot follow (it would read them as a plain Shard's). "
            f"Redistribute to a plain Shard first, e.g. {todo}")


def operand_names(call: Call) -> list:
    """The parameter name of each tensor operand (``tensors[1]`` inside a TensorList)."""
    params = [p for p in call.op.params if p.kind != "static"]
    listed = len(call.inputs) - (len(params) - 1)  # operands a TensorList parameter takes
    names = []
    for p in params:
        names += [f"{p.name}[{i}]" for i in range(listed)] if p.kind == "tensors" else [p.name]
    return [n for n, s in zip(names, call.inputs) if not isinstance(s, type)]


def fix_cost(ins, row) -> tuple:
    """How costly moving ``ins`` to ``row`` is, to suggest the cheapest fix: leaving a Shard or
    Partial takes a collective, entering a Shard from Replicate is a local slice, and among
    equals Replicate is the plainest target."""
    changed = [(a, b) for a, b in zip(ins, row) if a != b]
    return (sum(a != R for a, _ in changed), sum(b != R for _, b in changed), len(changed))


def placement_error(call: Call, table, missing) -> ValueError:
    names = operand_names(call)
    specs = call.tensors
    fixes = [list(s.placements) for s in specs]
    lines = []
    for mesh_dim, ins in missing:
        best = min(table, key=lambda row: fix_cost(ins, row))
        for k, p in enumerate(best):
            fixes[k][mesh_dim] = p
        got = ", ".join(f"{n}={p}" for n, p in zip(names, ins))
        lines.append(f"mesh dim {mesh_dim}: no rule takes ({got})")
    todo = [
        f"{n} = {n}.redistribute(placements={fix!r})"
        for n, fix, s in zip(names, fixes, specs)
        if tuple(fix) != s.placements
    ]
    accepted = "; ".join(
        "(" + ", ".join(map(str, row)) + ")" for row in list(table)[:8]
    )
    return ValueError(
        f"dtorch.{call.op.name}: input placements are not supported: {'; '.join(lines)}. "
        f"Accepted per mesh dim: {accepted}. Redistribute first, e.g. {'; '.join(todo)}"
    )


def inplace_error(call: Call, placed: Placed) -> ValueError:
    """An in-place operator writes its input's blocks, so its result must keep the input's
    placements; the fix is to bring the other operands to Replicate on the mesh dims that
    would change (Shard + Replicate then chunks locally)."""
    names, specs = operand_names(call), call.tensors
    target = specs[0].placements
    moved = (placed.pre[0] if placed.pre and placed.pre[0] else None) or target
    dims = [i for i, (a, b, c) in enumerate(zip(target, moved, placed.outs[0])) if not a == b == c]
    todo = []
    for n, s in zip(names[1:], specs[1:]):
        fix = [R if i in dims else p for i, p in enumerate(s.placements)]
        if tuple(fix) != s.placements:
            todo.append(f"{n} = {n}.redistribute(placements={fix!r})")
    return ValueError(
        f"dtorch.{call.op.name}: an in-place operator keeps its input's placements "
        f"({placements_str(target)}), but with these operands the result would be "
        f"{placements_str(placed.outs[0])}; redistribute the other operand first, e.g. "
        f"{'; '.join(todo) or 'use the out-of-place form'}"
    )


# -- row builders ---------------------------------------------------------------------------------


def replicate_only(call: Call) -> Placed:
    return expand(call, [])


def pointwise_rows(call: Call, *, linear=(), partials=LINEAR_PARTIALS):
    """Elementwise ops with broadcasting: sharding an output dim shards the inputs' matching dims
    (inputs that broadcast along it stay Replicate). ``linear`` says where ``partials`` pass
    through: "all" (additive: P + P = P), or the operand positions that may be Partial while the
    others are Replicate (multiplicative: P * R = P)."""
    out_shape = call.outs[0][0]
    specs = call.tensors
    rows = []
    for d in range(len(out_shape)):
        ins = []
        for s in specs:
            di = d - (len(out_shape) - len(s.shape))
            ins.append(Shard(di) if di >= 0 and s.shape[di] == out_shape[d] else R)
        rows.append(((Shard(d),), tuple(ins)))
    # ``linear`` names operand positions (a Python scalar may hold one: 2 / P is not linear)
    tensor_pos = [k for k, s in enumerate(call.inputs) if not isinstance(s, type)]
    for p in partials:
        if linear == "all" and not call.has_scalar:
            rows.append(((p,), (p,) * len(specs)))
        elif linear != "all":
            for k in linear:
                if k in tensor_pos:
                    rows.append(((p,), tuple(p if j == k else R for j in tensor_pos)))
    return rows


def pointwise(linear=(), auto_chunk=False, partials=LINEAR_PARTIALS):
    def rule(call: Call) -> Placed:
        rows = pointwise_rows(call, linear=linear, partials=partials)
        return expand(call, rows, auto_chunk=auto_chunk)

    return rule


def einsum_rows(in_labels, out_labels: str, shapes) -> list:
    """Contractions: a label kept in the output may be sharded in every input that has it (others
    replicate); a contracted label sharded in every input that has it gives a Partial sum; and one
    Partial input with the others Replicate stays Partial (the product is linear in each input)."""
    size = {}
    for labels, shape in zip(in_labels, shapes):
        for c, n in zip(labels, shape):
            size[c] = max(size.get(c, 1), n)
    rows = []
    for c in dict.fromkeys("".join(in_labels)):
        if any(lab.count(c) > 1 for lab in in_labels):  # a diagonal ("ii"): one shard holds
            continue  # rows of it, not its own block of the diagonal
        ins = tuple(
            Shard(lab.index(c)) if c in lab and shape[lab.index(c)] == size[c] else R
            for lab, shape in zip(in_labels, shapes)
        )
        if all(p == R for p in ins):
            continue
        out = Shard(out_labels.index(c)) if c in out_labels else Partial()
        rows.append(((out,), ins))
    for p in LINEAR_PARTIALS:
        for k in range(len(in_labels)):
            rows.append(((p,), tuple(p if j == k else R for j in range(len(in_labels)))))
    return rows
