"""What a checkpoint holds and where its bytes are: the catalog ``{key: Entry}``, read from
safetensors headers and index files only (never from the tensors' data).

A checkpoint is one of
- a ``.safetensors`` file;
- a directory with ``dtorch.index.json`` (``save_checkpoint``'s): per key the global shape and
  dtype and the pieces, each a block (offsets, shape) stored under a key of one file, and the
  files of that save with their sizes. Its files carry the save's id in their names
  (``rank00000-mesh0-<id>.safetensors``, ``client-<id>.safetensors``), so a save never
  overwrites the files an older index names (``commit.py``);
- a directory with an HF index (``model.safetensors.index.json``: ``weight_map`` key -> file),
  or with ``model.safetensors``, or with other ``*.safetensors`` files (each key in one);
- an index file itself (either kind, told apart by its fields);
- a torch state dict (``.pt``, ``.pth``, ``.bin``, or ``pytorch_model.bin`` in a directory),
  which ``load_checkpoint`` reads with torch's own loader instead (``torch_file``).

Nothing is trusted: a directory holding dtorch's rank files but no dtorch index is the rest of
a save that did not finish and is refused, never read as "whatever files are there"; an index
is checked field by field, and the files it names by size, by their headers (``headers.py``)
and by where they are: inside the checkpoint's directory (no ``..``, no absolute path, no
symlink out of it), except a symlink into the ``blobs/`` of the same HF hub cache entry
(``models--org--name/snapshots/<rev>/model.safetensors -> ../../blobs/<sha>``).
"""

from __future__ import annotations

import glob
import math
import os
import pathlib
import re
from typing import NamedTuple

import torch

from .headers import naturals, read_header, read_json
from .kernels import DTYPES

DTORCH_INDEX = "dtorch.index.json"
HF_INDEX = "model.safetensors.index.json"
TORCH_SUFFIXES = (".pt", ".pth", ".bin")
VERSION = 2  # 1: no "files" (written before saves were committed); still read

# the files save_checkpoint writes (a leftover of a killed save is one), and no user's file:
# rank files (also the unversioned names and ".partial" files of older saves), client files
# and index drafts
OWNED = re.compile(r"rank\d{5}-mesh\d+(-[0-9a-f]+)?\.safetensors(\.\d+\.partial)?"
                   r"|client-[0-9a-f]+\.safetensors|client\.safetensors\.\d+\.partial"
                   rf"|{re.escape(DTORCH_INDEX)}\.[0-9a-f]+\.partial")


def rank_file(mesh: int, save_id: str) -> str:
    """The name template (of ``device``) of a device's file of the ``mesh``-th mesh."""
    return f"rank{{device:05d}}-mesh{mesh}-{save_id}.safetensors"


def client_file(save_id: str) -> str:
    return f"client-{save_id}.safetensors"


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
        for key, entry in file_entries(member(path, os.path.basename(file), path)).items():
            if key in entries:
                raise ValueError(f"load_checkpoint: {key!r} is in two files of {path}; name "
                                 f"the one to read, or add an index")
            entries[key] = entry
    return entries


def _safetensors_layout(directory: str) -> str | None:
    """The index of a directory, or the directory itself when it holds safetensors files."""
    if os.path.lexists(os.path.join(directory, DTORCH_INDEX)):
        return os.path.join(directory, DTORCH_INDEX)
    leftovers = sorted(f for f in os.listdir(directory)
                       if OWNED.fullmatch(f) and f.endswith(".safetensors"))
    if leftovers:
        raise ValueError(f"load_checkpoint: {directory} is an incomplete dtorch checkpoint: it "
                         f"holds files of save_checkpoint ({leftovers[0]}, ...) but no "
                         f"{DTORCH_INDEX}, so no save there finished; save it again")
    if os.path.lexists(os.path.join(directory, HF_INDEX)):
        return os.path.join(directory, HF_INDEX)
    others = sorted(glob.glob(os.path.join(directory, "*.safetensors.index.json")))
    if others:
        return others[0]
    return directory if glob.glob(os.path.join(directory, "*.safetensors")) else None


def member(directory: str, name, named_by: str) -> str:
    """The path of the file ``name`` of the checkpoint ``directory``, refused (``ValueError``)
    unless it lies inside it (or in its HF hub cache entry's ``blobs/``)."""
    if not isinstance(name, str) or not name or os.path.isabs(name) or (
            ".." in pathlib.PurePath(name).parts):
        raise ValueError(f"{named_by} names the file {name!r}, which is not a path inside "
                         f"{directory}")
    path = os.path.join(directory, name)
    real, root = os.path.realpath(path), os.path.realpath(directory)
    if not (_inside(real, root) or _inside(real, _hub_blobs(root))):
        raise ValueError(f"{named_by} names {name!r}, which resolves to {real}, outside the "
                         f"checkpoint {directory} (a symlink out of it)")
    return path


def _inside(path: str, root: str | None) -> bool:
    return root is not None and os.path.commonpath([path, root]) == root


def _hub_blobs(directory: str) -> str | None:
    """``models--org--name/blobs`` where ``directory`` is in that entry's ``snapshots/``."""
    parts = pathlib.PurePath(directory).parts
    for i in range(len(parts) - 3, 0, -1):
        if parts[i].startswith("models--") and parts[i + 1] == "snapshots":
            return os.path.realpath(os.path.join(*parts[:i + 1], "blobs"))
    return None


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
    index = read_json(index_path)
    if isinstance(index, dict) and "tensors" in index:
        return _dtorch_entries(index_path, index)
    if isinstance(index, dict) and "weight_map" in index:
        return _hf_entries(index_path, index["weight_map"])
    raise ValueError(f"{index_path} is neither a dtorch index (an object with tensors) nor an "
                     f"HF one (weight_map)")


class _Files:
    """The headers of an index's files, each read once, each file checked on first use
    (``member``; in a dtorch index, named in ``files`` with its size)."""

    def __init__(self, index_path: str, sizes: dict | None):
        self.index_path, self.sizes, self.headers = index_path, sizes, {}
        self.directory = os.path.dirname(os.path.abspath(index_path))

    def header(self, file) -> tuple:
        """(path, first data byte, header) of ``file``."""
        if file not in self.headers:
            path = member(self.directory, file, self.index_path)
            if self.sizes is not None:
                self._check_size(file, path)
            self.headers[file] = (path, *read_header(path))
        return self.headers[file]

    def _check_size(self, file: str, path: str) -> None:
        if file not in self.sizes:
            raise ValueError(f"{self.index_path}: a piece is in {file!r}, which its files do "
                             f"not name")
        size = os.stat(path).st_size
        if size != self.sizes[file]:
            raise ValueError(f"{self.index_path}: {file} has {size} bytes, not the "
                             f"{self.sizes[file]} it was saved with (changed since)")


def _hf_entries(index_path: str, weight_map) -> dict:
    if not isinstance(weight_map, dict) or not all(isinstance(f, str)
                                                   for f in weight_map.values()):
        raise ValueError(f"{index_path}: weight_map is not an object of file names")
    files, out = _Files(index_path, None), {}
    for key, file in weight_map.items():
        path, start, found = files.header(file)
        if key not in found:
            raise ValueError(f"{index_path}: {key!r} is not in {file}")
        dtype, shape, begin, _ = found[key]
        out[key] = Entry(DTYPES[dtype], shape,
                         (Piece(path, start + begin, dtype, shape, (0,) * len(shape)),))
    return out


def _dtorch_entries(index_path: str, index: dict) -> dict:
    version, tensors = index.get("version", 1), index["tensors"]
    if version not in (1, VERSION):
        raise ValueError(f"{index_path}: index version {version!r}, which this dtorch does not "
                         f"read (a newer dtorch wrote it?)")
    if not isinstance(tensors, dict):
        raise ValueError(f"{index_path}: tensors is not an object")
    sizes = _sizes(index_path, index.get("files")) if version >= 2 else None
    files = _Files(index_path, sizes)
    return {key: _dtorch_entry(index_path, key, info, files) for key, info in tensors.items()}


def _sizes(index_path: str, files) -> dict:
    """``{file: size}`` of a dtorch index's ``files``."""
    if not isinstance(files, dict) or not all(
            isinstance(f, dict) and type(f.get("size")) is int for f in files.values()):
        raise ValueError(f"{index_path}: files is not an object of {{\"size\": bytes}}")
    return {name: f["size"] for name, f in files.items()}


def _dtorch_entry(index_path: str, key: str, info, files: _Files) -> Entry:
    def bad(what: str):
        return ValueError(f"{index_path}: tensor {key!r} {what}")

    if not isinstance(info, dict) or not naturals(info.get("shape")) or not isinstance(
            info.get("pieces"), list):
        raise bad("is not an object with a shape (integers >= 0), a dtype and pieces")
    dtype = getattr(torch, info.get("dtype"), None) if isinstance(info.get("dtype"), str) else None
    if not isinstance(dtype, torch.dtype):
        raise bad(f"has dtype {info.get('dtype')!r}, which this torch does not have")
    shape, pieces = tuple(info["shape"]), []
    for p in info["pieces"]:
        if not (isinstance(p, dict) and isinstance(p.get("file"), str)
                and isinstance(p.get("key"), str) and naturals(p.get("offsets")) and naturals(p.get("shape"))):
            raise bad(f"has a piece {p!r}, not an object with file, key, offsets and shape")
        path, start, found = files.header(p.get("file"))
        if p["key"] not in found:
            raise bad(f"has a piece under {p['key']!r} of {p['file']}, which holds no such key")
        dtype_name, stored, begin, _ = found[p["key"]]
        offsets = tuple(p["offsets"])
        if stored != tuple(p["shape"]) or len(offsets) != len(shape) or any(
                o + n > s for o, n, s in zip(offsets, stored, shape)):
            raise bad(f"has a piece ({p['file']}) that does not fit its shape {list(shape)}")
        pieces.append(Piece(path, start + begin, dtype_name, stored, offsets))
    if sum(math.prod(p.shape) for p in pieces) != math.prod(shape):
        raise bad(f"has pieces that do not cover its shape {list(shape)}")
    if _overlap(pieces):  # (as many elements as the shape, so some would never be read)
        raise bad(f"has pieces that overlap, and so leave part of its shape {list(shape)} out")
    return Entry(dtype, shape, tuple(pieces))


def _overlap(pieces) -> bool:
    """Whether two of the blocks share an element: a sweep along the first dim, which compares
    only the blocks whose rows meet (a layout's blocks are mostly apart there)."""
    boxes = sorted((p.offsets, p.shape) for p in pieces if math.prod(p.shape))
    live: list = []
    for offsets, shape in boxes:
        if offsets:
            live = [(o, n) for o, n in live if o[0] + n[0] > offsets[0]]
        if any(all(a < c + m and c < a + k for a, k, c, m in zip(o, n, offsets, shape))
               for o, n in live):
            return True
        live.append((offsets, shape))
    return False
