"""Checkpoint operators: each device reads its own block of a tensor straight from a safetensors
file, and writes its own blocks to a file of its own (``dtorch.checkpoint`` is the user's side);
the failure token a load reads to learn whether its values arrived (``failure_token``).

A safetensors file is an 8-byte little-endian header length, a JSON header naming each tensor's
dtype, shape and byte range, and the tensors' bytes, row-major. The client reads only headers
and tells each read where the bytes are: ``read_safetensors_(input, pieces)`` fills ``input``
(its own layout: any placements, uneven shards, Partial) from ``pieces``, a msgpack list of
``[path, start, dtype, shape, offsets]``: the stored array of ``shape`` whose first byte is at
``start`` in the file at ``path``, and where it sits in the tensor (``offsets``). A plain
checkpoint has one piece per tensor; one that ``save_checkpoint`` wrote on another mesh has a
piece per saved block. Each device reads only the overlap of each piece with its block
(``ctx.out_offsets``, ``ctx.out_local_shape``), so no process holds the whole tensor; on a
Partial sum mesh dim, coordinate 0 reads the value and the others hold zeros (``ctx.partition``'s
rule).

Reads are positioned reads (``os.preadv``) straight into the block where the dtype matches: one
read where its bytes lie together in the file (a Shard(0) block, a whole tensor), a vectored read
per batch of rows where each row holds a run of them (a Shard(1) block; the bytes between runs go
to one small scratch buffer). A dtype cast or a CUDA device reads whole rows through a buffer of
at most ``READ_CHUNK`` bytes. Nothing the size of a tensor is allocated, so a host's memory
grows by its blocks and no more. A large contiguous read (at least twice
``config.read_split_min``) is split over the host's torch threads, as torch's own copies are.
Not ``safetensors.safe_open``: its ``"pt"`` handle maps the whole file, and every page a host
touches through it stays in that process's resident memory until the handle closes (so a cached
handle would hold the file's share of every block on top of the blocks), while opening one per
tensor parses the whole header each time (1.3 ms for a header of 1000 tensors). The client
checks every header and index before a host reads (``checkpoint/headers.py``).

``write_safetensors(plan, *tensors)`` writes, on every device, the blocks it owns of
``tensors`` to one safetensors file (``plan``: msgpack ``[directory, name, keys]``, ``name`` a
``str.format`` template of ``device``). A block is written once: by the device at coordinate 0 of
every mesh dim the tensor is not sharded on (``writes_block``); the caller lays Partial and,
where a tensor dim fits, Replicate mesh dims out as shards first (``save.write_layout``). The
bytes stream from each block to the file with no copy (safetensors' ``save_file`` would copy
every tensor to bytes first), and the file and its directory are fsynced before the kernel
returns. The name is new (``save_checkpoint``'s carry a save id), so
nothing older is touched; a write that fails removes what it wrote. The result is a 0-dim
int64 token, Partial(max) on every mesh dim: each device's errno (0: written), so reading it
gives the worst failure of any device as a value, with no kernel error (the runtime stays as
it was); the op is IMPURE.

>>> import dtorch, torch, os, tempfile
>>> from dtorch.checkpoint.kernels import write_file, read_into, pack_pieces
>>> path = os.path.join(tempfile.mkdtemp(), "t.safetensors")
>>> write_file(path, [("w", torch.arange(12.).reshape(4, 3))])
>>> start = 8 + int.from_bytes(open(path, "rb").read(8), "little")  # data begins after the header
>>> x = dtorch.empty(4, 3, device_mesh=dtorch.DeviceMesh("cpu", [0, 1]),
...                  placements=[dtorch.Shard(1)])
>>> read_into(x, pack_pieces([(path, start, "F32", (4, 3), (0, 0))])).to_torch()[1]
tensor([3., 4., 5.])
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import itertools
import json
import math
import os
import struct

import msgpack
import torch

from .. import config
from .. import protocol as P
from ..ops.registry import IMPURE, INPLACE, OVERWRITES, OpDef, issue, register
from ..ops.rules import Placed
from ..placement import Partial, Shard
from ..tensor import Tensor

# safetensors' dtype names (the format's own table; torch lacks some on older versions)
DTYPES = {name: getattr(torch, attr) for name, attr in (
    ("F64", "float64"), ("F32", "float32"), ("F16", "float16"), ("BF16", "bfloat16"),
    ("I64", "int64"), ("I32", "int32"), ("I16", "int16"), ("I8", "int8"), ("U8", "uint8"),
    ("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"), ("BOOL", "bool"),
    ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"), ("C64", "complex64"),
) if hasattr(torch, attr)}
NAMES = {dtype: name for name, dtype in DTYPES.items()}

READ_CHUNK = 8 << 20  # bytes a read may buffer where it cannot land in the block itself


# -- reading --------------------------------------------------------------------------------------


def pack_pieces(pieces) -> bytes:
    """The ``pieces`` operand of ``read_safetensors_``: ``(path, start, dtype name, shape,
    offsets)`` per stored array."""
    return msgpack.packb([[p, s, d, list(sh), list(o)] for p, s, d, sh, o in pieces])


def read_block(pieces, offsets, shape, out: torch.Tensor) -> torch.Tensor:
    """Fills ``out``, the block of a tensor at ``offsets`` of ``shape``, from the overlap of each
    piece with it (a piece that misses it is not touched)."""
    for path, start, dtype, piece_shape, piece_offsets in pieces:
        lo = [max(a, b) for a, b in zip(offsets, piece_offsets)]
        hi = [min(a + n, b + m) for a, n, b, m in zip(offsets, shape, piece_offsets, piece_shape)]
        if any(h <= low for low, h in zip(lo, hi)):
            continue
        dst = out[tuple(slice(low - a, h - a) for low, h, a in zip(lo, hi, offsets))]
        read_region(path, start, DTYPES[dtype], tuple(piece_shape),
                    tuple(low - b for low, b in zip(lo, piece_offsets)),
                    tuple(h - low for low, h in zip(lo, hi)), dst)
    return out


def read_region(path: str, start: int, dtype, shape: tuple, offsets: tuple, size: tuple,
                out: torch.Tensor) -> None:
    """Reads the block at ``offsets`` of ``size`` of the row-major array of ``dtype`` and
    ``shape`` stored from byte ``start`` of ``path``, into ``out`` (cast to its dtype)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO in its place: no hang (preadv fails)
    try:
        _read_rows(fd, start, dtype, shape, offsets, size, out)
    finally:
        os.close(fd)


def _read_rows(fd, pos, dtype, shape, off, n, out) -> None:
    if not shape:  # a 0-dim tensor
        out.copy_(_read_tensor(fd, pos, dtype, ()))
        return
    row = math.prod(shape[1:]) * dtype.itemsize  # bytes of one index of dim 0
    direct = out.dtype == dtype and out.device.type == "cpu"
    if direct and tuple(n[1:]) == tuple(shape[1:]) and out.is_contiguous():
        _pread_split(fd, pos + off[0] * row, P.buffer_of(out))  # the block's bytes lie together
        return
    # a run of bytes per row, each straight into its row (the bytes between them: few)
    if direct and len(shape) > 1 and tuple(n[2:]) == tuple(shape[2:]) and (
            row - n[1] * row // shape[1] <= READ_CHUNK) and (not n[0] or out[0].is_contiguous()):
        _scatter_rows(fd, pos, dtype, shape, off, n, out)
        return
    if direct or row > READ_CHUNK:  # one index of dim 0 at a time: one dim down
        for i in range(n[0]):
            _read_rows(fd, pos + (off[0] + i) * row, dtype, shape[1:], off[1:], n[1:], out[i])
        return
    # a cast or another device: whole rows through a bounded buffer
    step = max(1, READ_CHUNK // max(row, 1))
    inner = (slice(None),) + tuple(slice(o, o + m) for o, m in zip(off[1:], n[1:]))
    for i in range(0, n[0], step):
        k = min(step, n[0] - i)
        rows = _read_tensor(fd, pos + (off[0] + i) * row, dtype, (k, *shape[1:]))
        out[i:i + k].copy_(rows[inner])


def _scatter_rows(fd, pos, dtype, shape, off, n, out) -> None:
    """Rows whose part in the block is one run of bytes (a Shard(1) block): one vectored read
    per batch of rows, each run into its row of ``out`` and the bytes between runs into one
    small scratch buffer, so nothing the size of the tensor is allocated."""
    item = dtype.itemsize
    row = math.prod(shape[1:]) * item
    inner = math.prod(shape[2:]) * item
    run, stride = n[1] * inner, out.stride(0) * item if n[0] > 1 else 0
    if not run or not n[0]:
        return
    # the bytes from out's first row to its last, as one buffer each row is a slice of
    span = out.as_strided(((n[0] - 1) * (stride // item) + run // item,), (1,))
    rows = memoryview(P.buffer_of(span))
    scratch = memoryview(bytearray(row - run)) if row > run else None
    first = pos + off[0] * row + off[1] * inner
    batch = max(1, _IOV_MAX // 2)
    for i in range(0, n[0], batch):
        views = []
        for r in range(i, min(i + batch, n[0])):
            views.append(rows[r * stride:r * stride + run])
            if scratch is not None:
                views.append(scratch)
        if scratch is not None:
            views.pop()  # nothing to skip after the last run
        _pread(fd, first + i * row, views)


_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


def _read_tensor(fd, pos: int, dtype, shape) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype)
    _pread(fd, pos, [P.buffer_of(t)])
    return t


def _pread_split(fd, pos: int, buffer) -> None:
    """One large read split over the process's torch threads: copying from the page cache is
    memory-bound, and one thread does not saturate the memory system."""
    view = memoryview(buffer).cast("B")
    parts = min(torch.get_num_threads(), len(view) // config.read_split_min)
    if parts < 2:
        return _pread(fd, pos, [view])
    if not _POOL:
        _POOL.append(concurrent.futures.ThreadPoolExecutor(torch.get_num_threads(),
                                                           thread_name_prefix="dtorch-read"))
    step = -(-len(view) // parts)
    list(_POOL[0].map(lambda a: _pread(fd, pos + a, [view[a:a + step]]),
                      range(0, len(view), step)))


_POOL: list = []  # the readers' threads, made on first use


def _pread(fd, pos: int, buffers) -> None:
    """Fills ``buffers`` in turn from the bytes at ``pos`` on (short reads continued)."""
    views = [memoryview(b).cast("B") for b in buffers]
    views = [v for v in views if len(v)]
    while views:
        got = os.preadv(fd, views, pos)
        if got == 0:
            raise EOFError(f"the checkpoint file ends at byte {pos}, inside a tensor's data (a "
                           f"truncated file, or one changed since its header was read)")
        pos += got
        while views and got >= len(views[0]):
            got -= len(views.pop(0))
        if got:
            views[0] = views[0][got:]


def _read_into(ctx, input, pieces):
    if not ctx.holds_value():
        return input.zero_()
    pieces = msgpack.unpackb(pieces)
    # a block is a box of the tensor, or for a sub-split dim several: one per range of it
    ranges = [[(sum(n for _, n in dim[:k]), offset, n) for k, (offset, n) in enumerate(dim)]
              for dim in ctx.out_specs[0].local_pieces(ctx.out_coord)]
    for box in itertools.product(*ranges):
        read_block(pieces, [offset for _, offset, _ in box], [n for *_, n in box],
                   input[tuple(slice(at, at + n) for at, _, n in box)])
    return input


# -- writing --------------------------------------------------------------------------------------


def writes_block(placements, coord) -> bool:
    """Whether the device at mesh ``coord`` writes its block of a tensor laid out so: a
    Replicate mesh dim's copies are equal, and coordinate 0 writes (never Partial: reduce it)."""
    return all(c == 0 for p, c in zip(placements, coord) if not isinstance(p, Shard))


def write_file(path: str, items, metadata: dict | None = None) -> None:
    """Writes ``items`` (key, torch tensor) as the safetensors file ``path`` and fsyncs it,
    streaming each tensor's bytes (larger dtypes first, so every tensor's data is aligned to
    its dtype). A write that fails (a full disk) removes the file before it raises."""
    items = sorted(items, key=lambda kv: -kv[1].element_size())
    header, offset = {}, 0
    for key, t in items:
        if t.dtype not in NAMES:
            raise TypeError(f"safetensors has no dtype {t.dtype} (tensor {key!r})")
        size = t.numel() * t.element_size()
        header[key] = {"dtype": NAMES[t.dtype], "shape": list(t.shape),
                       "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt", **(metadata or {})}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    try:
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for _, t in items:
                if t.numel():
                    f.write(P.buffer_of(t.detach().to("cpu").contiguous()))
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(path)
        raise


def sync_directory(directory: str) -> None:
    """fsyncs ``directory``, so the names made in it survive a crash of the machine."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(ctx, plan, *blocks):
    directory, name, keys = msgpack.unpackb(plan)
    items = [(key, block) for key, block, spec in zip(keys, blocks, ctx.in_specs[1:])
             if writes_block(spec.placements, ctx.coord) and block.numel()]
    failure = 0
    if items:
        try:
            write_file(os.path.join(directory, name.format(device=ctx.device.index)), items)
            sync_directory(directory)
        except OSError as e:  # a value, not a kernel error: the client raises it (errno kept)
            failure = e.errno or errno.EIO
    return torch.tensor(failure, dtype=torch.int64, device=ctx.device.torch_device)


# -- fronts (the user's calls are dtorch.checkpoint's) ------------------------------------------


def read_into(target: Tensor, pieces: bytes) -> Tensor:
    """Fills ``target`` in place, each device its own block, from ``pieces``
    (``pack_pieces``)."""
    return issue("read_safetensors_", (target, pieces), ())


def write_blocks(plan: bytes, tensors) -> Tensor:
    """Each device of the tensors' mesh writes the blocks it owns (see the module's docstring);
    returns the token: ``token.item()`` waits for every device and is the largest errno of their
    writes (0: all written)."""
    if any(isinstance(p, Partial) for t in tensors for p in t.placements):
        raise ValueError("write_safetensors: a Partial tensor must be reduced first, e.g. "
                         "t.redistribute(placements=[Replicate(), ...])")
    for t in tensors:
        if t.dtype not in NAMES:
            raise TypeError(f"write_safetensors: safetensors has no dtype {t.dtype}")
    return issue("write_safetensors", (plan, *tensors), ())


def _same_layout(call) -> Placed:
    return Placed((call.tensors[0].placements,))


def _token(call) -> Placed:
    return Placed(((Partial("max"),) * len(call.mesh.shape),))  # each device's errno


register(OpDef("read_safetensors_", "read_safetensors_(input: Tensor, pieces: Tensor)",
               _read_into, _same_layout, meta=lambda input, pieces: input, function=False,
               flags=INPLACE | OVERWRITES, uses_context=True, front=read_into,
               doc="Fills each device's block of ``input`` from safetensors files."))
register(OpDef("write_safetensors", "write_safetensors(plan: Tensor, tensors: TensorList)",
               _write, _token, meta=lambda plan, *blocks: torch.empty((), dtype=torch.int64,
                                                                      device="meta"),
               function=False, flags=IMPURE, uses_context=True, front=write_blocks,
               doc="Each device writes the blocks it owns to a safetensors file of its own."))


# -- failure tokens -------------------------------------------------------------------------------


def failure_token(tensors):
    """A token that carries the first failure any of ``tensors`` (on one mesh) carries, on any
    device: reading it (``to_torch()``) raises that failure (the op and the user's line that
    failed), else gives zeros. One element per device, so reading it hears from every device:
    what a load reads to know that its values arrived (``nn.modules.module.check_loaded``).

    >>> import dtorch
    >>> mesh = dtorch.DeviceMesh("cpu", [0, 1])
    >>> x = dtorch.ones(4, device_mesh=mesh, placements=[dtorch.Shard(0)])
    >>> failure_token([x, x * 2]).to_torch()
    tensor([0, 0])
    """
    tensors = tuple(tensors)
    with torch.no_grad():  # a token has no gradient: autograd records nothing of it
        return issue("failure_token", tensors, (tensors[0].device_mesh.size(),))


def _no_failure(ctx, *blocks, devices):
    return torch.zeros(1, dtype=torch.int64, device=ctx.device.torch_device)


def one_per_device(call) -> Placed:
    return Placed(((Shard(0),) * len(call.mesh.shape),))


register(OpDef("failure_token", "failure_token(tensors: TensorList, devices)", _no_failure,
               one_per_device, meta=lambda *blocks, devices: torch.empty(
                   devices, dtype=torch.int64, device="meta"), function=False,
               uses_context=True, front=failure_token,
               sub_splits=True))  # (its Shard is one token per device, no input's layout)
