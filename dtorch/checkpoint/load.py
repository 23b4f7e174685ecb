"""``load_checkpoint``: a checkpoint into a module's parameters and buffers, each in its own
layout, with no full copy anywhere.

For safetensors the client reads only headers and index files (``index.catalog``), matches keys
to ``module.state_dict()`` and issues, per tensor, one ``read_safetensors_`` into the target
itself: each device reads its own block from the file (``checkpoint/kernels.py``). A host's memory
therefore grows by its blocks and a read buffer (at most ``READ_CHUNK``, 8 MiB), and the
client's by the headers. A torch state dict (``.pt``/``.bin``) is read with
``torch.load(weights_only=True, mmap=True)`` and ``Module.load_state_dict``: torch's format
has no per-block reads, so there each tensor passes through the client.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.nn.modules.module import _IncompatibleKeys
from tqdm.auto import tqdm

from ..nn.modules.module import check_loaded, mismatch
from ..nn.parameter import Parameter
from ..tensor import Tensor
from . import index
from .headers import check_regular
from .kernels import pack_pieces, read_block, read_into
from .save import wait_for_saves

PROGRESS_DELAY_S = 2.0  # the bar shows only for loads longer than this (and on a terminal)
PROGRESS_STEP = 64 << 20  # bytes between two readings of the hosts' progress


def load_checkpoint(module, path, *, key_map=None, dtype=None, strict=True, progress=None):
    """Loads the checkpoint at ``path`` into ``module`` (or a dict of dtorch tensors, each
    filled in place, as ``save_checkpoint`` takes one): a ``.safetensors`` file, a directory
    of them with an HF ``model.safetensors.index.json`` or ``save_checkpoint``'s index (saved on
    any mesh: each block is read from the pieces that overlap it), or a torch state dict.

    ``key_map`` renames checkpoint keys to the module's: a dict (keys it lacks stay as they
    are) or a callable (``None``: skip that key). ``dtype`` makes floating parameters and
    buffers that dtype, the values cast on the hosts as they are read (without it, each value
    is cast to its parameter's dtype, as ``load_state_dict`` does). ``strict`` and the result
    are torch's: missing and unexpected keys raise (``strict=False``: returned), and so does
    a shape or kind-of-dtype mismatch, before anything is read. ``progress``: a tqdm bar over
    bytes and tensors, shown when the load lasts over 2 s on a terminal (None); True or False
    force it on or off.

    >>> import dtorch, torch, tempfile, os
    >>> from safetensors.torch import save_file
    >>> path = os.path.join(tempfile.mkdtemp(), "m.safetensors")
    >>> save_file({"w": torch.arange(6.).reshape(3, 2)}, path)
    >>> class M(dtorch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         mesh = dtorch.DeviceMesh("cpu", [0, 1])
    ...         self.w = dtorch.nn.Parameter(dtorch.zeros(3, 2, device_mesh=mesh,
    ...                                                   placements=[dtorch.Shard(0)]))
    >>> m = M()
    >>> load_checkpoint(m, path)
    <All keys matched successfully>
    >>> m.w.to_torch()[2]
    tensor([4., 5.])
    """
    targets = _targets(module, dtype)
    wait_for_saves()  # an async save still being written may be this checkpoint
    rename = renamer(key_map)
    file = index.torch_file(str(path))
    if file is not None:
        if targets is not None:
            raise TypeError("load_checkpoint: a dict of tensors loads from safetensors files; "
                            f"{file} is a torch file (load it into a module)")
        return _load_torch(module, file, rename, dtype, strict)
    entries = remap(index.catalog(str(path)), rename)
    if targets is None:
        targets = module.state_dict(keep_vars=True)
    missing = [k for k in targets if k not in entries]
    unexpected = [k for k in entries if k not in targets]
    keys = [k for k in targets if k in entries]
    check(module, strict, missing, unexpected,
          [e for e in (mismatch(k, targets[k], entries[k]) for k in keys) if e])
    if dtype is not None:
        targets = retype(module, dtype, set(keys))
    # file by file, in file order: each host's reads go forward through each file
    keys.sort(key=lambda k: entries[k].pieces[0][:2] if entries[k].pieces else ("", 0))
    read_all(keys, targets, entries, progress)
    check_loaded(module, {k: targets[k] for k in keys if isinstance(targets[k], Tensor)})
    return _IncompatibleKeys(missing, unexpected)


def _targets(module, dtype) -> dict | None:
    """The tensors a dict of them names (each filled in place, as ``save_checkpoint``'s dict
    is written), or None for a module (its state dict, once the arguments are checked)."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"load_checkpoint: dtype must be a floating torch.dtype, got {dtype!r}")
    if isinstance(module, torch.nn.Module):
        return None
    if not isinstance(module, Mapping) or not all(isinstance(t, Tensor)
                                                  for t in module.values()):
        raise TypeError(f"load_checkpoint: expects a dtorch.nn.Module or a dict of dtorch "
                        f"tensors, got {type(module).__name__}")
    if dtype is not None:
        raise TypeError("load_checkpoint: dtype= casts a module's parameters; a dict's tensors "
                        "keep their dtypes (make them in the dtype wanted)")
    return dict(module)


def renamer(key_map):
    """The function from a checkpoint key to the module's (None: skip it)."""
    if key_map is None:
        return lambda k: k
    if isinstance(key_map, Mapping):
        return lambda k: key_map.get(k, k)
    if callable(key_map):
        return key_map
    raise TypeError(f"load_checkpoint: key_map must be a dict or a callable, got "
                    f"{type(key_map).__name__}")


def remap(entries: Mapping, rename) -> dict:
    """``entries`` under the module's names (``rename``: ``renamer(key_map)``)."""
    out, source = {}, {}
    for key, entry in entries.items():
        new = rename(key)
        if new is None:
            continue
        if new in out:
            raise ValueError(f"load_checkpoint: key_map maps both {source[new]!r} and {key!r} "
                             f"to {new!r}")
        out[new], source[new] = entry, key
    return out


def check(module, strict: bool, missing, unexpected, errors) -> None:
    """torch's ``load_state_dict`` error, raised before anything is read."""
    messages = list(errors)
    if strict and unexpected:
        messages.insert(0, "Unexpected key(s) in state_dict: {}. ".format(
            ", ".join(f'"{k}"' for k in unexpected)))
    if strict and missing:
        messages.insert(0, "Missing key(s) in state_dict: {}. ".format(
            ", ".join(f'"{k}"' for k in missing)))
    if messages:
        raise RuntimeError("Error(s) in loading state_dict for {}:\n\t{}".format(
            type(module).__name__, "\n\t".join(messages)))


def retype(module, dtype: torch.dtype, loaded: set) -> dict:
    """Makes ``module``'s floating parameters and buffers ``dtype``, as ``Module.to`` does:
    those the checkpoint fills as new empty tensors in their layouts (nothing to cast), the
    others cast. Returns the new ``state_dict(keep_vars=True)``."""
    import dtorch  # (this package loads with dtorch itself)

    new, old = {}, []
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for table in (sub._parameters, sub._buffers):
            for name, t in list(table.items()):
                if not isinstance(t, Tensor) or not t.dtype.is_floating_point or (
                        t.dtype == dtype):
                    continue
                if id(t) not in new:  # a tensor at two places (tied) stays one tensor
                    old.append(t)
                    key = f"{prefix}.{name}" if prefix else name
                    value = (dtorch.empty(tuple(t.shape), dtype=dtype, device_mesh=t.device_mesh,
                                          placements=t.placements)
                             if key in loaded else t.to(dtype))
                    new[id(t)] = Parameter(value, t.requires_grad) if isinstance(
                        t, Parameter) else value
                table[name] = new[id(t)]
    return module.state_dict(keep_vars=True)


def read_all(keys, targets: dict, entries: dict, progress) -> None:
    """Issues the reads, follows them with the progress bar, and waits for the last: a read
    that fails (a file gone since its header was read) raises here."""
    import dtorch

    total = sum(entries[k].nbytes for k in keys)
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="load_checkpoint",
               delay=PROGRESS_DELAY_S, disable=None if progress is None else not progress,
               postfix=f"0/{len(keys)} tensors")
    marks, since, count = [], 0, 0
    for i, key in enumerate(keys):
        target, entry = targets[key], entries[key]
        if isinstance(target, Tensor):
            read_into(target, pack_pieces(entry.pieces))
        else:  # a torch tensor among the module's: it lives here, so it is read here
            read_block(entry.pieces, (0,) * len(entry.shape), entry.shape, target.detach())
        since, count = since + entry.nbytes, count + 1
        if not bar.disable and (since >= PROGRESS_STEP or i == len(keys) - 1):
            marks.append((dtorch.default_graph.sync_future(), since, count))
            since = count = 0
    done = 0
    for future, nbytes, n in marks:
        future.wait()
        done += n
        bar.set_postfix_str(f"{done}/{len(keys)} tensors", refresh=False)
        bar.update(nbytes)
    bar.close()
    dtorch.sync()


def _load_torch(module, file: str, rename, dtype, strict):
    """A torch state dict: torch's safe loader (``weights_only``: tensors and plain containers,
    never arbitrary objects), mapped from the file where the format allows it."""
    check_regular(file)
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as e:
        if "mmap" not in str(e):  # only the legacy (non-zip) format refuses mmap
            raise
        state = torch.load(file, map_location="cpu", weights_only=True)
    if not isinstance(state, Mapping):
        raise TypeError(f"load_checkpoint: {file} holds a {type(state).__name__}, not a state "
                        f"dict")
    state = remap(state, rename)
    if dtype is not None:
        module.to(dtype)  # load_state_dict then casts each value to it
    return module.load_state_dict(state, strict=strict)
