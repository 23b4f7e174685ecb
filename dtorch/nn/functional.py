"""dtorch.nn.functional: torch.nn.functional's names on distributed tensors.

Most functions here are generated from the operator registry (entries with
``functional=True``), like the ones under ``dtorch.``. The few written out below need more than a
signature (dropout draws its seed operand on the client).
"""

from ..client.dispatch import call_op as _call_op
from ..factories import _seeds


def dropout(input, p=0.5, training=True, inplace=False):
    """``torch.nn.functional.dropout``: zeroes each element with probability ``p`` and scales the
    rest by ``1 / (1 - p)`` when ``training``; the identity otherwise. Draws come from dtorch's
    seed (``dtorch.manual_seed``), each device for its own block (``ops/activation.py``), so the
    values differ from torch's for the same seed.

    >>> import dtorch, torch
    >>> x = dtorch.ones((4, 3), device_mesh=dtorch.DeviceMesh("cpu", [0, 1]),
    ...                 placements=[dtorch.Shard(0)])
    >>> sorted(set(dtorch.nn.functional.dropout(x, 0.5).to_torch().flatten().tolist()) - {0.0})
    [2.0]
    """
    seed = _seeds.getrandbits(63) if training else 0
    return _call_op("dropout", (input, seed), (p, training, inplace))
