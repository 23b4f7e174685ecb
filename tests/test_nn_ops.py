"""nn ops against torch.nn.functional: batch-sharded (and channel-sharded) inputs with
Replicate weights over meshes and uneven batches; everything else raises ValueError at the call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

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
    if name == "max_pool2d" and P in placements:
        placements = [Partial("max")]
        accepted = accepted + (Partial("max"),)
        t = t.abs()  # contributions of a P(max) value: device 0 holds it, the rest the identity
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
    with pytest.raises(ValueError, match="redistribute"):
        DF.mse_loss(distribute(a, mesh, [S1] * mesh.ndim), y if placements[0] != S1 else
                    distribute(b, mesh, [S0] * mesh.ndim), reduction=reduction)
