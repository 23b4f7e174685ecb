"""Finite-difference gradient checks of dtorch's autograd: ``torch.autograd.gradcheck``, in
float64, of every registry op that has a gradient, on the one-device, 1-D (3 devices) and 2-D
(2 x 2) meshes of conftest.py, with Shard (uneven blocks), Replicate and Partial operands.

Method. ``Distributed`` makes a dtorch computation a torch function: its forward lays each
float64 input out on the mesh (``helpers.distribute``: a Partial operand is a leaf whose pieces
are genuine, different contributions that sum to its value), runs the op with grad mode on and
returns the results' full values; its backward is ``dtorch.autograd.grad`` of those results,
the incoming gradients laid out like them. gradcheck compares that backward with central
differences of dtorch's own forward. It runs in fast mode (``v^T J u`` for random ``u``, ``v``
against the finite difference along ``u``), on the inputs flattened into one vector and on
every layout of a mesh at once (their results stacked): three forwards (the value, then the
central difference) and two backwards (the second checks that the first is deterministic)
check an op on a mesh, each issuing every layout's calls before its one wait. A wrong gradient
on any layout or input changes the product (``test_a_wrong_gradient_fails``); a failure is
then narrowed down to its layout.

Coverage. The ops are the registry's (``OPS``): every dtorch entry whose kernel autograd records
(none that communicates, writes in place or acts outside its results; composites are made of
entries), less ``NO_GRADIENT``, which says why each of those has none. ``CASES`` gives each op
its inputs, a function of them and the placements each operand may take; the layouts checked
are those of ``layouts`` the op's placement rule takes (it refuses, say, a Partial operand of a
nonlinear op). Inputs lie where the op is smooth: positive for logs and roots, inside (-1, 1)
for acos and asin, elsewhere at least 0.2 from zero (the kink of abs, relu, sign, ...). The
seeded random values lie far, against the step of 1e-6, from ties (max, sort) and jumps
(floor, round, fmod), so that piecewise constant ops are checked too: their gradient is zero,
which a finite difference sees.
"""

from __future__ import annotations

import itertools
import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from torch.autograd.gradcheck import GradcheckError

import dtorch
import extension_kernels as K
from dtorch import Partial, Replicate, Shard
from dtorch.autograd import tape
from dtorch.ops.registry import REGISTRY, issue
from dtorch.protocol import COMM, IMPURE, INPLACE
from helpers import distribute

F = dtorch.nn.functional
R, P = Replicate(), Partial()
# the undefined-gradient check is the wrapper's (materialized zeros), not dtorch's
GRADCHECK = {"eps": 1e-6, "atol": 1e-5, "rtol": 1e-3, "fast_mode": True,
             "check_undefined_grad": False}


class Distributed(torch.autograd.Function):
    """``case.fn`` as one torch function, from its inputs (flattened into one vector) to the
    results of every layout of ``layouts`` (flattened into one vector): each layout runs on
    dtorch leaves of the inputs laid out so on ``mesh``. The forward and the backward issue
    every layout's calls before their one wait."""

    @staticmethod
    def forward(ctx, case, mesh, layouts, flat):
        xs = [v.view(a.shape) for v, a in zip(flat.split(case.sizes()), case.args)]
        ctx.runs = []
        for layout in layouts:
            leaves = [distribute(x, mesh, p).requires_grad_() for x, p in zip(xs, layout)]
            with torch.enable_grad():  # a Function's forward runs under no_grad
                outs = case.fn(*leaves)
            outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
            # the op under test is on the tape: the check cannot pass through other ops alone
            ops = {node.name() for node in tape._reachable(outs)}
            assert case.name in ops, f"{case.name} not recorded: {sorted(ops)}"
            ctx.runs.append((leaves, outs))
        return torch.cat([v.reshape(-1) for v in values(o for _, outs in ctx.runs for o in outs)])

    @staticmethod
    def backward(ctx, grad):
        outs = [o for _, os in ctx.runs for o in os]
        grads = iter(g.view(o.shape) for g, o in zip(grad.split([o.numel() for o in outs]), outs))
        found = []
        for leaves, outs in ctx.runs:
            # torch gradients: grad() lays each out like its output (a Partial one Replicate)
            gs = dtorch.autograd.grad(outs, leaves, [next(grads) for _ in outs],
                                      retain_graph=True, allow_unused=True)
            found += [dtorch.zeros_like(x) if g is None else g for g, x in zip(gs, leaves)]
        found, n = values(found), len(ctx.runs[0][0])
        return None, None, None, torch.cat([sum(found[i::n]).reshape(-1) for i in range(n)])


def values(tensors) -> list:
    """The tensors' full values, fetched together (one wait, not one per tensor)."""
    return [f.get() for f in [t.to_torch_async() for t in tensors]]


def gradcheck(function, case, mesh, layouts, xs, **kw) -> bool:
    """gradcheck of ``function`` (``Distributed``) on ``layouts`` at ``xs``. In fast mode it
    checks ``v^T J u`` for random ``u`` and ``v``: with the inputs one vector and the layouts'
    results stacked, one central difference and one backward (run twice, to check that it is
    deterministic) cover every input on every layout, and a wrong gradient on any of them
    changes the product."""
    flat = torch.cat([x.reshape(-1) for x in xs]).requires_grad_()
    return torch.autograd.gradcheck(lambda v: function.apply(case, mesh, layouts, v), (flat,),
                                    **{**GRADCHECK, **case.gradcheck, **kw})


# -- inputs ---------------------------------------------------------------------------------------

DOMAINS = {  # uniform u in [0, 1), sign s in {-1, 1}
    "signed": lambda u, s: s * (0.2 + u),  # away from the kink at 0
    "wide": lambda u, s: s * (0.2 + 7 * u),  # both sides of hardtanh's, hardswish's, relu6's kinks
    "unit": lambda u, s: s * (0.1 + 0.7 * u),  # inside acos's and asin's (-1, 1)
    "positive": lambda u, s: 0.5 + u,  # logs, roots, a pow's base
}


@dataclass(frozen=True)
class Arg:
    shape: tuple
    domain: str = "signed"
    places: tuple | None = None  # the placements it may take on one mesh dim (None: all)

    def options(self) -> tuple:
        if self.places is not None:
            return self.places
        return (*(Shard(d) for d in range(len(self.shape))), R, P)


@dataclass
class Case:
    fn: Callable | None  # of the dtorch operands (None: the registry's public function)
    args: list
    gradcheck: dict = field(default_factory=dict)
    name: str = ""

    def inputs(self, seed: int) -> list:
        g = torch.Generator().manual_seed(seed)
        out = []
        for a in self.args:
            u = torch.rand(a.shape, generator=g, dtype=torch.float64)
            s = torch.randint(0, 2, a.shape, generator=g, dtype=torch.float64) * 2 - 1
            out.append(DOMAINS[a.domain](u, s))
        return out

    def sizes(self) -> list:
        return [math.prod(a.shape) for a in self.args]


def public(name) -> Callable:
    """The op as the registry exports it: ``dtorch.<name>``, ``F.<name>`` or a method."""
    op = REGISTRY[name]
    if op.function:
        return getattr(dtorch, name)
    if op.functional:
        return getattr(F, name)
    return lambda x, *rest: getattr(x, op.methods[0])(*rest)


def case(fn, *args, **gradcheck_kw) -> Case:
    """A case of ``fn`` (None: the op itself) of ``args``: shapes (signed values) or ``Arg``s."""
    return Case(fn, [a if isinstance(a, Arg) else Arg(a) for a in args], gradcheck_kw)


def const(t: torch.Tensor, like) -> dtorch.Tensor:
    """A non-differentiable operand (an index, a mask, a target) on ``like``'s mesh, sharded
    as ``like`` on the leading dims they share (rules take an index sharded with its input),
    else Replicate."""
    placements = [p if p.is_shard() and p.dim < t.ndim and t.shape[p.dim] == like.shape[p.dim]
                  else R for p in like.placements]
    return dtorch.from_torch(t, device_mesh=like.device_mesh, placements=placements)


X = (5, 4)  # 2, 2, 1 rows and 2, 1, 1 columns on 3 devices; 3, 2 rows on 2
VEC, IMG = (5,), (1, 2, 4, 4)
ROWS = torch.tensor([4, 0, 2])  # three distinct rows of X
COLS = torch.tensor([[0, 3], [2, 1], [3, 2], [1, 0], [2, 3]])  # two distinct columns per row
PICK = torch.tensor([3, 0, 3])  # columns of X
MASK = torch.tensor([[True, False, True, False]] * 2 + [[False, True, True, True]] * 3)
TARGET = torch.tensor([3, 0, 1, 1, 2])
TOKENS = torch.tensor([[4, 0], [2, 2], [1, 3]])  # rows of a (5, 4) table
MEAN, VAR = torch.tensor([0.1, -0.2, 0.3, 0.0]).double(), torch.tensor([0.5, 1, 2, 1.5]).double()
NOT_PARTIAL = (Shard(0), Shard(1), R)  # for an X operand


def unary(domain="signed") -> Case:
    return case(None, Arg(X, domain))


CASES = {
    # -- pointwise, one operand
    **{name: unary() for name in (
        "abs", "atan", "ceil", "cos", "cosh", "erf", "exp", "expm1", "floor", "neg",
        "reciprocal", "round", "sigmoid", "sign", "sin", "sinh", "square", "tan", "tanh", "trunc",
        "clone", "contiguous", "double", "relu", "selu", "celu", "elu", "gelu", "silu", "mish",
        "softplus", "softsign", "tanhshrink", "logsigmoid", "hardshrink", "softshrink",
        "leaky_relu")},
    **{name: unary("wide") for name in ("hardtanh", "relu6", "hardsigmoid", "hardswish")},
    **{name: unary("unit") for name in ("acos", "asin")},
    **{name: unary("positive") for name in ("log", "log10", "log1p", "log2", "sqrt", "rsqrt")},
    "threshold": case(lambda x: dtorch.threshold(x, 0.3, -2.0), X),
    "dropout": case(lambda x: (dtorch.manual_seed(0), F.dropout(x, 0.3))[1], X),  # one mask
    # casts: linear, checked with a step their precision resolves
    "float": case(None, X, eps=1e-3, atol=1e-3),
    "to": case(lambda x: x.to(torch.float32), X, eps=1e-3, atol=1e-3),
    "half": case(None, X, eps=1e-1, atol=3e-2, rtol=3e-2),
    "bfloat16": case(None, X, eps=2.5e-1, atol=1e-1, rtol=1e-1),
    # -- pointwise, two or three operands (some broadcast)
    **{name: case(None, X, X) for name in (
        "sub", "div", "atan2", "fmod", "remainder", "maximum", "minimum")},
    "add": case(None, X, (4,)),
    "mul": case(None, X, (5, 1)),
    "pow": case(None, Arg(X, "positive"), X),
    "rdiv": case(lambda x: 2.5 / x, X),
    "rsub": case(lambda x: 1.5 - x, X),
    "rpow": case(lambda x: 1.5 ** x, X),
    "addcdiv": case(lambda a, b, c: dtorch.addcdiv(a, b, c, value=0.5), X, X, X),
    "addcmul": case(lambda a, b, c: dtorch.addcmul(a, b, c, value=0.5), X, X, X),
    "lerp": case(None, X, X, X),
    "where": case(lambda a, b: dtorch.where(a > 0, a, b), X, X),
    "where_method": case(lambda a, b: a.where(a > 0, b), X, X),
    "clamp": case(None, Arg(X, "wide"), X, X),
    "clip": case(lambda x: dtorch.clip(x, -0.5, 0.8), X),
    "masked_fill": case(lambda x, v: x.masked_fill(const(MASK, x), v), X, ()),
    # Replicate only: the k-th True of the whole mask takes source[k], which no shard places
    "masked_scatter": case(lambda x, s: x.masked_scatter(const(MASK, x), s),
                           Arg(X, places=(R,)), Arg(X, places=(R,))),
    # -- products
    "matmul": case(None, X, (4, 3)),
    "mm": case(None, X, (4, 3)),
    "bmm": case(None, (2, 5, 4), (2, 4, 3)),
    "dot": case(None, VEC, VEC),
    "mv": case(None, X, (4,)),
    "outer": case(None, VEC, (4,)),
    "addmm": case(None, (5, 3), X, (4, 3)),
    "baddbmm": case(None, (2, 5, 3), (2, 5, 4), (2, 4, 3)),
    "einsum": case(lambda a, b: dtorch.einsum("ij,kj->ik", a, b), X, (3, 4)),
    "linear": case(None, X, (3, 4), (3,)),
    # -- reductions and normalizations along a dim
    "sum": case(lambda x: (x.sum(), x.sum(0, keepdim=True)), X),
    "mean": case(lambda x: (x.mean(), x.mean(1)), X),
    "prod": case(lambda x: x.prod(1), X),
    # not over a sharded dim: that makes a Partial(max/min), which has no gradient yet
    "amax": case(lambda x: x.amax(1), Arg(X, places=(Shard(0), R, P))),
    "amin": case(lambda x: x.amin(0), Arg(X, places=(Shard(1), R, P))),
    "max": case(lambda x: x.max(1)[0], Arg(X, places=(Shard(0), R, P))),
    "min": case(lambda x: x.min(0)[0], Arg(X, places=(Shard(1), R, P))),
    "std": case(lambda x: x.std(1), X),
    "var": case(lambda x: x.var(1, correction=0), X),
    "norm": case(lambda x: x.norm(dim=1), X),
    "logsumexp": case(lambda x: x.logsumexp(1), X),
    "cumsum": case(lambda x: x.cumsum(0), X),
    "cumprod": case(lambda x: x.cumprod(1), X),
    "softmax": case(lambda x: x.softmax(1), X),
    "log_softmax": case(lambda x: x.log_softmax(0), X),
    "sort": case(lambda x: x.sort(1)[0], X),
    "topk": case(lambda x: x.topk(2, dim=1)[0], X),
    "layer_norm": case(lambda x, w, b: F.layer_norm(x, (4,), w, b), X, (4,), (4,)),
    "rms_norm": case(lambda x, w: F.rms_norm(x, (4,), w), X, (4,)),
    "group_norm": case(lambda x, w, b: F.group_norm(x, 2, w, b), (2, 4, 3), (4,), (4,)),
    # inference (the op), and training (dtorch's operators over the batch: its statistics)
    "batch_norm": case(lambda x, w, b: (F.batch_norm(x, const(MEAN, x), const(VAR, x), w, b),
                                        F.batch_norm(x, None, None, w, b, training=True)),
                       X, (4,), (4,)),
    "cross_entropy": case(lambda x: F.cross_entropy(x, const(TARGET, x)), X),
    "nll_loss": case(lambda x: F.nll_loss(x, const(TARGET, x)), X),
    "mse_loss": case(None, X, X),
    "scaled_dot_product_attention": case(
        lambda q, k, v: (F.scaled_dot_product_attention(q, k, v),
                         F.scaled_dot_product_attention(q, k, v, is_causal=True)),
        (1, 2, 3, 4), (1, 2, 3, 4), (1, 2, 3, 4)),
    # its kernel computes in float32: a step float32 resolves
    "_apply_rotary_emb": case(lambda x, c, s: F._apply_rotary_emb(x, [c, s]),
                              (1, 2, 3, 4), (3, 4), (3, 4), eps=1e-3, atol=1e-4),
    "conv1d": case(None, (2, 2, 5), (3, 2, 2), (3,)),
    "conv2d": case(None, IMG, (3, 2, 2, 2), (3,)),
    "adaptive_avg_pool2d": case(lambda x: F.adaptive_avg_pool2d(x, 2), IMG),
    "avg_pool2d": case(lambda x: F.avg_pool2d(x, 2), IMG),
    "max_pool2d": case(lambda x: F.max_pool2d(x, 2), IMG),
    "interpolate": case(lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"), IMG),
    "pad": case(lambda x: F.pad(x, (1, 2)), X),
    # -- shapes
    "cat": case(lambda a, b: dtorch.cat([a, b], 0), X, (3, 4)),
    "stack": case(lambda a, b: dtorch.stack([a, b], 1), X, X),
    "chunk": case(lambda x: x.chunk(2, 1), X),
    "split": case(lambda x: x.split(2, 0), X),
    "unbind": case(lambda x: x.unbind(1), X),
    "expand": case(lambda x: x.expand(5, 4), (1, 4)),
    "expand_as": case(lambda x: x.expand_as(const(torch.zeros(X, dtype=torch.float64), x)), (4,)),
    "flatten": case(lambda x: x.flatten(1), (2, 3, 4)),
    "flip": case(lambda x: x.flip(0), X),
    "movedim": case(lambda x: x.movedim(0, 2), (2, 3, 4)),
    "narrow": case(lambda x: x.narrow(0, 1, 3), X),
    "permute": case(lambda x: x.permute(2, 0, 1), (2, 3, 4)),
    "repeat": case(lambda x: x.repeat(2, 1), X),
    "repeat_interleave": case(lambda x: x.repeat_interleave(2, dim=0), X),
    "reshape": case(lambda x: x.reshape(5, 2, 2), X),
    "view": case(lambda x: x.view(5, 2, 2), X),
    "squeeze": case(lambda x: x.squeeze(1), (5, 1, 4)),
    "unsqueeze": case(lambda x: x.unsqueeze(1), X),
    "t": case(lambda x: x.t(), X),
    "transpose": case(lambda x: x.transpose(0, 2), (2, 3, 4)),
    "tile": case(lambda x: x.tile((2, 1)), X),
    "tril": case(lambda x: x.tril(), X),
    "triu": case(lambda x: x.triu(1), X),
    "roll": case(lambda x: x.roll(1, 0), X),
    "unflatten": case(lambda x: x.unflatten(1, (2, 2)), X),
    # a slice, an int and an index (a column twice: its gradient sums)
    "getitem": case(lambda x: (x[:, 1:3], x[:, 2], x[:, const(PICK, x)]), X),
    # a Replicate block read as a Partial piece: the value times the number of pieces
    "relabel": case(lambda x: x.view([P if p.is_replicate() else p for p in x.placements]),
                    Arg(X, places=NOT_PARTIAL)),
    # the second half of a cat along its shard: a sub-split cut back into a segment
    "_take_segments": case(lambda x: issue("_take_segments", (dtorch.cat([x, x * 2], 0),),
                                           (0, 5, 5)), Arg(X, places=(Shard(0), R))),
    # -- indexing
    "gather": case(lambda x: x.gather(1, const(COLS, x)), X),
    "index_select": case(lambda x: x.index_select(0, const(ROWS, x)), X),
    "index_add": case(lambda x, s: x.index_add(0, const(ROWS, x), s), X, (3, 4)),
    # accumulate=True: Partial operands pass (Replicate only without)
    "index_put": case(lambda x, v: x.index_put([const(ROWS, x)], v, accumulate=True), X, (3, 4)),
    "scatter": case(lambda x, s: x.scatter(1, const(COLS, x), s), X, (5, 2)),
    "scatter_add": case(lambda x, s: x.scatter_add(1, const(COLS, x), s), X, (5, 2)),
    "embedding": case(lambda w: F.embedding(const(TOKENS, w), w), X),
    "vocab_parallel_embedding": case(lambda w: F.vocab_parallel_embedding(const(TOKENS, w), w),
                                     Arg(X, places=NOT_PARTIAL)),
    # -- extensions: a registered op (its custom_op carrier) and a local_map
    "custom_op": case(lambda x: K.double(x), Arg(X, places=(Shard(0), R, P))),
    "local_map": case(lambda x: dtorch.local_map(torch.sin, x.placements)(x),
                      Arg(X, places=NOT_PARTIAL)),
}
for _name, _case in CASES.items():
    _case.name = _name
    if _case.fn is None:
        _case.fn = public(_name)

_INTEGER = "an integer or bool result: nothing to differentiate"
_NO_OPERAND = "a factory: no floating operand (a seed is an integer)"
NO_GRADIENT = {
    **{name: _INTEGER for name in (
        "all", "any", "allclose", "equal", "argmax", "argmin", "argsort", "bitwise_and",
        "bitwise_not", "bitwise_or", "bitwise_xor", "eq", "ne", "lt", "le", "gt", "ge",
        "isfinite", "isinf", "isnan", "logical_and", "logical_not", "logical_or", "logical_xor",
        "one_hot", "bool", "byte", "char", "int", "long", "short", "failure_token", "isin")},
    **{name: _NO_OPERAND for name in (
        "arange", "empty", "eye", "full", "linspace", "logspace", "ones", "zeros", "from_data",
        "rand", "randn", "randint", "randperm", "uninitialized")},
    "floor_divide": "torch: derivative for aten::floor_divide is not implemented",
    "rfloordiv": "torch: derivative for aten::floor_divide is not implemented",
    "rmod": "torch: derivative for aten::remainder (scalar, tensor) is not implemented",
    "detach": "no history by definition (tape.NOT_RECORDED)",
}


def has_tape(op) -> bool:
    """Whether autograd records calls of ``op`` through the hosts' VJP: a dtorch kernel that
    neither communicates (the two that do differentiate through their collectives, checked
    against torch in test_context_parallel.py and test_moe.py), writes in place (never
    recorded: optimizer updates among them), nor acts outside its results (IMPURE: markers,
    memory, files); a composite is made of such entries."""
    return (op.origin == "dtorch" and op.kernel is not None
            and not op.flags & (COMM | INPLACE | IMPURE))


OPS = sorted(name for name, op in REGISTRY.items() if has_tape(op) and name not in NO_GRADIENT)


def test_every_op_has_a_case_or_a_reason():
    assert sorted(CASES) == OPS, (f"no case: {sorted(set(OPS) - set(CASES))}, "
                                  f"not a recorded op: {sorted(set(CASES) - set(OPS))}")
    assert not set(NO_GRADIENT) - set(REGISTRY)


# -- layouts --------------------------------------------------------------------------------------


def refused(case, operands) -> bool:
    """Whether the op's placement rule refuses these operands' layouts: it raises at the call,
    before any kernel runs, and there is no gradient to check."""
    try:
        with torch.no_grad():
            case.fn(*operands)
    except ValueError as e:
        if "placements are not supported" not in str(e):
            raise
        return True
    return False


def layouts(case, mesh, xs) -> list:
    """The layouts to check ``case`` on, one placement list per operand, among those the op's
    rule takes (asked with blank operands, ``empty``: only their layouts matter).

    - One device: Replicate, and Partial (a Partial of one piece) for the operands that may be.
    - A 1-D mesh: each operand in each of its options, the others aligned with it where the
      rule takes that, else rotated apart, else Replicate.
    - A 2-D mesh, from those: the last (Partial where the op takes it) over the second, and the
      first (most often Shard(0)) twice: a dim sharded over both mesh dims, in nested uneven
      blocks.
    """
    options = [a.options() for a in case.args]
    blanks: dict = {}

    def takes(layout) -> bool:
        for i, ps in enumerate(layout):
            if (i, *ps) not in blanks:
                blanks[(i, *ps)] = dtorch.empty(xs[i].shape, dtype=torch.float64,
                                                device_mesh=mesh, placements=ps)
        return not refused(case, [blanks[(i, *ps)] for i, ps in enumerate(layout)])

    if math.prod(mesh.shape) == 1:
        partial = [[P] if P in opts else [R] for opts in options]
        return [[[R] for _ in options]] + ([partial] if [P] in partial and takes(partial) else [])
    pad = [R] * (mesh.ndim - 1)  # the other mesh dims Replicate: rules match one at a time
    found = []
    for i, opts in enumerate(options):
        for k, o in enumerate(opts):
            if any(layout[i] == o for layout in found):
                continue
            prefs = [[o] if j == i else
                     [p for p in dict.fromkeys([o, other[(k + j - i) % len(other)], R])
                      if p in other] for j, other in enumerate(options)]
            for layout in itertools.product(*prefs):
                if takes([[p, *pad] for p in layout]):
                    found.append(list(layout))
                    break
    if mesh.ndim == 1:
        return [[[p] for p in layout] for layout in found]
    out = []
    for a, b in ((found[-1], found[1 % len(found)]), (found[0], found[0])):
        layout = [[p, q] for p, q in zip(a, b)]
        if layout not in out and takes(layout):
            out.append(layout)
    return out


MESHES = ("one", "mesh1", "mesh2")


@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize("name", OPS)
def test_gradcheck(name, mesh_name, request):
    """dtorch's gradient of ``name`` equals finite differences of its forward, on every layout
    of ``layouts`` on the mesh."""
    case, mesh = CASES[name], request.getfixturevalue(mesh_name)
    xs = case.inputs(seed=zlib.crc32(name.encode()))  # each op its own inputs, whatever others
    checked = layouts(case, mesh, xs)
    if mesh_name != "one" and any(o != R for a in case.args for o in a.options()):
        # the op's rule takes some operand distributed: the check is not Replicate alone
        assert any(p != R for layout in checked for ps in layout for p in ps), checked
    if not gradcheck(Distributed, case, mesh, checked, xs, raise_exception=False):
        for layout in checked:  # which layout: gradcheck's error says what differs
            try:
                gradcheck(Distributed, case, mesh, [layout], xs)
            except GradcheckError as e:
                pytest.fail(f"{name} on {layout}: {e}")
        pytest.fail(f"{name}: only the layouts together fail: {checked}")


class Scaled(Distributed):
    """dtorch's backward, 1% too large: a gradient gradcheck must reject."""

    @staticmethod
    def backward(ctx, grad):
        return tuple(g if g is None else g * 1.01 for g in Distributed.backward(ctx, grad))


def test_a_wrong_gradient_fails(mesh1):
    """The check is not vacuous: a backward 1% off fails, and so does one layout's lost
    gradient among right ones (``b`` detached where it is Partial: the same values, no
    gradient through it)."""
    mul = Case(dtorch.mul, [Arg((4,)), Arg((4,))], name="mul")
    xs = mul.inputs(seed=0)
    checked = [[[Shard(0)], [Shard(0)]], [[P], [R]], [[R], [P]]]
    assert gradcheck(Distributed, mul, mesh1, checked, xs)
    assert not gradcheck(Scaled, mul, mesh1, checked, xs, raise_exception=False)
    lost = Case(lambda a, b: a * (b.detach() if b.placements == [P] else b), mul.args,
                name="mul")
    assert gradcheck(Distributed, lost, mesh1, checked[:2], xs)
    assert not gradcheck(Distributed, lost, mesh1, checked, xs, raise_exception=False)


def test_a_max_over_a_sharded_dim_has_no_gradient_yet(mesh1):
    """Why the cases of amax, amin, max and min reduce unsharded dims only: over a sharded dim
    they make a Partial(max/min), whose gradient dtorch refuses yet (docs/training.md). When
    this fails, it has one: widen their cases."""
    x = distribute(torch.rand(5, 4, dtype=torch.float64), mesh1, [Shard(0)]).requires_grad_()
    for reduce, op in ((lambda t: t.amax(0), "max"), (lambda t: t.amin(0), "min"),
                       (lambda t: t.max(), "max")):
        with pytest.raises(NotImplementedError, match=rf"Partial\('{op}'\)"):
            dtorch.autograd.grad(reduce(x).sum(), [x])
