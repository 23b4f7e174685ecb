"""``Embedding`` (DTorch's: the embedding dim sharded on ``tp_dim``), and the
vocabulary-parallel ``VocabParallelEmbedding`` that large vocabularies need.

| class | weight on tp | input on tp | output on tp |
|---|---|---|---|
| ``Embedding`` | ``S(1)`` (columns) | ``R`` | ``S(-1)`` |
| ``EmbeddingWithReplicateOutput`` | ``S(1)`` | ``R`` | ``R`` (all-gather) |
| ``VocabParallelEmbedding`` | ``S(0)`` (rows) | ``R`` | ``R`` (all-reduce) |

``VocabParallelEmbedding`` keeps ``1 / tp`` of the table per device: each device looks up the
indices in its block of rows (uneven blocks too), zeros for the others, and the Partial sum is
reduced in ``redistribute_output`` (override it to return ``S(d)``, a reduce-scatter, for
sequence parallelism, or the Partial itself). Every other mesh dim holds the table whole
(Replicate): indices sharded there (the batch) shard the output alike.

>>> import torch

import dtorch
>>> mesh = dtorch.DeviceMesh("cpu", [0, 1], mesh_dim_names=["tp"])
>>> emb = VocabParallelEmbedding(5, 4, device_mesh=mesh)
>>> emb.weight.placements, emb(dtorch.tensor([[0, 4]], device_mesh=mesh)).placements
([Shard(dim=0)], [Replicate()])
"""

from __future__ import annotations

import torch

import dtorch

from ...placement import Replicate, Shard, is_int
from ...tensor import Tensor
from .. import functional as F
from .. import init
from ..parameter import Parameter
from .linear import check_tp_input, redistribute_on, resolve_tp_dim, tp_placements
from .module import Module, load_into

__all__ = ["Embedding", "EmbeddingWithReplicateOutput", "VocabParallelEmbedding"]


class Embedding(Module):
    """torch's ``nn.Embedding`` with the table's columns sharded on ``tp_dim``: the input
    ``R`` there, the output's last dim sharded. ``max_norm`` (which rewrites the table during
    the lookup) is not supported; ``scale_grad_by_freq`` and ``sparse`` concern gradients only."""

    _tp_weight = Shard(1)

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx=None,
                 max_norm=None, norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                 sparse: bool = False, _weight=None, _freeze: bool = False, device=None,
                 dtype=None, device_mesh=None, *, tp_dim="tp"):
        super().__init__()
        if padding_idx is not None and not is_int(padding_idx):
            raise TypeError(f"{type(self).__name__}: padding_idx must be an int or None, got "
                            f"{padding_idx!r}; dtorch takes torch's argument order "
                            f"(num_embeddings, embedding_dim, padding_idx, ...): pass device=, "
                            f"dtype= and device_mesh= by keyword")
        if max_norm is not None:
            raise NotImplementedError(f"{type(self).__name__}: max_norm is not supported (it "
                                      f"renormalises the table in place during the lookup)")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = _padding_index(padding_idx, num_embeddings)
        self.max_norm, self.norm_type = max_norm, norm_type
        self.scale_grad_by_freq, self.sparse = scale_grad_by_freq, sparse
        mesh = dtorch.get_default_device_mesh(device, device_mesh)
        self.tp_dim = resolve_tp_dim(mesh, tp_dim)
        if _weight is not None and dtype is None:
            dtype = _weight.dtype
        self.weight = Parameter(dtorch.empty(
            (num_embeddings, embedding_dim), dtype=dtype, device_mesh=mesh,
            placements=tp_placements(mesh, self.tp_dim, self._tp_weight)),
            requires_grad=not _freeze)
        if _weight is None:
            self.reset_parameters()
        else:
            error = load_into(self.weight, _weight, "_weight")
            if error:
                raise ValueError(f"{type(self).__name__}: {error}")

    @classmethod
    def from_pretrained(cls, embeddings, freeze: bool = True, padding_idx=None, max_norm=None,
                        norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                        sparse: bool = False, **kwargs):
        """torch's ``from_pretrained``: the table given (a torch or dtorch 2-D tensor), laid
        out as this class lays its weight out (``device_mesh=``, ``tp_dim=`` as for the
        constructor)."""
        if embeddings.dim() != 2:
            raise ValueError("Embeddings parameter is expected to be 2-dimensional")
        rows, cols = embeddings.shape
        return cls(rows, cols, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse,
                   _weight=embeddings, _freeze=freeze, **kwargs)

    def reset_parameters(self) -> None:
        """torch's initialisation, in place: ``normal_(0, 1)``, the ``padding_idx`` row zero."""
        w = self.weight
        init.normal_(w)
        if self.padding_idx is not None:
            rows = dtorch.arange(self.num_embeddings, device_mesh=w.device_mesh,
                                 placements=_rows_layout(w.placements))
            with torch.no_grad():
                w.copy_(dtorch.where((rows == self.padding_idx).unsqueeze(1), 0.0, w))

    def redistribute_input(self, input, input_placement=None):
        """``input`` with ``input_placement`` on the tp dim when given, then checked: ``R``
        there (every device looks every index up)."""
        if self.tp_dim is not None and isinstance(input, Tensor):
            input = redistribute_on(input, self.tp_dim, input_placement)
        if self.tp_dim is not None:
            check_tp_input(self, input, self.tp_dim, Replicate())
        return (input,), {}

    def redistribute_output(self, output, output_placement=None):
        """``output`` with ``output_placement`` on the tp dim when given."""
        return redistribute_on(output, self.tp_dim, output_placement)

    def forward(self, input: Tensor) -> Tensor:
        return F.embedding(input, self.weight, self.padding_idx)

    def extra_repr(self) -> str:
        text = f"{self.num_embeddings}, {self.embedding_dim}"
        if self.padding_idx is not None:
            text += f", padding_idx={self.padding_idx}"
        if self.sparse:
            text += ", sparse=True"
        if self.tp_dim is not None:
            text += f", tp_dim={self.tp_dim}"
        return text


class EmbeddingWithReplicateOutput(Embedding):
    """``Embedding`` whose output is gathered to ``R`` on ``tp_dim``."""

    def redistribute_output(self, output, output_placement=Replicate()):
        return super().redistribute_output(output, output_placement)


class VocabParallelEmbedding(Embedding):
    """``Embedding`` with the vocabulary (the table's rows) sharded on ``tp_dim``: each device
    holds ``num_embeddings / tp`` rows, looks up the indices in its block (zeros for the
    others) and the Partial sum is all-reduced to ``R`` (``redistribute_output``)."""

    _tp_weight = Shard(0)

    def forward(self, input: Tensor) -> Tensor:
        return F.vocab_parallel_embedding(input, self.weight, self.padding_idx)

    def redistribute_output(self, output, output_placement=Replicate()):
        return super().redistribute_output(output, output_placement)


def _padding_index(padding_idx, num_embeddings: int):
    """torch's checks and normalisation of ``padding_idx`` (a negative one counts from the
    end)."""
    if padding_idx is None:
        return None
    padding_idx = int(padding_idx)
    if padding_idx > 0 and padding_idx >= num_embeddings:
        raise AssertionError("Padding_idx must be within num_embeddings")
    if padding_idx < 0 and padding_idx < -num_embeddings:
        raise AssertionError("Padding_idx must be within num_embeddings")
    return padding_idx + num_embeddings if padding_idx < 0 else padding_idx


def _rows_layout(placements) -> list:
    """The placements of a vector of the table's row indices: sharded where the rows are."""
    return [Shard(0) if p == Shard(0) else Replicate() for p in placements]

