"""Kernels for tests/test_extension.py: a module the hosts import by name (found through the
import root the client sends, since tests/ is not on the hosts' path)."""

import torch

import dtorch
from dtorch import Partial, Shard


def scale_rows(x, factor, *, offset=0.0):
    """Local: a result the shape of its input (keeps any Shard)."""
    return x * factor + offset


def first_rows(x, n):
    """Each block's first ``n`` rows: an S(0) result of n rows per device."""
    return x[:n]


def split_stats(x):
    """Two results: the local sum (a Partial contribution) and the block itself."""
    return x.sum(), x


def returns_input(x):
    return x


def row_softmax(input, dim):
    return torch.softmax(input, dim)


def bad_uneven(x):
    """Blocks of 3, 2, 2 rows give 1, 2, 2: not the array_split blocks of 5 rows (2, 2, 1)."""
    return x[:1] if x.shape[0] == 3 else x


def fails_on_values(x):
    if x.device.type != "meta":
        raise ValueError("boom on the host")
    return x


# an operator registered when this module is imported (also on the hosts)
softmax = dtorch.register_op(
    "ext_softmax(input: Tensor, dim)", row_softmax,
    # softmax along ``dim`` needs that dim whole; other dims may be sharded
    lambda call: [((Shard(d),), (Shard(d),)) for d in range(len(call.tensors[0].shape))
                  if d != call.static["dim"] % len(call.tensors[0].shape)],
    methods=("ext_softmax",))

# a linear operator: a Partial input gives a Partial output
def twice(input):
    return input + input


double = dtorch.register_op("ext_double(input: Tensor)", "extension_kernels.twice",
                            [((Shard(0),), (Shard(0),)), ((Partial(),), (Partial(),))],
                            meta=lambda input: torch.empty_like(input))
