"""The first operator set against plain torch: elementwise, casts, matmul, reductions, shapes.

Every case runs the same lambda on torch tensors and on dtorch tensors laid out over a mesh
(fixtures ``one`` (one device: bit-identical), ``mesh1`` (3), ``mesh2`` (2x2), ``mesh3``
(2x2x2)) with uneven shapes, then compares shape, dtype, values and output placements.
Hypothesis checks the placement rules against full-tensor ground truth on genuine Partial
contributions: a layout outside the documented rows raises a ValueError at the call site, any
other gives torch's values, and each op executes a minimum of examples.
"""

from __future__ import annotations

import math
import operator

import pytest
import torch
from hypothesis import given, strategies as st

import dtorch
from dtorch import Partial, Replicate, Shard
from dtorch.placement import placements_str
from helpers import (
    aligned_placements,
    assert_close,
    assert_executed,
    assert_refused,
    check_like_torch,
    distribute,
    fixture_settings,
    layout_fixture,
    layout_id,
    lib,
    mostly,
    product_rows,
    reshape_refused,
    sample,
)

R, S0, S1, S2, P = Replicate(), Shard(0), Shard(1), Shard(2), Partial()
HYPOTHESIS = fixture_settings(12)

# (mesh fixture, placements) for 2-D tensors: even and nested shards, Replicate mixed in
LAYOUTS_2D = [
    ("one", (R,)), ("one", (S1,)), ("mesh1", (S0,)), ("mesh1", (S1,)), ("mesh1", (R,)),
    ("mesh2", (S0, S1)), ("mesh2", (S1, S0)), ("mesh2", (R, S0)), ("mesh2", (S0, S0)),
    ("mesh3", (S0, S1, R)), ("mesh3", (S1, S1, S0)),
]


layout = layout_fixture(LAYOUTS_2D)


def replicated(mesh) -> list:
    return [R] * mesh.ndim


# -- unary ----------------------------------------------------------------------------------------

UNARY = {
    "neg": torch.neg, "abs": torch.abs, "exp": torch.exp, "log": torch.log, "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt, "sin": torch.sin, "cos": torch.cos, "tanh": torch.tanh,
    "sigmoid": torch.sigmoid, "relu": torch.relu, "clone": torch.clone,
}
POSITIVE_ONLY = ("log", "sqrt", "rsqrt")


@pytest.mark.parametrize("name", UNARY)
@pytest.mark.parametrize("shape", [(5, 7), (6, 4)], ids=str)
def test_unary(name, shape, layout):
    mesh, placements, exact = layout
    t = sample(shape, positive=name in POSITIVE_ONLY)
    x = distribute(t, mesh, placements)
    for y in (getattr(dtorch, name)(x), getattr(x, name)()):
        assert y.placements == placements
        assert_close(y, UNARY[name](t), exact)


@pytest.mark.parametrize("name", UNARY)
@pytest.mark.parametrize("dtype", [torch.float64, torch.int64, torch.bool], ids=str)
def test_unary_dtypes(name, dtype, mesh2, one):
    """Results as torch's (int -> float for exp, log, ...), or torch's own error at the call
    (abs of bool, neg of bool)."""
    t = sample((5, 7), dtype, positive=True)
    for mesh, placements, exact in ((mesh2, [S1, S0], False), (one, [R], True)):
        x = distribute(t, mesh, placements)
        check_like_torch(lambda v: getattr(v, name)(), [x], [t], exact)


def test_unary_dunders_and_dtypes(mesh1):
    t = sample((5, 7), torch.float64)
    i = sample((5, 7), torch.int64)
    x, xi = distribute(t, mesh1, [S1]), distribute(i, mesh1, [S0])
    assert_close(-x, -t)
    assert_close(abs(xi), abs(i))
    assert_close(abs(xi).sqrt(), i.abs().sqrt())  # int -> float, as torch
    assert_close(x.contiguous(), t)


# -- binary ---------------------------------------------------------------------------------------

BINARY = {
    "+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv,
    "**": operator.pow, "==": operator.eq, "!=": operator.ne, "<": operator.lt,
    "<=": operator.le, ">": operator.gt, ">=": operator.ge,
}
# shapes of the second operand against a (5, 7) first one: same, broadcast rows, broadcast cols
OTHER_SHAPES = [(5, 7), (7,), (5, 1)]


@pytest.mark.parametrize("op", BINARY)
@pytest.mark.parametrize("other_shape", OTHER_SHAPES, ids=str)
def test_binary_tensors(op, other_shape, layout):
    mesh, placements, exact = layout
    fn = BINARY[op]
    a, b = sample((5, 7), positive=True), sample(other_shape, seed=1, positive=True)
    x = distribute(a, mesh, placements)
    for b_placements in (aligned_placements(placements, (5, 7), other_shape), replicated(mesh)):
        y = distribute(b, mesh, b_placements)
        out = fn(x, y)
        assert out.placements == placements  # the Replicate side is chunked locally
        assert_close(out, fn(a, b), exact)
        assert_close(fn(y, x), fn(b, a), exact)


@pytest.mark.parametrize("op", BINARY)
@pytest.mark.parametrize("scalar", [2, 0.5, True], ids=repr)
def test_binary_scalars_both_sides(op, scalar, layout):
    mesh, placements, exact = layout
    fn = BINARY[op]
    a = sample((5, 7), positive=True)
    x = distribute(a, mesh, placements)
    check_like_torch(lambda t: fn(t, scalar), [x], [a], exact)
    check_like_torch(lambda t: fn(scalar, t), [x], [a], exact)


DTYPE_PAIRS = [
    (torch.int64, torch.float32), (torch.float32, torch.float64), (torch.int64, torch.int64),
    (torch.bool, torch.int64), (torch.bool, torch.bool), (torch.int32, torch.int64),
    (torch.float16, torch.float32), (torch.bfloat16, torch.int64),
]


@pytest.mark.parametrize("da,db", DTYPE_PAIRS, ids=str)
@pytest.mark.parametrize("op", ["+", "*", "/", "==", "<"])
def test_type_promotion(op, da, db, mesh2):
    fn = BINARY[op]
    a, b = sample((5, 7), da, positive=True), sample((7,), db, seed=1, positive=True)
    x, y = distribute(a, mesh2, [S0, S1]), distribute(b, mesh2, [R, S0])
    check_like_torch(fn, [x, y], [a, b])
    check_like_torch(fn, [y, x], [b, a])
    for scalar in (3, 1.5, False):
        check_like_torch(lambda t: fn(t, scalar), [x], [a])
        check_like_torch(lambda t: fn(scalar, t), [x], [a])


def test_zero_dim_operand_promotes_as_torch(mesh1):
    """A 0-d tensor does not raise the dtype of a dimensioned one (torch's rule)."""
    s, a = torch.tensor(2.5, dtype=torch.float64), sample((5, 7))
    out = distribute(s, mesh1, [R]) * distribute(a, mesh1, [S0])
    assert out.dtype == torch.float32
    assert_close(out, s * a)


def test_named_binary_functions(mesh1):
    a, b = sample((5, 7)), sample((5, 7), seed=1)
    x, y = distribute(a, mesh1, [S1]), distribute(b, mesh1, [S1])
    assert_close(dtorch.add(x, y, alpha=2), torch.add(a, b, alpha=2))
    assert_close(x.sub(y, alpha=3), a.sub(b, alpha=3))
    assert_close(dtorch.div(x, 2.0), a / 2.0)
    assert_close(dtorch.div(2.0, x), torch.div(2.0, a))
    assert_close(x.div(y, rounding_mode="floor"), a.div(b, rounding_mode="floor"))
    assert_close(dtorch.maximum(x, y), torch.maximum(a, b))
    assert_close(dtorch.minimum(x, y), torch.minimum(a, b))
    assert_close(x.pow(2), a.pow(2))
    assert_close(dtorch.eq(x, y), torch.eq(a, b))


# -- in-place -------------------------------------------------------------------------------------

INPLACE = {
    "+=": operator.iadd, "-=": operator.isub, "*=": operator.imul, "/=": operator.itruediv,
    "**=": operator.ipow,
}


@pytest.mark.parametrize("op", INPLACE)
@pytest.mark.parametrize("other", ["tensor", "replicate", "broadcast", "scalar"])
def test_inplace(op, other, layout):
    mesh, placements, exact = layout
    fn = INPLACE[op]
    a = sample((5, 7), positive=True)
    b = {"tensor": sample((5, 7), seed=1, positive=True), "replicate": sample((5, 7), seed=1),
         "broadcast": sample((7,), seed=2, positive=True), "scalar": 1.5}[other]
    x = distribute(a, mesh, placements)
    if other == "scalar":
        y = b
    elif other == "replicate":
        y = distribute(b, mesh, replicated(mesh))
        b = b.abs() + 0.5
        y = y.abs() + 0.5
    else:
        y = distribute(b, mesh, aligned_placements(placements, (5, 7), b.shape))
    x_before = x
    x = fn(x, y)
    assert x is x_before and x.placements == placements
    assert_close(x, fn(a.clone(), b), exact)


def test_inplace_methods(mesh2):
    a, b = sample((5, 7)), sample((5, 7), seed=1, positive=True)
    x, y = distribute(a, mesh2, [S0, R]), distribute(b, mesh2, [R, R])  # y: chunked locally
    expected = a.clone()
    for name, arg in (("add_", y), ("sub_", 2), ("mul_", y), ("div_", y), ("pow_", 2)):
        assert getattr(x, name)(arg) is x
        getattr(expected, name)(b if arg is y else arg)
    assert x.placements == [S0, R]
    assert_close(x, expected)
    x.add_(y, alpha=2)
    assert_close(x, expected.add_(b, alpha=2))


def test_inplace_is_seen_by_views(mesh1):
    """A view shares its base's blocks, as in torch."""
    a = sample((6, 4))
    x = distribute(a, mesh1, [S0])
    v = x.view(24)
    x += 1
    assert_close(v, (a + 1).view(24))


def test_inplace_may_not_change_dtype_or_layout(mesh1):
    x = distribute(sample((5, 7), torch.int64), mesh1, [S0])
    with pytest.raises(RuntimeError):  # torch's own refusal: int += float
        x += 1.5
    r = distribute(sample((5, 7)), mesh1, [R])
    with pytest.raises(ValueError, match=r"add_.*redistribute"):
        r += distribute(sample((5, 7)), mesh1, [S0])  # R += S would shard r
    with pytest.raises(ValueError, match=r"mul_.*redistribute"):
        r *= distribute(sample((5, 7)), mesh1, [P])  # R *= P would make r Partial
    with pytest.raises(RuntimeError):  # a broadcast in-place result has torch's shape error
        distribute(sample((7,)), mesh1, [R]).add_(distribute(sample((5, 7)), mesh1, [R]))
    assert_close(x, sample((5, 7), torch.int64))  # nothing ran


# -- Partial: linear ops pass it through, the rest refuse it ------------------------------------

def rep(t):
    """Replicate on a dtorch tensor; the identity on a torch one (so a lambda runs on both)."""
    return t.redistribute(placements=[R]) if isinstance(t, dtorch.Tensor) else t


PARTIAL_LINEAR = {
    "P+P": lambda x, y: x + y, "P-P": lambda x, y: x - y, "P*2": lambda x, y: x * 2,
    "2*P": lambda x, y: 2 * x, "P/2": lambda x, y: x / 2, "-P": lambda x, y: -x,
    "P.clone": lambda x, y: x.clone(), "P.float64": lambda x, y: x.to(torch.float64),
    "P.contiguous": lambda x, y: x.contiguous(),
    "P*R": lambda x, y: x * rep(y), "R*P": lambda x, y: rep(y) * x,
    "P/R": lambda x, y: x / rep(y).abs(), "P@R": lambda x, y: x @ rep(y).t(),
    "P.T": lambda x, y: x.t(), "P.reshape": lambda x, y: x.reshape(7, 5),
    "P.unsqueeze": lambda x, y: x.unsqueeze(1), "cat(P,P)": lambda x, y: lib(x).cat([x, y], 1),
    "stack(P,P)": lambda x, y: lib(x).stack([x, y]), "P.add_(P)": lambda x, y: x.clone().add_(y),
    "P*=2": lambda x, y: x.clone().mul_(2),
}
REDUCING = {  # reductions of a Partial sum stay Partial; over sharded dims they reduce
    "sum(P)": lambda x, y: x.sum(dim=0), "sum(P) all": lambda x, y: x.sum(),
    "mean(P)": lambda x, y: x.mean(dim=1, keepdim=True),
}
PARTIAL_REFUSED = {
    "relu(P)": lambda x, y: x.relu(), "P+1": lambda x, y: x + 1, "1-P": lambda x, y: 1 - x,
    "P*P": lambda x, y: x * y, "2/P": lambda x, y: 2 / x, "P.exp": lambda x, y: x.exp(),
    "P.long": lambda x, y: x.long(), "amax(P)": lambda x, y: x.amax(),
    "P>0": lambda x, y: x > 0, "P**2": lambda x, y: x ** 2, "P+R": lambda x, y: x + rep(y),
    "P.add_(1)": lambda x, y: x.add_(1), "div(2,P)": lambda x, y: dtorch.div(2.0, x),
    "P@P": lambda x, y: x @ y.t(), "R/P": lambda x, y: rep(y) / x,
    "cat(P,R)": lambda x, y: dtorch.cat([x, rep(y)]),
    "P.div(2, floor)": lambda x, y: x.div(2, rounding_mode="floor"),  # rounding is not linear
    "P//2": lambda x, y: x // 2, "P%2": lambda x, y: x % 2,
}


@pytest.mark.parametrize("name", {**PARTIAL_LINEAR, **REDUCING})
def test_partial_passes_through_linear_ops(name, mesh1):
    fn = {**PARTIAL_LINEAR, **REDUCING}[name]
    a, b = sample((5, 7)), sample((5, 7), seed=1)
    x, y = distribute(a, mesh1, [P]), distribute(b, mesh1, [P])
    out = fn(x, y)
    assert out.placements == [P]
    assert_close(out, fn(a, b))


@pytest.mark.parametrize("name", PARTIAL_REFUSED)
def test_partial_refused_by_nonlinear_ops(name, mesh1):
    x, y = distribute(sample((5, 7)), mesh1, [P]), distribute(sample((5, 7), seed=1), mesh1, [P])
    assert_refused(PARTIAL_REFUSED[name], x, y)


MOVEMENTS = {  # they combine no elements, so every Partial passes, max and min included
    "clone": lambda x, y: x.clone(), "contiguous": lambda x, y: x.t().contiguous(),
    "t": lambda x, y: x.t(), "permute": lambda x, y: x.permute(1, 0),
    "reshape": lambda x, y: x.reshape(35), "unsqueeze": lambda x, y: x.unsqueeze(0),
    "cat": lambda x, y: lib(x).cat([x, y]), "stack": lambda x, y: lib(x).stack([x, y], 2),
}


@pytest.mark.parametrize("name", MOVEMENTS)
@pytest.mark.parametrize("op", ["max", "min", "avg"])
def test_every_partial_passes_movements(name, op, mesh1):
    fn = MOVEMENTS[name]
    a, b = sample((5, 7)), sample((5, 7), seed=1)
    x, y = distribute(a, mesh1, [Partial(op)]), distribute(b, mesh1, [Partial(op)])
    out = fn(x, y)
    assert out.placements == [Partial(op)]
    assert_close(out, fn(a, b))


def test_partial_casts(mesh1):
    """A Partial sum passes a cast that converts every contribution exactly (widening)."""
    a, f = sample((5, 7), torch.int64), sample((5, 7))
    x, y = distribute(a, mesh1, [P]), distribute(f, mesh1, [P])
    for out, expected in ((y.double(), f.double()), (y.to(torch.complex64), f.to(torch.complex64)),
                          (distribute(a.to(torch.int16), mesh1, [P]).float(), a.float()),
                          (distribute(f.half(), mesh1, [P]).float(), f.half().float())):
        assert out.placements == [P]
        assert_close(out, expected)
    for cast in (lambda v: v.half(), lambda v: v.bfloat16(),  # narrowing: each part rounds
                 lambda v: v.int()):  # truncation is not linear
        assert_refused(cast, y)
    assert_refused(lambda v: v.float(), x)  # int64 -> float32 rounds each contribution
    assert_refused(lambda v: v.float(), distribute(a > 0, mesh1, [P]))  # a bool sum saturates


def test_partial_on_2d_mesh(mesh2):
    a, b = sample((5, 7)), sample((5, 7), seed=1)
    x, y = distribute(a, mesh2, [P, S1]), distribute(b, mesh2, [P, R])
    out = (x + y) * 3 - x
    assert out.placements == [P, S1]
    assert_close(out, (a + b) * 3 - a)
    s = out.sum(dim=1)  # the sharded dim reduces across mesh dim 1; the Partial stays
    assert s.placements == [P, R]
    assert_close(s, ((a + b) * 3 - a).sum(dim=1))


# -- casts ----------------------------------------------------------------------------------------

CASTS = {"float": torch.float32, "double": torch.float64, "half": torch.float16,
         "bfloat16": torch.bfloat16, "long": torch.int64, "int": torch.int32, "bool": torch.bool}


@pytest.mark.parametrize("name", CASTS)
@pytest.mark.parametrize("src", [torch.float32, torch.int64, torch.bool], ids=str)
def test_casts(name, src, layout):
    mesh, placements, exact = layout
    t = sample((5, 7), src) * (3 if src != torch.bool else 1)
    x = distribute(t, mesh, placements)
    assert_close(getattr(x, name)(), getattr(t, name)(), exact)
    assert_close(x.to(CASTS[name]), t.to(CASTS[name]), exact)
    assert_close(x.to(dtype=CASTS[name]), t.to(dtype=CASTS[name]), exact)


# -- matmul ---------------------------------------------------------------------------------------

# (a shape, b shape, a placements, b placements, result placements) on a 1-D mesh
MATMUL_1D = [
    ((5, 4), (4, 6), [S0], [R], [S0]),  # rows of a
    ((5, 4), (4, 7), [R], [S1], [S1]),  # columns of b
    ((5, 4), (4, 6), [S1], [S0], [P]),  # the contracted dim: a Partial sum
    ((5, 4), (4, 6), [P], [R], [P]),  # linear in a
    ((5, 4), (4, 6), [R], [P], [P]),  # linear in b
    ((5, 4), (4, 6), [R], [R], [R]),
    ((3, 5, 4), (4, 6), [S0], [R], [S0]),  # batch
    ((3, 5, 4), (3, 4, 6), [S0], [S0], [S0]),
    ((1, 5, 4), (3, 4, 6), [R], [S0], [S0]),  # broadcast batch
    ((2, 1, 5, 4), (3, 4, 6), [S0], [R], [S0]),
    ((3, 5, 4), (4, 6), [S1], [R], [S1]),
    ((3, 5, 4), (3, 4, 6), [S2], [S1], [P]),
    ((4,), (4,), [S0], [S0], [P]),  # dot: a 0-d Partial
    ((5, 4), (4,), [S0], [R], [S0]),
    ((4,), (4, 6), [R], [S1], [S0]),
    ((4,), (3, 4, 6), [S0], [S1], [P]),
]


@pytest.mark.parametrize("sa,sb,pa,pb,expected", MATMUL_1D,
                         ids=[f"{sa}{placements_str(pa)}@{sb}{placements_str(pb)}"
                              for sa, sb, pa, pb, _ in MATMUL_1D])
def test_matmul_rows(sa, sb, pa, pb, expected, mesh1):
    a, b = sample(sa), sample(sb, seed=1)
    x, y = distribute(a, mesh1, pa), distribute(b, mesh1, pb)
    out = x @ y
    assert out.placements == expected
    assert_close(out, a @ b)
    assert_close(dtorch.matmul(x, y), torch.matmul(a, b))


def test_mm_bmm_and_2d_mesh(mesh2, one):
    a, b = sample((5, 4)), sample((4, 6), seed=1)
    x, y = distribute(a, mesh2, [S0, S1]), distribute(b, mesh2, [R, S0])
    out = dtorch.mm(x, y)
    assert out.placements == [S0, P]
    assert_close(out, a @ b)
    ab, bb = sample((4, 5, 3)), sample((4, 3, 2), seed=1)
    out = distribute(ab, mesh2, [S0, S1]).bmm(distribute(bb, mesh2, [S0, R]))
    assert out.placements == [S0, S1]
    assert_close(out, torch.bmm(ab, bb))
    exact = distribute(ab, one, [S0]) @ distribute(bb, one, [S0])
    assert_close(exact, ab @ bb, exact=True)


def test_matmul_of_mismatched_shards_raises(mesh1):
    x, y = distribute(sample((5, 4)), mesh1, [S1]), distribute(sample((4, 6)), mesh1, [R])
    assert_refused(operator.matmul, x, y, op="matmul")
    assert_refused(dtorch.mm, distribute(sample((5, 4)), mesh1, [S0]),
                   distribute(sample((4, 6)), mesh1, [S0]), op="mm")
    assert_refused(dtorch.bmm, distribute(sample((3, 5, 4)), mesh1, [S0]),  # batch shards match
                   distribute(sample((3, 4, 6)), mesh1, [R]), op="bmm")


# -- reductions -----------------------------------------------------------------------------------

REDUCTIONS = ("sum", "mean", "amax", "amin")


@pytest.mark.parametrize("name", REDUCTIONS)
@pytest.mark.parametrize("dim,keepdim", [(None, False), (0, False), (1, True), (-1, False),
                                         ((0, 1), False), ((0, 1), True), ([1], False)],
                         ids=lambda v: repr(v))
def test_reductions(name, dim, keepdim, layout):
    mesh, placements, exact = layout
    t = sample((5, 7))
    x = distribute(t, mesh, placements)
    kwargs = {} if dim is None else {"dim": dim, "keepdim": keepdim}
    out = getattr(x, name)(**kwargs)
    assert_close(out, getattr(t, name)(**kwargs), exact)
    dims = {0, 1} if dim is None else {d % 2 for d in ([dim] if isinstance(dim, int) else dim)}
    for p, q in zip(placements, out.placements):  # a reduced shard reduces across devices
        assert q == R if p.is_shard() and p.dim in dims else q.is_shard() or q == p


@pytest.mark.parametrize("name", ["sum", "mean"])
def test_reduction_dtype(name, mesh2, one):
    i = sample((5, 7), torch.int64)
    for mesh, exact in ((mesh2, False), (one, True)):
        x = distribute(i, mesh, [S0, S1][: mesh.ndim])
        assert_close(getattr(x, name)(dim=0, dtype=torch.float64),
                     getattr(i, name)(dim=0, dtype=torch.float64), exact)
        assert_close(getattr(x, name)(dtype=torch.float64), getattr(i, name)(dtype=torch.float64),
                     exact)
    b = sample((5, 7), torch.bool)
    assert_close(distribute(b, mesh2, [S1, S0]).sum(dim=1), b.sum(dim=1))
    assert_close(distribute(i, mesh2, [S1, S0]).sum(), i.sum())


def test_reductions_with_empty_shards(mesh1, mesh3):
    """(2, 3) over 3 devices leaves one shard empty; (1, 3) over 2x2x2 leaves most empty."""
    for shape, mesh, placements in (((2, 3), mesh1, [S0]), ((1, 3), mesh3, [S0, S0, S1])):
        t = sample(shape)
        x = distribute(t, mesh, placements)
        for name in REDUCTIONS:
            assert_close(getattr(x, name)(dim=0), getattr(t, name)(dim=0))
            assert_close(getattr(x, name)(), getattr(t, name)())
        i = sample(shape, torch.int64)
        assert_close(distribute(i, mesh, placements).amin(dim=0), i.amin(dim=0))


def test_amax_of_partial_max(mesh1):
    a = sample((5, 7))
    x = distribute(a, mesh1, [Partial("max")])
    out = x.amax(dim=1)
    assert out.placements == [Partial("max")]
    assert_close(out, a.amax(dim=1))


# -- shapes ---------------------------------------------------------------------------------------

# (shape, placements on mesh1 (3 devices) or mesh2 (2x2), new shape, result placements or None
# when the call must raise: merging or splitting a shard is fine only when the blocks stay
# array_split chunks of the result)
RESHAPES = [
    ((6, 4), [S0], (24,), [S0]),  # merge: 6 rows split evenly
    ((5, 4), [S0], (20,), None),  # merge, uneven rows: local blocks would not be chunks
    ((6, 4), [S1], (24,), None),  # merge with the inner dim sharded
    ((24,), [S0], (6, 4), [S0]),  # split: outer dim keeps the shard
    ((24,), [S0], (4, 6), None),  # split: 4 rows cannot split over 3 devices
    ((6, 4), [S0], (2, 12), None),
    ((6, 4), [S0], (3, 2, 4), [S0]),
    ((5, 7), [S1], (5, 7, 1), [S1]),  # unit dims are free
    ((5, 7), [S0], (1, 5, 7), [S1]),
    ((5, 1, 7), [S2], (5, 7), [S1]),
    ((3, 5, 2), [S1], (3, 10), None),  # 5 rows over 3 devices
    ((3, 6, 2), [S1], (3, 12), [S1]),
    ((3, 5, 2), [S0], (15, 2), [S0]),
    ((3, 5, 2), [S2], (3, 5, 2), [S2]),
    ((3, 5, 2), [P], (30,), [P]),  # linear: a Partial passes
    ((8, 4), [S0, S0], (32,), [S0, S0]),  # nested shards of one dim: 4 even chunks
    ((6, 4), [S0, S0], (24,), None),  # 6 rows over 4 devices
    ((4, 6), [S0, S1], (24,), None),  # two dims of one group sharded
    ((4, 6), [S0, S1], (2, 2, 6), [S0, S2]),
    ((4, 6), [S1, S0], (4, 2, 3), [S1, S0]),
    ((4, 6), [S1, S0], (4, 3, 2), None),  # 3 rows of the split over 2 devices
]


@pytest.mark.parametrize("shape,placements,new,expected", RESHAPES,
                         ids=[f"{s}{placements_str(p)}->{n}" for s, p, n, _ in RESHAPES])
@pytest.mark.parametrize("method", ["reshape", "view"])
def test_reshape_merge_split(shape, placements, new, expected, method, mesh1, mesh2):
    mesh = mesh1 if len(placements) == 1 else mesh2
    t = sample(shape)
    x = distribute(t, mesh, placements)
    if expected is None:
        with pytest.raises(ValueError, match=rf"{method}.*redistribute"):
            getattr(x, method)(new)
        fixed = x.redistribute(placements=[R] * mesh.ndim)
        assert_close(getattr(fixed, method)(new), t.reshape(new))
        return
    out = getattr(x, method)(*new)
    assert out.placements == expected
    assert_close(out, t.reshape(new))
    assert_close(getattr(x, method)(-1, *new[1:]), t.reshape(new))


def test_reshape_never_silently_wrong(mesh1, mesh2):
    """Any reshape of any layout: refused exactly where the documented rule says
    (``reshape_refused``), else torch's values. Layouts lean to Replicate, Partials and the
    outermost dim's shard (which most reshapes keep), so that most examples run."""
    executed = []

    @fixture_settings(30)
    @given(shape=st.lists(st.integers(1, 6), min_size=1, max_size=3), data=st.data())
    def example(shape, data):
        mesh = data.draw(st.sampled_from([mesh1, mesh2]))
        choices = [R, R, P, Partial("max"), S0, S0] + [Shard(d) for d in range(len(shape))]
        placements = data.draw(st.lists(st.sampled_from(choices), min_size=mesh.ndim,
                                        max_size=mesh.ndim))
        new = _factorization(math.prod(shape), data)
        t = sample(tuple(shape))
        x = distribute(t, mesh, placements)
        refused = reshape_refused(shape, new, placements, mesh)
        if check_like_torch(lambda v: v.reshape(new), [x], [t], refused=refused, op="reshape"):
            executed.append(new)

    example()
    assert_executed({"reshape": len(executed)}, ["reshape"], 15)


def _factorization(numel: int, data) -> tuple:
    """A random shape with ``numel`` elements (unit dims included now and then)."""
    dims, rest = [], numel
    while rest > 1 and len(dims) < 3:
        divisors = [d for d in range(2, rest + 1) if rest % d == 0]
        d = data.draw(st.sampled_from(divisors))
        dims.append(d)
        rest //= d
    dims.append(rest)
    if data.draw(st.booleans()):
        dims.insert(data.draw(st.integers(0, len(dims))), 1)
    return tuple(data.draw(st.permutations(dims)))


LAYOUTS_3D = [("one", (S0,)), ("mesh1", (S1,)), ("mesh1", (S2,)), ("mesh2", (S0, S2)),
              ("mesh2", (S1, S1)), ("mesh3", (S2, R, S1)), ("mesh1", (P,))]
SHAPE_OPS = {
    "transpose": lambda x: x.transpose(0, 2), "transpose-neg": lambda x: x.transpose(-1, 1),
    "permute": lambda x: x.permute(2, 0, 1), "permute-tuple": lambda x: x.permute((1, 2, 0)),
    "unsqueeze0": lambda x: x.unsqueeze(0), "unsqueeze-1": lambda x: x.unsqueeze(-1),
    "squeeze": lambda x: x.unsqueeze(1).squeeze(),
    "squeeze-dim": lambda x: x.unsqueeze(2).squeeze(2),
    "flatten": lambda x: x.flatten(), "flatten12": lambda x: x.flatten(1),
    "flatten01": lambda x: x.flatten(0, 1), "contiguous": lambda x: x.transpose(0, 1).contiguous(),
}


@pytest.mark.parametrize("name", SHAPE_OPS)
@pytest.mark.parametrize("layout3", LAYOUTS_3D, ids=layout_id)
def test_shape_ops(name, layout3, request):
    mesh_name, placements = layout3
    mesh = request.getfixturevalue(mesh_name)
    t = sample((3, 5, 2))
    x = distribute(t, mesh, list(placements))
    fn = SHAPE_OPS[name]
    refused = name.startswith("flatten") and reshape_refused(t.shape, fn(t).shape, placements, mesh)
    check_like_torch(fn, [x], [t], mesh_name == "one", refused=refused, op="flatten")


def test_shape_op_placements(mesh2):
    x = distribute(sample((3, 5, 2)), mesh2, [S0, S2])
    assert x.transpose(0, 2).placements == [S2, S0]
    assert x.permute(1, 2, 0).placements == [S2, S1]
    assert x.unsqueeze(1).placements == [S0, Shard(3)]
    assert distribute(sample((3, 1, 2)), mesh2, [S0, S2]).squeeze(1).placements == [S0, S1]
    y = distribute(sample((4, 6)), mesh2, [S0, R])
    assert y.t().placements == [S1, R]
    assert_close(y.t(), sample((4, 6)).t())


def test_squeeze_of_uneven_shard_keeps_global_dims(mesh1):
    """A (2, 1) tensor over 3 devices has an empty block: squeeze goes by global sizes."""
    t = sample((2, 1, 3))
    x = distribute(t, mesh1, [S0])
    assert_close(x.squeeze(), t.squeeze())
    assert_close(x.squeeze(1), t.squeeze(1))
    assert_close(distribute(sample((3, 1)), mesh1, [S0]).squeeze(), sample((3, 1)).squeeze())


@pytest.mark.parametrize("join", ["cat", "stack"])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_cat_stack(join, dim, layout):
    mesh, placements, exact = layout
    a, b = sample((5, 7)), sample((5, 7), seed=1)
    x, y = distribute(a, mesh, placements), distribute(b, mesh, placements)
    out = getattr(dtorch, join)([x, y, x], dim=dim)
    assert_close(out, getattr(torch, join)([a, b, a], dim), exact)
    if join == "cat":  # joined along its shard: a sub-split of the three inputs (test_sub_split)
        d = dim % 2
        assert out.placements == [Shard(d, (a.shape[d],) * 3) if p.is_shard(d) else p
                                  for p in placements]


def test_cat_of_different_sizes_and_dtypes(mesh2):
    a, b = sample((5, 7)), sample((2, 7), torch.int64, seed=1)
    out = dtorch.cat([distribute(a, mesh2, [S1, R]), distribute(b, mesh2, [S1, R])])
    assert out.placements == [S1, R]
    assert_close(out, torch.cat([a, b]))


def test_one_device_program_is_bit_identical(one):
    a, b = sample((6, 4)), sample((4, 5), seed=1)
    x, y = distribute(a, one, [R]), distribute(b, one, [R])
    out = ((x @ y).relu() * 0.5 + 1).sigmoid().reshape(3, 10).t().sum(dim=0) / 3
    assert_close(out, ((a @ b).relu() * 0.5 + 1).sigmoid().reshape(3, 10).t().sum(dim=0) / 3,
                 exact=True)


# -- hypothesis: binary ops, matmul and reductions against ground truth ---------------------------
# Each property draws per mesh dim mostly from the rows the docs accept (so most examples run,
# and each op must execute a minimum of them), the rest at random; a drawn layout outside the
# documented rows must be refused, one inside them must give torch's values.

PA, PMAX, PMIN = Partial("avg"), Partial("max"), Partial("min")
HYP_BINARY = {  # op -> its Partial rows (docs/ops.md): (a, b) for one mesh dim
    "+": [(P, P), (PA, PA)], "-": [(P, P), (PA, PA)],
    "*": [(P, R), (R, P), (PA, R), (R, PA)], "/": [(P, R), (PA, R)], "<": [],
}
ANY = [R, P, PA, PMAX, PMIN]
MIN_EXECUTED = 5  # of 12 examples per op


def binary_rows(out_shape, b_shape) -> list:
    """Shard rows of one mesh dim: an output dim sharded through the operands that have it at
    full size (either may be Replicate: it is chunked locally to meet the other)."""
    off = len(out_shape) - len(b_shape)
    rows = []
    for d in range(len(out_shape)):
        rows.append((Shard(d), R))
        if d >= off and b_shape[d - off] == out_shape[d]:
            rows += [(Shard(d), Shard(d - off)), (R, Shard(d - off))]
    return rows


@pytest.mark.parametrize("op", HYP_BINARY)
def test_binary_placements_never_silently_wrong(op, mesh2):
    """Any two layouts of broadcastable operands: refused exactly outside the documented rows,
    else torch's values."""
    executed = []

    @HYPOTHESIS
    @given(data=st.data())
    def example(data):
        out_shape = tuple(data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
        b_shape = tuple(data.draw(st.sampled_from([1, n])) for n in out_shape)
        b_shape = b_shape[data.draw(st.integers(0, len(b_shape) - 1)):]
        rows = [(R, R)] + HYP_BINARY[op] + binary_rows(out_shape, b_shape)
        random_row = st.tuples(*[st.sampled_from(ANY + [Shard(d) for d in range(len(s))])
                                 for s in (out_shape, b_shape)])
        per_dim = [mostly(data, st.sampled_from(rows), random_row) for _ in range(mesh2.ndim)]
        a, b = sample(out_shape, positive=True), sample(b_shape, seed=1, positive=True)
        x, y = (distribute(t, mesh2, [r[k] for r in per_dim], seed=k) for k, t in enumerate((a, b)))
        refused = not all(row in rows for row in per_dim)
        if check_like_torch(BINARY[op], [x, y], [a, b], refused=refused):
            executed.append(per_dim)

    example()
    assert_executed({op: len(executed)}, [op], MIN_EXECUTED)


def matmul_rows(a_shape, b_shape) -> list:
    """docs/ops.md's matmul rows for one mesh dim: those of its einsum form, batch dims
    broadcast from the right."""
    nb = max(len(a_shape), len(b_shape), 2) - 2
    batch = [f"b{i}" for i in range(nb)]
    a = batch[nb - max(len(a_shape) - 2, 0):] + (["n"] if len(a_shape) > 1 else []) + ["k"]
    b = batch[nb - max(len(b_shape) - 2, 0):] + ["k"] + (["m"] if len(b_shape) > 1 else [])
    out = batch + (["n"] if len(a_shape) > 1 else []) + (["m"] if len(b_shape) > 1 else [])
    return list(product_rows([a, b], [a_shape, b_shape], out))


@pytest.mark.parametrize("mesh_name", ["mesh1", "mesh2"])
def test_matmul_placements_never_silently_wrong(mesh_name, request):
    """Any layouts of matmul operands (batched, broadcast, 1-D): refused exactly outside the
    documented rows, else torch's product."""
    mesh = request.getfixturevalue(mesh_name)
    executed = []

    @fixture_settings(20)
    @given(data=st.data())
    def example(data):
        n, k, m = (data.draw(st.integers(1, 5)) for _ in range(3))
        batch = tuple(data.draw(st.lists(st.integers(1, 3), max_size=2)))
        a_shape = data.draw(st.sampled_from([(k,), (n, k), batch + (n, k)]))
        b_shape = data.draw(st.sampled_from([(k,), (k, m), batch + (k, m),
                                             tuple(1 for _ in batch) + (k, m)]))
        rows = matmul_rows(a_shape, b_shape)
        random_row = st.tuples(*[st.sampled_from(ANY + [Shard(d) for d in range(len(s))])
                                 for s in (a_shape, b_shape)])
        per_dim = [mostly(data, st.sampled_from(rows), random_row) for _ in range(mesh.ndim)]
        a, b = sample(a_shape), sample(b_shape, seed=1)
        x, y = (distribute(t, mesh, [r[j] for r in per_dim], seed=j) for j, t in enumerate((a, b)))
        refused = not all(row in rows for row in per_dim)
        if check_like_torch(operator.matmul, [x, y], [a, b], refused=refused, op="matmul"):
            executed.append(per_dim)

    example()
    assert_executed({"matmul": len(executed)}, ["matmul"], 2 * MIN_EXECUTED)


REDUCTION_PARTIALS = {"sum": (P, PA), "mean": (P, PA), "amax": (PMAX,), "amin": (PMIN,)}


@pytest.mark.parametrize("name", REDUCTIONS)
def test_reductions_never_silently_wrong(name, mesh1, mesh2):
    """Sharded reduced dims reduce on their own; a Partial passes exactly as documented."""
    executed = []

    @HYPOTHESIS
    @given(data=st.data())
    def example(data):
        mesh = data.draw(st.sampled_from([mesh1, mesh2]))
        shape = tuple(data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
        passes = list(REDUCTION_PARTIALS[name])
        taken = st.sampled_from([R, *passes] + [Shard(d) for d in range(len(shape))])
        placements = [mostly(data, taken, st.sampled_from(ANY)) for _ in range(mesh.ndim)]
        dims = data.draw(st.lists(st.integers(0, len(shape) - 1), unique=True,
                                  max_size=len(shape)))
        kwargs = {"dim": tuple(dims), "keepdim": data.draw(st.booleans())} if dims else {}
        t = sample(shape)
        refused = any(p.is_partial() and p not in passes for p in placements)
        if check_like_torch(lambda v: getattr(v, name)(**kwargs), [distribute(t, mesh, placements)],
                            [t], refused=refused, op=name):
            executed.append(placements)

    example()
    assert_executed({name: len(executed)}, [name], MIN_EXECUTED)
