"""dtorch.nn's layers against their torch twins: every module loaded with its twin's weights
(``load_state_dict(torch_module.state_dict())``) gives torch's outputs, bit for bit on one
device and allclose on distributed meshes (a batch of 5, uneven over 3 and 4 devices; channels
sharded where the op's rule allows), prints as torch's, and refuses at the call what the
placement rules refuse. Ends with a small CNN built from torch modules."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as TF

import dtorch
import dtorch.nn as nn
from dtorch import Partial, PoolingKind, Replicate, Shard
from helpers import assert_close, assert_refused, distribute

R, S0, S1, S2 = Replicate(), Shard(0), Shard(1), Shard(2)

# (mesh fixture, input placements): pointwise-like ops take the batch and the channels sharded
CHANNEL_LAYOUTS = [("one", (R,)), ("mesh1", (S0,)), ("mesh1", (S1,)), ("mesh2", (S0, S1))]
# conv and group norm: the batch only (5 samples over 3 and over 2 x 2 devices)
BATCH_LAYOUTS = [("one", (R,)), ("mesh1", (S0,)), ("mesh2", (S0, S0))]


def _ids(row) -> str:
    return f"{row[0]}-{''.join(map(str, row[1]))}"


@pytest.fixture(params=CHANNEL_LAYOUTS, ids=_ids)
def layout(request):
    name, placements = request.param
    return request.getfixturevalue(name), list(placements), name == "one"


@pytest.fixture(params=BATCH_LAYOUTS, ids=_ids)
def batch_layout(request):
    name, placements = request.param
    return request.getfixturevalue(name), list(placements), name == "one"


def sample(*shape, seed=0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def randomized(module: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """``module`` with random floating parameters and buffers (variances positive), so a
    twin that ignored one of them would differ."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in module.state_dict().items():
            if t.is_floating_point():
                value = torch.rand(t.shape, generator=g) + 0.5 if "var" in name else (
                    torch.randn(t.shape, generator=g))
                t.copy_(value)
    return module


def twin(name: str, *args, mesh, train: bool = False, **kwargs):
    """(dtorch module, torch module) of class ``name``, the dtorch one on ``mesh`` loaded with
    the torch one's (random) state, both in the same mode."""
    tmod = randomized(getattr(torch.nn, name)(*args, **kwargs))
    dmod = getattr(nn, name)(*args, device_mesh=mesh, **kwargs)
    result = dmod.load_state_dict(tmod.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    return dmod.train(train), tmod.train(train)


def run(dmod, tmod, t, mesh, placements, exact):
    """Both modules on ``t`` (the dtorch one on ``t`` laid out as ``placements``)."""
    x = dtorch.from_torch(t, device_mesh=mesh, placements=placements)
    assert_close(dmod(x), tmod(t.clone()), exact)


# -- activations ----------------------------------------------------------------------------------

ACTIVATIONS = [
    ("ReLU", {}), ("ReLU", {"inplace": True}), ("ReLU6", {}), ("ReLU6", {"inplace": True}),
    ("Hardtanh", {"min_val": -0.5, "max_val": 2.0}), ("Sigmoid", {}), ("Tanh", {}),
    ("LeakyReLU", {"negative_slope": 0.2}), ("LeakyReLU", {"inplace": True}),
    ("ELU", {"alpha": 0.7}), ("ELU", {"inplace": True}), ("SELU", {}), ("SELU", {"inplace": True}),
    ("CELU", {"alpha": 0.7}), ("CELU", {"inplace": True}), ("SiLU", {}),
    ("SiLU", {"inplace": True}),
    ("GELU", {}), ("GELU", {"approximate": "tanh"}), ("Mish", {}), ("Mish", {"inplace": True}),
    ("Hardswish", {}), ("Hardswish", {"inplace": True}), ("Hardsigmoid", {}),
    ("Hardsigmoid", {"inplace": True}), ("Softplus", {"beta": 2.0, "threshold": 1.0}),
    ("Softsign", {}), ("Tanhshrink", {}), ("Threshold", {"threshold": 0.1, "value": 20.0}),
    ("Threshold", {"threshold": 0.1, "value": 20.0, "inplace": True}),
    ("Hardshrink", {"lambd": 0.3}), ("Softshrink", {"lambd": 0.3}), ("LogSigmoid", {}),
    ("GLU", {}), ("Softmax", {"dim": -1}), ("LogSoftmax", {"dim": 3}), ("Softmin", {"dim": -1}),
]


@pytest.mark.parametrize("name, kwargs", ACTIVATIONS,
                         ids=[f"{n}-{'-'.join(map(str, k.values()))}" for n, k in ACTIVATIONS])
def test_activation_like_torch(name, kwargs, layout):
    mesh, placements, exact = layout
    dmod, tmod = getattr(nn, name)(**kwargs), getattr(torch.nn, name)(**kwargs)
    assert repr(dmod) == repr(tmod)
    t = sample(5, 6, 3, 4) * 3
    x = dtorch.from_torch(t, device_mesh=mesh, placements=placements)
    expected = tmod(t.clone())
    out = dmod(x)
    assert_close(out, expected, exact)
    assert out.placements == placements
    if kwargs.get("inplace"):  # the input itself holds the result, as in torch
        assert_close(x, expected, exact)


@pytest.mark.parametrize("num_parameters", [1, 6])
def test_prelu_like_torch(num_parameters, layout):
    mesh, placements, exact = layout
    dmod, tmod = twin("PReLU", num_parameters, mesh=mesh)
    assert repr(dmod) == repr(tmod)
    run(dmod, tmod, sample(5, 6, 3, 4), mesh, placements, exact)


def test_softmax2d(mesh1):
    t = sample(5, 6, 3, 4)
    for placements in ([S0], [S2]):
        x = dtorch.from_torch(t, device_mesh=mesh1, placements=placements)
        assert_close(nn.Softmax2d()(x), torch.nn.Softmax2d()(t))
    assert_refused(nn.Softmax2d(), dtorch.from_torch(t, device_mesh=mesh1, placements=[S1]))
    with pytest.raises(ValueError):
        nn.Softmax2d()(dtorch.from_torch(t[0, 0]))


def test_activations_refuse_what_their_rules_refuse(mesh1):
    t = sample(5, 6)
    part = distribute(t, mesh1, [Partial()])
    for module in (nn.CELU(), nn.Softsign(), nn.LogSigmoid(), nn.GELU(), nn.Softmax(1)):
        assert_refused(module, part)
    assert_refused(nn.Softmax(dim=1), dtorch.from_torch(t, device_mesh=mesh1, placements=[S1]))
    assert_refused(nn.GLU(dim=0), dtorch.from_torch(t.T.contiguous(), device_mesh=mesh1,
                                                    placements=[S0]))
    with pytest.raises(RuntimeError, match="Halving dimension must be even"):
        nn.GLU()(dtorch.from_torch(sample(2, 3)))
    # relu is non-decreasing: a Partial(max) passes
    parts = distribute(t, mesh1, [Partial("max")])
    assert_close(nn.ReLU()(parts), torch.relu(t))


# -- normalisation --------------------------------------------------------------------------------

NORMS = [
    ("LayerNorm", ((3, 4),), {}), ("LayerNorm", (4,), {"bias": False}),
    ("LayerNorm", (4,), {"elementwise_affine": False, "eps": 1e-3}),
    ("RMSNorm", (4,), {}), ("RMSNorm", ((3, 4),), {"eps": 1e-6}),
    ("RMSNorm", (4,), {"elementwise_affine": False}),
    ("BatchNorm2d", (6,), {}), ("BatchNorm2d", (6,), {"affine": False, "eps": 1e-3}),
    ("BatchNorm2d", (6,), {"bias": False}),
]


@pytest.mark.parametrize("name, args, kwargs", NORMS,
                         ids=[f"{n}-{a}-{'-'.join(map(str, k.values()))}" for n, a, k in NORMS])
def test_norm_like_torch(name, args, kwargs, layout):
    mesh, placements, exact = layout
    dmod, tmod = twin(name, *args, mesh=mesh, **kwargs)
    assert repr(dmod) == repr(tmod)
    run(dmod, tmod, sample(5, 6, 3, 4), mesh, placements, exact)


@pytest.mark.parametrize("affine, bias", [(True, True), (True, False), (False, True)])
def test_group_norm_like_torch(affine, bias, batch_layout):
    mesh, placements, exact = batch_layout
    dmod, tmod = twin("GroupNorm", 3, 6, mesh=mesh, affine=affine, bias=bias, eps=1e-4)
    assert repr(dmod) == repr(tmod)
    run(dmod, tmod, sample(5, 6, 3, 4), mesh, placements, exact)


def test_norms_refuse_sharded_normalized_dims(mesh1):
    x = dtorch.from_torch(sample(5, 6, 3, 4), device_mesh=mesh1, placements=[S1])
    assert_refused(nn.GroupNorm(3, 6, device_mesh=mesh1), x)
    assert_refused(nn.LayerNorm((6, 3, 4), device_mesh=mesh1), x)
    with pytest.raises(ValueError, match="divisible"):
        nn.GroupNorm(4, 6)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_batch_norm_training_uses_batch_statistics(momentum, layout):
    """Training mode: the batch's statistics normalise, the running ones move as torch's (two
    steps), and eval mode then uses them."""
    mesh, placements, _ = layout
    dmod, tmod = twin("BatchNorm2d", 6, mesh=mesh, train=True, momentum=momentum)
    for seed in (0, 1):
        run(dmod, tmod, sample(5, 6, 3, 4, seed=seed) * 2 + 1, mesh, placements, False)
    for name, value in tmod.state_dict().items():
        assert_close(dmod.state_dict()[name], value)
    dmod.eval(), tmod.eval()
    run(dmod, tmod, sample(5, 6, 3, 4, seed=2), mesh, placements, False)


def test_batch_norm_without_running_stats(mesh1):
    dmod, tmod = twin("BatchNorm2d", 6, mesh=mesh1, track_running_stats=False)
    assert set(dmod.state_dict()) == set(tmod.state_dict()) == {"weight", "bias"}
    run(dmod, tmod, sample(5, 6, 3, 4), mesh1, [S0], False)  # eval: the batch's statistics


def test_batch_norm_channels_last_and_checks(mesh1):
    t = sample(5, 6, 3, 4)
    nhwc = t.permute(0, 2, 3, 1).contiguous()
    tmod = randomized(torch.nn.BatchNorm2d(6))
    state = {k: v.clone() for k, v in tmod.state_dict().items()}
    for train, placements in [(False, S0), (False, Shard(3)), (True, S0), (True, Shard(3))]:
        tmod.load_state_dict(state)
        dmod = nn.BatchNorm2d(6, is_nchw=False, device_mesh=mesh1)
        dmod.load_state_dict(state)
        dmod.train(train), tmod.train(train)
        x = dtorch.from_torch(nhwc, device_mesh=mesh1, placements=[placements])
        assert_close(dmod(x), tmod(t).permute(0, 2, 3, 1))
        assert_close(dmod.running_var, tmod.running_var)
        assert repr(dmod).endswith("is_nchw=False)")
    with pytest.raises(ValueError, match="expected 4D input"):
        nn.BatchNorm2d(6)(dtorch.from_torch(sample(5, 6)))
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        nn.BatchNorm2d(6).train()(dtorch.from_torch(sample(1, 6, 1, 1)))
    nn.BatchNorm2d(6)(dtorch.from_torch(sample(1, 6, 1, 1)))  # eval mode: running statistics


def test_norms_start_as_torch(mesh1):
    for dmod, tmod in [(nn.LayerNorm(4), torch.nn.LayerNorm(4)),
                       (nn.RMSNorm(4), torch.nn.RMSNorm(4)),
                       (nn.GroupNorm(2, 4), torch.nn.GroupNorm(2, 4)),
                       (nn.BatchNorm2d(4), torch.nn.BatchNorm2d(4))]:
        state = tmod.state_dict()
        assert list(dmod.state_dict()) == list(state)
        for name, value in dmod.state_dict().items():
            assert_close(value, state[name], exact=True)
    ln = nn.LayerNorm(4, device_mesh=mesh1)
    ln.weight.copy_(dtorch.zeros(4, device_mesh=mesh1))
    ln.reset_parameters()
    assert_close(ln.weight, torch.ones(4), exact=True)


# -- convolution ----------------------------------------------------------------------------------

CONV2D = [
    (3, {}), (3, {"padding": 1}), (3, {"padding": "same"}), (3, {"padding": "valid", "stride": 2}),
    ((2, 3), {"padding": (1, 2), "stride": (2, 1), "dilation": (1, 2)}),
    ((2, 4), {"padding": "same"}), (3, {"padding": "same", "dilation": 2}),
    (3, {"groups": 2, "bias": False}), (3, {"groups": 2, "padding": 1, "padding_mode": "reflect"}),
    (3, {"padding": (1, 2), "padding_mode": "circular"}),
    ((3, 2), {"padding": "same", "padding_mode": "replicate"}),
]
CONV1D = [
    (3, {}), (3, {"padding": "same"}), (4, {"padding": "same", "dilation": 2}),
    (3, {"stride": 2, "padding": 1, "bias": False}), (3, {"groups": 2}),
    (3, {"padding": 2, "padding_mode": "circular"}), (3, {"padding": "valid"}),
]


def _conv_ids(cases):
    return [f"{k}-{'-'.join(f'{a}={v}' for a, v in kw.items())}" for k, kw in cases]


@pytest.mark.parametrize("kernel, kwargs", CONV2D, ids=_conv_ids(CONV2D))
def test_conv2d_like_torch(kernel, kwargs, batch_layout):
    mesh, placements, exact = batch_layout
    dmod, tmod = twin("Conv2d", 4, 6, kernel, mesh=mesh, **kwargs)
    assert repr(dmod) == repr(tmod)
    run(dmod, tmod, sample(5, 4, 9, 8), mesh, placements, exact)


@pytest.mark.parametrize("kernel, kwargs", CONV1D, ids=_conv_ids(CONV1D))
def test_conv1d_like_torch(kernel, kwargs, batch_layout, request):
    mesh, placements, exact = batch_layout
    if exact and kwargs.get("groups", 1) > 1:
        request.applymarker(pytest.mark.xfail(strict=False, reason=(
            "known gap (runtime): a host's stream threads run torch with fewer intra-op "
            "threads than the client, and torch picks another CPU backend for a grouped conv1d "
            "by thread count: the last bit may differ from the client's torch")))
    dmod, tmod = twin("Conv1d", 4, 6, kernel, mesh=mesh, **kwargs)
    assert repr(dmod) == repr(tmod)
    run(dmod, tmod, sample(5, 4, 11), mesh, placements, exact)


@pytest.mark.parametrize("kwargs", [{}, {"padding": "same", "bias": False},
                                    {"stride": 2, "padding": 1, "padding_mode": "reflect"}])
def test_conv2d_channels_last(kwargs, batch_layout):
    """``is_nchw=False``: channels-last input and output, the same weight as torch's."""
    mesh, placements, _ = batch_layout
    tmod = randomized(torch.nn.Conv2d(4, 6, 3, **kwargs))
    dmod = nn.Conv2d(4, 6, 3, is_nchw=False, device_mesh=mesh, **kwargs)
    dmod.load_state_dict(tmod.state_dict())
    t = sample(5, 4, 9, 8)
    x = dtorch.from_torch(t.permute(0, 2, 3, 1).contiguous(), device_mesh=mesh,
                          placements=placements)
    assert_close(dmod(x), tmod(t).permute(0, 2, 3, 1))


def tf_same_pads(size, kernel, stride):
    """TensorFlow's SAME: ceil(size / stride) outputs, the extra padding after (F.pad order)."""
    pads = []
    for n, k, s in zip(size, kernel, stride):
        need = max(0, (math.ceil(n / s) - 1) * s + k - n)
        pads.append((need // 2, need - need // 2))
    (top, bottom), (left, right) = pads
    return left, right, top, bottom


def test_conv2d_dtorch_paddings(batch_layout):
    """DTorch's forms: four paddings (h_begin, w_begin, h_end, w_end), and "same" with a
    stride (ceil(size / stride) outputs; torch refuses it)."""
    mesh, placements, exact = batch_layout
    t = sample(5, 4, 9, 8)
    x = dtorch.from_torch(t, device_mesh=mesh, placements=placements)
    tmod = randomized(torch.nn.Conv2d(4, 6, 3))
    four = nn.Conv2d(4, 6, 3, padding=(1, 0, 2, 1), device_mesh=mesh)
    four.load_state_dict(tmod.state_dict())
    assert_close(four(x), tmod(TF.pad(t, (0, 1, 1, 2))), exact)
    strided = nn.Conv2d(4, 6, 3, stride=2, padding="same", device_mesh=mesh)
    strided.load_state_dict(tmod.state_dict())
    expected = TF.conv2d(TF.pad(t, tf_same_pads((9, 8), (3, 3), (2, 2))), tmod.weight,
                         tmod.bias, 2)
    assert expected.shape[-2:] == (5, 4)
    assert_close(strided(x), expected.detach(), exact)


def test_conv_checks_as_torch():
    for kwargs in [{"groups": 4}, {"groups": 0}, {"padding": "full"},
                   {"padding_mode": "mirror"}]:
        with pytest.raises(ValueError):
            torch.nn.Conv2d(4, 6, 3, **kwargs)
        with pytest.raises(ValueError):
            nn.Conv2d(4, 6, 3, **kwargs)
    with pytest.raises(ValueError, match="strided"):
        nn.Conv1d(4, 6, 3, stride=2, padding="same")


def test_conv_parameters_start_as_torch(mesh2):
    """Replicate on the graph's mesh (device_mesh_guard), torch's shapes and names, uniform in
    +-1/sqrt(fan_in) as torch's reset_parameters."""
    with dtorch.default_graph.device_mesh_guard(mesh2):
        conv = nn.Conv2d(4, 6, (3, 2), groups=2, dtype=torch.float64)
    bound = 1 / math.sqrt(2 * 3 * 2)
    for name, p in conv.named_parameters():
        assert p.device_mesh == mesh2 and p.placements == [R, R], name
        assert p.dtype == torch.float64
        value = p.to_torch()
        assert value.abs().max() <= bound, name
        if value.numel() > 20:  # (6 bias values may well all be small: no spread check there)
            assert value.std() > bound / 4, name
    assert [(n, tuple(p.shape)) for n, p in conv.named_parameters()] == [
        (n, tuple(p.shape)) for n, p in torch.nn.Conv2d(4, 6, (3, 2), groups=2).named_parameters()]
    one = nn.Conv1d(2, 3, 1, bias=False, device="cpu:2")
    assert one.weight.device_mesh == dtorch.DeviceMesh("cpu", [2]) and one.bias is None


# -- pooling --------------------------------------------------------------------------------------

POOLS = [
    ("MaxPool2d", (2,), {}), ("MaxPool2d", (3, 2, 1), {"ceil_mode": True}),
    ("MaxPool2d", (3,), {"stride": 1, "padding": 1, "dilation": 2}),
    ("MaxPool2d", (2,), {"return_indices": True}), ("AvgPool2d", (2,), {}),
    ("AvgPool2d", (3, 2, 1), {"count_include_pad": False}),
    ("AvgPool2d", (3, 2, 1), {"ceil_mode": True, "divisor_override": 4}),
    ("AdaptiveAvgPool2d", ((2, 3),), {}), ("AdaptiveAvgPool2d", (1,), {}),
    ("MaxPool1d", (3, 2, 1), {}), ("MaxPool1d", (2,), {"return_indices": True}),
    ("AvgPool1d", (3,), {"stride": 2, "padding": 1, "count_include_pad": False}),
]


@pytest.mark.parametrize("name, args, kwargs", POOLS,
                         ids=[f"{n}-{a}-{'-'.join(map(str, k.values()))}" for n, a, k in POOLS])
def test_pool_like_torch(name, args, kwargs, layout):
    mesh, placements, exact = layout
    dmod, tmod = getattr(nn, name)(*args, **kwargs), getattr(torch.nn, name)(*args, **kwargs)
    assert repr(dmod) == repr(tmod)
    t = sample(5, 6, 11) if name.endswith("1d") else sample(5, 6, 8, 9)
    run(dmod, tmod, t, mesh, placements, exact)


def test_pool_default_stride_is_the_kernel():
    """torch's default (DTorch's is 1)."""
    assert nn.MaxPool2d(3).stride == 3 and nn.AvgPool2d((2, 3)).stride == (2, 3)
    assert nn.Pooling2d(PoolingKind.max, 2).stride == 2
    assert nn.Pooling2d(PoolingKind.avg, 2, stride=1).stride == 1


def test_dtorch_pooling_forms(layout):
    mesh, placements, exact = layout
    t = sample(5, 6, 8, 9)
    x = dtorch.from_torch(t, device_mesh=mesh, placements=placements)
    cases = [
        (nn.Pooling2d(PoolingKind.max, 2), TF.max_pool2d(t, 2)),
        (nn.Pooling2d(PoolingKind.avg, 3, stride=2, padding=1, count_include_pad=False),
         TF.avg_pool2d(t, 3, 2, 1, count_include_pad=False)),
        (nn.Pooling2d(PoolingKind.max, 3, stride=2, padding="same"),
         TF.max_pool2d(TF.pad(t, tf_same_pads((8, 9), (3, 3), (2, 2)), value=-math.inf), 3, 2)),
        (nn.MaxPool2d(3, 2, padding="valid"), TF.max_pool2d(t, 3, 2)),
        (nn.AvgPool2d(2, padding=(0, 1, 1, 0)), TF.avg_pool2d(TF.pad(t, (1, 0, 0, 1)), 2)),
        (nn.GlobalAvgPool2d(), t.mean((-2, -1), keepdim=True)),
        (nn.GlobalMaxPool2d(), t.amax((-2, -1), keepdim=True)),
    ]
    for module, expected in cases:
        assert_close(module(x), expected, exact)


def test_pooling_channels_last(mesh1):
    t = sample(5, 6, 8, 9)
    nhwc = t.permute(0, 2, 3, 1).contiguous()
    cases = [(nn.MaxPool2d(2, is_nchw=False), TF.max_pool2d(t, 2)),
             (nn.AvgPool2d(3, 2, 1, is_nchw=False), TF.avg_pool2d(t, 3, 2, 1)),
             (nn.AdaptiveAvgPool2d(2, is_nchw=False), TF.adaptive_avg_pool2d(t, 2)),
             (nn.Pooling2d(PoolingKind.max, 2, is_nchw=False), TF.max_pool2d(t, 2)),
             (nn.GlobalMaxPool2d(is_nchw=False), t.amax((-2, -1), keepdim=True)),
             (nn.GlobalAvgPool2d(False), t.mean((-2, -1), keepdim=True))]
    for placements in ([S0], [Shard(3)]):
        x = dtorch.from_torch(nhwc, device_mesh=mesh1, placements=placements)
        for module, expected in cases:
            assert_close(module(x), expected.permute(0, 2, 3, 1))
    assert repr(nn.GlobalAvgPool2d(is_nchw=False)) == "GlobalAvgPool2d(is_nchw=False)"


def test_global_pooling_over_sharded_image(mesh1):
    t = sample(2, 3, 7, 5)
    x = dtorch.from_torch(t, device_mesh=mesh1, placements=[S2])
    assert_close(nn.GlobalAvgPool2d()(x), t.mean((-2, -1), keepdim=True))
    assert_close(nn.GlobalMaxPool2d()(x), t.amax((-2, -1), keepdim=True))


def test_adaptive_pool_to_normal_pool():
    assert nn.AdaptivePool.to_normal_pool(8, 4) == (2, 2)
    assert nn.AdaptivePool.to_normal_pool(7, 3) == (2, 3)
    t = sample(2, 3, 8, 8)
    stride, kernel = nn.AdaptivePool.to_normal_pool(8, 4)
    x = dtorch.from_torch(t)
    assert_close(nn.AvgPool2d(kernel, stride)(x), TF.adaptive_avg_pool2d(t, 4))


def test_pooling_refusals():
    with pytest.raises(ValueError, match="Invalid padding string"):
        nn.MaxPool2d(2, padding="full")
    with pytest.raises(NotImplementedError, match="dilation"):
        nn.AvgPool2d(2, dilation=2)
    with pytest.raises(NotImplementedError, match="return_indices"):
        nn.MaxPool2d(2, padding="same", return_indices=True)(dtorch.from_torch(sample(1, 2, 4, 4)))


# -- dropout and shape modules --------------------------------------------------------------------


def test_dropout_checks_p_as_torch():
    for p in (-0.1, 1.5):
        with pytest.raises(ValueError, match="between 0 and 1"):
            nn.Dropout(p)
    assert repr(nn.Dropout(1.0)) == repr(torch.nn.Dropout(1.0))
    assert repr(nn.Dropout(0.2, inplace=True)) == repr(torch.nn.Dropout(0.2, inplace=True))


@pytest.mark.parametrize("placements", [[R], [S0]], ids=["R", "S0"])
def test_dropout_honours_train_and_eval(placements, mesh1):
    t = sample(60, 50)
    x = dtorch.from_torch(t, device_mesh=mesh1, placements=placements)
    drop = nn.Dropout(0.3)
    assert not drop.training  # a new module starts in eval mode, as DTorch's do
    assert_close(drop(x), t, exact=True)
    out = drop.train()(x).to_torch()
    kept = out != 0
    assert 0.2 < 1 - kept.float().mean().item() < 0.4
    torch.testing.assert_close(out[kept], t[kept] / 0.7)
    assert_close(drop.eval()(x), t, exact=True)
    model = nn.Sequential(nn.Dropout(1.0))
    assert_close(model.train()(x), torch.zeros_like(t), exact=True)
    assert_close(model.eval()(x), t, exact=True)
    assert_close(nn.Dropout(0.0).train()(x), t, exact=True)
    y = dtorch.from_torch(t, device_mesh=mesh1, placements=placements)
    out = nn.Dropout(0.5, inplace=True).train()(y)
    assert_close(y, out.to_torch(), exact=True)
    assert (out.to_torch() == 0).any()


SHAPES = [("Flatten", (), {}), ("Flatten", (2,), {}), ("Flatten", (), {"start_dim": 1,
                                                                       "end_dim": 2}),
          ("Unflatten", (1, (2, 3)), {})]


@pytest.mark.parametrize("name, args, kwargs", SHAPES,
                         ids=[f"{n}-{a}-{k}" for n, a, k in SHAPES])
def test_shape_modules_like_torch(name, args, kwargs, batch_layout):
    mesh, placements, exact = batch_layout
    dmod, tmod = getattr(nn, name)(*args, **kwargs), getattr(torch.nn, name)(*args, **kwargs)
    assert repr(dmod) == repr(tmod)
    run(dmod, tmod, sample(5, 6, 3, 4), mesh, placements, exact)


# -- a small CNN built from torch modules ---------------------------------------------------------


def cnn(lib):
    """Conv2d-BatchNorm2d-ReLU-MaxPool2d-Flatten-Linear from ``lib`` (torch.nn or dtorch.nn)."""
    return lib.Sequential(lib.Conv2d(3, 8, 3, padding=1), lib.BatchNorm2d(8), lib.ReLU(),
                          lib.MaxPool2d(2), lib.Flatten(), lib.Linear(8 * 4 * 4, 10))


def test_cnn_twin_loads_torch_state_dict(batch_layout):
    mesh, placements, exact = batch_layout
    torch.manual_seed(0)  # torch's init (outputs near 1), and random running statistics
    torch_cnn = cnn(torch.nn).eval()
    randomized(torch_cnn[1])
    with dtorch.default_graph.device_mesh_guard(mesh):  # every layer on the graph's mesh
        dtorch_cnn = cnn(nn)
    assert all(p.device_mesh == mesh for p in dtorch_cnn.parameters())
    assert list(dtorch_cnn.state_dict()) == list(torch_cnn.state_dict())
    dtorch_cnn.load_state_dict(torch_cnn.state_dict())
    dtorch_cnn.eval()
    assert repr(dtorch_cnn) == repr(torch_cnn)
    t = sample(5, 3, 8, 8)
    with torch.no_grad():
        expected = torch_cnn(t)
    out = dtorch_cnn(dtorch.from_torch(t, device_mesh=mesh, placements=placements))
    assert_close(out, expected, exact)
    assert out.placements == placements
