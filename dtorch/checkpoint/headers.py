"""Reading what a checkpoint's files say about themselves, trusting none of it: a file is
opened only once ``stat`` says it is a regular file (a FIFO would block the reader forever),
and a safetensors header is checked before any byte it points at is read.

A safetensors file is an 8-byte little-endian header length ``n``, ``n`` bytes of a JSON object
``{key: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}`` and the
data section, the offsets counting from its first byte. Checked here: ``n`` fits the file; the
header is a JSON object; every dtype is one this torch has; shapes and offsets are integers
>= 0; each range holds exactly shape x dtype bytes, lies inside the data section and overlaps no
other tensor's. Any failure raises ``ValueError`` naming the file (and the key).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import stat
import struct

from .kernels import DTYPES

MAX_HEADER = 100_000_000  # safetensors' own bound on a header


def check_regular(path: str, mode: int | None = None) -> None:
    """``ValueError`` unless ``path`` (whose ``st_mode`` is ``mode``, when known) is a regular
    file."""
    kind = stat.S_IFMT(os.stat(path).st_mode if mode is None else mode)
    if kind != stat.S_IFREG:
        raise ValueError(f"{path} is not a regular file (st_mode type {kind:#o}); a checkpoint "
                         f"is read from regular files only")


def open_regular(path: str) -> int:
    """A read-only descriptor of the regular file ``path``: stat before opening, and opened
    non-blocking in case it changed in between."""
    check_regular(path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        check_regular(path, os.fstat(fd).st_mode)
    except ValueError:
        os.close(fd)
        raise
    return fd


def read_json(path: str):
    """The JSON value in the regular file ``path`` (``ValueError`` naming it when it is not
    JSON)."""
    with os.fdopen(open_regular(path), "rb") as f:
        raw = f.read()
    try:
        return json.loads(raw)
    except ValueError as e:  # a JSONDecodeError or bytes that are not UTF-8
        raise ValueError(f"{path} is not a JSON file ({e})") from None


def read_header(path: str) -> tuple:
    """(first data byte, ``{key: (dtype name, shape, begin, end)}``) of the safetensors file
    ``path``, every entry checked (the module's docstring)."""
    with os.fdopen(open_regular(path), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < n <= min(MAX_HEADER, size - 8):
            raise ValueError(f"{path} is not a safetensors file: its header length ({n}) does "
                             f"not fit the file's {size} bytes (a truncated file?)")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"{path} is not a safetensors file: its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a safetensors file: its header is a JSON "
                         f"{type(header).__name__}, not an object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError(f"{path}: the header's __metadata__ is not an object of strings")
    data = size - 8 - n
    out = {key: _checked(path, key, info, data) for key, info in header.items()}
    _check_disjoint(path, out)
    return 8 + n, out


def _checked(path: str, key: str, info, data: int) -> tuple:
    """``(dtype, shape, begin, end)`` of the header's ``key``, or ``ValueError``."""
    def bad(what: str):
        return ValueError(f"{path}: tensor {key!r} {what}")

    if not isinstance(info, dict):
        raise bad(f"is described by a JSON {type(info).__name__}, not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise bad(f"has dtype {dtype!r}, which this torch does not have")
    if not naturals(shape):
        raise bad(f"has shape {shape!r}, not a list of integers >= 0")
    if not (naturals(offsets) and len(offsets) == 2):
        raise bad(f"has data_offsets {offsets!r}, not two integers >= 0")
    begin, end = offsets
    if end - begin != math.prod(shape) * DTYPES[dtype].itemsize or end > data:
        raise bad(f"of shape {shape} and dtype {dtype} has bytes {begin}..{end}, which do not "
                  f"fit it or the file's data section of {data} bytes")
    return dtype, tuple(shape), begin, end


def naturals(value) -> bool:
    """A list of integers >= 0 (JSON's true and false are not integers here)."""
    return isinstance(value, list) and all(type(v) is int and v >= 0 for v in value)


def _check_disjoint(path: str, entries: dict) -> None:
    """No two tensors share a byte (else one would load the other's values)."""
    spans = sorted((begin, end, key) for key, (_, _, begin, end) in entries.items()
                   if end > begin)
    for (_, end, key), (begin, _, other) in itertools.pairwise(spans):
        if begin < end:
            raise ValueError(f"{path}: tensors {key!r} and {other!r} overlap (bytes "
                             f"{begin}..{end} of the data section are in both)")
