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


# -- kernels whose results on the hosts break what the client's metadata run promised -----------
# (the client runs local_map functions on meta tensors; hosts run them on real ones)


def host_rows(x, n):
    """``n`` rows on the hosts, the whole block on meta: wrong only on the devices whose block
    does not have ``n`` rows (uneven shards)."""
    return x[:n] if x.device.type != "meta" else x


def host_number(x):
    """A Python number on the hosts."""
    return float(x.sum()) if x.device.type != "meta" else x


def host_pair(x):
    """Two results on the hosts, one on meta."""
    return (x, x) if x.device.type != "meta" else x


def host_meta(x):
    """A tensor on the meta device, wherever it runs."""
    return torch.empty_like(x, device="meta")


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


# an operator whose kernel breaks its own meta rule on one device
def dtype_on_device_1(ctx, input):
    """float64 on device 1 only, float32 (the input's dtype) elsewhere."""
    return input.double() if ctx.device.index == 1 else input * 1


wrong_dtype = dtorch.register_op("ext_wrong_dtype(input: Tensor)", dtype_on_device_1,
                                 [((Shard(0),), (Shard(0),))], uses_context=True,
                                 meta=lambda input: torch.empty_like(input))


def allreduce_on_first_device(ctx, input):
    """All-reduces the block over mesh dim 0, on the mesh's first device only: a collective
    whose peers never come, so it lasts until its process group's deadline. (It runs on the
    compute stream, beside the communication stream's collectives: a kernel may do this only
    where nothing else uses the group meanwhile.)"""
    out = input.clone()
    if ctx.coord[0] == 0:
        pg, _ = ctx.group(0)
        pg.allreduce([out]).wait()
    return out


lonely_allreduce = dtorch.register_op("ext_lonely_allreduce(input: Tensor)",
                                      allreduce_on_first_device, uses_context=True,
                                      meta=lambda input: torch.empty_like(input))
