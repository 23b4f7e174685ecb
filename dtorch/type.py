"""DTorch's enums (``dtorch.OperatorFormat``, ``PaddingType``, ``PoolingKind``) and
``SdpaOption``: the argument types of DTorch's forms of conv, pooling and attention.

Each enum member has ``.name`` and ``.value`` and prints as DTorch's do
(``dtorch.OperatorFormat.nchw``). torch's own argument forms (``padding="same"``, a channels-last
memory format) keep working where the ops take both.

>>> import dtorch
>>> dtorch.OperatorFormat.nhwc, dtorch.PaddingType("same")
(dtorch.OperatorFormat.nhwc, dtorch.PaddingType.same)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class _Enum(enum.Enum):
    def __repr__(self) -> str:
        return f"dtorch.{type(self).__name__}.{self.name}"

    __str__ = __repr__


class OperatorFormat(_Enum):
    """The layout of an image tensor: ``nchw`` (torch's) or ``nhwc`` (channels last)."""

    nchw = "nchw"
    nhwc = "nhwc"


class PaddingType(_Enum):
    """How conv and pooling pad: by explicit amounts (``not_set``), or torch's ``"same"`` and
    ``"valid"``."""

    not_set = "not_set"
    same = "same"
    valid = "valid"


class PoolingKind(_Enum):
    avg = "avg"
    max = "max"


ULYSSES_CP = "ulysess_cp"  # DTorch's spelling of the mesh dim name (``ulysses_cp`` works too)
RING_CP = "ring_cp"
SAGE_ATTN_TYPES = (None, "", "auto", "qk_int8_pv_fp8", "qk_int8_pv_fp16")


@dataclass
class SdpaOption:
    """Which mesh dims ``scaled_dot_product_attention`` runs context parallelism over: a mesh
    dim name (looked up on the query's mesh; absent means off) or index (always on)."""

    ulysess_cp_dim: int | str | None = ULYSSES_CP
    ring_cp_dim: int | str | None = RING_CP
    sage_attn_type: str | None = None

    def check_valid(self) -> None:
        if self.sage_attn_type not in SAGE_ATTN_TYPES:
            raise ValueError(f"SdpaOption: sage_attn_type must be one of {SAGE_ATTN_TYPES}, got "
                             f"{self.sage_attn_type!r}")
        if self.sage_attn_type:
            raise NotImplementedError(
                "SdpaOption: SageAttention kernels are not part of dtorch; leave sage_attn_type "
                "None for torch's attention")
