"""nn ops against torch.nn.functional: batch-sharded (and channel-sharded) inputs with
Replicate weights over meshes and uneven batches; everything else raises ValueError at the call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings, strategies as st

import dtorch
from dtorch import Partial, Replicate, Shard
from helpers import assert_close, distribute

R, S0, S1, S2, P = Replicate(), Shard(0), Shard(1), Shard(2), Partial()
DF = dtorch.nn.functional


@pytest.fixture(scope="session")
def one():
    return dtorch.DeviceMesh("cpu", [0])


LAYOUTS = [("one", (R,)), ("mesh1", (S0,)), ("mesh1", (S1,)), ("mesh1", (P,)), ("mesh1", (S2,)),
           ("mesh2", (S0, S1)), ("mesh3", (S0, R, S0))]


@pytest.fixture(params=LAYOUTS, ids=lambda p: f"{p[0]}-{''.join(map(str, p[1]))}")
def layout(request):
    name, placements = request.param
    return request.getfixturevalue(name), list(placements), name == "one"


def sample(*shape, seed=0, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def rep(mesh):
    return [R] * mesh.ndim


def check(fn, x, t, exact, ok):
    """Runs on torch and dtorch; ``ok`` says whether the input placements are accepted."""
    expected = fn(torch, F, t)
    if not ok:
        with pytest.raises(ValueError, match="redistribute"):
            fn(dtorch, DF, x)
        return
    got = fn(dtorch, DF, x)
    for g, e in zip(got if isinstance(got, tuple) else (got,),
                    expected if isinstance(expected, tuple) else (expected,)):
        assert_close(g, e, exact)


W1, W2, B = sample(6, 3, 3, seed=1), sample(6, 2, 3, 3, seed=2), sample(6, seed=3)
IMAGE_OPS = {
    # name: (fn(lib, F, x), accepted placements per mesh dim)
    "conv2d": (lambda L, f, x: L.conv2d(x, _w(L, W2, x), _w(L, B, x), stride=2, padding=1),
               (R, S0)),
    "conv2d-groups": (lambda L, f, x: f.conv2d(x[:, :2] if L is torch else x[:, :2], _w(L, W2, x),
                                               None, padding="same", dilation=2), (R, S0)),
    "max_pool2d": (lambda L, f, x: f.max_pool2d(x, 2, ceil_mode=True), (R, S0, S1, P)),
    "max_pool2d-idx": (lambda L, f, x: f.max_pool2d(x, 3, 1, 1, return_indices=True),
                       (R, S0, S1)),
    "avg_pool2d": (lambda L, f, x: f.avg_pool2d(x, 2, padding=1, count_include_pad=False),
                   (R, S0, S1, P)),
    "adaptive_avg_pool2d": (lambda L, f, x: f.adaptive_avg_pool2d(x, (2, 3)), (R, S0, S1, P)),
    "interpolate": (lambda L, f, x: f.interpolate(x, scale_factor=2, mode="bilinear"),
                    (R, S0, S1, P)),
    "interpolate-nearest": (lambda L, f, x: f.interpolate(x, size=(3, 7)), (R, S0, S1, P)),
}


def _w(L, w, like):
    return w if L is torch else distribute(w, like.device_mesh, rep(like.device_mesh))


@pytest.mark.parametrize("name", IMAGE_OPS)
def test_image_ops(name, layout):
    mesh, placements, exact = layout
    fn, accepted = IMAGE_OPS[name]
    t = sample(5, 2, 6, 7)
    if name == "max_pool2d" and P in placements:  # a max of maxes: P(max) passes (P does not)
        check(fn, distribute(t, mesh, placements), t, exact, False)
        placements = [Partial("max")]
        accepted = accepted + (Partial("max"),)
    x = distribute(t, mesh, placements)
    check(fn, x, t, exact, all(p in accepted for p in placements))


def test_conv1d(mesh1):
    t, w = sample(7, 3, 9), sample(4, 3, 2, seed=1)
    x = distribute(t, mesh1, [S0])
    y = dtorch.conv1d(x, distribute(w, mesh1, [R]), stride=2)
    assert y.placements == [S0]
    assert_close(y, F.conv1d(t, w, stride=2))
    with pytest.raises(ValueError, match=r"weight = weight.redistribute\(placements=\[Repl"):
        dtorch.conv1d(x, distribute(w, mesh1, [S0]))
    with pytest.raises(RuntimeError):  # torch's own shape check, at the call
        dtorch.conv1d(x, distribute(sample(4, 2, 2), mesh1, [R]))


@pytest.mark.parametrize("placements", [[S0, R], [S1, S0], [R, S1], [R, P]], ids=str)
def test_embedding(placements, mesh2):
    """Indices sharded on any dim, or a table sharded by columns or Partial."""
    idx = torch.randint(0, 10, (5, 3), generator=torch.Generator().manual_seed(0))
    weight = sample(10, 6)
    ip = [p if p.is_shard() else R for p in placements]
    wp = [S1 if p == R and k == 1 else p if p.is_partial() else R
          for k, p in enumerate(placements)]
    y = DF.embedding(distribute(idx, mesh2, ip), distribute(weight, mesh2, wp), padding_idx=0)
    assert_close(y, F.embedding(idx, weight, padding_idx=0))


def test_one_hot(mesh1):
    idx = torch.randint(0, 4, (7, 2), generator=torch.Generator().manual_seed(0))
    for p in (S0, S1, R):
        assert_close(DF.one_hot(distribute(idx, mesh1, [p]), 5), F.one_hot(idx, 5))
    with pytest.raises(ValueError, match="num_classes"):
        DF.one_hot(distribute(idx, mesh1, [R]))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_mse_loss(reduction, layout):
    """Sharded 'mean' and 'sum' reduce on their own: the result is Replicate."""
    mesh, placements, exact = layout
    a, b = sample(7, 5, 3), sample(7, 5, 3, seed=1)
    x, y = distribute(a, mesh, placements), distribute(b, mesh, placements)
    expected = F.mse_loss(a, b, reduction=reduction)
    if P in placements:
        with pytest.raises(ValueError, match="redistribute"):
            DF.mse_loss(x, y, reduction=reduction)
        return
    got = DF.mse_loss(x, y, reduction=reduction)
    assert_close(got, expected, exact)
    if reduction != "none":
        assert got.placements == rep(mesh)
    if exact:  # one device: a Shard there is Replicate, which every layout matches
        return
    with pytest.raises(ValueError, match="redistribute"):
        DF.mse_loss(distribute(a, mesh, [S1] * mesh.ndim), y if placements[0] != S1 else
                    distribute(b, mesh, [S0] * mesh.ndim), reduction=reduction)


# -- cross_entropy, nll_loss ------------------------------------------------------------------------

W5 = torch.rand(5, generator=torch.Generator().manual_seed(4)) + 0.5
LOSS_LAYOUTS = [("one", (R,)), ("mesh1", (S0,)), ("mesh1", (R,)), ("mesh2", (S0, S0)),
                ("mesh2", (R, S0)), ("mesh3", (S0, R, S0))]
LOSS_CASES = {  # name: (fn, torch kwargs); "weight" in kwargs is distributed Replicate
    "ce": (F.cross_entropy, {}),
    "ce-sum": (F.cross_entropy, dict(reduction="sum")),
    "ce-none": (F.cross_entropy, dict(reduction="none")),
    "ce-weight": (F.cross_entropy, dict(weight=W5)),
    "ce-smooth": (F.cross_entropy, dict(label_smoothing=0.2, ignore_index=1)),
    "ce-weight-smooth": (F.cross_entropy, dict(weight=W5, label_smoothing=0.3)),
    "ce-weight-smooth-sum": (F.cross_entropy, dict(weight=W5, label_smoothing=0.3,
                                                   reduction="sum")),
    "ce-legacy": (F.cross_entropy, dict(size_average=False)),
    "nll": (F.nll_loss, {}),
    "nll-weight": (F.nll_loss, dict(weight=W5, ignore_index=2)),
    "nll-none": (F.nll_loss, dict(weight=W5, reduction="none")),
}


def class_target(n, *rest, ignored=(2,), seed=5, ignore_index=-100):
    t = torch.randint(0, 5, (n, *rest), generator=torch.Generator().manual_seed(seed))
    t[[i for i in ignored if i < n]] = ignore_index
    return t


def _loss_kwargs(kw, mesh):
    return {k: distribute(v, mesh, rep(mesh)) if isinstance(v, torch.Tensor) else v
            for k, v in kw.items()}


@pytest.mark.filterwarnings("ignore:size_average and reduce args will be deprecated")
@pytest.mark.parametrize("n", [7, 2])
@pytest.mark.parametrize("case", LOSS_CASES)
@pytest.mark.parametrize("where", LOSS_LAYOUTS, ids=lambda w: f"{w[0]}-{''.join(map(str, w[1]))}")
def test_class_losses(case, where, n, request):
    """A batch-sharded 'mean' divides the reduced sum by the reduced count (or total weight) of
    kept targets; uneven and empty blocks included (n=2 over 3 devices)."""
    mesh, placements = request.getfixturevalue(where[0]), list(where[1])
    fn, kw = LOSS_CASES[case]
    a, t = sample(n, 5), class_target(n, ignore_index=kw.get("ignore_index", -100))
    expected = fn(a, t, **kw)
    got = getattr(DF, fn.__name__)(distribute(a, mesh, placements),
                                   distribute(t, mesh, placements), **_loss_kwargs(kw, mesh))
    assert_close(got, expected, exact=where[0] == "one")
    reduced = kw.get("reduction", "mean") != "none"
    assert got.placements == (rep(mesh) if reduced else placements)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_spatial_and_probs(reduction, mesh2):
    """(N, C, d) inputs: batch and position dims shard (target dims shifted past the classes);
    class-probability targets shard like the input and 'mean' divides by the sample count."""
    a, t = sample(5, 4, 3), class_target(5, 3, seed=6).clamp(max=3)
    x, y = distribute(a, mesh2, [S0, S2]), distribute(t, mesh2, [S0, S1])
    got = DF.cross_entropy(x, y, reduction=reduction, label_smoothing=0.1)
    assert_close(got, F.cross_entropy(a, t, reduction=reduction, label_smoothing=0.1))
    if reduction == "none":
        assert got.placements == [S0, S1]
    probs = torch.softmax(sample(5, 4, 3, seed=7), 1)
    got = DF.cross_entropy(x, distribute(probs, mesh2, [S0, S2]), weight=_w(DF, W5[:4], x),
                           reduction=reduction)
    assert_close(got, F.cross_entropy(a, probs, weight=W5[:4], reduction=reduction))


def test_class_loss_one_sample(mesh1):
    a = sample(5)
    got = DF.cross_entropy(distribute(a, mesh1, [R]), distribute(torch.tensor(3), mesh1, [R]))
    assert_close(got, F.cross_entropy(a, torch.tensor(3)))


def test_class_loss_placement_errors(mesh1):
    """The class dim, the weight and Partials must be whole: a ValueError names the fix."""
    a, t = sample(7, 5), class_target(7)
    x, y = distribute(a, mesh1, [S0]), distribute(t, mesh1, [S0])
    with pytest.raises(ValueError, match=r"input = input.redistribute\(placements=\[Repl"):
        DF.cross_entropy(distribute(a, mesh1, [S1]), distribute(t, mesh1, [R]))
    with pytest.raises(ValueError, match=r"weight = weight.redistribute"):
        DF.nll_loss(x, y, weight=distribute(W5, mesh1, [S0]))
    with pytest.raises(ValueError, match="redistribute"):
        DF.cross_entropy(x, distribute(t, mesh1, [R]))
    with pytest.raises(ValueError, match="redistribute"):
        DF.nll_loss(distribute(a, mesh1, [P]), distribute(t, mesh1, [R]), reduction="sum")


LOSS_ERRORS = {  # torch's own errors, raised at the call
    "int32 target": lambda L, a, t, w: L.cross_entropy(a, t.int()),
    "float target": lambda L, a, t, w: L.nll_loss(a, t.float()),
    "weight size": lambda L, a, t, w: L.cross_entropy(a, t, weight=w[:4]),
    "weight dtype": lambda L, a, t, w: L.nll_loss(a, t, weight=w.double()),
    "smoothing": lambda L, a, t, w: L.cross_entropy(a, t, label_smoothing=1.5),
    "batch": lambda L, a, t, w: L.cross_entropy(a, t[:3]),
    "reduction": lambda L, a, t, w: L.nll_loss(a, t, reduction="avg"),
}


@pytest.mark.parametrize("name", LOSS_ERRORS)
def test_class_loss_torch_errors(name, mesh1):
    a, t = sample(7, 5), class_target(7)
    with pytest.raises(Exception) as expected:
        LOSS_ERRORS[name](F, a, t, W5)
    d = [distribute(v, mesh1, [R]) for v in (a, t, W5)]
    with pytest.raises(expected.type):
        LOSS_ERRORS[name](DF, *d)


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(n=st.integers(0, 6), ignored=st.lists(st.integers(0, 5), max_size=3),
       weighted=st.booleans(), smoothing=st.sampled_from([0.0, 0.25]),
       reduction=st.sampled_from(["mean", "sum", "none"]), seed=st.integers(0, 99))
def test_cross_entropy_batches(mesh1, n, ignored, weighted, smoothing, reduction, seed):
    """Any batch size over 3 devices (empty blocks, every target ignored: 0 / 0 is nan)."""
    a, t = sample(n, 5, seed=seed), class_target(n, ignored=ignored, seed=seed)
    kw = dict(weight=W5 if weighted else None, label_smoothing=smoothing, reduction=reduction)
    got = DF.cross_entropy(distribute(a, mesh1, [S0]), distribute(t, mesh1, [S0]),
                           **_loss_kwargs(kw, mesh1))
    expected = F.cross_entropy(a, t, **kw)
    torch.testing.assert_close(got.to_torch(), expected, equal_nan=True)


# -- scaled_dot_product_attention -----------------------------------------------------------------

ATTN_LAYOUTS = [("one", (R,)), ("mesh1", (S0,)), ("mesh1", (S1,)), ("mesh2", (S0, S1)),
                ("mesh2", (S1, S1)), ("mesh3", (S0, S1, R))]
MASKS = {  # name: (mask of (B, H, L, S) = (5, 4, 3, 6) scores, or None; its placements follow q's)
    "none": None,
    "bool-2d": torch.rand(3, 6, generator=torch.Generator().manual_seed(8)) > 0.3,
    "float-4d": sample(5, 4, 3, 6, seed=9),
    "bool-head-broadcast": torch.rand(5, 1, 3, 6, generator=torch.Generator().manual_seed(10))
    > 0.3,
}


def _mask_placements(mask, placements):
    """The mask's dims matching q's sharded batch/head dims of the same size shard alike."""
    off = 4 - mask.dim()
    return [Shard(p.dim - off) if p.is_shard() and p.dim >= off
            and mask.shape[p.dim - off] > 1 else R for p in placements]


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("where", ATTN_LAYOUTS, ids=lambda w: f"{w[0]}-{''.join(map(str, w[1]))}")
def test_attention(mask, where, request):
    """Batch and head dims shard alike in query, key, value and mask (uneven: 5 and 4 over 3)."""
    mesh, placements = request.getfixturevalue(where[0]), list(where[1])
    q, k, v = sample(5, 4, 3, 8), sample(5, 4, 6, 8, seed=1), sample(5, 4, 6, 2, seed=2)
    m = MASKS[mask]
    expected = F.scaled_dot_product_attention(q, k, v, m, scale=0.3)
    dm = None if m is None else distribute(m, mesh, _mask_placements(m, placements))
    got = DF.scaled_dot_product_attention(*(distribute(t, mesh, placements) for t in (q, k, v)),
                                          dm, scale=0.3)
    assert_close(got, expected, exact=where[0] == "one")
    assert got.placements == placements


@pytest.mark.parametrize("placements", [[S0, R], [R, S0], [S0, S0], [S1, R], [S1, S1],
                                        [S0, S1]], ids=str)
def test_attention_gqa_and_causal(placements, mesh2):
    """GQA (6 query heads, 2 key heads): the batch shards alike; the query heads shard (uneven
    over 4 devices: 2, 1, 2, 1) with key and value heads Replicate; causal masks line up
    top-left (L != S), as torch."""
    q, k, v = sample(3, 6, 4, 8), sample(3, 2, 5, 8, seed=1), sample(3, 2, 5, 8, seed=2)
    kv_placements = [R if p == S1 else p for p in placements]
    got = DF.scaled_dot_product_attention(
        distribute(q, mesh2, placements), *(distribute(t, mesh2, kv_placements) for t in (k, v)),
        is_causal=True, enable_gqa=True)
    assert_close(got, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    assert got.placements == placements
    # key heads sharded too where their blocks line up with the query's (6 and 2 over 2: 3, 1)
    heads = [distribute(t, mesh2, [S1, R]) for t in (q, k, v)]
    assert_close(DF.scaled_dot_product_attention(*heads, enable_gqa=True),
                 F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    heads = [distribute(t, mesh2, [S1, S1]) for t in (q, k, v)]  # over 4: 2, 1, 2, 1 and 1, 0
    with pytest.raises(ValueError, match=r"key = key.redistribute\(placements=\[Replicate"):
        DF.scaled_dot_product_attention(*heads, enable_gqa=True)


def test_attention_partial_value(mesh1):
    """softmax(q k^T / sqrt(E)) @ v is linear in v: a Partial value gives a Partial output."""
    q, k, v = sample(2, 3, 4, 8), sample(2, 3, 5, 8, seed=1), sample(2, 3, 5, 6, seed=2)
    got = DF.scaled_dot_product_attention(distribute(q, mesh1, [R]), distribute(k, mesh1, [R]),
                                          distribute(v, mesh1, [P]))
    assert got.placements == [P]
    assert_close(got, F.scaled_dot_product_attention(q, k, v))


def test_attention_causal_and_mask(mesh1):
    """torch's CPU kernel applies both a mask and the causal triangle (its meta kernel refuses)."""
    q, m = sample(5, 2, 4, 8), sample(4, 4, seed=11) > 0
    x = distribute(q, mesh1, [S0])
    got = DF.scaled_dot_product_attention(x, x, x, distribute(m, mesh1, [R]), is_causal=True)
    assert_close(got, F.scaled_dot_product_attention(q, q, q, m, is_causal=True))


@pytest.mark.parametrize("dim", [2, 3])
def test_attention_sequence_and_embedding_must_be_whole(dim, mesh1):
    """Context parallel is not there yet: a sharded sequence or embedding dim raises."""
    q, k, v = (distribute(sample(2, 3, 4, 8, seed=s), mesh1, [Shard(dim)]) for s in range(3))
    with pytest.raises(ValueError, match=r"query = query.redistribute\(placements=\[Replicate"):
        DF.scaled_dot_product_attention(q, k, v)


ATTN_ERRORS = {  # (exception, fn(L, q, k, v)): torch's own errors and dropout, at the call
    "dropout": (NotImplementedError, lambda L, q, k, v: L.scaled_dot_product_attention(
        q, k, v, dropout_p=0.1)),
    "int mask": (RuntimeError, lambda L, q, k, v: L.scaled_dot_product_attention(
        q, k, v, (q[0, 0, :, :1] > 0).long())),
    "heads": (RuntimeError, lambda L, q, k, v: L.scaled_dot_product_attention(
        q, k[:, :2], v[:, :2])),
    "dtypes": (RuntimeError, lambda L, q, k, v: L.scaled_dot_product_attention(
        q, k, v.double())),
}


@pytest.mark.parametrize("name", ATTN_ERRORS)
def test_attention_errors(name, mesh1):
    error, fn = ATTN_ERRORS[name]
    q = sample(2, 3, 4, 8)
    if error is not NotImplementedError:
        with pytest.raises(error):
            fn(F, q, q, q)
    x = distribute(q, mesh1, [R])
    with pytest.raises(error):
        fn(DF, x, x, x)
