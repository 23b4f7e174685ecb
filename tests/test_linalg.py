"""Products against plain torch: matmul's family, outer, einsum, and the affine ops (addmm,
baddbmm, linear), over meshes x placements x dtypes x uneven sizes.

Rows are checked two ways: tables of the contraction cases with the placements they must give,
and hypothesis over every layout, mostly the documented rows: a layout outside them raises a
ValueError naming the redistribute, any other gives torch's values (bit for bit on one device).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

import dtorch
import dtorch.nn.functional as F
from dtorch import Partial, Replicate, Shard
from dtorch.placement import placements_str
from helpers import (
    assert_close,
    assert_executed,
    check_like_torch,
    distribute,
    fixture_settings,
    lib,
    mostly,
    product_rows,
    sample,
)

R, S0, S1, S2, P, PA = Replicate(), Shard(0), Shard(1), Shard(2), Partial(), Partial("avg")
HYPOTHESIS = fixture_settings(10)
MIN_EXECUTED = 4  # of 10 examples per equation or op


def run(fn, ts, mesh, placements):
    """``fn`` on dtorch tensors laid out as ``placements`` (None stays None)."""
    return fn(*[None if t is None else distribute(t, mesh, p) for t, p in zip(ts, placements)])


def check(fn, ts, mesh, placements, expected_placements=None) -> None:
    out = run(fn, ts, mesh, placements)
    if expected_placements is not None:
        assert out.placements == expected_placements
    assert_close(out, fn(*ts), exact=len(mesh.devices) == 1)


def check_row(fn, name, ts, mesh, placements, expected) -> None:
    """A row of a rule table: ``expected`` None means ``dtorch.<name>`` refuses the layout with
    a ValueError that names a redistribute; else the result has placements ``expected``."""
    if expected is None:
        with pytest.raises(ValueError, match=rf"dtorch\.{name}.*redistribute"):
            run(fn, ts, mesh, placements)
        return
    check(fn, ts, mesh, placements, expected)


# -- the affine ops: addmm, baddbmm, linear ------------------------------------------------------

ADDMM = lambda c, a, b: torch.addmm(c, a, b, beta=0.5, alpha=2) if isinstance(a, torch.Tensor) \
    else dtorch.addmm(c, a, b, beta=0.5, alpha=2)  # noqa: E731

# (input shape, input placements, mat1, mat2 placements, result placements or None: refused)
ADDMM_1D = [
    ((5, 6), [S0], [S0], [R], [S0]),  # rows of mat1: the input's rows follow
    ((6,), [R], [S0], [R], [S0]),  # a broadcast input stays whole
    ((1, 6), [R], [S0], [R], [S0]),
    ((5, 6), [S1], [R], [S1], [S1]),  # columns of mat2
    ((6,), [S0], [R], [S1], [S1]),  # a 1-d input's only dim is the columns
    ((5, 6), [R], [S1], [S0], [P]),  # contracted dim: a Partial sum, the input added once
    ((5, 6), [P], [S1], [S0], [P]),  # P + P = P
    ((5, 6), [R], [P], [R], [P]),  # linear in mat1
    ((5, 6), [P], [R], [P], [P]),
    ((5, 6), [PA], [PA], [R], [PA]),
    ((5, 6), [R], [R], [PA], [PA]),  # avg of (t + p_i) is t + avg p
    ((5, 6), [R], [R], [R], [R]),
    ((5, 6), [R], [S0], [R], None),  # a whole input would be added to every row block
    ((5, 6), [S0], [R], [R], None),
    ((5, 6), [P], [R], [R], None),  # P + R is not a Partial
    ((5, 6), [PA], [S1], [S0], None),  # a Partial sum plus a Partial avg
    ((5, 6), [S0], [S1], [S0], None),
]


@pytest.mark.parametrize("sc,pc,pa,pb,expected", ADDMM_1D,
                         ids=[f"{s}{placements_str(c)}+{placements_str(a)}@{placements_str(b)}"
                              for s, c, a, b, _ in ADDMM_1D])
def test_addmm_rows(sc, pc, pa, pb, expected, mesh1):
    ts = [sample(sc, seed=2), sample((5, 4)), sample((4, 6), seed=1)]
    check_row(ADDMM, "addmm", ts, mesh1, [pc, pa, pb], expected)


def test_addmm_refusal_names_the_local_chunk(mesh1):
    with pytest.raises(ValueError, match=r"input = input\.redistribute\(placements="
                                         r"\[Shard\(dim=0\)\]\)"):
        run(ADDMM, [sample((5, 6)), sample((5, 4)), sample((4, 6))], mesh1, [[R], [S0], [R]])


@pytest.mark.parametrize("layout", [
    ([S0], [S0], [S0]), ([S1], [S1], [R]), ([S2], [R], [S2]), ([P], [S2], [S1]),
    ([R], [S2], [S1]), ([R], [R], [R]),
], ids=lambda v: "+".join(map(placements_str, v)))
def test_baddbmm(layout, mesh1, one):
    ts = [sample((3, 5, 6), seed=2), sample((3, 5, 4)), sample((3, 4, 6), seed=1)]

    def fn(c, a, b):
        return (dtorch if isinstance(a, dtorch.Tensor) else torch).baddbmm(c, a, b, beta=2,
                                                                          alpha=0.5)

    check(fn, ts, mesh1, list(layout))
    check(fn, ts, one, [[S0], [S0], [S0]])
    assert_close(distribute(ts[0], mesh1, layout[0]).baddbmm(
        distribute(ts[1], mesh1, layout[1]), distribute(ts[2], mesh1, layout[2])),
        ts[0].baddbmm(ts[1], ts[2]))


def torch_linear(x, w, b=None):
    return (F if isinstance(x, dtorch.Tensor) else torch.nn.functional).linear(x, w, b)


# (x shape, x placements, weight placements, bias placements or None (no bias), result)
LINEAR_1D = [
    ((3, 5, 4), [R], [S0], [S0], [S2]),  # column parallel: out features sharded
    ((3, 5, 4), [R], [S0], None, [S2]),
    ((3, 5, 4), [S2], [S1], [R], [P]),  # row parallel: the bias is added once
    ((3, 5, 4), [S2], [S1], None, [P]),
    ((3, 5, 4), [S0], [R], [R], [S0]),  # data parallel
    ((3, 5, 4), [S1], [R], None, [S1]),
    ((5, 4), [P], [R], [P], [P]),
    ((4,), [R], [S0], [S0], [S0]),
    ((4,), [S0], [S1], [R], [P]),
    ((3, 5, 4), [R], [S0], [R], None),  # a whole bias on a sharded output: chunk it first
    ((3, 5, 4), [S2], [R], [R], None),
    ((3, 5, 4), [R], [R], [S0], None),
]


@pytest.mark.parametrize("sx,px,pw,pb,expected", LINEAR_1D,
                         ids=[f"{s}{placements_str(x)}-{placements_str(w)}-"
                              f"{pb and placements_str(pb)}" for s, x, w, pb, _ in LINEAR_1D])
def test_linear_rows(sx, px, pw, pb, expected, mesh1):
    ts = [sample(sx), sample((6, 4), seed=1), None if pb is None else sample((6,), seed=2)]
    check_row(torch_linear, "linear", ts, mesh1, [px, pw, pb], expected)


def test_linear_on_one_device_is_bit_identical(one):
    x, w, b = sample((3, 5, 4)), sample((6, 4), seed=1), sample((6,), seed=2)
    for bias in (b, None):
        out = F.linear(distribute(x, one, [S0]), distribute(w, one, [R]),
                       None if bias is None else distribute(bias, one, [R]))
        assert_close(out, torch.nn.functional.linear(x, w, bias), exact=True)
    assert_close(F.linear(distribute(x, one, [R]), distribute(w, one, [R]), bias=None),
                 torch.nn.functional.linear(x, w), exact=True)
    assert not hasattr(dtorch, "linear")  # torch has it under nn.functional only


# -- dot, mv, outer -------------------------------------------------------------------------------


@pytest.mark.parametrize("name,sa,sb,pa,pb,expected", [
    ("dot", (7,), (7,), [S0], [S0], [P]), ("dot", (7,), (7,), [P], [R], [P]),
    ("mv", (5, 7), (7,), [S0], [R], [S0]), ("mv", (5, 7), (7,), [S1], [S0], [P]),
    ("outer", (5,), (7,), [S0], [R], [S0]), ("outer", (5,), (7,), [R], [S0], [S1]),
    ("outer", (5,), (7,), [P], [R], [P]), ("outer", (5,), (7,), [R], [PA], [PA]),
])
def test_vector_products(name, sa, sb, pa, pb, expected, mesh1, one):
    fn = lambda a, b: getattr(a, name)(b)  # noqa: E731
    ts = [sample(sa), sample(sb, seed=1)]
    check(fn, ts, mesh1, [pa, pb], expected)
    check(fn, ts, one, [[R], [R]])
    check(lambda a, b: getattr(dtorch if isinstance(a, dtorch.Tensor) else torch, name)(a, b),
          ts, mesh1, [pa, pb])


def test_vector_products_refuse_mismatched_shards(mesh1):
    with pytest.raises(ValueError, match=r"dtorch\.outer.*redistribute"):
        run(lambda a, b: a.outer(b), [sample((5,)), sample((7,))], mesh1, [[S0], [P]])
    with pytest.raises(ValueError, match=r"dtorch\.dot.*redistribute"):
        run(lambda a, b: a.dot(b), [sample((7,)), sample((7,))], mesh1, [[S0], [R]])


# -- einsum ---------------------------------------------------------------------------------------

EQUATIONS = {  # equation -> operand shapes (7 over 3 devices: uneven)
    "ij,jk->ik": [(5, 7), (7, 4)], "bij,bjk->bik": [(3, 5, 7), (3, 7, 4)],
    "ij,jk": [(5, 7), (7, 4)], "ij->": [(5, 7)], "ij->ji": [(5, 7)], "ii->i": [(5, 5)],
    "ii": [(5, 5)], "i,j->ij": [(5,), (7,)], "ij,jk,kl->il": [(5, 7), (7, 4), (4, 3)],
    "...ij,...jk->...ik": [(2, 3, 5, 7), (3, 7, 4)], "...j,j": [(3, 5, 7), (7,)],
    "bij,bj->bi": [(3, 5, 7), (1, 7)], "i,i->": [(7,), (7,)], "ji,kj": [(5, 7), (4, 5)],
}


def equation_labels(equation: str, shapes) -> tuple:
    """Each operand's labels and the result's, ``...`` spelled as digits aligned from the right
    and an implicit result made explicit (torch's rule: the broadcast dims, then the letters
    used once, in order)."""
    lhs, arrow, rhs = equation.partition("->")
    terms = lhs.split(",")
    n = max((len(s) - len(t) + 3 for t, s in zip(terms, shapes) if "..." in t), default=0)
    digits = "".join(map(str, range(n)))
    ins = [t.replace("...", digits[n - (len(s) - len(t) + 3):]) for t, s in zip(terms, shapes)]
    if arrow:
        return ins, rhs.replace("...", digits)
    letters = "".join(ins)
    return ins, digits + "".join(sorted(c for c in set(letters) if c.isalpha()
                                        and letters.count(c) == 1))


def drawn(data, rows, shapes, mesh):
    """Per mesh dim a row: four in five from ``rows``, the rest at random."""
    random_row = st.tuples(*[st.sampled_from([R, P, PA, Partial("max")] +
                                             [Shard(d) for d in range(len(s))]) for s in shapes])
    return [mostly(data, st.sampled_from(rows), random_row) for _ in range(mesh.ndim)]


@pytest.mark.parametrize("equation", sorted(EQUATIONS))
def test_einsum_never_silently_wrong(equation, mesh1, mesh2, mesh3):
    """Any operand layouts: refused exactly outside the documented rows, else torch's values;
    each equation executes a minimum of examples."""
    shapes = EQUATIONS[equation]
    labels, out = equation_labels(equation, shapes)
    rows = product_rows(labels, shapes, out)
    ts = [sample(s, seed=k) for k, s in enumerate(shapes)]
    executed = []

    @HYPOTHESIS
    @given(data=st.data())
    def example(data):
        mesh = data.draw(st.sampled_from([mesh1, mesh2, mesh3]))
        per_dim = drawn(data, sorted(rows, key=str), shapes, mesh)
        as_list = data.draw(st.booleans())  # torch.einsum(eq, [a, b]) as well as (eq, a, b)

        def fn(*xs):
            return lib(xs[0]).einsum(equation, list(xs) if as_list else xs[0],
                                     *([] if as_list else xs[1:]))

        xs = [distribute(t, mesh, [r[k] for r in per_dim], seed=k) for k, t in enumerate(ts)]
        refused = not all(r in rows for r in per_dim)
        if check_like_torch(fn, xs, ts, refused=refused, op="einsum"):
            executed.append(per_dim)

    example()
    assert_executed({equation: len(executed)}, [equation], MIN_EXECUTED)


@pytest.mark.parametrize("equation", EQUATIONS)
def test_einsum_replicated_and_one_device(equation, mesh2, one):
    ts = [sample(s, seed=k) for k, s in enumerate(EQUATIONS[equation])]
    fn = lambda *xs: (dtorch if isinstance(xs[0], dtorch.Tensor) else torch).einsum(  # noqa: E731
        equation, *xs)
    check(fn, ts, one, [[R]] * len(ts))
    check(fn, ts, mesh2, [[R, R]] * len(ts))


def test_einsum_rows(mesh2):
    a, b, c = sample((5, 7)), sample((7, 4), seed=1), sample((4, 3), seed=2)
    x, y, z = (distribute(a, mesh2, [S0, S1]), distribute(b, mesh2, [R, S0]),
               distribute(c, mesh2, [R, R]))
    out = dtorch.einsum("ij,jk,kl->il", x, y, z)
    assert out.placements == [S0, P]  # i kept, j contracted
    assert_close(out, torch.einsum("ij,jk,kl->il", a, b, c))
    with pytest.raises(ValueError, match=r"redistribute"):  # a diagonal is not a block's
        dtorch.einsum("ii->i", distribute(sample((5, 5)), mesh2, [S0, R]))


# -- dtypes and torch's errors --------------------------------------------------------------------


@pytest.mark.parametrize("da,db", [(torch.float64, torch.float64), (torch.int64, torch.int64),
                                   (torch.float32, torch.float64), (torch.int64, torch.float32)],
                         ids=str)
@pytest.mark.parametrize("name", ["matmul", "mm", "outer", "einsum", "addmm", "linear"])
def test_dtypes_as_torch(name, da, db, mesh2):
    """torch refuses mixed dtypes in products: dtorch raises the same error type at the call."""
    fns = {
        "matmul": (lambda a, b: a @ b, [(5, 4), (4, 6)]),
        "mm": (lambda a, b: a.mm(b), [(5, 4), (4, 6)]),
        "outer": (lambda a, b: a.outer(b), [(5,), (6,)]),
        "einsum": (lambda a, b: (dtorch if isinstance(a, dtorch.Tensor) else torch).einsum(
            "ij,jk->ik", a, b), [(5, 4), (4, 6)]),
        "addmm": (lambda a, b: a.addmm(a, b.t()), [(5, 4), (4, 4)]),
        "linear": (lambda a, b: torch_linear(a, b), [(5, 4), (6, 4)]),
    }
    fn, shapes = fns[name]
    ts = [sample(shapes[0], da), sample(shapes[1], db, seed=1)]
    try:
        expected = fn(*ts)
    except Exception as e:  # noqa: BLE001 - torch's own error type, at the call
        with pytest.raises(type(e)):
            run(fn, ts, mesh2, [[R, S0], [R, R]])
        return
    out = run(fn, ts, mesh2, [[S0, R], [R, R]])
    assert_close(out, expected)


def test_integer_addmm_as_torch(mesh1, one):
    ts = [sample((5, 6), torch.int64), sample((5, 4), torch.int64), sample((4, 6), torch.int64)]
    check(ADDMM, ts, one, [[R], [R], [R]])  # float beta on integers: whatever torch does
    fn = lambda c, a, b: c.addmm(a, b, beta=2, alpha=3)  # noqa: E731
    check(fn, ts, mesh1, [[S0], [S0], [R]], [S0])
    check(fn, ts, mesh1, [[R], [S1], [S0]], [P])


# -- hypothesis: the affine ops over every layout --------------------------------------------------


AFFINE = {  # name: (fn, shapes of (term, a, b) or (x, w[, bias]), labels of the product)
    "addmm": (ADDMM, [(5, 6), (5, 3), (3, 6)], (["nk", "km"], "nm")),
    "baddbmm": (lambda c, a, b: c.baddbmm(a, b, beta=0.5, alpha=2),
                [(3, 5, 6), (3, 5, 3), (3, 3, 6)], (["bnk", "bkm"], "bnm")),
    "linear": (lambda x, w, b: torch_linear(x, w, b), [(3, 5, 3), (6, 3), (6,)],
               (["bnk", "mk"], "bnm")),
    "linear-nobias": (lambda x, w: torch_linear(x, w), [(5, 3), (6, 3)], (["nk", "mk"], "nm")),
}


def term_takes(term_shape, out_shape, term, product) -> bool:
    """docs/ops.md: the added term is sharded like a sharded product where it has that dim at
    full size (Replicate where it broadcasts), a Partial sum or Replicate (added once) on a
    Partial sum, a Partial avg or Replicate on a Partial avg, Replicate on Replicate."""
    if product.is_shard():
        d = product.dim - (len(out_shape) - len(term_shape))
        full = d >= 0 and term_shape[d] == out_shape[product.dim]
        return term == (Shard(d) if full else R)
    return term in (product, R)


@pytest.mark.parametrize("name", AFFINE)
def test_affine_never_silently_wrong(name, mesh2, mesh3):
    """Any layouts of the product's operands and the added term (whole, or broadcast): refused
    exactly outside the documented rows, else torch's values."""
    fn, shapes, (labels, out) = AFFINE[name]
    executed = []

    @fixture_settings(20)  # three operands over 2 or 3 mesh dims: fewer draws all line up
    @given(data=st.data())
    def example(data):
        mesh = data.draw(st.sampled_from([mesh2, mesh3]))
        sh = list(shapes)
        term = None if name == "linear-nobias" else 2 if name == "linear" else 0
        if term is not None and data.draw(st.booleans()):  # a broadcast term
            sh[term] = (1,) + sh[term][1:] if data.draw(st.booleans()) else sh[term][-1:]
        factors = [k for k in range(len(sh)) if k != term]
        rows = product_rows(labels, [sh[k] for k in factors], out)
        out_shape = fn(*[torch.empty(s, device="meta") for s in sh]).shape
        per_dim = drawn(data, sorted(rows, key=str), [sh[k] for k in factors], mesh)
        if term is not None:  # the term follows the product where it may, else at random
            choices = [R, P, PA] + [Shard(d) for d in range(len(sh[term]))]
            per_dim = [row[:term] + (mostly(data, st.sampled_from([
                p for p in choices if term_takes(sh[term], out_shape, p, rows.get(row, R))] or
                [R]), st.sampled_from(choices)),) + row[term:] for row in per_dim]
        ts = [sample(s, seed=k) for k, s in enumerate(sh)]
        xs = [distribute(t, mesh, [r[k] for r in per_dim], seed=k) for k, t in enumerate(ts)]
        refused = not all(
            tuple(r[k] for k in factors) in rows and (term is None or term_takes(
                sh[term], out_shape, r[term], rows[tuple(r[k] for k in factors)]))
            for r in per_dim)
        if check_like_torch(fn, xs, ts, refused=refused, op=name.split("-")[0]):
            executed.append(per_dim)

    example()
    assert_executed({name: len(executed)}, [name], 2 * MIN_EXECUTED)
