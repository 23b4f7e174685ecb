"""``save_checkpoint``'s commit, as a database commits: write everything under new names, fsync,
then publish with one atomic rename.

1. Leftovers of saves that did not finish (files of ``index.OWNED``'s shapes that the current
   index does not name) are removed, so they never fill the disk.
2. Every file is written under a new name carrying this save's id (``index.rank_file``); each
   host fsyncs its files and the directory. The current index and the files it names are not
   touched.
3. The index, naming this save's files with their sizes, is written beside
   (``dtorch.index.json.<id>.partial``), fsynced, and renamed over ``dtorch.index.json``: that
   rename is the commit. The directory is fsynced after it.
4. The files the new index does not name (the previous save's) are removed.

A crash (of the program, a host or the machine) before step 3's rename leaves the old index and
its files, which load as they were, and at worst garbage that the next save removes; after it,
the new. A directory with rank files and no index (a first save that did not finish) does not
load (``index._safetensors_layout``). A save that fails removes what it wrote (a host whose
write fails, its own file at once; the client, the files of this save that others completed),
so a full disk is freed, and raises an ``OSError`` naming the directory. One save at a time may
write a directory: a second one's step 1 or 4 would remove the first one's files.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets

import torch

from .headers import read_json
from .index import DTORCH_INDEX, OWNED, VERSION


def new_save_id() -> str:
    return secrets.token_hex(6)


def named_files(directory: str) -> set | None:
    """The files the directory's index names (none without an index), or None when that index
    is not one this save can read: then nothing is removed before the commit."""
    path = os.path.join(directory, DTORCH_INDEX)
    if not os.path.lexists(path):
        return set()
    try:
        files = read_json(path).get("files")
    except (OSError, ValueError, AttributeError):
        return None
    return set(files) if isinstance(files, dict) else None


def remove_unnamed(directory: str, keep: set) -> None:
    """Removes dtorch's files in ``directory`` (``OWNED``) that are not in ``keep``."""
    for name in os.listdir(directory):
        if OWNED.fullmatch(name) and name not in keep:
            _remove(os.path.join(directory, name))


def abandon(directory: str, save_id: str) -> None:
    """Removes the files of the save ``save_id``, unless its index was published (an interrupt
    right after the rename: those files are the checkpoint now)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        if read_json(os.path.join(directory, DTORCH_INDEX)).get("save_id") == save_id:
            return
    for name in os.listdir(directory):
        if OWNED.fullmatch(name) and save_id in name:
            _remove(os.path.join(directory, name))


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):  # garbage at worst: the next save tries again
        os.remove(path)


def sizes(directory: str, tensors: dict) -> dict:
    """The index's ``files``: ``{name: {"size": bytes}}`` of every file a piece is in."""
    names = sorted({p["file"] for t in tensors.values() for p in t["pieces"]})
    return {name: {"size": os.stat(os.path.join(directory, name)).st_size} for name in names}


def publish(directory: str, save_id: str, tensors: dict, files: dict) -> str:
    """Makes this save the directory's checkpoint: its index, naming ``files``, written beside,
    fsynced and renamed over ``dtorch.index.json``."""
    total = sum(math.prod(t["shape"]) * getattr(torch, t["dtype"]).itemsize
                for t in tensors.values())
    index = {"format": "dtorch", "version": VERSION, "save_id": save_id,
             "metadata": {"total_size": total}, "files": files, "tensors": tensors}
    path = os.path.join(directory, DTORCH_INDEX)
    draft = f"{path}.{save_id}.partial"
    with open(draft, "w") as f:
        json.dump(index, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(draft, path)  # the commit
    return path


def save_error(directory: str, error: OSError) -> OSError:
    """The error the user sees when a save fails to write (the directory named, the errno
    kept: a full disk is ENOSPC)."""
    return OSError(error.errno, f"save_checkpoint: could not write the checkpoint {directory}: "
                                f"{error.strerror or error}. Nothing of this save is left there "
                                f"and the checkpoint that was there is unchanged")
