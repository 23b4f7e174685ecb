"""What a checkpoint holds and where its bytes are: the catalog ``{key: Entry}``, read from
safetensors headers and index files only (never from the tensors' data).

A checkpoint is one of
- a ``.safetensors`` file;
- a directory with ``dtorch.index.json`` (``save_checkpoint``'s): per key the global shape and
  dtype and the pieces, each a block (offsets, shape) stored under a key of one file;
- a directory with an HF index (``model.safetensors.index.json``: ``weight_map`` key -> file),
  or with ``model.safetensors``, or with other ``*.safetensors`` files (each key in one);
- an index file itself (either kind, told apart by its fields);
- a torch state dict (``.pt``, ``.pth``, ``.bin``, or ``pytorch_model.bin`` in a directory),
  which ``load_checkpoint`` reads with torch's own loader instead (``torch_file``).
"""

from __future__ import annotations

import glob
import json
import math
import os
import struct
from typing import NamedTuple

import torch

from ..ops.checkpoint import DTYPES

DTORCH_INDEX = "dtorch.index.json"
HF_INDEX = "model.safetensors.index.json"
TORCH_SUFFIXES = (".pt", ".pth", ".bin")
MAX_HEADER = 100_000_000  # safetensors' own bound on a header


class Piece(NamedTuple):
    """A stored block of a tensor: the array of ``dtype`` (a safetensors name) and ``shape``
    whose bytes start at ``start`` in ``path``, at ``offsets`` in the tensor."""

    path: str
    start: int
    dtype: str
    shape: tuple
    offsets: tuple


class Entry(NamedTuple):
    dtype: torch.dtype
    shape: tuple
    pieces: tuple

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def torch_file(path: str) -> str | None:
    """The torch state dict ``path`` is or holds (a directory without safetensors files), or
    None for a safetensors checkpoint."""
    if not os.path.isdir(path):
        return path if path.endswith(TORCH_SUFFIXES) else None
    if _safetensors_layout(path) is not None:
        return None
    found = [os.path.join(path, f) for f in ("pytorch_model.bin", "model.pt")]
    return next((f for f in found if os.path.exists(f)), None)


def catalog(path: str) -> dict:
    """``{key: Entry}`` of the safetensors checkpoint at ``path``."""
    path = os.path.abspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"load_checkpoint: no checkpoint at {path}")
    if not os.path.isdir(path):
        return index_entries(path) if path.endswith(".json") else file_entries(path)
    layout = _safetensors_layout(path)
    if layout is None:
        raise FileNotFoundError(f"load_checkpoint: {path} holds no {DTORCH_INDEX}, no "
                                f"*.safetensors.index.json, no *.safetensors and no torch "
                                f"state dict")
    if layout.endswith(".json"):
        return index_entries(layout)
    entries = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        for key, entry in file_entries(file).items():
            if key in entries:
                raise ValueError(f"load_checkpoint: {key!r} is in two files of {path}; name "
                                 f"the one to read, or add an index")
            entries[key] = entry
    return entries


def _safetensors_layout(directory: str) -> str | None:
    """The index of a directory, or the directory itself when it holds safetensors files."""
    for name in (DTORCH_INDEX, HF_INDEX):
        if os.path.exists(os.path.join(directory, name)):
            return os.path.join(directory, name)
    others = sorted(glob.glob(os.path.join(directory, "*.safetensors.index.json")))
    if others:
        return others[0]
    return directory if glob.glob(os.path.join(directory, "*.safetensors")) else None


def read_header(path: str) -> tuple:
    """(first data byte, ``{key: (dtype name, shape, begin, end)}``) of a safetensors file, with
    the format's checks: a dtype it names, and byte ranges that fit their shapes and the file."""
    with open(path, "rb") as f:
        head = f.read(8)
        size = os.fstat(f.fileno()).st_size
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < n <= min(MAX_HEADER, size - 8):
            raise ValueError(f"{path} is not a safetensors file (no header)")
        header = json.loads(f.read(n))
    start, out = 8 + n, {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        if dtype not in DTYPES:
            raise ValueError(f"{path}: tensor {key!r} has dtype {dtype}, which this torch "
                             f"does not have")
        if end - begin != math.prod(shape) * DTYPES[dtype].itemsize or start + end > size:
            raise ValueError(f"{path}: tensor {key!r} of shape {list(shape)} has bytes "
                             f"{begin}..{end}, which do not fit it or the file")
        out[key] = (dtype, shape, begin, end)
    return start, out


def file_entries(path: str) -> dict:
    start, header = read_header(path)
    zeros = {}
    return {key: Entry(DTYPES[dtype], shape, (Piece(path, start + begin, dtype, shape,
                                                     zeros.setdefault(len(shape),
                                                                      (0,) * len(shape))),))
            for key, (dtype, shape, begin, _) in header.items()}


def index_entries(index_path: str) -> dict:
    """The catalog an index describes: ``dtorch.index.json`` (``tensors``) or an HF index
    (``weight_map``)."""
    with open(index_path) as f:
        index = json.load(f)
    directory = os.path.dirname(os.path.abspath(index_path))
    headers: dict = {}

    def header(file: str) -> tuple:
        if file not in headers:
            headers[file] = read_header(os.path.join(directory, file))
        return headers[file]

    if "tensors" in index:
        return {key: _dtorch_entry(key, info, directory, header)
                for key, info in index["tensors"].items()}
    if "weight_map" in index:
        out = {}
        for key, file in index["weight_map"].items():
            start, found = header(file)
            if key not in found:
                raise ValueError(f"{index_path}: {key!r} is not in {file}")
            dtype, shape, begin, _ = found[key]
            out[key] = Entry(DTYPES[dtype], shape, (Piece(os.path.join(directory, file),
                                                          start + begin, dtype, shape,
                                                          (0,) * len(shape)),))
        return out
    raise ValueError(f"{index_path} is neither a dtorch index (tensors) nor an HF one "
                     f"(weight_map)")


def _dtorch_entry(key: str, info: dict, directory: str, header) -> Entry:
    shape, pieces = tuple(info["shape"]), []
    for p in info["pieces"]:
        start, found = header(p["file"])
        dtype, stored, begin, _ = found[p["key"]]
        offsets = tuple(p["offsets"])
        if stored != tuple(p["shape"]) or len(offsets) != len(shape) or any(
                o < 0 or o + n > s for o, n, s in zip(offsets, stored, shape)):
            raise ValueError(f"{DTORCH_INDEX}: a piece of {key!r} ({p['file']}) does not fit "
                             f"its tensor of shape {list(shape)}")
        pieces.append(Piece(os.path.join(directory, p["file"]), start + begin, dtype, stored,
                            offsets))
    if sum(math.prod(p.shape) for p in pieces) != math.prod(shape):
        raise ValueError(f"{DTORCH_INDEX}: the pieces of {key!r} do not cover its shape "
                         f"{list(shape)}")
    return Entry(getattr(torch, info["dtype"]), shape, tuple(pieces))


def write_index(directory: str, tensors: dict) -> str:
    """Writes ``dtorch.index.json``: ``tensors`` is ``{key: {"dtype", "shape", "pieces"}}``
    with pieces ``{"file", "key", "offsets", "shape"}`` (files relative to ``directory``).
    Written beside, then renamed: a reader sees the old index or the new one."""
    total = sum(math.prod(t["shape"]) * getattr(torch, t["dtype"]).itemsize
                for t in tensors.values())
    index = {"format": "dtorch", "version": 1, "metadata": {"total_size": total},
             "tensors": tensors}
    path = os.path.join(directory, DTORCH_INDEX)
    partial = f"{path}.{os.getpid()}.partial"
    with open(partial, "w") as f:
        json.dump(index, f, indent=1)
    os.replace(partial, path)
    return path
