"""Checkpoint files are checked before any byte of them is trusted: safetensors headers, dtorch
and HF indexes, where the files an index names are (inside the checkpoint, or an HF hub cache's
blobs) and what kind of file they are (a FIFO must not hang the load). Every check raises at
``load_checkpoint``, before the runtime is asked for anything."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from safetensors.torch import save_file

import dtorch
from dtorch.checkpoint import kernels as ops
from dtorch.checkpoint import load_checkpoint

SAVE_ID = "0123456789ab"
RANK = f"rank00000-mesh0-{SAVE_ID}.safetensors"


def raw_file(path, header, data: bytes = b"", length: int | None = None):
    """A safetensors file of ``header`` (a JSON value, or raw bytes) and ``data``."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


def f32(shape, begin, end):
    return {"dtype": "F32", "shape": shape, "data_offsets": [begin, end]}


# (case, header, data bytes, what the message must also say); each would load silently, or
# raise a bare JSONDecodeError / KeyError / TypeError, without its check
BAD_HEADERS = [
    ("overlapping", {"a": f32([2], 0, 8), "b": f32([2], 4, 12)}, 12, "'a' and 'b' overlap"),
    ("negative offset", {"a": f32([1], -4, 0)}, 8, "'a' has data_offsets"),
    ("past the data", {"a": f32([2], 0, 8)}, 4, "'a' of shape"),
    ("size not shape x dtype", {"a": f32([3], 0, 8)}, 8, "'a' of shape"),
    ("end before begin", {"a": f32([0], 8, 4)}, 8, "'a' of shape"),
    ("unknown dtype", {"a": {"dtype": "F33", "shape": [1], "data_offsets": [0, 4]}}, 4,
     "'a' has dtype 'F33'"),
    ("dtype not a string", {"a": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}, 4,
     "'a' has dtype"),
    ("float offsets", {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0.0, 4.0]}}, 4,
     "'a' has data_offsets"),
    ("shape a string", {"a": {"dtype": "F32", "shape": "1", "data_offsets": [0, 4]}}, 4,
     "'a' has shape"),
    ("entry not an object", {"a": 3}, 4, "'a' is described by a JSON int"),
    ("header a list", [1, 2], 0, "a JSON list, not an object"),
    ("header not JSON", b"{nope", 0, "not JSON"),
    ("header not UTF-8", b"\xff\xfe", 0, "not JSON"),
    ("metadata a list", {"__metadata__": [1], "a": f32([1], 0, 4)}, 4, "__metadata__"),
]


@pytest.mark.parametrize("case, header, data, says", BAD_HEADERS, ids=[c[0] for c in BAD_HEADERS])
def test_a_bad_header_raises_naming_file_and_key(tmp_path, case, header, data, says):
    path = raw_file(tmp_path / "m.safetensors", header, bytes(data))
    with pytest.raises(ValueError) as e:
        load_checkpoint(dtorch.nn.Module(), path)
    assert str(path) in str(e.value) and says in str(e.value)


@pytest.mark.parametrize("length", [0, "one byte past the file", 10**6, 2**64 - 1])
def test_a_header_length_outside_the_file_raises(tmp_path, length):
    header = {"a": f32([1], 0, 4)}
    if length == "one byte past the file":  # the header, the 4 data bytes and one more
        length = len(json.dumps(header)) + 5
    path = raw_file(tmp_path / "m.safetensors", header, bytes(4), length=length)
    with pytest.raises(ValueError, match="header length"):
        load_checkpoint(dtorch.nn.Module(), path)
    (tmp_path / "short.safetensors").write_bytes(b"\x08\x00")  # not even a length
    with pytest.raises(ValueError, match="header length"):
        load_checkpoint(dtorch.nn.Module(), tmp_path / "short.safetensors")


def test_a_good_handmade_file_passes_the_checks(tmp_path):
    """The checks refuse only what is wrong: empty tensors anywhere, tensors in any order."""
    data = struct.pack("<3f", 1, 2, 3)
    header = {"b": f32([2], 4, 12), "a": f32([1], 0, 4), "e": f32([0], 4, 4),
              "__metadata__": {"format": "pt"}}
    path = raw_file(tmp_path / "m.safetensors", header, data)
    from dtorch.checkpoint.index import catalog

    entries = catalog(str(path))
    assert sorted(entries) == ["a", "b", "e"] and entries["b"].shape == (2,)


# -- indexes ----------------------------------------------------------------------------------


def dtorch_dir(tmp_path, **changes):
    """A directory with one rank file (``w``, 2 x 3 float32) and a dtorch index, whose fields
    ``changes`` replace (a callable: applied to the index)."""
    ops.write_file(str(tmp_path / RANK), [("w", torch.arange(6.0).reshape(2, 3))])
    index = {"format": "dtorch", "version": 2, "save_id": SAVE_ID,
             "files": {RANK: {"size": os.path.getsize(tmp_path / RANK)}},
             "tensors": {"w": {"dtype": "float32", "shape": [2, 3], "pieces": [
                 {"file": RANK, "key": "w", "offsets": [0, 0], "shape": [2, 3]}]}}}
    for key, value in changes.items():
        index = value(index) if callable(value) else {**index, key: value}
    (tmp_path / "dtorch.index.json").write_text(json.dumps(index))
    return tmp_path


def piece(**fields):
    def change(index):
        p = index["tensors"]["w"]["pieces"][0]
        p.update(fields)
        for k in [k for k, v in fields.items() if v is None]:
            del p[k]
        return index
    return change


def w_entry(value):
    def change(index):
        index["tensors"]["w"] = value
        return index
    return change


BAD_DTORCH_INDEXES = [
    ("tensors a list", {"tensors": []}, "tensors is not an object"),
    ("an entry without pieces", {"t": w_entry({"dtype": "float32", "shape": [2, 3]})},
     "tensor 'w' is not an object"),
    ("an unknown dtype", {"t": w_entry({"dtype": "float33", "shape": [2, 3], "pieces": []})},
     "tensor 'w' has dtype 'float33'"),
    ("a dtype that is no dtype", {"t": w_entry({"dtype": "add", "shape": [2, 3], "pieces": []})},
     "tensor 'w' has dtype 'add'"),
    ("a piece without its file", {"t": piece(file=None)}, "tensor 'w' has a piece"),
    ("a piece with negative offsets", {"t": piece(offsets=[-1, 0])}, "tensor 'w' has a piece"),
    ("a piece of another shape", {"t": piece(shape=[1, 3])}, "tensor 'w' has a piece"),
    ("a piece under a missing key", {"t": piece(key="v")}, "holds no such key"),
    ("no files", {"files": None}, "files is not an object"),
    ("a size that is not a number", {"files": {RANK: {"size": "1"}}}, "files is not an object"),
    ("a file the files do not name", {"files": {}}, "which its files do not name"),
    ("a file of another size", {"files": {RANK: {"size": 1}}}, "not the 1 it was saved with"),
    ("a newer version", {"version": 3}, "index version 3"),
    ("pieces that overlap and leave a gap", {"t": w_entry({"dtype": "float32", "shape": [4, 3],
                                                           "pieces": [
        {"file": RANK, "key": "w", "offsets": [0, 0], "shape": [2, 3]},
        {"file": RANK, "key": "w", "offsets": [1, 0], "shape": [2, 3]}]})}, "pieces that overlap"),
]


@pytest.mark.parametrize("case, changes, says", BAD_DTORCH_INDEXES,
                         ids=[c[0] for c in BAD_DTORCH_INDEXES])
def test_a_bad_dtorch_index_raises_naming_it(tmp_path, case, changes, says):
    directory = dtorch_dir(tmp_path, **changes)
    with pytest.raises(ValueError) as e:
        load_checkpoint(dtorch.nn.Module(), directory)
    assert str(directory / "dtorch.index.json") in str(e.value) and says in str(e.value)


def test_the_handmade_dtorch_index_itself_is_read(tmp_path):
    """(The base of the cases above is valid: each fails for its own change.)"""
    from dtorch.checkpoint.index import catalog

    entry = catalog(str(dtorch_dir(tmp_path)))["w"]
    assert entry.shape == (2, 3) and entry.pieces[0].path == str(tmp_path / RANK)


def test_an_index_of_version_1_is_still_read(tmp_path):
    """Written before saves named their files in the index: read without the size checks."""
    from dtorch.checkpoint.index import catalog

    directory = dtorch_dir(tmp_path, version=1, t=lambda index: {
        k: v for k, v in index.items() if k not in ("files", "save_id")})
    assert catalog(str(directory))["w"].shape == (2, 3)


@pytest.mark.parametrize("text, says", [
    ("{nope", "not a JSON file"), ("[1]", "neither a dtorch index"),
    ('{"weight_map": ["m.safetensors"]}', "weight_map is not an object"),
    ('{"weight_map": {"w": 3}}', "weight_map is not an object"),
    ('{"weight_map": {"v": "m.safetensors"}}', "'v' is not in m.safetensors"),
])
def test_a_bad_hf_index_raises_naming_it(tmp_path, text, says):
    save_file({"w": torch.ones(2)}, tmp_path / "m.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(text)
    with pytest.raises(ValueError) as e:
        load_checkpoint(dtorch.nn.Module(), tmp_path)
    assert "model.safetensors.index.json" in str(e.value) and says in str(e.value)


def test_rank_files_without_an_index_are_refused_as_incomplete(tmp_path):
    """The leftovers of a first save that did not finish: not read as whatever files are
    there, even beside a plain model file."""
    ops.write_file(str(tmp_path / RANK), [("w", torch.ones(2))])
    save_file({"w": torch.ones(2)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="incomplete dtorch checkpoint.*rank00000-mesh0"):
        load_checkpoint(dtorch.nn.Module(), tmp_path)


def test_a_plain_hf_directory_still_loads(tmp_path):
    """model.safetensors and no index at all (the most common download)."""
    save_file({"w": torch.arange(4.0)}, tmp_path / "model.safetensors")
    m = dtorch.nn.Module()
    m.w = dtorch.nn.Parameter(dtorch.zeros(4))
    load_checkpoint(m, tmp_path)
    assert torch.equal(m.w.to_torch(), torch.arange(4.0))


# -- where the named files are ----------------------------------------------------------------


@pytest.mark.parametrize("name", ["../outside.safetensors", "sub/../../outside.safetensors",
                                  "ABSOLUTE"])
def test_an_hf_index_may_not_name_files_outside(tmp_path, name):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    save_file({"w": torch.ones(2)}, tmp_path / "outside.safetensors")
    name = str(tmp_path / "outside.safetensors") if name == "ABSOLUTE" else name
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": name}}))
    with pytest.raises(ValueError, match="not a path inside"):
        load_checkpoint(dtorch.nn.Module(), directory)


def test_a_dtorch_index_may_not_name_files_outside(tmp_path):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    dtorch_dir(directory, t=piece(file=f"../ckpt/{RANK}"))
    with pytest.raises(ValueError, match="not a path inside"):
        load_checkpoint(dtorch.nn.Module(), directory)


def test_a_symlink_out_of_the_checkpoint_is_refused(tmp_path):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    save_file({"w": torch.ones(2)}, tmp_path / "secret.safetensors")
    (directory / "model.safetensors").symlink_to(tmp_path / "secret.safetensors")
    with pytest.raises(ValueError, match="outside the checkpoint"):
        load_checkpoint(dtorch.nn.Module(), directory)  # globbed, no index
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "model.safetensors"}}))
    with pytest.raises(ValueError, match="outside the checkpoint"):
        load_checkpoint(dtorch.nn.Module(), directory)


def test_an_hf_hub_cache_snapshot_loads_from_its_blobs(tmp_path):
    """HF's cache: snapshots/<rev>/ holds symlinks to ../../blobs/<sha>; those are allowed,
    a symlink into another model's blobs is not."""
    root = tmp_path / "hub" / "models--org--name"
    (root / "blobs").mkdir(parents=True)
    snapshot = root / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    save_file({"w": torch.arange(3.0)}, root / "blobs" / "f00d")
    (snapshot / "model.safetensors").symlink_to("../../blobs/f00d")
    m = dtorch.nn.Module()
    m.w = dtorch.nn.Parameter(dtorch.zeros(3))
    load_checkpoint(m, snapshot)
    assert torch.equal(m.w.to_torch(), torch.arange(3.0))
    other = tmp_path / "hub" / "models--org--other" / "blobs"
    other.mkdir(parents=True)
    save_file({"w": torch.ones(3)}, other / "beef")
    (snapshot / "model.safetensors").unlink()
    (snapshot / "model.safetensors").symlink_to(other / "beef")
    with pytest.raises(ValueError, match="outside the checkpoint"):
        load_checkpoint(m, snapshot)


# -- what kind of file ------------------------------------------------------------------------


@pytest.mark.timeout(20)  # without the check, opening a FIFO blocks until a writer comes
@pytest.mark.parametrize("name", ["model.safetensors", "model.safetensors.index.json",
                                  "dtorch.index.json", "pytorch_model.bin", "one.safetensors"])
def test_a_fifo_is_refused_not_opened(tmp_path, name):
    os.mkfifo(tmp_path / name)
    path = tmp_path / name if name == "one.safetensors" else tmp_path
    with pytest.raises(ValueError, match="not a regular file"):
        load_checkpoint(dtorch.nn.Module(), path)
