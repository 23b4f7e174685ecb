"""``save_checkpoint``: every device writes the blocks it owns to a safetensors file of its own,
then the client writes ``dtorch.index.json``, which says where each block of each tensor is, so
``load_checkpoint`` reads it back into any layout (another mesh, other placements, one device).

Files are ``rank{device:05d}-mesh{k}.safetensors`` (``k``: the tensors' mesh, in the order the
state dict first names it; most models have one). A Replicate mesh dim's copies are written
once (by coordinate 0), a Partial tensor is reduced first (an all-reduce, then written as
Replicate), a tensor at two keys (tied weights) once, and a torch tensor among a dtorch module's
by the client (``client.safetensors``). Each rank file is an ordinary safetensors file (one
block per key), so safetensors' own tools read it.
"""

from __future__ import annotations

import contextlib
import math
import os

import msgpack
import torch

from ..ops.checkpoint import write_blocks, write_file, writes_block
from ..placement import Partial, Replicate, local_region
from ..tensor import Tensor
from . import index

CLIENT_FILE = "client.safetensors"


def save_checkpoint(module, path) -> str:
    """Writes ``module``'s state dict (or a dict of tensors) to the directory ``path``; returns
    the index's path. It waits until every file is written.

    >>> import dtorch, tempfile
    >>> mesh = dtorch.DeviceMesh("cpu", [0, 1])
    >>> w = dtorch.arange(10.0, device_mesh=mesh, placements=[dtorch.Shard(0)])
    >>> directory = tempfile.mkdtemp()
    >>> _ = save_checkpoint({"w": w}, directory)
    >>> sorted(os.listdir(directory))
    ['dtorch.index.json', 'rank00000-mesh0.safetensors', 'rank00001-mesh0.safetensors']
    """
    import dtorch  # (this package loads with dtorch itself)

    state = module.state_dict(keep_vars=True) if isinstance(module, torch.nn.Module) else module
    path = os.path.abspath(str(path))
    os.makedirs(path, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):  # no index until every file is new
        os.remove(os.path.join(path, index.DTORCH_INDEX))
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
    for k, (mesh, items) in enumerate(groups.items()):
        name = f"rank{{device:05d}}-mesh{k}.safetensors"
        write_blocks(msgpack.packb([path, name, [key for key, _ in items]]),
                     [t for _, t in items])
        _add_pieces(tensors, mesh, name, items)
    if on_client:
        write_file(os.path.join(path, CLIENT_FILE), on_client)
        for key, t in on_client:
            if t.numel():
                tensors[key]["pieces"].append({"file": CLIENT_FILE, "key": key,
                                               "offsets": [0] * t.dim(), "shape": list(t.shape)})
    dtorch.sync()  # every device has written its file (or its failure raises here)
    return index.write_index(path, tensors)


def _reduced(t: Tensor) -> Tensor:
    """``t`` with its Partial mesh dims reduced to Replicate (the value, written once)."""
    if not any(isinstance(p, Partial) for p in t.placements):
        return t
    return t.redistribute(placements=[Replicate() if isinstance(p, Partial) else p
                                      for p in t.placements])


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
