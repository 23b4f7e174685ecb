"""DTorch's ``dtorch.compiled_op``: the fused operators of ``dtorch.nn.functional`` on plain
torch tensors, the reference a program compares dtorch's fused operators with.

DTorch compiles these with ``torch.compile``; dtorch's hosts run them as torch code (the
rotary embedding as one kernel, the others step by step), and these are that same code:
``apply_rotary_emb`` is the rotary embedding's host kernel, ``silu_linear_chunk`` and
``layer_norm_mul_add`` are the fused ops' steps on torch.nn.functional, ``rms_norm`` is torch's.

>>> import torch, dtorch
>>> x, cos, sin = torch.ones(1, 2, 4, 6), torch.ones(4, 6), torch.zeros(4, 6)
>>> torch.equal(dtorch.compiled_op.apply_rotary_emb(x, cos, sin), x)
True
"""

from torch.nn.functional import rms_norm  # the host kernel of dtorch's rms_norm

from .ops.activation import layer_norm_mul_add, silu_linear_chunk
from .ops.elementwise import _apply_rotary as apply_rotary_emb

__all__ = ["apply_rotary_emb", "layer_norm_mul_add", "rms_norm", "silu_linear_chunk"]
