"""The names and argument forms programs written for DTorch use, each against plain torch:
varargs given by keyword (``reshape(shape=)``, ``repeat(repeats=)``), torch's legacy
``Tensor(*sizes)``, indexing with dtorch index tensors of any layout, ``Module.__setattr__``'s
replacement rules and ``get_parameter``, ``Graph._set_default_dtype``,
``Tensor.parser_tensor_to_function_arg``, the fused ops against ``dtorch.compiled_op``, gelu's
error, and ``nn.functional._function_names``."""

from __future__ import annotations

import pytest
import torch

import dtorch
from dtorch import Partial, Replicate, Shard
from dtorch.client import session
from helpers import assert_close, sample

R = Replicate()


# -- varargs by keyword ---------------------------------------------------------------------------

def _lib(x):
    return dtorch if isinstance(x, dtorch.Tensor) else torch


KEYWORD_FORMS = [  # (id, fn on a (2, 3, 4) tensor of torch or dtorch, a dim its rule may shard)
    ("reshape-shape", lambda x: x.reshape(shape=(6, -1)), 2),
    ("reshape-list", lambda x: x.reshape(shape=[4, 6]), None),
    ("function-reshape", lambda x: (dtorch if isinstance(x, dtorch.Tensor) else torch).reshape(
        x, shape=(2, 3, 2, 2)), 1),
    ("repeat-repeats", lambda x: x.repeat(repeats=(2, 3, 1)), 2),
    ("repeat-new-dims", lambda x: x.repeat(repeats=[2, 1, 1, 2]), 1),
    ("repeat-zero", lambda x: x.repeat(2, 3, 0), None),
    ("view-size", lambda x: x.view(size=(6, 4)), 2),
    ("permute-dims", lambda x: x.permute(dims=(2, 0, 1)), 0),
    ("expand-size", lambda x: x[:1].expand(size=(5, 3, 4)), 1),
    ("flip-dims", lambda x: x.flip(dims=(0, 2)), 1),
    # axis=, NumPy's name of dim, which torch takes too
    ("cat-axis", lambda x: _lib(x).cat([x, x], axis=1), 2),
    ("stack-axis", lambda x: _lib(x).stack([x, x], axis=2), 0),
    ("sum-axis", lambda x: x.sum(axis=1), 2),
    ("mean-axis", lambda x: _lib(x).mean(x, axis=2, keepdim=True), 0),
]


@pytest.mark.parametrize("fn, dim", [r[1:] for r in KEYWORD_FORMS],
                         ids=[r[0] for r in KEYWORD_FORMS])
@pytest.mark.parametrize("layout", ["one", "replicate", "shard"])
def test_varargs_by_keyword_like_torch(fn, dim, layout, one, mesh1):
    t = sample((2, 3, 4))
    mesh, placements = {"one": (one, [R]), "replicate": (mesh1, [R]),
                        "shard": (mesh1, [R if dim is None else Shard(dim)])}[layout]
    assert_close(fn(dtorch.from_torch(t, mesh, placements)), fn(t), exact=layout == "one")


@pytest.mark.parametrize("call", [
    lambda lib, x: x.reshape(6, shape=(6, -1)),
    lambda lib, x: x.repeat(2, 1, 1, repeats=(2, 1, 1)),
    lambda lib, x: x.view(6, 4, size=(6, 4)),
    lambda lib, x: lib.rand(2, size=(2,)),
    lambda lib, x: lib.cat([x, x], 1, axis=1),
], ids=["reshape", "repeat", "view", "rand", "cat-axis"])
def test_varargs_both_ways_is_torchs_type_error(call):
    t = sample((2, 3, 4))
    with pytest.raises(TypeError):
        call(torch, t)
    with pytest.raises(TypeError, match="multiple values for argument"):
        call(dtorch, dtorch.from_torch(t))


def test_random_factories_take_size_by_keyword():
    g = torch.Generator().manual_seed(3)
    for name in ("rand", "randn"):
        expected = getattr(torch, name)(size=(2, 3), generator=torch.Generator().manual_seed(3))
        assert_close(getattr(dtorch, name)(size=(2, 3), generator=g), expected, exact=True)
        g.manual_seed(3)


# -- torch's legacy constructor -------------------------------------------------------------------


@pytest.mark.parametrize("args", [(), (2, 3), (3,), (torch.Size([1, 2]),), (torch.Size([]),),
                                  (2, 0, 1, 2)], ids=repr)
def test_legacy_constructor_takes_sizes_like_torch(args):
    expected = torch.Tensor(*args)
    x = dtorch.Tensor(*args)
    assert x.shape == expected.shape and x.dtype == expected.dtype
    assert x.to_torch().shape == expected.shape
    assert dtorch.LongTensor(*args).dtype == torch.int64


def test_legacy_constructor_on_a_mesh_and_data_forms_still_work(mesh1):
    x = dtorch.Tensor(5, 2, device_mesh=mesh1, placements=[Shard(0)])
    assert x.shape == (5, 2) and x.placements == [Shard(0)] and x.device_mesh == mesh1
    t = sample((4, 3))
    assert_close(dtorch.Tensor(t, mesh1, [Shard(1)]), t)  # data, mesh and placements, positional
    assert_close(dtorch.Tensor([1.5, 2.5]), torch.Tensor([1.5, 2.5]), exact=True)
    with pytest.raises(TypeError, match="multiple values for argument 'device_mesh'"):
        dtorch.Tensor(t, mesh1, device_mesh=mesh1)
    with pytest.raises(TypeError, match="4 positional arguments"):
        dtorch.Tensor(t, mesh1, [R], 3)


# -- indexing with dtorch index tensors of any layout ----------------------------------------------


INDEX_LAYOUTS = {"replicate": [R], "shard-0": [Shard(0)], "shard-1": [Shard(1)],
                 "partial": [Partial()], "one-device": None}


@pytest.mark.parametrize("index_layout", list(INDEX_LAYOUTS))
@pytest.mark.parametrize("x_placements", [[R], [Shard(2)], [Shard(0)]], ids=str)
def test_index_tensors_of_any_layout_index_like_torch(index_layout, x_placements, one, mesh1):
    """CLIP's pooling, ``x[arange(batch), ids.argmax(-1)]``, with the index tensors laid out
    anyhow, on another mesh too: they are made Replicate on the input's mesh, on the devices
    (nothing waits); on a batch-sharded ``x`` each device picks the rows its block holds."""
    t = sample((5, 7, 6))
    rows = sample((5, 7), torch.int64) % 5  # a 2-D index into dim 0
    columns = sample((5,), torch.int64, seed=1) % 7  # a 1-D index into dim 1

    def laid_out(index):
        placements = INDEX_LAYOUTS[index_layout]
        if placements is None:
            return dtorch.from_torch(index, one)
        if placements[0].is_shard() and placements[0].dim >= index.dim():
            placements = [Shard(0)]
        return dtorch.from_torch(index, mesh1, placements)

    x = dtorch.from_torch(t, mesh1, x_placements)
    arange = dtorch.arange(5)  # on the default (one-device) mesh
    assert_close(x[arange, laid_out(columns)], t[torch.arange(5), columns])
    assert_close(x[laid_out(rows)], t[rows])
    y = dtorch.from_torch(t.clone(), mesh1, x_placements)
    y[:, laid_out(columns)] = 0.0
    expected = t.clone()
    expected[:, columns] = 0.0
    assert_close(y, expected)


# -- Module: torch's replacement rules, get_parameter -----------------------------------------------


def _param(lib):
    return lib.nn.Parameter(lib.ones(2) if lib is dtorch else torch.ones(2))


def _buffer(lib):
    return lib.nn.Buffer(lib.ones(2) if lib is dtorch else torch.ones(2))


SETATTR = [  # (id, steps on a fresh module m of lib): torch's outcome is the expectation
    ("none-then-parameter", lambda lib, m: (setattr(m, "w", None), setattr(m, "w", _param(lib)))),
    ("int-then-parameter", lambda lib, m: (setattr(m, "w", 3), setattr(m, "w", _param(lib)))),
    ("none-then-buffer", lambda lib, m: (setattr(m, "w", None), setattr(m, "w", _buffer(lib)))),
    ("parameter-then-buffer", lambda lib, m: (setattr(m, "w", _param(lib)),
                                              setattr(m, "w", _buffer(lib)))),
    ("buffer-then-parameter", lambda lib, m: (setattr(m, "w", _buffer(lib)),
                                              setattr(m, "w", _param(lib)))),
    ("module-then-parameter", lambda lib, m: (setattr(m, "w", lib.nn.Linear(2, 2)),
                                              setattr(m, "w", _param(lib)))),
    ("parameter-then-module", lambda lib, m: (setattr(m, "w", _param(lib)),
                                              setattr(m, "w", lib.nn.Linear(2, 2)))),
    ("parameter-then-none", lambda lib, m: (setattr(m, "w", _param(lib)), setattr(m, "w", None))),
    ("parameter-then-int", lambda lib, m: (setattr(m, "w", _param(lib)), setattr(m, "w", 3))),
    ("buffer-then-int", lambda lib, m: (setattr(m, "w", _buffer(lib)), setattr(m, "w", 3))),
    ("buffer-then-module", lambda lib, m: (setattr(m, "w", _buffer(lib)),
                                           setattr(m, "w", lib.nn.Linear(2, 2)))),
    ("module-then-int", lambda lib, m: (setattr(m, "w", lib.nn.Linear(2, 2)), setattr(m, "w", 3))),
    ("attribute-then-register", lambda lib, m: (setattr(m, "w", None),
                                                m.register_parameter("w", _param(lib)))),
]


def _outcome(lib, steps):
    m = lib.nn.Module()
    try:
        steps(lib, m)
    except Exception as e:  # noqa: BLE001 - the outcome is the exception's type
        return type(e)
    return (sorted(n for n, _ in m.named_parameters()), sorted(n for n, _ in m.named_buffers()),
            sorted(m._modules), "w" in m.__dict__)


@pytest.mark.parametrize("steps", [s for _, s in SETATTR], ids=[i for i, _ in SETATTR])
def test_setattr_replaces_as_torch_does(steps):
    assert _outcome(dtorch, steps) == _outcome(torch, steps)


def test_a_parameter_replaces_a_plain_attribute_and_is_used():
    """diffusers' norms: ``self.weight = None`` then ``self.weight = nn.Parameter(...)``."""
    m = dtorch.nn.Module()
    m.weight = None
    m.weight = dtorch.nn.Parameter(dtorch.full((3,), 2.0))
    assert [n for n, _ in m.named_parameters()] == ["weight"] and "weight" not in m.__dict__
    assert_close(m.weight * dtorch.ones(3), torch.full((3,), 2.0), exact=True)
    m.load_state_dict({"weight": torch.tensor([1.0, 2.0, 3.0])})
    assert_close(m.weight, torch.tensor([1.0, 2.0, 3.0]), exact=True)


def test_get_parameter_finds_dtorch_parameters_with_torchs_errors():
    model = dtorch.nn.Sequential(dtorch.nn.Linear(2, 3), dtorch.nn.ReLU())
    ref = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU())
    assert model.get_parameter("0.weight") is model[0].weight
    assert model.get_parameter("0.bias").shape == ref.get_parameter("0.bias").shape
    model[0].scale, ref[0].scale = 3, 3
    for target in ("0.nothing", "2.weight", "0.scale"):
        with pytest.raises(AttributeError) as expected:
            ref.get_parameter(target)
        with pytest.raises(AttributeError, match=str(expected.value).split("`")[1]):
            model.get_parameter(target)


# -- Graph._set_default_dtype, Tensor.parser_tensor_to_function_arg --------------------------------


def test_set_default_dtype_sets_the_factories_dtype_until_set_again():
    g = dtorch.Graph()
    g._set_default_dtype(torch.float16)
    assert g.default_dtype is torch.float16 and dtorch.zeros(2, graph=g).dtype is torch.float16
    with g.dtype_guard(torch.float64):
        assert dtorch.ones(1, graph=g).dtype is torch.float64
    assert g.default_dtype is torch.float16  # the guard restores what was set
    g._set_default_dtype(None)
    assert g.default_dtype is torch.float32
    with pytest.raises(TypeError, match="_set_default_dtype"):
        g._set_default_dtype("float16")


def test_parser_tensor_to_function_arg_names_the_mesh_and_dtype(mesh1):
    parse = dtorch.Tensor.parser_tensor_to_function_arg
    assert parse(("cpu",), {"dtype": torch.float16}) == (dtorch.DeviceMesh("cpu", [0]),
                                                         torch.float16)
    assert parse((mesh1, torch.bfloat16), {}) == (mesh1, torch.bfloat16)
    assert parse((), {"device": mesh1, "silence_dtype_warnings": True}) == (mesh1, None)
    assert parse((torch.float64,), {}) == (None, torch.float64)
    assert parse((), {}) == (None, None)
    # a CUDA device is its one-device mesh, whether or not this machine has it
    assert parse((torch.device("cuda", 1),), {})[0] == dtorch.DeviceMesh("cuda", [1])
    other = dtorch.zeros(2, dtype=torch.int32, device_mesh=mesh1)
    assert parse((other,), {}) == (mesh1, torch.int32)
    with pytest.raises(TypeError, match="invalid combination"):
        parse((3,), {})


# -- the fused ops and their torch reference ------------------------------------------------------


FUSED = [  # (id, make torch inputs, dtorch fused op, compiled_op reference)
    ("rotary", lambda dt: (sample((1, 4, 8, 6), dt), sample((8, 6), seed=1),
                           sample((8, 6), seed=2)),
     lambda x, c, s: dtorch.nn.functional._apply_rotary_emb(x, [c, s]),
     dtorch.compiled_op.apply_rotary_emb),
    ("silu-linear-chunk", lambda dt: (sample((2, 8), dt), sample((24, 8), dt, seed=1),
                                      sample((24,), dt, seed=2)),
     lambda e, w, b: tuple(dtorch.nn.functional._silu_linear_chunk(e, w, b, 6)),
     lambda e, w, b: tuple(dtorch.compiled_op.silu_linear_chunk(e, w, b, 6))),
    ("layer-norm-mul-add", lambda dt: (sample((2, 5, 8), dt), sample((2, 8), dt, seed=1),
                                       sample((2, 8), dt, seed=2)),
     lambda x, s, h: dtorch.nn.functional._layer_norm_mul_add(x, s, h, (8,), 1e-6, None, None),
     lambda x, s, h: dtorch.compiled_op.layer_norm_mul_add(x, s, h, (8,), 1e-6, None, None)),
    ("layer-norm-mul-add-affine", lambda dt: (sample((2, 5, 8), dt), sample((2, 8), dt, seed=1),
                                              sample((2, 8), dt, seed=2),
                                              sample((8,), dt, seed=3), sample((8,), dt, seed=4)),
     lambda x, s, h, w, b: dtorch.nn.functional._layer_norm_mul_add(x, s, h, 8, 1e-5, w, b),
     lambda x, s, h, w, b: dtorch.compiled_op.layer_norm_mul_add(x, s, h, 8, 1e-5, w, b)),
    ("rms-norm", lambda dt: (sample((3, 8), dt), sample((8,), dt, seed=1)),
     lambda x, w: dtorch.nn.functional.rms_norm(x, (8,), w, 1e-6),
     lambda x, w: dtorch.compiled_op.rms_norm(x, (8,), w, 1e-6)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("row", FUSED, ids=[r[0] for r in FUSED])
def test_fused_ops_equal_their_torch_reference(row, dtype, one, mesh1):
    """Bit for bit on one device; on three, with the batch dim sharded, allclose."""
    _, make, fused, reference = row
    ts = make(dtype)
    expected = reference(*ts)
    assert_close(fused(*[dtorch.from_torch(t, one) for t in ts]), expected, exact=True)
    sharded = [dtorch.from_torch(ts[0], mesh1, [Shard(0)])]
    modulating = row[0].startswith("layer-norm-mul-add")  # scale and shift are per sample
    sharded += [dtorch.from_torch(t, mesh1, [Shard(0) if modulating and t.dim() == 2 else R])
                for t in ts[1:]]
    assert_close(fused(*sharded), expected)


def test_compiled_op_reference_is_the_math():
    """The reference is what the ops mean, not only what dtorch computes."""
    x, scale, shift = sample((2, 3, 4)), sample((2, 4), seed=1), sample((2, 4), seed=2)
    normed = torch.nn.functional.layer_norm(x, (4,))
    assert_close(dtorch.compiled_op.layer_norm_mul_add(x, scale, shift, (4,), 1e-5),
                 normed * (1 + scale[:, None]) + shift[:, None])
    e, w, b = sample((2, 4)), sample((6, 4), seed=1), sample((6,), seed=2)
    pieces = dtorch.compiled_op.silu_linear_chunk(e, w, b, 3)
    assert_close(torch.cat(pieces, 1), torch.nn.functional.silu(e) @ w.T + b)
    cos, sin = torch.ones(3, 4), torch.zeros(3, 4)
    q = sample((1, 2, 3, 4))
    assert_close(dtorch.compiled_op.apply_rotary_emb(q, cos, sin), q, exact=True)


# -- gelu's error, the functional list --------------------------------------------------------------


def test_gelu_refuses_an_unknown_approximate_at_the_call():
    x = dtorch.from_torch(sample((2, 3)))
    with pytest.raises(RuntimeError, match="none or tanh"):
        torch.nn.functional.gelu(sample((2, 3)), approximate="invalid_value")
    ids = repr(session._tensor_ids)
    for error in (ValueError, RuntimeError):  # DTorch's type, and torch's
        with pytest.raises(error, match="approximate argument must be either none or tanh"):
            dtorch.nn.functional.gelu(x, approximate="invalid_value")
    assert repr(session._tensor_ids) == ids
    for approximate in ("none", "tanh"):
        assert_close(dtorch.nn.functional.gelu(x, approximate=approximate),
                     torch.nn.functional.gelu(x.to_torch(), approximate=approximate), exact=True)


def test_function_names_are_torchs_or_dtorchs_private_forms():
    names = dtorch.nn.functional._function_names
    assert {"gelu", "linear", "scaled_dot_product_attention", "_apply_rotary_emb",
            "_silu_linear_chunk", "_layer_norm_mul_add"} <= set(names)
    assert "moe_experts" not in names and "SdpaOption" not in names
    for name in names:
        assert callable(getattr(dtorch.nn.functional, name))
        public = name.lstrip("_")
        assert name.startswith("_") or hasattr(torch.nn.functional, name), name
        if hasattr(torch, public):  # torch's top-level and Tensor names are dtorch's too
            assert hasattr(dtorch, public), public
        if hasattr(torch.Tensor, public):
            assert hasattr(dtorch.Tensor, public), public
    with pytest.raises(AttributeError):
        dtorch.nn.functional.no_such_function  # noqa: B018
