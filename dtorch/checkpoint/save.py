"""``save_checkpoint``: every device writes the blocks it owns to a safetensors file of its own,
then the client publishes ``dtorch.index.json``, which says where each block of each tensor is,
so ``load_checkpoint`` reads it back into any layout (another mesh, other placements, one
device). The save is committed as a database commits (``commit.py``): a crash leaves the old
checkpoint or the new one, never a mix.

Files are ``rank{device:05d}-mesh{k}-{save id}.safetensors`` (``k``: the tensors' mesh, in the
order the state dict first names it; most models have one). A Replicate mesh dim's copies are
written once (by coordinate 0), a Partial tensor is reduced first (an all-reduce, then written
as Replicate), a tensor at two keys (tied weights) once, and a torch tensor among a dtorch
module's by the client (``client-{save id}.safetensors``). Each rank file is an ordinary
safetensors file (one block per key), so safetensors' own tools read it.
"""

from __future__ import annotations

import contextlib
import math
import os

import msgpack
import torch

from ..placement import Partial, Replicate, local_region, plain
from ..tensor import Tensor
from . import commit, index
from .kernels import sync_directory, write_blocks, write_file, writes_block


def save_checkpoint(module, path) -> str:
    """Writes ``module``'s state dict (or a dict of tensors) to the directory ``path``; returns
    the index's path. It returns once every file is written and fsynced and the index
    published; a write that fails (a full disk) raises ``OSError`` and leaves the checkpoint
    that was there as it was.

    >>> import dtorch, tempfile
    >>> mesh = dtorch.DeviceMesh("cpu", [0, 1])
    >>> w = dtorch.arange(10.0, device_mesh=mesh, placements=[dtorch.Shard(0)])
    >>> directory = tempfile.mkdtemp()
    >>> _ = save_checkpoint({"w": w}, directory)
    >>> [name.split("-")[:2] for name in sorted(os.listdir(directory))]
    [['dtorch.index.json'], ['rank00000', 'mesh0'], ['rank00001', 'mesh0']]
    """
    import dtorch  # (this package loads with dtorch itself)

    state = module.state_dict(keep_vars=True) if isinstance(module, torch.nn.Module) else module
    path = os.path.abspath(str(path))
    os.makedirs(path, exist_ok=True)
    keep = commit.named_files(path)
    if keep is not None:
        commit.remove_unnamed(path, keep)  # the leftovers of saves that did not finish
    save_id = commit.new_save_id()
    try:
        tensors = _write_all(state, path, save_id)
        files = commit.sizes(path, tensors)
        sync_directory(path)
        index_path = commit.publish(path, save_id, tensors, files)
    except BaseException as e:
        with contextlib.suppress(Exception):  # the devices' writes still under way end first
            dtorch.sync()
        commit.abandon(path, save_id)
        if isinstance(e, OSError):
            raise commit.save_error(path, e) from e
        raise
    sync_directory(path)
    commit.remove_unnamed(path, set(files))  # the previous save's
    return index_path


def _write_all(state, path: str, save_id: str) -> dict:
    """Writes every file of the save and waits for them; returns the index's ``tensors``."""
    tensors, first, groups, on_client = {}, {}, {}, []
    for key, t in state.items():
        if id(t) in first:  # tied: the same pieces
            tensors[key] = tensors[first[id(t)]]
            continue
        first[id(t)] = key
        if isinstance(t, Tensor):
            groups.setdefault(t.device_mesh, []).append((key, _reduced(t)))
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
    failure = max((token.item() for token in tokens), default=0)  # waits for every device
    if failure:
        raise OSError(failure, f"a device could not write its blocks ({os.strerror(failure)})")
    return tensors


def _reduced(t: Tensor) -> Tensor:
    """``t`` with its Partial mesh dims reduced to Replicate (the value, written once), and a
    sub-split Shard made plain (a file holds each device's block as one box of the tensor)."""
    writable = [Replicate() if isinstance(p, Partial) else plain(p) for p in t.placements]
    if writable == t.placements:
        return t
    return t.redistribute(placements=writable)


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
