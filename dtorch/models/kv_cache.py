"""Key/value caches for decoding: a growing one (HF's ``DynamicCache``) and a static one (HF's
``StaticCache``), whose decode steps issue the same calls every step, so they replay.

Both hold, per layer, the keys and values ``[batch, kv_heads, seq, head_dim]`` in the layer's
layout, and give the model what a forward needs: the positions of its tokens (``positions``),
each layer's keys and values with the new ones in, and the mask of the positions a query may
see (``update``), and the step's end (``advance``).

- ``KVCache`` appends along the sequence (a ``cat``): every decode step's shapes, and its
  position (a static argument), are new, so the controller lowers each step anew.
- ``StaticKVCache(max_len)`` keeps ``max_len`` positions from the first decode step on (the
  prefill's padded with zeros): a step writes its key and value at the current position, held
  on the devices as a tensor (``dtorch.where`` of the one-hot slot), and attends over every
  slot through a mask of the positions written so far. Every decode step is then the same
  program with other inputs, which the controller replays and the hosts run as straight-line
  code. The masked slots take no part (a zero weight), so the tokens are those of the growing
  cache; the logits agree to float rounding (the softmax runs over a longer row).
"""

from __future__ import annotations

import torch

import dtorch

from ..nn.pipeline import hop
from ..placement import Replicate
from ..tensor import Tensor
from ..type import RING_CP, ULYSSES_CP

CP_DIMS = (ULYSSES_CP, "ulysses_cp", RING_CP)
R = Replicate()


class KVCache:
    """The keys and values of the positions seen so far, per layer, ``[batch, kv_heads, seq,
    head_dim]`` in the layer's layout; each step appends."""

    def __init__(self):
        self.layers: dict = {}

    def __len__(self) -> int:
        return self.seen(0)

    def seen(self, layer: int) -> int:
        """How many positions ``layer`` has cached."""
        past = self.layers.get(layer)
        return 0 if past is None else past[0].shape[2]

    def positions(self, seq: int, mesh) -> Tensor:
        """The positions ``[1, seq]`` of a step's tokens, on ``mesh`` (the first stage's)."""
        start = len(self)
        return dtorch.arange(start, start + seq, device_mesh=mesh).unsqueeze(0)

    def update(self, layer: int, key: Tensor, value: Tensor) -> tuple:
        """``(keys, values, mask)``: the layer's keys and values with these appended along the
        sequence, and no mask (a decode step's query sees every cached position)."""
        past = self.layers.get(layer)
        if past is not None:
            key = dtorch.cat((past[0], key), dim=2)
            value = dtorch.cat((past[1], value), dim=2)
        self.layers[layer] = (key, value)
        return key, value, None

    def advance(self, seq: int) -> None:
        """A forward of ``seq`` tokens is done (the growing cache counts by its tensors)."""

    def gather_sequence(self) -> None:
        """Every entry whole along the sequence (Replicate on the context-parallel dims): decode
        steps bring one position each, which context parallelism cannot split."""
        for layer, (k, v) in self.layers.items():
            names = [n for n in CP_DIMS if k.device_mesh.has_dim_name(n)]
            if names:
                layout = dict.fromkeys(names, R)
                self.layers[layer] = tuple(
                    t.redistribute_by_dict(None, layout, default_placement_mode="keep")
                    for t in (k, v))


class StaticKVCache(KVCache):
    """``max_len`` positions per layer, written in place of a slot each decode step (see the
    module doc); the prefill is as ``KVCache``'s."""

    def __init__(self, max_len: int):
        super().__init__()
        self.max_len = max_len
        self.length = 0  # positions written (known to the client: it counts the steps)
        self._pos: dict = {}  # mesh -> the next position, a [1] int64 tensor on the devices
        self._first = None  # the first stage's mesh, where the positions start
        self._step: dict = {}  # (what, mesh) -> this step's slot or mask there

    def __len__(self) -> int:
        return self.length

    def seen(self, layer: int) -> int:
        return self.length

    def positions(self, seq: int, mesh) -> Tensor:
        if self.length + seq > self.max_len:
            raise ValueError(f"StaticKVCache: {self.length} positions cached and {seq} more do "
                             f"not fit in max_len={self.max_len}; make the cache larger")
        if not self.length:  # the prefill
            return super().positions(seq, mesh)
        if self._first is None:
            self._first = mesh
            self._pos = {mesh: dtorch.full((1,), self.length, dtype=torch.int64,
                                           device_mesh=mesh)}
        return self._on(mesh).view(1, 1)

    def update(self, layer: int, key: Tensor, value: Tensor) -> tuple:
        past = self.layers.get(layer)
        if past is None:  # the prefill: kept as it is, padded at the first decode step
            self.layers[layer] = (key, value)
            return key, value, None
        k, v = past
        if k.shape[2] != self.max_len:
            k, v = (self._padded(t) for t in (k, v))
        mesh = key.device_mesh
        slot = self._per_step("slot", mesh, lambda p: (self._slots(mesh) == p).view(
            1, 1, self.max_len, 1))
        k, v = dtorch.where(slot, key, k), dtorch.where(slot, value, v)
        self.layers[layer] = (k, v)
        mask = self._per_step("mask", mesh, lambda p: (self._slots(mesh) <= p).view(
            1, 1, 1, self.max_len))
        return k, v, mask

    def advance(self, seq: int) -> None:
        self.length += seq
        if self._first is not None:  # a decode step: the next position, on the devices
            self._pos = {self._first: self._pos[self._first] + seq}
        self._step = {}

    # -- helpers ------------------------------------------------------------------------------
    def _on(self, mesh) -> Tensor:
        """The current position on ``mesh`` (moved from the first stage once a step)."""
        if mesh not in self._pos:
            self._pos[mesh] = hop(self._pos[self._first], mesh)
        return self._pos[mesh]

    def _per_step(self, what: str, mesh, make) -> Tensor:
        key = (what, mesh)
        if key not in self._step:
            self._step[key] = make(self._on(mesh))
        return self._step[key]

    def _slots(self, mesh) -> Tensor:
        return dtorch.arange(self.max_len, device_mesh=mesh)

    def _padded(self, t: Tensor) -> Tensor:
        """A prefill's keys or values followed by zeros up to ``max_len`` positions."""
        batch, heads, seq, dim = t.shape
        zeros = dtorch.zeros((batch, heads, self.max_len - seq, dim), dtype=t.dtype,
                             device_mesh=t.device_mesh, placements=t.placements)
        return dtorch.cat((t, zeros), dim=2)
