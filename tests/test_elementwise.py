"""Elementwise operators against plain torch: the unary math set, binary and logical/bitwise ops,
clamp/clip, where, masked_fill/masked_scatter, lerp, addcmul/addcdiv, their in-place forms.

Each case runs one lambda on torch tensors and on dtorch tensors laid out over a mesh (one
device: bit-identical; 3, 2x2 and 2x2x2 devices with uneven shards: allclose), or expects torch's
own exception type at the call. Hypothesis then draws operand placements (Shard, Replicate and
genuine Partial sum/avg/max/min contributions) for every op, mostly from its documented rows: a
layout outside them raises a ValueError naming a redistribute(), any other gives torch's values.
"""

from __future__ import annotations

import operator

import pytest
import torch
from hypothesis import given, strategies as st

import dtorch
from dtorch import Partial, Replicate, Shard
from helpers import (
    aligned_placements,
    assert_close,
    assert_executed,
    assert_refused,
    check_like_torch,
    distribute,
    fixture_settings,
    layout_fixture,
    lib,
    mostly,
    sample,
)

R, S0, S1, P = Replicate(), Shard(0), Shard(1), Partial()
HYPOTHESIS = fixture_settings(10)

# (mesh fixture, placements of a (5, 7) tensor): even, uneven, nested, Replicate mixed in
LAYOUTS = [("one", (R,)), ("mesh1", (S0,)), ("mesh1", (S1,)), ("mesh2", (S0, S1)),
           ("mesh2", (R, S0)), ("mesh3", (S1, S1, S0))]
DTYPES = [torch.float32, torch.float64, torch.int64, torch.bool]


layout = layout_fixture(LAYOUTS)


def check(fn, xs, ts, exact=False) -> None:
    """``check_like_torch``, where NaN matches NaN: the unary cases feed inf and NaN in."""
    check_like_torch(fn, xs, ts, exact, equal_nan=True)


# -- unary ----------------------------------------------------------------------------------------

UNARY = ["neg", "abs", "exp", "expm1", "log", "log1p", "log2", "log10", "sqrt", "rsqrt", "square",
         "reciprocal", "sign", "floor", "ceil", "round", "trunc", "sin", "cos", "tan", "asin",
         "acos", "atan", "sinh", "cosh", "tanh", "sigmoid", "erf", "isinf", "isnan", "isfinite",
         "logical_not", "bitwise_not"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_unary(dtype, layout):
    """Every unary op, as a function and a method: values, dtype (int -> float promotion) and
    torch's errors (bitwise_not of float, neg of bool) at the call; placements kept."""
    mesh, placements, exact = layout
    t = sample((5, 7), dtype, seed=3)
    if dtype.is_floating_point:
        t[0, :3] = torch.tensor([float("inf"), float("nan"), 0.75])  # out-of-domain values too
    x = distribute(t, mesh, placements)
    for name in UNARY:
        check(lambda v: getattr(lib(v), name)(v), [x], [t], exact)
        check(lambda v: getattr(v, name)(), [x], [t], exact)
        if hasattr(torch.Tensor, name + "_"):
            check(lambda v: getattr(v.clone(), name + "_")(), [x], [t], exact)
    assert dtorch.sin(x).placements == placements


def test_unary_extras(mesh2, one):
    t = sample((5, 7), torch.float64) * 10
    for mesh, pl, exact in ((mesh2, [S1, S0], False), (one, [R], True)):
        x = distribute(t, mesh, pl)
        check(lambda v: v.round(decimals=1), [x], [t], exact)
        check(lambda v: (dtorch if isinstance(v, dtorch.Tensor) else torch).round(v, decimals=-1),
              [x], [t], exact)
        i = distribute(t.long(), mesh, pl)
        check(lambda v: ~v, [i], [t.long()], exact)
        check(lambda v: ~(v > 0), [x], [t], exact)
        check(lambda v: abs(v), [x], [t], exact)


def test_inplace_unary_returns_self(mesh1):
    t = sample((5, 7))
    x = distribute(t, mesh1, [S1])
    assert x.exp_() is x and x.placements == [S1]
    assert_close(x, t.exp())
    with pytest.raises(RuntimeError):  # torch's: int -> float result cannot be stored in place
        distribute(t.long(), mesh1, [S0]).sqrt_()


# -- binary ---------------------------------------------------------------------------------------

BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
    "floor_divide": torch.floor_divide, "remainder": torch.remainder, "fmod": torch.fmod,
    "pow": torch.pow, "atan2": torch.atan2, "minimum": torch.minimum, "maximum": torch.maximum,
    "logical_and": torch.logical_and, "logical_or": torch.logical_or,
    "logical_xor": torch.logical_xor, "bitwise_and": torch.bitwise_and,
    "bitwise_or": torch.bitwise_or, "bitwise_xor": torch.bitwise_xor,
}
OPERATORS = {"&": operator.and_, "|": operator.or_, "^": operator.xor, "%": operator.mod,
             "//": operator.floordiv}
IN_PLACE_OPERATORS = {"&=": operator.iand, "|=": operator.ior, "^=": operator.ixor,
                      "%=": operator.imod, "//=": operator.ifloordiv}


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool], ids=str)
@pytest.mark.parametrize("other_shape", [(5, 7), (7,), (5, 1)], ids=str)
def test_binary(dtype, other_shape, layout):
    """Each binary op with a same-shape or broadcast operand (aligned or Replicate: chunked
    locally), both orders, a Python scalar on either side, the in-place form and the
    operators; or torch's error (bitwise ops on floats, bool subtraction)."""
    mesh, placements, exact = layout
    a, b = sample((5, 7), dtype, positive=True), sample(other_shape, dtype, seed=1, positive=True)
    x = distribute(a, mesh, placements)
    for b_placements in (aligned_placements(placements, (5, 7), other_shape), [R] * mesh.ndim):
        y = distribute(b, mesh, b_placements)
        for name in BINARY:
            check(lambda u, v: getattr(lib(u), name)(u, v), [x, y], [a, b], exact)
            check(lambda u, v: getattr(lib(u), name)(v, u), [x, y], [a, b], exact)
            if hasattr(torch.Tensor, name + "_"):
                check(lambda u, v: getattr(u.clone(), name + "_")(v), [x, y], [a, b], exact)
        for fn in OPERATORS.values():
            check(fn, [x, y], [a, b], exact)
            check(lambda u, v: fn(v, u), [x, y], [a, b], exact)
        for fn in IN_PLACE_OPERATORS.values():
            check(lambda u, v: fn(u.clone(), v), [x, y], [a, b], exact)
    for scalar in (2, True):
        for fn in list(OPERATORS.values()) + [torch.fmod, torch.atan2, torch.logical_and]:
            if fn in (torch.fmod, torch.atan2, torch.logical_and):
                f = (lambda u, s=scalar, fn=fn: getattr(lib(u), fn.__name__)(u, s))
            else:
                f = (lambda u, s=scalar, fn=fn: fn(u, s))
            check(f, [x], [a], exact)
        for fn in OPERATORS.values():
            check(lambda u, s=scalar, fn=fn: fn(s, u), [x], [a], exact)


def test_named_binary_keywords(mesh1):
    a, b = sample((5, 7)), sample((5, 7), seed=1, positive=True)
    x, y = distribute(a, mesh1, [S1]), distribute(b, mesh1, [R])
    for mode in (None, "trunc", "floor"):
        assert_close(dtorch.div(x, y, rounding_mode=mode), torch.div(a, b, rounding_mode=mode))
    assert_close(dtorch.sub(x, y, alpha=2), torch.sub(a, b, alpha=2))
    assert_close(x.fmod_(y), a.clone().fmod_(b))


# -- clamp, where, masks, lerp, addcmul, addcdiv --------------------------------------------------


def fused_cases(a, b, c, mask, pos):
    """(name, fn, operands) where each fn runs on torch or dtorch operands alike."""
    return [
        ("clamp scalars", lambda x: x.clamp(-0.5, 0.5), [a]),
        ("clamp min", lambda x: lib(x).clamp(x, min=0.1), [a]),
        ("clip max", lambda x: lib(x).clip(x, max=0.2), [a]),
        ("clamp tensors", lambda x, lo, hi: lib(x).clamp(x, lo, hi), [a, b, b + 1]),
        ("clamp tensor min", lambda x, lo: x.clamp(min=lo), [a, b]),
        ("clip_", lambda x, lo: x.clone().clip_(lo), [a, c]),
        ("clamp_", lambda x: x.clone().clamp_(max=0.0), [a]),
        ("clamp none", lambda x: lib(x).clamp(x), [a]),  # torch: RuntimeError
        ("where", lambda m, x, y: lib(x).where(m, x, y), [mask, a, b]),
        ("where scalar", lambda m, x: lib(x).where(m, x, 0.5), [mask, a]),
        ("where broadcast", lambda m, x, y: x.where(m, y), [mask, a, c]),
        ("masked_fill", lambda x, m: lib(x).masked_fill(x, m, 2.5), [a, mask]),
        ("masked_fill row", lambda x, m: x.masked_fill(m, -1.0), [a, mask[0]]),
        ("masked_fill 0-d", lambda x, m, v: x.masked_fill(m, v.sum()), [a, mask, b]),
        ("masked_fill_", lambda x, m: x.clone().masked_fill_(m, 0), [a, mask]),
        ("lerp", lambda x, y: lib(x).lerp(x, y, 0.3), [a, b]),
        ("lerp tensor", lambda x, y, w: x.lerp(y, w), [a, b, c]),
        ("lerp_", lambda x, y: x.clone().lerp_(y, 0.75), [a, b]),
        ("addcmul", lambda x, y, z: lib(x).addcmul(x, y, z, value=0.5), [a, b, c]),
        ("addcmul_", lambda x, y, z: x.clone().addcmul_(y, z), [a, b, c]),
        ("addcdiv", lambda x, y, z: lib(x).addcdiv(x, y, z, value=2), [a, b, pos]),
        ("addcdiv_", lambda x, y, z: x.clone().addcdiv_(y, z), [a, b, pos]),
        ("addcdiv int", lambda x, y, z: lib(x).addcdiv(x, y, z), [a.long(), b.long(), c.long()]),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_fused(dtype, layout):
    mesh, placements, exact = layout
    a, b = sample((5, 7), dtype), sample((5, 7), dtype, seed=1)
    c, pos = sample((7,), dtype, seed=2), sample((5, 7), dtype, seed=4, positive=True)
    mask = sample((5, 7), torch.bool, seed=5)
    for name, fn, ts in fused_cases(a, b, c, mask, pos):
        xs = [distribute(t, mesh, aligned_placements(placements, (5, 7), t.shape)) for t in ts]
        check(fn, xs, ts, exact)
        if not exact:  # the Replicate operands are chunked locally to meet the first one
            check(fn, [xs[0]] + [distribute(t, mesh, [R] * mesh.ndim) for t in ts[1:]], ts)


def test_clamp_promotes_as_torch(mesh1):
    i = sample((5, 7), torch.int64)
    x = distribute(i, mesh1, [S0])
    check(lambda v: v.clamp(min=0.5), [x], [i])
    check(lambda v: v.clamp(min=2, max=3), [x], [i])
    check(lambda v: v.clamp_(min=0.5), [x], [i.clone()])  # torch: RuntimeError (int result)


def test_masked_scatter(mesh1, mesh2, one):
    """The k-th True element (over the whole tensor) takes source[k]: Replicate operands only."""
    a, mask, src = sample((5, 7)), sample((5, 7), torch.bool, seed=5), sample((40,), seed=6)
    for mesh, exact in ((one, True), (mesh1, False), (mesh2, False)):
        rep = [R] * mesh.ndim
        x, m, s = (distribute(t, mesh, rep) for t in (a, mask, src))
        assert_close(dtorch.masked_scatter(x, m, s), a.masked_scatter(mask, src), exact)
        assert_close(x.clone().masked_scatter_(m, s), a.clone().masked_scatter_(mask, src), exact)
    xs = distribute(a, mesh1, [S0])
    with pytest.raises(ValueError, match=r"masked_scatter.*redistribute\(placements=\[Replicate"):
        xs.masked_scatter(distribute(mask, mesh1, [S0]), distribute(src, mesh1, [R]))


# -- placement rules against ground truth ---------------------------------------------------------

PA, PMAX, PMIN = Partial("avg"), Partial("max"), Partial("min")
MONOTONE = ("exp", "expm1", "floor", "ceil", "round", "trunc", "atan", "sinh", "tanh", "erf",
            "sigmoid", "sign")
# docs/ops.md's Partial rows, one mesh dim: per op, the tuples of operand placements (Partial and
# Replicate) that pass; every other tuple holding a Partial is refused
LINEAR = [(P,), (PA,)]
PARTIAL_ROWS = {
    "neg": LINEAR, **{n: [(PMAX,), (PMIN,)] for n in MONOTONE},
    "add": [(P, P), (PA, PA)], "sub": [(P, P), (PA, PA)],
    "mul": [(P, R), (R, P), (PA, R), (R, PA)], "div": [(P, R), (PA, R)],
    "maximum": [(PMAX, PMAX), (PMAX, R), (R, PMAX)],
    "minimum": [(PMIN, PMIN), (PMIN, R), (R, PMIN)],
    "scalar*P": LINEAR, "clamp": [(PMAX,), (PMIN,)], "clamp tensor": [(PMAX, R), (PMIN, R)],
    "where": [(R, P, P), (R, PA, PA)], "masked_fill 0-d": [(P, R, P), (PA, R, PA)],
    "lerp": [(P, P), (PA, PA)], "lerp tensor": [(P, P, R), (PA, PA, R)],
    "addcmul": [(P, P, R), (P, R, P), (PA, PA, R), (PA, R, PA)],
    "addcdiv": [(P, P, R), (PA, PA, R)],
}
REPLICATE_ONLY = {"masked_scatter"}  # the k-th True takes source[k]: no shard places it alone

# name -> (fn, operand shapes, operand dtypes); each fn works on torch and dtorch operands
RULE_OPS = {
    **{n: (lambda x, n=n: getattr(lib(x), n)(x), [(4, 5)], [torch.float32]) for n in UNARY
       if n not in ("logical_not", "bitwise_not", "isinf", "isnan", "isfinite")},
    **{n: (lambda x, y, n=n: getattr(lib(x), n)(x, y), [(4, 5), (4, 5)], [torch.float32] * 2)
       for n in BINARY if not n.startswith(("bitwise", "logical"))},
    "bitwise_and": (lambda x, y: x & y, [(4, 5), (5,)], [torch.int64] * 2),
    "P+scalar": (lambda x: x + 1, [(4, 5)], [torch.float32]),
    "scalar*P": (lambda x: 3 * x, [(4, 5)], [torch.float32]),
    "clamp": (lambda x: x.clamp(-0.5, 0.5), [(4, 5)], [torch.float32]),
    "clamp tensor": (lambda x, lo: x.clamp(min=lo), [(4, 5), (4, 5)], [torch.float32] * 2),
    "where": (lambda m, x, y: lib(x).where(m, x, y),
              [(4, 5), (4, 5), (5,)], [torch.bool, torch.float32, torch.float32]),
    "where scalar": (lambda m, x: lib(x).where(m, x, 0.0), [(4, 5), (4, 5)],
                     [torch.bool, torch.float32]),
    "masked_fill": (lambda x, m: x.masked_fill(m, 1.0), [(4, 5), (4, 5)],
                    [torch.float32, torch.bool]),
    "masked_fill 0-d": (lambda x, m, v: x.masked_fill(m, v), [(4, 5), (4, 5), ()],
                        [torch.float32, torch.bool, torch.float32]),
    "lerp": (lambda x, y: x.lerp(y, 0.25), [(4, 5), (4, 5)], [torch.float32] * 2),
    "lerp tensor": (lambda x, y, w: x.lerp(y, w), [(4, 5), (4, 5), (4, 5)], [torch.float32] * 3),
    "addcmul": (lambda x, y, z: x.addcmul(y, z, value=2), [(4, 5), (4, 5), (5,)],
                [torch.float32] * 3),
    "addcdiv": (lambda x, y, z: x.addcdiv(y, z.abs() + 1), [(4, 5), (4, 5), (4, 5)],
                [torch.float32] * 3),
    "masked_scatter": (lambda x, m, s: x.masked_scatter(m, s), [(4, 5), (4, 5), (20,)],
                       [torch.float32, torch.bool, torch.float32]),
}
POSITIVE = ("log", "sqrt", "rsqrt", "log2", "log10")
CHOICES = [R, P, PA, PMAX, PMIN]
MIN_EXECUTED = 4  # of 10 examples per op, four in five mesh dims drawn from accepted rows


def shard_rows(shapes) -> list:
    """The accepted Shard rows of one mesh dim: output dim d sharded, each operand sharded along
    it where it has it at full size, else Replicate."""
    out = torch.broadcast_shapes(*shapes)
    rows = []
    for d in range(len(out)):
        row = []
        for shape in shapes:
            k = d - (len(out) - len(shape))
            row.append(Shard(k) if k >= 0 and shape[k] == out[d] else R)
        if any(p.is_shard() for p in row):
            rows.append(tuple(row))
    return rows


def accepted(name, shapes, ins) -> bool:
    """One mesh dim's operand placements ``ins`` match a documented row: all Replicate; a Partial
    row of PARTIAL_ROWS; or Shard rows, where a Replicate operand meeting a Shard one is chunked
    locally (several operands)."""
    if all(p == R for p in ins):
        return True
    if any(p.is_partial() for p in ins):
        return ins in PARTIAL_ROWS.get(name, [])
    if name in REPLICATE_ONLY:
        return False
    return any(all(p == q or p == R for p, q in zip(ins, row)) for row in shard_rows(shapes))


@pytest.mark.parametrize("name", sorted(RULE_OPS))
def test_rules_match_ground_truth(name, mesh1, mesh2):
    """Operand layouts drawn for every op, most from its documented rows: a layout the rows
    refuse raises the ValueError naming a redistribute(), any other gives torch's values on
    genuine Partial contributions."""
    fn, shapes, dtypes = RULE_OPS[name]
    ts = [sample(s, dt, seed=k, positive=name in POSITIVE)
          for k, (s, dt) in enumerate(zip(shapes, dtypes))]
    rows = [(R,) * len(shapes)] + PARTIAL_ROWS.get(name, [])
    rows += [] if name in REPLICATE_ONLY else shard_rows(shapes)
    # (an integer or bool operand cannot be Partial(avg): creating it raises)
    random_row = st.tuples(*[st.sampled_from([p for p in CHOICES if dt.is_floating_point or p != PA]
                                             + [Shard(d) for d in range(len(s))])
                             for s, dt in zip(shapes, dtypes)])
    executed = []

    @HYPOTHESIS
    @given(data=st.data())
    def example(data):
        mesh = data.draw(st.sampled_from([mesh1, mesh2]))
        per_dim = [mostly(data, st.sampled_from(rows), random_row) for _ in range(mesh.ndim)]
        xs = [distribute(t, mesh, [r[k] for r in per_dim], seed=data.draw(st.integers(0, 99)))
              for k, t in enumerate(ts)]
        ok = all(accepted(name, shapes, r) for r in per_dim)
        if check_like_torch(fn, xs, ts, equal_nan=True, refused=not ok):
            executed.append(per_dim)

    example()
    assert_executed({name: len(executed)}, [name], MIN_EXECUTED)


def test_partial_rows(mesh1):
    """The documented Partial pass-throughs keep the Partial (no reduction is added)."""
    a, b = sample((5, 7)), sample((5, 7), seed=1)
    x, y = distribute(a, mesh1, [P]), distribute(b, mesh1, [P], seed=1)
    m, r = distribute(a > 0, mesh1, [R]), distribute(b, mesh1, [R])
    cases = [(dtorch.where(m, x, y), torch.where(a > 0, a, b)), (x.lerp(y, 0.5), a.lerp(b, 0.5)),
             (x.addcmul(y, r), a.addcmul(b, b)),
             (x.addcdiv(y, r.abs() + 1), a.addcdiv(b, b.abs() + 1))]
    for out, expected in cases:
        assert out.placements == [P]
        assert_close(out, expected)
    mx = distribute(a, mesh1, [PMAX])
    for out, expected in ((mx.exp(), a.exp()), (mx.clamp(-0.3, 0.3), a.clamp(-0.3, 0.3)),
                          (dtorch.maximum(mx, distribute(b, mesh1, [PMAX], seed=1)),
                           torch.maximum(a, b)), (mx.floor(), a.floor())):
        assert out.placements == [PMAX]
        assert_close(out, expected)
    for refused in (lambda: x + 1, lambda: x.clamp(0, 1), lambda: dtorch.where(m, x, 1.0),
                    lambda: x.masked_fill(m, 1.0), lambda: mx.log(), lambda: x.exp()):
        assert_refused(refused)
