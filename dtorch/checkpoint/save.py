"""``save_checkpoint``: every device writes the blocks it owns to a safetensors file of its own,
then the client publishes ``dtorch.index.json``, which says where each block of each tensor is,
so ``load_checkpoint`` reads it back into any layout (another mesh, other placements, one
device). The save is committed as a database commits (``commit.py``): a crash leaves the old
checkpoint or the new one, never a mix.

Files are ``rank{device:05d}-mesh{k}-{save id}.safetensors`` (``k``: the tensors' mesh, in the
order the state dict first names it; most models have one). Every element is written once,
and the devices share the writing: a tensor's Replicate or Partial mesh dims are written as if
they sharded a tensor dim that no other mesh dim shards (``write_layout``: a Replicate copy
keeps its chunk, a local copy of its share; a Partial is reduce-scattered), so each device
writes its share of a replicated tensor rather than coordinate 0 writing all of it; a dim that
no tensor dim fits stays Replicate and coordinate 0 writes it. A tensor at two keys (tied
weights) is written once, and a torch tensor among a dtorch module's by the client
(``client-{save id}.safetensors``). Each rank file is an ordinary safetensors file (one block
per key), so safetensors' own tools read it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import os
import threading

import msgpack
import torch

from ..client import dispatch
from ..placement import Partial, Replicate, Shard, local_region, plain
from ..tensor import Tensor
from . import commit, index
from .kernels import sync_directory, write_blocks, write_file, writes_block


def save_checkpoint(module, path, *, async_: bool = False):
    """Writes ``module``'s state dict (or a dict of tensors) to the directory ``path``; returns
    the index's path. It returns once every file is written and fsynced and the index
    published; a write that fails (a full disk) raises ``OSError`` and leaves the checkpoint
    that was there as it was.

    ``async_=True`` returns at once a ``concurrent.futures.Future`` of the index's path, while
    the devices write a snapshot: each tensor copied as it is at this call (on a graph of the
    checkpoint's own, so the copies wait only for the work that made the values, and the
    program's later work waits for nothing but the copies before it changes them), then the
    files written from the copies on that graph's streams beside the program's, and committed
    by a thread of the client. The copies hold a second share of the state on each device until
    their files are written. The next ``save_checkpoint`` or ``load_checkpoint`` waits for the
    save first (and raises its error, as ``future.result()`` does); the commit is the same.

    >>> import dtorch, tempfile
    >>> mesh = dtorch.DeviceMesh("cpu", [0, 1])
    >>> w = dtorch.arange(10.0, device_mesh=mesh, placements=[dtorch.Shard(0)])
    >>> directory = tempfile.mkdtemp()
    >>> _ = save_checkpoint({"w": w}, directory)
    >>> [name.split("-")[:2] for name in sorted(os.listdir(directory))]
    [['dtorch.index.json'], ['rank00000', 'mesh0'], ['rank00001', 'mesh0']]
    >>> future = save_checkpoint({"w": w * 2}, directory, async_=True)
    >>> future.result() == os.path.join(directory, "dtorch.index.json")
    True
    """
    wait_for_saves()
    state = module.state_dict(keep_vars=True) if isinstance(module, torch.nn.Module) else module
    path = os.path.abspath(str(path))
    os.makedirs(path, exist_ok=True)
    keep = commit.named_files(path)
    if keep is not None:
        commit.remove_unnamed(path, keep)  # the leftovers of saves that did not finish
    save_id = commit.new_save_id()
    try:
        tensors, tokens = _write_all(state, path, save_id, snapshot=async_)
    except BaseException as e:
        _abandon(path, save_id, e)
    if not async_:
        return _commit(path, save_id, tensors, tokens)
    future = SaveFuture()
    with _pending_lock:
        _committer().submit(future.run, _commit, path, save_id, tensors, tokens)
        _pending.append(future)
    return future


class SaveFuture(concurrent.futures.Future):
    """An async save's future (``concurrent.futures.Future``): its result is the index's path.
    Its error is raised once: by ``result()`` or ``exception()`` when the program asks, else by
    the next ``save_checkpoint`` or ``load_checkpoint`` (``wait_for_saves``)."""

    reported = False

    def run(self, fn, *args) -> None:
        try:
            self.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - the program's to see
            self.set_exception(e)

    def result(self, timeout=None):
        self.reported = True
        return super().result(timeout)

    def exception(self, timeout=None):
        self.reported = True
        return super().exception(timeout)


# async saves not yet waited for, oldest first, and the one thread that commits them in order
_pending: list = []
_pending_lock = threading.Lock()
_threads: list = []
_snapshots: list = []  # the graph the snapshots' copies and writes run on (made on first use)


def _committer():
    if not _threads:
        _threads.append(concurrent.futures.ThreadPoolExecutor(1, "dtorch-checkpoint"))
    return _threads[0]


def wait_for_saves() -> None:
    """Waits for every async save issued so far; raises the first error the program has not
    been given yet."""
    with _pending_lock:
        pending, _pending[:] = list(_pending), []
    error = None
    for future in pending:
        failure = concurrent.futures.Future.exception(future)  # waits (not a report)
        if failure is not None and not future.reported:
            future.reported = True
            error = error or failure
    if error is not None:
        raise error


def _commit(path: str, save_id: str, tensors: dict, tokens: list) -> str:
    """Waits for the devices' writes, then publishes the index (``commit.py``)."""
    try:
        failure = max((token.item() for token in tokens), default=0)  # waits for every device
        if failure:
            raise OSError(failure, f"a device could not write its blocks "
                                   f"({os.strerror(failure)})")
        files = commit.sizes(path, tensors)
        sync_directory(path)
        index_path = commit.publish(path, save_id, tensors, files)
    except BaseException as e:
        _abandon(path, save_id, e)
    sync_directory(path)
    commit.remove_unnamed(path, set(files))  # the previous save's
    return index_path


def _abandon(path: str, save_id: str, e: BaseException):
    """Removes what a failed save wrote (once the devices' writes under way end), then raises:
    an ``OSError`` naming the directory, or ``e`` itself (called where ``e`` is handled)."""
    import dtorch  # (this package loads with dtorch itself)

    with contextlib.suppress(Exception):
        dtorch.sync()
    commit.abandon(path, save_id)
    if isinstance(e, OSError):
        raise commit.save_error(path, e) from e
    raise e


def _as_written(t: Tensor, snapshot: bool) -> Tensor:
    """``t`` in its ``write_layout``. ``snapshot``: a copy of it as it is now, made on the
    snapshots' graph (``save_checkpoint(async_=True)``): the redistribute, whose result is a
    tensor of its own, is that copy where the layout changes."""
    import dtorch

    placements = write_layout(t)
    if not snapshot:
        return t if placements == list(t.placements) else t.redistribute(placements=placements)
    if not _snapshots:
        _snapshots.append(dtorch.Graph())
    graph = _snapshots[0]
    # the copy is made on the snapshots' graph: its kernels, and the writes that read it, run
    # on that graph's streams, never queued on the program's
    if placements != list(t.placements):  # the redistribute's result is that copy
        return dispatch.redistribute(t, placements=placements, graph=graph)
    copy = dtorch.empty_like(t, graph=graph)
    with graph:
        return copy.copy_(t)


def write_layout(t: Tensor) -> list:
    """The placements ``t`` is written in: each Replicate or Partial mesh dim (of more than
    one device) shards the largest tensor dim that no other mesh dim shards and that has a row
    for each of its devices, so the devices write equal shares; a sub-split Shard is made
    plain (a file holds each device's block as one box of the tensor); a Partial that no
    tensor dim fits is reduced to Replicate (written once, by coordinate 0).

    >>> import dtorch
    >>> mesh = dtorch.DeviceMesh("cpu", [[0, 1], [2, 3]])
    >>> t = dtorch.zeros(5, 3, device_mesh=mesh, placements=[Replicate(), Shard(0)])
    >>> write_layout(t)
    [Shard(dim=1), Shard(dim=0)]
    >>> write_layout(dtorch.zeros(3, device_mesh=mesh, placements=[Replicate(), Replicate()]))
    [Shard(dim=0), Replicate()]
    """
    placements = [plain(p) for p in t.placements]
    taken = {p.dim for p in placements if isinstance(p, Shard)}
    for i, p in enumerate(placements):
        n = t.device_mesh.shape[i]
        if isinstance(p, Shard) or (n == 1 and not isinstance(p, Partial)):
            continue
        fits = [d for d in range(t.dim()) if d not in taken and t.shape[d] >= n]
        if fits:
            d = max(fits, key=lambda d: (t.shape[d], -d))
            taken.add(d)
            placements[i] = Shard(d)
        else:
            placements[i] = Replicate()
    return placements


def _write_all(state, path: str, save_id: str, snapshot: bool = False) -> tuple:
    """Issues every file of the save (the client's own written at once): the index's
    ``tensors`` and the devices' tokens (``write_blocks``). ``snapshot``: the devices write
    copies (``_snapshot``), on the snapshots' graph."""
    tensors, first, groups, on_client = {}, {}, {}, []
    for key, t in state.items():
        if id(t) in first:  # tied: the same pieces
            tensors[key] = tensors[first[id(t)]]
            continue
        first[id(t)] = key
        if isinstance(t, Tensor):
            t = _as_written(t, snapshot)
            groups.setdefault(t.device_mesh, []).append((key, t))
        elif isinstance(t, torch.Tensor):
            on_client.append((key, t.detach()))
        else:
            raise TypeError(f"save_checkpoint: {key!r} is a {type(t).__name__}, not a tensor")
        tensors[key] = {"dtype": str(t.dtype)[6:], "shape": list(t.shape), "pieces": []}
    tokens = []
    for k, (mesh, items) in enumerate(groups.items()):
        name = index.rank_file(k, save_id)
        tokens.append(write_blocks(msgpack.packb([path, name, [key for key, _ in items]]),
                                   [t for _, t in items]))
        _add_pieces(tensors, mesh, name, items)
    if on_client:
        name = index.client_file(save_id)
        write_file(os.path.join(path, name), on_client)
        for key, t in on_client:
            if t.numel():
                tensors[key]["pieces"].append({"file": name, "key": key,
                                               "offsets": [0] * t.dim(), "shape": list(t.shape)})
    return tensors, tokens


def _add_pieces(tensors: dict, mesh, name: str, items) -> None:
    """The index's record of what each device of ``mesh`` writes (``writes_block``, as the
    hosts decide it)."""
    for device in mesh.devices:
        coord = mesh.coordinate_of(device)
        for key, t in items:
            placements = tuple(t.placements)
            if not writes_block(placements, coord):
                continue
            shape, offsets = local_region(tuple(t.shape), mesh.shape, placements, coord)
            if math.prod(shape):
                tensors[key]["pieces"].append({"file": name.format(device=device), "key": key,
                                               "offsets": list(offsets), "shape": list(shape)})
