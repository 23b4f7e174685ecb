"""Checkpoints: round trips across layouts (every device writes its own blocks, every device reads
only its own), HF and plain safetensors files, torch state dicts, key maps, dtype casts and
torch's key errors. Memory bounds are measured in benchmarks/bench_checkpoint.py."""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import dtorch
from dtorch import Partial, Replicate, Shard, config
from dtorch.checkpoint import load_checkpoint, save_checkpoint

R = Replicate()


def build(values: dict, layout) -> dtorch.nn.Module:
    """A dtorch module whose state dict has the keys of ``values``, each laid out as
    ``layout(key, value)`` says (mesh, placements): floats are parameters, the rest buffers.
    Submodules follow the dotted names (``a.w`` is parameter ``w`` of submodule ``a``)."""
    root = dtorch.nn.Module()
    for key, value in values.items():
        *path, name = key.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, dtorch.nn.Module())
            module = getattr(module, part)
        mesh, placements = layout(key, value)
        t = dtorch.from_torch(value, mesh, placements)
        if value.is_floating_point():
            module.register_parameter(name, dtorch.nn.Parameter(t))
        else:
            module.register_buffer(name, t)
    return root


def zeros_like_layout(values: dict, layout) -> dtorch.nn.Module:
    return build({k: torch.zeros_like(v) for k, v in values.items()}, layout)


def assert_holds(module, values: dict) -> None:
    state = module.state_dict()
    assert sorted(state) == sorted(values)
    for key, value in values.items():
        got = state[key].to_torch()
        assert got.dtype == value.dtype, key
        assert torch.equal(got, value), key


def values_for_round_trips() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "a.w": torch.randn(7, 5, generator=g),                     # uneven on 2 and 4
        "a.b": torch.randn(5, generator=g),
        "b.w": torch.randn(3, 9, generator=g).to(torch.bfloat16),  # 3 rows on 4: one empty block
        "c.v": torch.randn(2, 3, 4, dtype=torch.float64, generator=g),
        "steps": torch.tensor(7),                                  # a 0-dim int buffer
        "mask": torch.tensor([True, False, True]),
    }


ONE = ("cpu", [0])
TP2 = ("cpu", [0, 1])
TP4 = ("cpu", [0, 1, 2, 3])

# per layout: placements by key (one mesh dim); Partial ones are reduced on save and read by
# coordinate 0 on load
PLACEMENTS = {
    "1": {},
    "tp2": {"a.w": [Shard(0)], "a.b": [Partial()], "b.w": [Shard(1)], "c.v": [Shard(2)],
            "mask": [Shard(0)]},
    "tp4": {"a.w": [Shard(1)], "a.b": [Shard(0)], "b.w": [Shard(0)], "c.v": [Partial()],
            "mask": [Shard(0)]},
    # sub-split Shards (what cat along a sharded dim makes): saved as plain ones, loaded into
    # each device's pieces
    "tp2s": {"a.w": [Shard(0, (4, 3))], "b.w": [Shard(1, (5, 1, 3))], "c.v": [Shard(2, (1, 3))],
             "mask": [Shard(0, (1, 2))]},
}
MESHES = {"1": ONE, "tp2": TP2, "tp4": TP4, "tp2s": TP2}


def layout_of(name: str):
    mesh = dtorch.DeviceMesh(*MESHES[name])
    return lambda key, value: (mesh, PLACEMENTS[name].get(key, [R]))


@pytest.mark.parametrize("source, target", [("1", "tp2"), ("tp2", "tp4"), ("tp4", "1"),
                                            ("tp2", "tp2"), ("tp4", "tp2s"), ("tp2s", "1"),
                                            ("tp2s", "tp2s")])
def test_round_trip_across_layouts(tmp_path, source, target):
    values = values_for_round_trips()
    saved = build(values, layout_of(source))
    save_checkpoint(saved, tmp_path)
    loaded = zeros_like_layout(values, layout_of(target))
    assert load_checkpoint(loaded, tmp_path) is not None
    assert_holds(loaded, values)
    for key, t in loaded.state_dict().items():  # each keeps its own layout
        assert t.placements == list(PLACEMENTS[target].get(key, [R])), key


def test_each_device_writes_its_own_share_once(tmp_path):
    """dp2 x tp2: every device writes an ordinary safetensors file of its blocks, each element
    once; a Replicate mesh dim is written as a shard of a tensor dim no other mesh dim shards
    (so the replicas share the writing), on the largest such dim; where no tensor dim is left
    (a vector on two Replicate dims) one coordinate writes; the index says where each is."""
    mesh = dtorch.DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=["dp", "tp"])
    values = {"w": torch.arange(15.0).reshape(5, 3), "b": torch.arange(3.0),
              "s": torch.tensor(7.0)}
    layouts = {"w": [R, Shard(0)], "b": [R, R], "s": [R, R]}
    save_checkpoint(build(values, lambda k, v: (mesh, layouts[k])), tmp_path)
    index = json.loads((tmp_path / "dtorch.index.json").read_text())
    files = [f"rank{d:05d}-mesh0-{index['save_id']}.safetensors" for d in range(4)]
    assert sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors")) == files
    assert index["files"] == {f: {"size": os.path.getsize(tmp_path / f)} for f in files}
    # w: rows split on tp (3 + 2), columns on dp (2 + 1); device = 2 * dp + tp
    assert index["tensors"]["w"]["pieces"] == [
        {"file": files[0], "key": "w", "offsets": [0, 0], "shape": [3, 2]},
        {"file": files[1], "key": "w", "offsets": [3, 0], "shape": [2, 2]},
        {"file": files[2], "key": "w", "offsets": [0, 2], "shape": [3, 1]},
        {"file": files[3], "key": "w", "offsets": [3, 2], "shape": [2, 1]}]
    # b: split on dp only (its one dim is taken), written by tp coordinate 0; s by device 0
    assert index["tensors"]["b"]["pieces"] == [
        {"file": files[0], "key": "b", "offsets": [0], "shape": [2]},
        {"file": files[2], "key": "b", "offsets": [2], "shape": [1]}]
    assert index["tensors"]["s"]["pieces"] == [
        {"file": files[0], "key": "s", "offsets": [], "shape": []}]
    held = [load_file(tmp_path / f) for f in files]
    assert torch.equal(held[3]["w"], values["w"][3:, 2:]) and sorted(held[3]) == ["w"]
    assert torch.equal(held[2]["b"], values["b"][2:]) and sorted(held[2]) == ["b", "w"]
    assert sorted(held[0]) == ["b", "s", "w"] and torch.equal(held[0]["s"], values["s"])
    loaded = build({k: torch.zeros_like(v) for k, v in values.items()}, on_one)
    load_checkpoint(loaded, tmp_path)
    assert_holds(loaded, values)


def test_tied_and_client_tensors(tmp_path):
    """A tensor at two keys is saved once and loads into both; a torch parameter inside a
    dtorch module is written and read by the client."""
    mesh = dtorch.DeviceMesh(*TP2)
    m = build({"emb": torch.randn(6, 4)}, lambda k, v: (mesh, [Shard(0)]))
    m.head = dtorch.nn.Module()
    m.head.register_parameter("w", m.emb)
    m.register_parameter("local", torch.nn.Parameter(torch.arange(4.0)))
    save_checkpoint(m, tmp_path)
    index = json.loads((tmp_path / "dtorch.index.json").read_text())
    assert index["tensors"]["head.w"]["pieces"] == index["tensors"]["emb"]["pieces"]
    other = build({"emb": torch.zeros(6, 4)}, on_one)
    other.head = dtorch.nn.Module()
    other.head.register_parameter("w", dtorch.nn.Parameter(dtorch.zeros(6, 4)))
    other.register_parameter("local", torch.nn.Parameter(torch.zeros(4)))
    load_checkpoint(other, tmp_path)
    assert torch.equal(other.head.w.to_torch(), m.emb.to_torch())
    assert torch.equal(other.local.detach(), torch.arange(4.0))


def test_a_plain_file_with_key_maps(tmp_path):
    path = tmp_path / "m.safetensors"
    w, b = torch.randn(5, 7), torch.randn(7)
    save_file({"model.w": w, "model.b": b, "extra": torch.ones(2)}, path)
    mesh = dtorch.DeviceMesh(*TP2)
    layout = {"w": [Shard(1)], "b": [Shard(0)]}
    m = zeros_like_layout({"w": w, "b": b}, lambda k, v: (mesh, layout[k]))
    result = load_checkpoint(m, path, key_map={"model.w": "w", "model.b": "b"}, strict=False)
    assert result.missing_keys == [] and result.unexpected_keys == ["extra"]
    assert_holds(m, {"w": w, "b": b})
    m = zeros_like_layout({"w": w, "b": b}, lambda k, v: (mesh, layout[k]))
    load_checkpoint(m, path, key_map=lambda k: None if k == "extra" else k[len("model."):])
    assert_holds(m, {"w": w, "b": b})
    with pytest.raises(ValueError, match="maps both"):
        load_checkpoint(m, path, key_map=lambda k: "w")


def test_dtype_casts(tmp_path):
    """Each value takes its parameter's dtype (cast on the hosts); ``dtype=`` makes the floating
    parameters that dtype, keeping their layouts and ties."""
    path = tmp_path / "m.safetensors"
    w = torch.randn(6, 4)
    save_file({"w": w, "n": torch.tensor([1, 2, 3])}, path)
    mesh = dtorch.DeviceMesh(*TP2)
    m = build({"w": torch.zeros(6, 4, dtype=torch.bfloat16),
               "n": torch.zeros(3, dtype=torch.int32)}, lambda k, v: (mesh, [Shard(0)]))
    load_checkpoint(m, path)
    assert_holds(m, {"w": w.to(torch.bfloat16), "n": torch.tensor([1, 2, 3], dtype=torch.int32)})
    m = build({"w": torch.zeros(6, 4), "n": torch.zeros(3, dtype=torch.int64)},
              lambda k, v: (mesh, [Shard(1)] if k == "w" else [R]))
    m.tied = dtorch.nn.Module()
    m.tied.register_parameter("w", m.w)
    load_checkpoint(m, path, dtype=torch.float16, strict=False)
    assert m.w.dtype == torch.float16 and m.w.placements == [Shard(1)]
    assert isinstance(m.w, dtorch.nn.Parameter) and m.tied.w is m.w
    assert torch.equal(m.w.to_torch(), w.half()) and m.n.dtype == torch.int64


def on_one(key, value):
    return dtorch.DeviceMesh(*ONE), [R]


def test_key_errors_are_torchs_and_raise_before_reading(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"w": torch.ones(3), "extra": torch.ones(1)}, path)
    m = build({"w": torch.zeros(3), "b": torch.zeros(2)}, on_one)
    with pytest.raises(RuntimeError) as e:
        load_checkpoint(m, path)
    assert str(e.value) == ('Error(s) in loading state_dict for Module:\n\tMissing key(s) in '
                            'state_dict: "b". \n\tUnexpected key(s) in state_dict: "extra". ')
    assert torch.equal(m.w.to_torch(), torch.zeros(3))  # nothing was read
    result = load_checkpoint(m, path, strict=False)
    assert (result.missing_keys, result.unexpected_keys) == (["b"], ["extra"])
    assert torch.equal(m.w.to_torch(), torch.ones(3))
    wrong = build({"w": torch.zeros(4)}, on_one)
    with pytest.raises(RuntimeError, match="size mismatch for w"):
        load_checkpoint(wrong, path, strict=False)
    ints = build({"w": torch.zeros(3, dtype=torch.int64)}, on_one)
    with pytest.raises(RuntimeError, match="dtype mismatch for w"):
        load_checkpoint(ints, path, strict=False)


def test_bad_files_raise_at_the_call(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_checkpoint(dtorch.nn.Module(), tmp_path / "nothing.safetensors")
    bad = tmp_path / "bad.safetensors"
    save_file({"w": torch.ones(100)}, bad)
    data = bad.read_bytes()
    bad.write_bytes(data[:-8])  # the header now promises bytes the file lacks
    m = build({"w": torch.zeros(100)}, on_one)
    with pytest.raises(ValueError, match="do not fit"):
        load_checkpoint(m, bad)
    with pytest.raises(TypeError, match="key_map"):
        load_checkpoint(m, tmp_path, key_map=3)


def test_a_torch_state_dict(tmp_path):
    values = {"a.w": torch.randn(5, 3), "steps": torch.tensor(4)}
    torch.save({"model." + k: v for k, v in values.items()}, tmp_path / "m.pt")
    mesh = dtorch.DeviceMesh(*TP2)
    m = zeros_like_layout(values, lambda k, v: (mesh, [Shard(0)] if v.dim() else [R]))
    load_checkpoint(m, tmp_path / "m.pt", key_map=lambda k: k[len("model."):])
    assert_holds(m, values)
    directory = tmp_path / "hf"
    directory.mkdir()
    torch.save(values, directory / "pytorch_model.bin")
    m = zeros_like_layout(values, lambda k, v: (mesh, [R]))
    load_checkpoint(m, directory, dtype=torch.float64)
    assert_holds(m, {"a.w": values["a.w"].double(), "steps": values["steps"]})


def test_progress_bar_path(tmp_path):
    """With the bar on, the load follows the hosts' progress through sync futures; the values
    are the same."""
    values = {"w": torch.randn(8, 8)}
    save_file(values, tmp_path / "m.safetensors")
    m = zeros_like_layout(values, lambda k, v: (dtorch.DeviceMesh(*TP2), [Shard(0)]))
    load_checkpoint(m, tmp_path / "m.safetensors", progress=True)
    assert_holds(m, values)


def test_an_hf_model_saved_with_save_pretrained(tmp_path):
    """A tiny Llama saved in HF's sharded format (several files and an index) loads into a dtorch
    module of the same names on a dp x tp mesh, every 2-D weight Shard(0) on tp."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=128)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(tmp_path, max_shard_size="50KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()
                if k in index["weight_map"]}
    mesh = dtorch.DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=["dp", "tp"])
    m = zeros_like_layout(expected, lambda k, v: (mesh, [R, Shard(0)] if v.dim() == 2 else [R, R]))
    assert load_checkpoint(m, tmp_path).missing_keys == []
    assert_holds(m, expected)


# -- the block reader, against torch's slicing (in this process, no runtime) ------------------


def random_case(g: torch.Generator):
    """A stored array, a block of it and a destination: shape, offsets, size, dtype pair."""
    ndim = int(torch.randint(0, 4, (), generator=g))
    shape = tuple(int(s) for s in torch.randint(1, 6, (ndim,), generator=g))
    off = tuple(int(torch.randint(0, s, (), generator=g)) for s in shape)
    size = tuple(int(torch.randint(1, s - o + 1, (), generator=g)) for s, o in zip(shape, off))
    return shape, off, size


@pytest.mark.parametrize("chunk", [1 << 20, 16])  # 16 bytes: rows one at a time, dims down
@pytest.mark.parametrize("cast", [False, True])
def test_read_region_matches_slicing(tmp_path, monkeypatch, chunk, cast):
    from dtorch.checkpoint import kernels as ops

    monkeypatch.setattr(ops, "READ_CHUNK", chunk)
    g = torch.Generator().manual_seed(chunk + cast)
    for case in range(60):
        shape, off, size = random_case(g)
        stored = torch.randn(shape, generator=g)
        path = str(tmp_path / f"{case}.safetensors")
        ops.write_file(path, [("x", stored)])
        start = 8 + int.from_bytes(open(path, "rb").read(8), "little")
        want = stored[tuple(slice(o, o + n) for o, n in zip(off, size))]
        dtype = torch.float64 if cast else torch.float32
        # into a block of its own, and into a strided part of a larger tensor
        out = torch.zeros(size, dtype=dtype)
        ops.read_region(path, start, torch.float32, shape, off, size, out)
        assert torch.equal(out, want.to(dtype)), (shape, off, size)
        if size:
            wide = torch.zeros(*size[:-1], size[-1] + 3, dtype=dtype)
            ops.read_region(path, start, torch.float32, shape, off, size, wide[..., 1:-2])
            assert torch.equal(wide[..., 1:-2], want.to(dtype)), (shape, off, size)
            assert not wide[..., 0].any() and not wide[..., -2:].any()


@pytest.mark.parametrize("nbytes, parts", [(8188, 1), (8192, 2)])
def test_a_read_splits_at_twice_read_split_min(tmp_path, monkeypatch, nbytes, parts):
    """With read_split_min = 4096 and two threads a read of 8188 bytes is one pread, one of
    8192 two (each from the readers' pool); the values are the same."""
    from dtorch.checkpoint import kernels as ops

    stored = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(0))
    path = str(tmp_path / "x.safetensors")
    ops.write_file(path, [("x", stored)])
    start = 8 + int.from_bytes((tmp_path / "x.safetensors").read_bytes()[:8], "little")
    calls, real = [], ops._pread
    monkeypatch.setattr(ops, "_pread", lambda fd, pos, bufs: (
        calls.append((pos, threading.current_thread().name)), real(fd, pos, bufs)))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = torch.zeros_like(stored)
        with config.Context(read_split_min=4096):
            ops.read_region(path, start, torch.float32, stored.shape, (0,), stored.shape, out)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(out, stored)
    assert sorted(pos for pos, _ in calls) == [start + i * (nbytes // parts)
                                               for i in range(parts)]
    pool = [name.startswith("dtorch-read") for _, name in calls]
    assert pool == [parts > 1] * parts
