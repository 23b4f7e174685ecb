"""DTorch's operator names and argument forms (docs/ops.md, "DTorch's argument forms and fused
ops") against plain torch on the same inputs, beside torch's own forms, which keep working:
bit-identical on the one-device mesh, allclose distributed, over several placements with uneven
sizes. Each form is called the DTorch way and the torch way; placements a step's rule refuses
raise its ValueError naming the redistribute()."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as TF

import dtorch
import dtorch.nn.functional as F
from dtorch import Partial, Replicate, Shard
from dtorch.ops.registry import REGISTRY
from dtorch.type import OperatorFormat, PaddingType, PoolingKind, SdpaOption
from helpers import assert_close, assert_refused, distribute, layout_fixture

R, S0, S1, S2, S3, P = Replicate(), Shard(0), Shard(1), Shard(2), Shard(3), Partial()
NCHW, NHWC = OperatorFormat.nchw, OperatorFormat.nhwc

# (mesh, placements of the main operand); sizes below are uneven over 3 devices and 2 x 2
LAYOUTS = [("one", [R]), ("mesh1", [S0]), ("mesh1", [R]), ("mesh2", [S0, S1]),
           ("mesh2", [R, S0])]
layout = layout_fixture(LAYOUTS)
# images (N, C, H, W): the batch shards (several mesh dims, unevenly), the channels do not for conv
IMAGE_LAYOUTS = [("one", [R]), ("mesh1", [S0]), ("mesh1", [R]), ("mesh2", [S0, S0]),
                 ("mesh2", [R, S0])]
image_layout = layout_fixture(IMAGE_LAYOUTS)


def sample(*shape, seed=0, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def channels_last(placements) -> list:
    """The placements of an (N, H, W, C) tensor that shard as ``placements`` do (N, C, H, W)."""
    dims = {1: 3, 2: 1, 3: 2}
    return [Shard(dims.get(p.dim, p.dim)) if p.is_shard() else p for p in placements]


def rep(t, like):
    """``t`` Replicate on the mesh of ``like`` (weights, freqs)."""
    return distribute(t, like.device_mesh, [R] * like.device_mesh.ndim)


# -- names: top-level re-exports, aliases, methods ------------------------------------------------


def test_functional_names_at_top_level():
    """DTorch re-exports these nn.functional names at top level: the same functions."""
    for name in ("batch_norm", "dropout", "embedding", "group_norm", "layer_norm", "rms_norm",
                 "softmax", "log_softmax", "conv2d"):
        assert getattr(dtorch, name) is getattr(F, name), name
    assert F.SdpaOption is SdpaOption
    assert F.dropout is REGISTRY["dropout"].front  # a registry front, nothing hand-placed
    assert dtorch.max is dtorch.Tensor.max is REGISTRY["max"].front


COMPARE = ["greater", "less", "greater_equal", "less_equal", "not_equal"]


@pytest.mark.parametrize("name", COMPARE)
def test_comparison_aliases(name, layout):
    mesh, placements, exact = layout
    a, b = sample(5, 4), sample(5, 4, seed=1)
    x, y = distribute(a, mesh, placements), distribute(b, mesh, placements)
    assert_close(getattr(dtorch, name)(x, y), getattr(torch, name)(a, b), exact)
    assert_close(getattr(x, name)(0.25), getattr(a, name)(0.25), exact)
    assert_close(getattr(dtorch, name)(x, rep(b[0], x)), getattr(torch, name)(a, b[0]), exact)
    assert getattr(x, name)(y).placements == placements


def test_softmax_forms(layout):
    """torch.softmax(x, dim, dtype), x.softmax(dim, dtype) and F.softmax(x, dim, _stacklevel,
    dtype) on one entry (the layouts shard dims 0 and 1, the softmax runs along 2)."""
    mesh, placements, exact = layout
    t = sample(5, 3, 6)
    x = distribute(t, mesh, placements)
    f64 = torch.float64
    assert_close(x.softmax(2), t.softmax(2), exact)
    assert_close(x.softmax(-1, f64), t.softmax(-1, f64), exact)
    assert_close(dtorch.softmax(x, 2, f64), torch.softmax(t, 2, f64), exact)
    assert_close(dtorch.softmax(x, dim=2, dtype=f64), torch.softmax(t, dim=2, dtype=f64), exact)
    assert_close(F.softmax(x, 2, 3, f64), TF.softmax(t, 2, 3, f64), exact)
    assert_close(x.log_softmax(2), t.log_softmax(2), exact)
    assert_close(dtorch.log_softmax(x, -1, f64), torch.log_softmax(t, -1, f64), exact)
    if S0 in placements:
        assert_refused(lambda: x.softmax(0), op="softmax")


@pytest.mark.parametrize("name", ["byte", "char", "short"])
def test_small_int_casts(name, layout):
    mesh, placements, exact = layout
    t = sample(5, 4) * 40
    x = distribute(t, mesh, placements)
    y = getattr(x, name)()
    assert_close(y, getattr(t, name)(), exact)
    assert y.placements == placements
    assert y.short().byte().dtype == torch.uint8


def test_small_int_casts_refuse_partial(mesh1):
    x = distribute(sample(5, 4), mesh1, [P])
    for name in ("byte", "char", "short"):
        assert_refused(getattr(x, name), op=name)


def test_cpu_and_cuda(mesh2):
    x = distribute(sample(5, 4), mesh2, [S0, R])
    assert x.cpu() is x
    assert x.cpu(memory_format=torch.preserve_format) is x
    with pytest.raises(NotImplementedError, match=r"to_torch\(\)"):
        x.cuda()
    assert x.contiguous().placements == [S0, R]


def test_cpu_and_cuda_on_a_cuda_mesh():
    """The fronts' CUDA branch, on a stand-in for a tensor on a one-GPU CUDA mesh (this test
    needs no GPU)."""
    class Mesh:
        device_type, devices = "cuda", (1,)

    class OnCuda:
        device_mesh = Mesh()

    x = OnCuda()
    cpu, cuda = REGISTRY["cpu"].front, REGISTRY["cuda"].front
    assert cuda(x) is x and cuda(x, 1) is x and cuda(x, "cuda:1") is x
    with pytest.raises(NotImplementedError, match="redistribute"):
        cuda(x, 0)
    with pytest.raises(NotImplementedError, match="device types"):
        cpu(x)


# -- chunk, squeeze -------------------------------------------------------------------------------


def test_chunk_forms(layout):
    """The layouts shard dims 0 and 1; the chunks cut dims 2 and 3 (and 0 by default)."""
    mesh, placements, exact = layout
    t = sample(5, 4, 7, 3)
    x = distribute(t, mesh, placements)
    forms = [  # (dtorch call, torch call): DTorch's count ``chunk=``, torch's ``chunks=``
        (lambda: dtorch.chunk(x, chunk=3, dim=2), lambda: torch.chunk(t, chunks=3, dim=2)),
        (lambda: dtorch.chunk(x, 3, 2), lambda: torch.chunk(t, 3, 2)),
        (lambda: x.chunk(chunk=2, dim=-1), lambda: t.chunk(chunks=2, dim=-1)),
        (lambda: x.chunk(chunks=4, dim=2), lambda: t.chunk(chunks=4, dim=2)),
        (lambda: dtorch.chunk(x, 2), lambda: torch.chunk(t, 2)),  # dim 0 by default
    ]
    for mine, theirs in forms:
        if S0 in placements and mine is forms[-1][0]:
            assert_refused(mine, op="chunk")
            continue
        got = mine()
        assert isinstance(got, tuple)
        assert_close(got, theirs(), exact)
        assert got[0].placements == placements
    with pytest.raises(TypeError):
        dtorch.chunk(x, 3, chunk=3)
    with pytest.raises(TypeError):
        x.chunk()


def test_squeeze_forms(layout):
    mesh, placements, exact = layout
    t = sample(5, 4, 1, 3, 1)
    x = distribute(t, mesh, placements)
    assert_close(x.squeeze(2), t.squeeze(2), exact)
    assert_close(dtorch.squeeze(x, [2, 4]), torch.squeeze(t, [2, 4]), exact)
    assert_close(x.squeeze((2, -1)), t.squeeze((2, -1)), exact)
    assert_close(x.squeeze(), t.squeeze(), exact)


# -- conv2d: DTorch's form beside torch's ---------------------------------------------------------

IMG, W = sample(5, 4, 7, 6), sample(6, 2, 3, 3, seed=1)  # groups=2: weight (6, 4 / 2, 3, 3)
BIAS = sample(6, seed=2)
CONV_FORMS = {  # name: (dtorch call on x, w, b; torch call on the same)
    "dtorch positional": (
        lambda x, w, b: F.conv2d(x, w, b, 1, PaddingType.not_set, 1, 1, 2, NCHW),
        lambda x, w, b: TF.conv2d(x, w, b, 1, 1, 1, 2)),
    "dtorch keywords": (
        lambda x, w, b: F.conv2d(x, w, bias=b, stride=(2, 1), padding=(1, 2), group=2),
        lambda x, w, b: TF.conv2d(x, w, b, stride=(2, 1), padding=(1, 2), groups=2)),
    "torch positional": (
        lambda x, w, b: dtorch.conv2d(x, w, b, 2, 1, 1, 2),
        lambda x, w, b: torch.conv2d(x, w, b, 2, 1, 1, 2)),
    "padding_type same": (
        lambda x, w, b: F.conv2d(x, w, b, 1, PaddingType.same, dilation=2, group=2),
        lambda x, w, b: TF.conv2d(x, w, b, padding="same", dilation=2, groups=2)),
    "torch same": (
        lambda x, w, b: F.conv2d(x, w, b, padding="same", groups=2),
        lambda x, w, b: TF.conv2d(x, w, b, padding="same", groups=2)),
    "padding_type valid": (
        lambda x, w, b: F.conv2d(x, w, b, 1, padding_type=PaddingType.valid, group=2),
        lambda x, w, b: TF.conv2d(x, w, b, padding="valid", groups=2)),
    # DTorch's "same" with a stride: ceil(size / stride) outputs, the extra padding after
    "strided same": (  # (7, 6) by 3 x 3 kernels, stride 2: pads (1, 1) and (0, 1)
        lambda x, w, b: F.conv2d(x, w, b, 2, PaddingType.same, 0, 1, 2),
        lambda x, w, b: TF.conv2d(TF.pad(x, (0, 1, 1, 1)), w, b, 2, groups=2)),
    "four paddings": (  # (h_begin, w_begin, h_end, w_end)
        lambda x, w, b: F.conv2d(x, w, b, padding=(1, 0, 2, 1), groups=2),
        lambda x, w, b: TF.conv2d(TF.pad(x, (0, 1, 1, 2)), w, b, groups=2)),
    "four even paddings": (
        lambda x, w, b: F.conv2d(x, w, b, 1, PaddingType.not_set, (1, 2, 1, 2), 1, 2),
        lambda x, w, b: TF.conv2d(x, w, b, padding=(1, 2), groups=2)),
}


@pytest.mark.parametrize("name", CONV_FORMS)
def test_conv2d_forms(name, image_layout):
    mesh, placements, exact = image_layout
    mine, theirs = CONV_FORMS[name]
    x = distribute(IMG, mesh, placements)
    got = mine(x, rep(W, x), rep(BIAS, x))
    assert_close(got, theirs(IMG, W, BIAS), exact)
    assert got.placements == placements


@pytest.mark.parametrize("how", ["format", "is_nchw", "positional"])
def test_conv2d_channels_last(how, image_layout):
    mesh, placements, exact = image_layout
    t = IMG.movedim(1, -1).contiguous()  # (N, H, W, C)
    x = distribute(t, mesh, channels_last(placements))
    w, b = rep(W, x), rep(BIAS, x)
    got = {"format": lambda: F.conv2d(x, w, b, padding=1, groups=2, format=NHWC),
           "is_nchw": lambda: F.conv2d(x, w, b, padding=1, groups=2, is_nchw=False),
           "positional": lambda: F.conv2d(x, w, b, 1, PaddingType.not_set, 1, 1, 2, NHWC)}[how]()
    expected = TF.conv2d(t.movedim(-1, 1), W, BIAS, padding=1, groups=2).movedim(1, -1)
    assert_close(got, expected, exact)
    assert got.placements == channels_last(placements)


def test_conv2d_argument_errors(mesh1):
    x = distribute(IMG, mesh1, [S0])
    w = rep(W, x)
    with pytest.raises(TypeError):
        F.conv2d(x, w, None, 1, 1, groups=2, group=2)
    with pytest.raises(TypeError):
        F.conv2d(x, w, None, 1, 1, padding=1)
    with pytest.raises(ValueError):
        F.conv2d(x, w, None, 1, PaddingType.same, 1, group=2)
    with pytest.raises(ValueError):
        F.conv2d(x, w, None, format=NHWC, is_nchw=True)
    with pytest.raises(RuntimeError):  # torch's own check (groups)
        F.conv2d(x, w)


@pytest.mark.parametrize("case", ["tiled", "1x1", "three devices", "untiled", "padded",
                                  "partial windows"])
def test_conv2d_image_shards(case, mesh1, mesh2):
    """DTorch's rows: an image dim whose windows tile it (kernel == stride, no padding, no
    dilation) shards when each block holds whole windows, as many on every device."""
    shape, kernel, stride, padding, mesh, placements, ok = {
        "tiled": ((2, 4, 12, 16), 2, 2, 0, mesh2, [S2, S3], True),  # 12 and 16 % (2 * 2)
        "1x1": ((2, 4, 11, 7), 1, 1, 0, mesh1, [S3], True),  # any size
        "three devices": ((2, 4, 12, 18), 2, 2, 0, mesh1, [S3], True),  # 18 % (2 * 3)
        "untiled": ((2, 4, 12, 18), 3, 2, 0, mesh1, [S2], False),  # windows overlap
        "padded": ((2, 4, 12, 18), 2, 2, 1, mesh1, [S2], False),
        "partial windows": ((2, 4, 10, 10), 2, 2, 0, mesh1, [S3], False),  # blocks 4, 3, 3
    }[case]
    t, w = sample(*shape), sample(5, 4, kernel, kernel, seed=1)
    x = distribute(t, mesh, placements)
    call = lambda: F.conv2d(x, rep(w, x), None, stride, PaddingType.not_set, padding)  # noqa
    if not ok:
        assert_refused(call, op="conv2d")
        return
    got = call()
    assert got.placements == placements
    assert_close(got, TF.conv2d(t, w, None, stride, padding))


# -- norms ----------------------------------------------------------------------------------------


def test_batch_norm_forms(image_layout):
    mesh, placements, exact = image_layout
    t = sample(5, 3, 4, 2)
    stats = [sample(3, seed=1), sample(3, seed=2).abs() + 0.5, sample(3, seed=3),
             sample(3, seed=4)]
    x = distribute(t, mesh, placements)
    mean, var, scale, bias = (rep(s, x) for s in stats)
    expected = TF.batch_norm(t, *stats, eps=1e-3)
    assert_close(F.batch_norm(x, mean, var, scale=scale, bias=bias, eps=1e-3), expected, exact)
    assert_close(dtorch.batch_norm(x, mean, var, weight=scale, bias=bias, eps=1e-3), expected,
                 exact)
    assert_close(F.batch_norm(x, mean, var, scale, bias, False, 0.1, 1e-3, NCHW), expected,
                 exact)
    last = distribute(t.movedim(1, -1).contiguous(), mesh, channels_last(placements))
    for kw in ({"format": NHWC}, {"is_nchw": False}):
        got = F.batch_norm(last, mean, var, scale, bias, eps=1e-3, **kw)
        assert_close(got, expected.movedim(1, -1), exact)
        assert got.placements == channels_last(placements)
    with pytest.raises(TypeError):
        F.batch_norm(x, mean, var, scale, scale=scale)
    with pytest.raises(TypeError):  # torch.batch_norm's order (weight, bias first)
        dtorch.batch_norm(x, scale, bias, mean, var, False, 0.1, 1e-5, True)


def test_layer_group_rms_norm_forms(layout):
    mesh, placements, exact = layout
    t = sample(5, 4, 6)
    x = distribute(t, mesh, placements)
    w6, b6, w4, b4 = (rep(sample(n, seed=s), x) for n, s in ((6, 1), (6, 2), (4, 3), (4, 4)))
    tw6, tb6, tw4, tb4 = (sample(n, seed=s) for n, s in ((6, 1), (6, 2), (4, 3), (4, 4)))
    assert_close(F.layer_norm(x, (6,), scale=w6, bias=b6, eps=1e-3),
                 TF.layer_norm(t, (6,), tw6, tb6, 1e-3), exact)
    assert_close(dtorch.layer_norm(x, [6], w6, b6), torch.layer_norm(t, [6], tw6, tb6), exact)
    if S1 in placements:  # group_norm mixes the channels
        assert_refused(lambda: F.group_norm(x, 2, scale=w4), op="group_norm")
    else:
        assert_close(F.group_norm(x, 2, scale=w4, bias=b4, eps=1e-3),
                     TF.group_norm(t, 2, tw4, tb4, 1e-3), exact)
        assert_close(dtorch.group_norm(x, 2, w4), torch.group_norm(t, 2, tw4), exact)
    assert_close(F.rms_norm(x, (6,), w6, 1e-5), TF.rms_norm(t, (6,), tw6, 1e-5), exact)
    assert_close(F.rms_norm(x, (6,), w6, eps=None), TF.rms_norm(t, (6,), tw6, None), exact)
    assert_close(dtorch.rms_norm(x, 6, scale=w6), torch.rms_norm(t, [6], tw6), exact)
    assert_close(F.rms_norm(x, (6,)), TF.rms_norm(t, (6,)), exact)
    with pytest.raises(TypeError):
        F.layer_norm(x, (6,), w6, scale=w6)


# -- pooling --------------------------------------------------------------------------------------

MAX, AVG = PoolingKind.max, PoolingKind.avg
POOL_FORMS = {  # name: (_pooling2d args after the input, torch reference of t)
    "max": ((MAX, 1, 3, 2, PaddingType.not_set, 1, False, True),
            lambda t: TF.max_pool2d(t, 3, 2, 1)),
    "max dilated ceil": ((MAX, 2, (2, 3), 1, PaddingType.not_set, (1, 0), True, True),
                         lambda t: TF.max_pool2d(t, (2, 3), 1, (1, 0), 2, ceil_mode=True)),
    "avg": ((AVG, 1, 2, (2, 1), PaddingType.not_set, 1, False, False),
            lambda t: TF.avg_pool2d(t, 2, (2, 1), 1, count_include_pad=False)),
    "avg ceil": ((AVG, 1, 3, 2, PaddingType.not_set, 1, True, True),
                 lambda t: TF.avg_pool2d(t, 3, 2, 1, ceil_mode=True)),
    "max valid": ((MAX, 1, 2, 2, PaddingType.valid, 0, True, True),
                  lambda t: TF.max_pool2d(t, 2, 2)),
    # same: ceil(size / stride) outputs; (7, 6) with kernel 3, stride 2: pads (1, 1) and (0, 1)
    "max same": ((MAX, 1, 3, 2, PaddingType.same, 0, True, True),
                 lambda t: TF.max_pool2d(TF.pad(t, (0, 1, 1, 1), value=-torch.inf), 3, 2)),
    "avg same": ((AVG, 1, 3, 1, PaddingType.same, 0, False, True),
                 lambda t: TF.avg_pool2d(t, 3, 1, 1)),
    "max four": ((MAX, 1, 2, 2, PaddingType.not_set, (1, 0, 0, 1), False, True),
                 lambda t: TF.max_pool2d(TF.pad(t, (0, 1, 1, 0), value=-torch.inf), 2, 2)),
    "avg four": ((AVG, 1, 2, 2, PaddingType.not_set, (0, 1, 1, 0), False, True),
                 lambda t: TF.avg_pool2d(TF.pad(t, (1, 0, 0, 1)), 2, 2)),
}


@pytest.mark.parametrize("name", POOL_FORMS)
def test_pooling2d(name, image_layout):
    mesh, placements, exact = image_layout
    args, reference = POOL_FORMS[name]
    t = sample(5, 3, 7, 6)
    x = distribute(t, mesh, placements)
    got = F._pooling2d(x, *args)
    assert_close(got, reference(t), exact)
    assert got.placements == placements
    last = distribute(t.movedim(1, -1).contiguous(), mesh, channels_last(placements))
    assert_close(F._pooling2d(last, *args, NHWC), reference(t).movedim(1, -1), exact)
    assert_close(F._pooling2d(last, *args, format=NHWC), reference(t).movedim(1, -1), exact)


def test_pooling2d_partial_and_refusals(mesh1):
    t = sample(5, 3, 7, 6)
    got = F._pooling2d(distribute(t, mesh1, [Partial("max")]), MAX, 1, 2, 2,
                       PaddingType.same, 0, False, True)
    assert got.placements == [Partial("max")]
    assert_close(got, TF.max_pool2d(TF.pad(t, (0, 0, 0, 1), value=-torch.inf), 2, 2))
    assert_refused(lambda: F._pooling2d(distribute(t, mesh1, [P]), MAX, 1, 2, 2,
                                        PaddingType.valid, 0, False, True), op="max_pool2d")
    assert_refused(lambda: F._pooling2d(distribute(t, mesh1, [S2]), AVG, 1, 2, 2,
                                        PaddingType.valid, 0, False, True), op="avg_pool2d")
    x = distribute(t, mesh1, [S0])
    with pytest.raises(NotImplementedError):
        F._pooling2d(x, AVG, 2, 2, 2, PaddingType.valid, 0, False, True)
    with pytest.raises(NotImplementedError):
        F._pooling2d(x, AVG, 1, 2, 2, PaddingType.same, 0, False, False)
    with pytest.raises(ValueError):
        F._pooling2d(x, AVG, 1, 2, 2, PaddingType.same, 1, False, True)


@pytest.mark.parametrize("kind", [AVG, MAX], ids=str)
@pytest.mark.parametrize("placements", [[S0], [S1], [S2], [S3], [P]], ids=str)
def test_global_pooling2d(kind, placements, one, mesh1):
    """The mean (amax) over H and W: a sharded H or W reduces on its own."""
    t = sample(4, 3, 5, 7)
    if kind is MAX and P in placements:
        placements = [Partial("max")]
    expected = (t.mean((-2, -1), keepdim=True) if kind is AVG else
                t.amax((-2, -1), keepdim=True))
    assert_close(F._global_pooling2d(distribute(t, one, [R]), kind), expected, exact=True)
    got = F._global_pooling2d(distribute(t, mesh1, placements), kind)
    assert_close(got, expected)
    assert got.placements == ([R] if placements[0] in (S2, S3) else placements)
    last = distribute(t.movedim(1, -1).contiguous(), mesh1, channels_last(placements))
    assert_close(F._global_pooling2d(last, kind, NHWC), expected.movedim(1, -1))
    if kind is AVG:
        assert_close(got, TF.adaptive_avg_pool2d(t, 1))


# -- fused ops ------------------------------------------------------------------------------------


def rotary_reference(x, cos, sin, unbind=-1):
    """diffusers' apply_rotary_emb (use_real=True), DTorch's compiled op."""
    cos, sin = cos[None, None], sin[None, None]
    if unbind == -1:
        real, imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
        rotated = torch.stack([-imag, real], dim=-1).flatten(3)
    else:
        real, imag = x.reshape(*x.shape[:-1], 2, -1).unbind(-2)
        rotated = torch.cat([-imag, real], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


ROTARY_LAYOUTS = [("one", [R]), ("mesh1", [S0]), ("mesh1", [S1]), ("mesh1", [S2]),
                  ("mesh2", [S2, S1]), ("mesh2", [S0, S2])]
rotary_layout = layout_fixture(ROTARY_LAYOUTS)


@pytest.mark.parametrize("unbind", [-1, -2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_apply_rotary_emb(unbind, dtype, rotary_layout):
    """Replicate freqs meeting a sequence-sharded x are chunked to match it (DTorch's R -> S)."""
    mesh, placements, exact = rotary_layout
    t, cos, sin = sample(2, 3, 5, 8, dtype=dtype), sample(5, 8, seed=1), sample(5, 8, seed=2)
    x = distribute(t, mesh, placements)
    freqs = (rep(cos, x), rep(sin, x))
    expected = rotary_reference(t, cos, sin, unbind)
    got = F._apply_rotary_emb(x, list(freqs), use_real_unbind_dim=unbind)
    assert_close(got, expected, exact)
    assert got.placements == placements
    assert_close(F._apply_rotary_emb(x, freqs, True, unbind), expected, exact)
    if S2 in placements:  # freqs already sharded along the sequence
        sharded = [S0 if p == S2 else R for p in placements]
        f = [distribute(c, mesh, sharded) for c in (cos, sin)]
        assert_close(F._apply_rotary_emb(x, f, use_real_unbind_dim=unbind), expected, exact)


def test_apply_rotary_emb_refusals_and_errors(mesh1):
    t, cos, sin = sample(2, 3, 5, 8), sample(5, 8, seed=1), sample(5, 8, seed=2)
    freqs = [distribute(c, mesh1, [R]) for c in (cos, sin)]
    got = F._apply_rotary_emb(distribute(t, mesh1, [P]), freqs)  # linear in x (float32)
    assert got.placements == [P]
    assert_close(got, rotary_reference(t, cos, sin))
    half = distribute(t.bfloat16(), mesh1, [P])
    assert_refused(lambda: F._apply_rotary_emb(half, freqs), op="_apply_rotary_emb")
    assert_refused(lambda: F._apply_rotary_emb(distribute(t, mesh1, [S3]), freqs),
                   op="_apply_rotary_emb")
    x = distribute(t, mesh1, [S0])
    with pytest.raises(ValueError, match="Size of freqsCis must be two"):
        F._apply_rotary_emb(x, freqs[:1])
    with pytest.raises(ValueError, match="Size of freqsCis must be two"):
        F._apply_rotary_emb(x, freqs * 2)
    with pytest.raises(ValueError, match="use_real_unbind_dim"):
        F._apply_rotary_emb(x, freqs, use_real_unbind_dim=0)
    with pytest.raises(NotImplementedError):
        F._apply_rotary_emb(x, freqs, use_real=False)


@pytest.mark.parametrize("placements", [[R], [S0]], ids=str)
def test_silu_linear_chunk(placements, one, mesh1):
    emb, w, b = sample(5, 8), sample(12, 8, seed=1), sample(12, seed=2)
    expected = list(TF.linear(TF.silu(emb), w, b).chunk(3, dim=1))
    for mesh, exact in ((one, True), (mesh1, False)):
        x = distribute(emb, mesh, placements if mesh is mesh1 else [R])
        got = F._silu_linear_chunk(x, rep(w, x), rep(b, x), 3)
        assert isinstance(got, list) and len(got) == 3
        for g, e in zip(got, expected):
            assert_close(g, e, exact)
    x = distribute(emb, mesh1, [R])  # column-parallel weight: dim 1 sharded, chunk refuses it
    assert_refused(lambda: F._silu_linear_chunk(x, distribute(w, mesh1, [S0]),
                                                distribute(b, mesh1, [S0]), 3), op="chunk")


def test_layer_norm_mul_add(layout):
    mesh, placements, exact = layout
    t, scale, shift = sample(5, 4, 6), sample(5, 6, seed=1), sample(5, 6, seed=2)
    weight, bias = sample(6, seed=3), sample(6, seed=4)
    x = distribute(t, mesh, placements)
    s, h = rep(scale, x), rep(shift, x)
    normed = TF.layer_norm(t, (6,), None, None, 1e-6)
    assert_close(F._layer_norm_mul_add(x, s, h, (6,), 1e-6, None, None),
                 normed * (1 + scale[:, None]) + shift[:, None], exact)
    normed = TF.layer_norm(t, (6,), weight, bias)
    got = F._layer_norm_mul_add(x, s, h, [6], norm_scale=rep(weight, x), norm_bias=rep(bias, x))
    assert_close(got, normed * (1 + scale[:, None]) + shift[:, None], exact)
    assert got.placements == placements


# -- attention: sdpa_option -----------------------------------------------------------------------


def test_sdpa_option(mesh1, mesh2):
    q, k, v = sample(2, 4, 6, 8), sample(2, 4, 6, 8, seed=1), sample(2, 4, 6, 8, seed=2)
    expected = TF.scaled_dot_product_attention(q, k, v, is_causal=True)
    named = dtorch.DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=["dp", "ulysess_cp"])
    heads = [distribute(t, named, [S0, S1]) for t in (q, k, v)]
    for option in (None, SdpaOption(), SdpaOption(ulysess_cp_dim=None, ring_cp_dim=None)):
        got = F.scaled_dot_product_attention(*heads, is_causal=True, sdpa_option=option)
        assert_close(got, expected)
        assert got.placements == [S0, S1]
    assert_close(F._scaled_dot_product_attention(*heads, None, 0.0, True), expected)
    # context parallelism (tests/test_context_parallel.py has the cases)
    seq = [distribute(t, named, [S0, S2]) for t in (q, k, v)]
    plain = TF.scaled_dot_product_attention(q, k, v)
    for option in (None, SdpaOption(ulysess_cp_dim="ulysses_cp")):
        got = F.scaled_dot_product_attention(*seq, sdpa_option=option)
        assert_close(got, plain)
        assert got.placements == [S0, S2]
    assert_close(F.scaled_dot_product_attention(  # an index: always on
        *[distribute(t, mesh1, [S2]) for t in (q, k, v)], sdpa_option=SdpaOption(ring_cp_dim=0)),
        plain)
    # no such dim: as before, the sequence must be whole (a placement refusal)
    assert_refused(lambda: F.scaled_dot_product_attention(
        *[distribute(t, mesh1, [S2]) for t in (q, k, v)]), op="scaled_dot_product_attention")
    with pytest.raises(NotImplementedError):
        F.scaled_dot_product_attention(*heads, sdpa_option=SdpaOption(sage_attn_type="auto"))
    with pytest.raises(ValueError):
        F.scaled_dot_product_attention(*heads, sdpa_option=SdpaOption(sage_attn_type="bad"))


# -- dropout --------------------------------------------------------------------------------------


def test_dropout_front(mesh1):
    t = sample(6, 5) + 3
    x = distribute(t, mesh1, [S0])
    dtorch.manual_seed(3)
    first = dtorch.dropout(x, 0.5).to_torch()
    dtorch.manual_seed(3)
    with pytest.raises(ValueError):  # checked before the draw: the seed stays
        dtorch.dropout(x, 1.5)
    assert torch.equal(F.dropout(x, 0.5, True).to_torch(), first)
    assert_close(dtorch.dropout(x, 0.5, False), t)
    assert_close(torch.dropout(t, 0.0, True), dtorch.dropout(x, 0.0, True).to_torch())


def test_embedding_at_top_level(mesh2):
    idx, weight = torch.tensor([[0, 2, 1], [3, 3, 0]]), sample(4, 5)
    x = distribute(idx, mesh2, [S0, R])
    got = dtorch.embedding(x, distribute(weight, mesh2, [R, S1]))
    assert_close(got, TF.embedding(idx, weight))
    assert got.placements == [S0, S2]
