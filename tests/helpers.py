"""Comparing dtorch programs with plain torch across meshes and placements.

A test builds torch operands with ``sample``, lays them out with ``distribute`` over a
``layout_fixture`` (the ``one``, ``mesh1``, ``mesh2`` and ``mesh3`` meshes of conftest.py), runs
the same function on both with ``check_like_torch`` (or ``torch_expected`` where dtorch may
refuse a layout first) and compares with ``assert_close``. Partial operands are genuine
(``partial_parts``: every device a different contribution), so a value check fails when a rule
lets a Partial through a function that does not commute with its reduction. Every case says
whether the placement rules refuse it (``assert_refused``): an unexpected refusal fails as much
as a wrong value. Property tests count the examples they executed (``assert_executed``).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import re

import pytest
import torch
from hypothesis import HealthCheck, settings, strategies as st

import dtorch
from dtorch import Partial, Replicate, Shard
from dtorch.placement import placements_str


def fixture_settings(max_examples: int) -> settings:
    """Hypothesis settings for a ``@given`` test that also takes pytest fixtures (the meshes,
    ``layout``): they hold no per-example state, so the function-scoped-fixture health check is
    off; no deadline, as an example may start the runtime or plan a new redistribute.
    Derandomized: the examples are the same in every run, so a test asserting how many of them
    executed (``assert_executed``) cannot fail by chance."""
    return settings(max_examples=max_examples, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


def mostly(data, likely, other):
    """A draw from the strategy ``likely`` four times in five, else from ``other``: a property
    over layouts draws most of them from the rows an op accepts, so that most examples run.
    (``st.one_of`` would not do: it picks its distinct branches alike, however often one is
    listed.)"""
    return data.draw(likely if data.draw(st.sampled_from(range(5))) else other)


def placement_choices(tensor_ndim: int, partial: bool = True) -> list:
    """Every single-mesh-dim placement for a tensor of ``tensor_ndim`` dims."""
    out = [Replicate()] + [Shard(d) for d in range(tensor_ndim)]
    return out + [Partial()] if partial else out


def all_placements(mesh_ndim: int, tensor_ndim: int, partial: bool = True) -> list:
    return [list(p) for p in itertools.product(placement_choices(tensor_ndim, partial),
                                              repeat=mesh_ndim)]


def aligned_placements(placements, out_shape, shape) -> list:
    """Placements of an operand of ``shape`` broadcast to ``out_shape`` that follow the output's
    shards (Replicate where it broadcasts)."""
    off = len(out_shape) - len(shape)
    out = []
    for p in placements:
        d = p.dim - off if p.is_shard() else -1
        out.append(Shard(d) if d >= 0 and shape[d] == out_shape[p.dim] else Replicate())
    return out


def reshape_refused(old, new, placements, mesh) -> bool:
    """docs/ops.md's reshape rule: a sharded dim keeps its shard when it is the outermost
    non-unit dim of its merged or split group and, unless the group is one dim kept whole, the
    shard count divides both its size and the size of the group's outer new dim; any other
    shard is refused (a unit dim's included)."""
    groups = _reshape_groups(tuple(old), tuple(new))
    for d, size in enumerate(old):
        if not any(p.is_shard(d) for p in placements):
            continue
        if size == 1:
            return True
        olds, news = next(g for g in groups if d in g[0])
        count = math.prod(n for p, n in zip(placements, mesh.shape) if p.is_shard(d))
        if d != olds[0] or (len(olds), len(news)) != (1, 1) and (
                size % count or new[news[0]] % count):
            return True
    return False


def _reshape_groups(old, new) -> list:
    """[(old dims, new dims)]: the non-unit dims a reshape merges and splits together."""
    a = [d for d, n in enumerate(old) if n != 1]
    b = [d for d, n in enumerate(new) if n != 1]
    groups, i, j = [], 0, 0
    while i < len(a):
        olds, news, po, pn = [a[i]], [b[j]], old[a[i]], new[b[j]]
        i, j = i + 1, j + 1
        while po != pn:
            if po < pn:
                olds.append(a[i])
                po, i = po * old[a[i]], i + 1
            else:
                news.append(b[j])
                pn, j = pn * new[b[j]], j + 1
        groups.append((olds, news))
    return groups


def product_rows(labels, shapes, out) -> dict:
    """docs/ops.md's product rows for one mesh dim, {operand placements: result placement}, from
    the einsum labels of each operand and of the result: a label sharded in every operand that
    has it at full size (a kept one shards the result, a contracted one makes a Partial sum; a
    diagonal label none); one Partial operand, the others Replicate, stays Partial."""
    size = {}
    for labs, shape in zip(labels, shapes):
        for c, n in zip(labs, shape):
            size[c] = max(size.get(c, 1), n)
    R = Replicate()
    rows = {(R,) * len(labels): R}
    for c in size:
        if any(labs.count(c) > 1 for labs in labels):
            continue
        row = tuple(Shard(labs.index(c)) if c in labs and shape[labs.index(c)] == size[c] else R
                    for labs, shape in zip(labels, shapes))
        if row != (R,) * len(labels):
            rows[row] = Shard(out.index(c)) if c in out else Partial()
    for p in (Partial(), Partial("avg")):
        for k in range(len(labels)):
            rows[tuple(p if j == k else R for j in range(len(labels)))] = p
    return rows


def layout_id(layout) -> str:
    """A test id for a (mesh fixture name, placements) row: ``mesh2-S(0)S(1)``."""
    return f"{layout[0]}-{placements_str(layout[1])}"


def layout_fixture(layouts: list):
    """A ``layout`` fixture over ``layouts``, rows of (mesh fixture name, placements). Each test
    gets (mesh, placements as a list, exact): exact (bit-identical to torch) on ``one``, the
    one-device mesh. Use as ``layout = layout_fixture(LAYOUTS)`` in a test module."""

    @pytest.fixture(params=layouts, ids=layout_id)
    def layout(request):
        name, placements = request.param
        return request.getfixturevalue(name), list(placements), name == "one"

    return layout


def lib(x):
    """dtorch for a dtorch tensor, torch for a torch one: ``lib(x).cat(...)`` runs on both."""
    return dtorch if isinstance(x, dtorch.Tensor) else torch


def sample(shape, dtype=torch.float32, seed=0, positive=False) -> torch.Tensor:
    """A seeded torch tensor: normal floats, ints in [-5, 5], random bools. ``positive`` (for
    logs, roots and divisors) gives floats >= 0.5, ints in [1, 5] and all-True bools."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(1 if positive else 0, 2, shape, generator=g).bool()
    if not dtype.is_floating_point:
        return torch.randint(1 if positive else -5, 6, shape, generator=g, dtype=dtype)
    t = torch.randn(shape, generator=g, dtype=dtype)
    return t.abs() + 0.5 if positive else t


def distribute(t: torch.Tensor, mesh, placements, seed: int = 0) -> dtorch.Tensor:
    """``t`` laid out as ``placements`` on ``mesh``. A Partial mesh dim holds genuine
    contributions (``partial_parts``), not the value on one device: each device of that mesh
    dim gets its own part, so a rule that lets a Partial through a function that does not
    commute with the reduction gives a wrong value. The parts of every Partial mesh dim are
    stacked in leading dims sharded over those mesh dims, and each device drops its size-1
    leading dims (a local_map): the blocks are then the contributions."""
    placements = list(placements)
    partial_dims = [i for i, p in enumerate(placements) if p.is_partial()]
    if not partial_dims:
        return dtorch.from_torch(t, device_mesh=mesh, placements=placements)
    g = torch.Generator().manual_seed(seed)
    stacked = t
    for lead, i in enumerate(partial_dims):  # the outermost reduction first (assemble's order)
        parts = partial_parts(stacked, placements[i].reduce_op, mesh.shape[i], g)
        stacked = parts.movedim(0, lead)
    lead = len(partial_dims)
    layout = [Shard(partial_dims.index(i)) if p.is_partial() else
              Shard(p.dim + lead, p.sub_split) if p.is_shard() else p
              for i, p in enumerate(placements)]
    x = dtorch.from_torch(stacked.contiguous(), device_mesh=mesh, placements=layout)
    return dtorch.local_map(torch.squeeze, placements)(x, tuple(range(lead)))


def partial_parts(t: torch.Tensor, op: str, n: int, g: torch.Generator) -> torch.Tensor:
    """``n`` random contributions whose ``op`` reduction is ``t``, stacked (``[n, *t.shape]``).

    - ``sum``: parts of mixed signs that add up to ``t`` exactly, adding in device order (as
      the client does) or in float32 (as a low-precision collective should): each float part
      is a multiple of the element's last-bit unit (its ulp) with as many bits as the dtype
      holds, and so is every running total. Integers: small random parts, the last one the
      rest (wrapping, as integer sums do). Bools: an "or", as their saturating sum.
    - ``max`` (``min``): every part at or below (above) ``t``, ``t`` itself on a random device
      per element.
    - ``avg``: parts whose mean is ``t`` (the float sum of ``n * t`` rounds once for n = 3).
    Non-finite elements sit on one device (the others: the identity). Complex: real and
    imaginary parts apart.
    """
    if n == 1:
        return t.unsqueeze(0).clone()
    if t.is_complex():
        return torch.view_as_complex(partial_parts(torch.view_as_real(t), op, n, g).contiguous())
    if op in ("max", "min") or t.dtype == torch.bool:
        return _extremum_parts(t, op, n, g)
    if not t.is_floating_point():
        return _integer_parts(t, op, n, g)
    bits = int(round(-math.log2(torch.finfo(t.dtype).eps))) + 1  # precision, the implicit bit too
    wide = t.double()
    finite = torch.isfinite(wide)
    mant, exp = torch.frexp(torch.where(finite, wide, 0.0))
    # t = m * unit with |m| < 2 ** bits; the parts are k * unit with |k| < 2 ** bits
    m = torch.ldexp(mant, torch.full_like(exp, bits)).long()
    total = m * n if op == "avg" else m
    k = _walk(total, n, 2 ** bits - 1, g)
    parts = torch.ldexp(k.double(), (exp - bits).expand_as(k))
    parts[0] = torch.where(finite, parts[0], wide)
    return parts.to(t.dtype)


def _walk(total: torch.Tensor, n: int, bound: int, g: torch.Generator) -> torch.Tensor:
    """``n`` random integer steps from 0 to ``total``, stacked: each step and each running
    total at most ``bound`` in size (the totals at most ``|total|`` where that is larger: an
    average's ``n * t``)."""
    limit = torch.maximum(total.abs(), torch.full_like(total, bound))
    steps, here = [], torch.zeros_like(total)
    for j in range(1, n):
        left = (n - j) * bound  # the remaining steps must still reach the total
        lo = torch.maximum(torch.maximum(-limit, here - bound), total - left)
        hi = torch.minimum(torch.minimum(limit, here + bound), total + left)
        u = torch.rand(total.shape, generator=g, dtype=torch.float64)
        nxt = torch.minimum(lo + (u * (hi - lo + 1).double()).long(), hi)
        steps.append(nxt - here)
        here = nxt
    steps.append(total - here)
    return torch.stack(steps)


def _integer_parts(t, op, n, g):
    """Integer parts: small random ones, the last the rest (a sum of ``n * t`` for avg)."""
    wide = t.long()
    parts = torch.randint(-3, 4, (n - 1, *t.shape), generator=g, dtype=torch.int64)
    if op == "avg":
        parts = wide + parts
        rest = wide * n - parts.sum(0)
    else:
        rest = wide - parts.sum(0)
    return torch.cat([parts, rest.unsqueeze(0)]).to(t.dtype)


def _extremum_parts(t, op, n, g):
    """Parts at or below ``t`` (max; above for min), ``t`` on a random device per element.
    Bools: a random subset of the devices holds True where ``t`` is (max, or a bool sum), or
    False where it is not (min)."""
    winner = torch.randint(0, n, t.shape, generator=g)
    lose = torch.arange(n).view(-1, *[1] * t.dim()) != winner
    down = op != "min"
    if t.dtype == torch.bool:
        coin = torch.randint(0, 2, (n, *t.shape), generator=g).bool()
        others = t & coin if down else t | coin
    elif t.is_floating_point():
        noise = (torch.rand((n, *t.shape), generator=g, dtype=torch.float64) + 0.1)
        wide = t.double()
        step = noise * (wide.abs() + 1)
        # rounding to the dtype goes to the nearest value, which stays on t's side
        others = (wide - step if down else wide + step).to(t.dtype)
    else:
        info = torch.iinfo(t.dtype)
        step = torch.randint(1, 4, (n, *t.shape), generator=g)
        wide = t.long()
        others = (wide - step).clamp(min=info.min) if down else (wide + step).clamp(max=info.max)
        others = others.to(t.dtype)
    return torch.where(lose, others, t.expand_as(others))


def assert_close(actual, expected, exact: bool = False, equal_nan: bool = False) -> None:
    """``actual`` (a dtorch.Tensor or torch.Tensor) equals ``expected``: bit for bit when
    ``exact`` (one device), else allclose for floats and equal for integers and bools; dtype and
    shape always match. A tuple ``expected`` (``split``, ``max(dim)``) needs a tuple of as many
    outputs, compared one by one. ``equal_nan``: NaN where torch has NaN passes."""
    if isinstance(expected, tuple):
        assert isinstance(actual, tuple) and len(actual) == len(expected), (actual, expected)
        for a, e in zip(actual, expected):
            assert_close(a, e, exact, equal_nan)
        return
    value = actual.to_torch() if isinstance(actual, dtorch.Tensor) else actual
    if isinstance(actual, dtorch.Tensor):
        assert tuple(actual.shape) == tuple(expected.shape), (actual.shape, expected.shape)
        assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert value.shape == expected.shape, (value.shape, expected.shape)
    assert value.dtype == expected.dtype, (value.dtype, expected.dtype)
    if exact and not equal_nan:
        assert torch.equal(value, expected), (value, expected)
        return
    # distributed float kernels may differ from one-device ones in the last bits (vectorized
    # tails, another summation order): torch.testing's tolerances for the dtype (float64's are
    # tight enough to catch a float32 round trip); integers and bools have no rounding to forgive
    inexact = (expected.is_floating_point() or expected.is_complex()) and not exact
    tol = {} if inexact else {"rtol": 0, "atol": 0}
    torch.testing.assert_close(value, expected, equal_nan=equal_nan, **tol)


def assert_within_torch_error(actual, reference, torch_result, factor: float = 4.0) -> None:
    """``actual`` is as close to ``reference`` (the same computation in float64) as torch's own
    result in ``actual``'s dtype is, within ``factor``: the tolerance comes from the error the
    computation has on this machine (another summation order, such as a ring's blockwise
    log-sum-exp, may round differently), plus a few units in the last place of the values, for
    results torch happens to get exact. The dtypes and shapes must match torch's."""
    value = actual.to_torch() if isinstance(actual, dtorch.Tensor) else actual
    assert value.shape == torch_result.shape and value.dtype == torch_result.dtype, (
        value.shape, value.dtype, torch_result.shape, torch_result.dtype)
    reference = reference.double()
    torch_error = (torch_result.double() - reference).abs().max().item()
    ulps = 4 * torch.finfo(value.dtype).eps * reference.abs().max().item()
    bound = factor * torch_error + ulps
    error = (value.double() - reference).abs()
    assert error.max().item() <= bound, (
        f"{(error > bound).sum().item()} of {error.numel()} elements are off by up to "
        f"{error.max().item():.3g} from the float64 reference; torch's own {value.dtype} result "
        f"is off by {torch_error:.3g}, so the bound is {bound:.3g}")


TORCH_RAISED = object()  # what torch_expected returns when torch raised


def torch_expected(fn, ts, xs):
    """``fn(*ts)`` on the torch operands ``ts``. Where torch raises, asserts that ``fn(*xs)`` on
    the dtorch operands ``xs`` raises the same exception type, at the call, and returns
    ``TORCH_RAISED``."""
    try:
        return fn(*ts)
    except Exception as e:  # noqa: BLE001 - whatever torch raises, dtorch must raise too
        with pytest.raises(type(e)):
            fn(*xs)
        return TORCH_RAISED


def check_like_torch(fn, xs, ts, exact: bool = False, equal_nan: bool = False,
                     refused: bool = False, op: str = "") -> bool:
    """``fn`` on dtorch operands ``xs`` gives ``fn`` on torch operands ``ts`` (``assert_close``),
    or raises torch's exception type at the call; a case the placement rules refuse (the test
    says so: ``refused``) raises ``assert_refused``'s ValueError instead. Returns whether it
    compared a value."""
    expected = torch_expected(fn, ts, xs)
    if expected is TORCH_RAISED:
        return False
    if refused:
        assert_refused(fn, *xs, op=op)
        return False
    assert_close(fn(*xs), expected, exact, equal_nan)
    return True


def assert_refused(fn, *args, op: str = "") -> None:
    """``fn(*args)`` is refused at the call: a ValueError naming ``dtorch.<op>`` (any op when
    not given) and the ``redistribute(`` that fixes it. A test states each refusal it expects
    (from a table, or from the op's documented rows); anything else must run."""
    name = re.escape(op) if op else r"\w+"
    with pytest.raises(ValueError, match=rf"dtorch\.{name}\b.*redistribute\("):
        fn(*args)


def assert_executed(counts, keys, minimum: int) -> None:
    """Every key (an op of a property test) ran at least ``minimum`` examples that were not
    refused: a property over layouts proves nothing about the ones it never executes."""
    short = {k: counts.get(k, 0) for k in keys if counts.get(k, 0) < minimum}
    assert not short, f"fewer than {minimum} executed (not refused) examples: {short}"


@contextlib.contextmanager
def runtime_with(**env):
    """A runtime whose processes read these environment variables (the next operator starts
    it), then the one the session had again, with the variables as they were (the suite may
    run under DTORCH_REPLAY=0 or DTORCH_FUSION=0 as a whole)."""
    saved = {name: os.environ.get(name) for name in env}
    dtorch.shutdown()
    os.environ.update(env)
    try:
        yield
    finally:
        dtorch.shutdown()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
