"""Pipeline parallelism: micro-batches through stages on stage meshes.

The schedule is the program order. Each micro-batch is issued through every stage in turn, and
the calls return at once (dispatch is asynchronous). A stage's kernels queue on its own
devices' streams, and a hop between stages is a point-to-point ``move``. Each device therefore
runs its stage's micro-batches back to back while the next stage works on the previous one.
This is GPipe's forward schedule, and nothing here waits.

>>> import dtorch
>>> mesh = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["pp"])
>>> s0, s1 = mesh.unbind("pp")
>>> stages = [dtorch.nn.Linear(4, 4, device_mesh=s0), dtorch.nn.Linear(4, 2, device_mesh=s1)]
>>> x = dtorch.ones((8, 4), device_mesh=s0)
>>> y = dtorch.nn.pipeline(stages, x, microbatches=4)
>>> y.shape, y.device_mesh == s1
(torch.Size([8, 2]), True)
"""

from __future__ import annotations

import math

import dtorch

from ..placement import Replicate, Shard

__all__ = ["pipeline", "hop", "stage_mesh", "split_microbatches", "join_microbatches"]


def stage_mesh(stage):
    """The mesh a stage runs on: a ``(callable, mesh)`` pair's mesh, or the mesh of a module's
    first parameter."""
    if isinstance(stage, tuple):
        return stage[1]
    params = getattr(stage, "parameters", None)
    if params is not None:
        for p in params():
            return p.device_mesh
    raise ValueError(f"pipeline: cannot tell the mesh of stage {stage!r} (it has no "
                     "parameters); pass it as a (callable, mesh) pair")


def hop(h, mesh):
    """``h`` on ``mesh`` with its placements kept (a point-to-point move between meshes of one
    shape); ``h`` itself when it is there already."""
    if h.device_mesh == mesh:
        return h
    if h.device_mesh.ndim == mesh.ndim:
        return h.redistribute(device_mesh=mesh, placements=h.placements)
    return h.redistribute(device_mesh=mesh, placements=[Replicate()] * mesh.ndim)


def _blocks_along(x, dim: int) -> int:
    """How many blocks dim ``dim`` of ``x`` is sharded into (1: whole on every device)."""
    n = 1
    for size, p in zip(x.device_mesh.shape, x.placements):
        if isinstance(p, Shard) and p.dim % x.ndim == dim:
            n *= size
    return n


def split_microbatches(x, microbatches: int, dim: int = 0) -> tuple:
    """``(pieces, n)``: ``x`` cut into ``microbatches`` pieces along ``dim``, never moving data.

    Where ``dim`` is whole on each device the pieces are ``x.chunk(microbatches, dim)``
    (``n == 1``). Where it is sharded into ``n`` even blocks (a ``Shard(0)`` batch on a "dp"
    dim), each device cuts its own block: piece ``i`` is chunk ``i`` of every device's block,
    still sharded. So a piece interleaves the batch, which ``join_microbatches`` undoes, and the
    split is local with no gather."""
    dim %= x.ndim
    n = _blocks_along(x, dim)
    if n == 1 or x.shape[dim] % n:
        return x.chunk(microbatches, dim), 1
    shape = list(x.shape)
    rest = shape[dim + 1:]
    blocks = x.view(*shape[:dim], n, shape[dim] // n, *rest)
    pieces = blocks.chunk(microbatches, dim + 1)
    return tuple(p.reshape(*shape[:dim], n * p.shape[dim + 1], *rest) for p in pieces), n


def join_microbatches(pieces, n: int, dim: int = 0):
    """The inverse of ``split_microbatches``: the pieces joined along ``dim``."""
    if len(pieces) == 1:
        return pieces[0]
    if n == 1:
        return dtorch.cat(list(pieces), dim)
    first = pieces[0]
    dim %= first.ndim
    shape = list(first.shape)
    rest = shape[dim + 1:]
    blocks = [p.view(*shape[:dim], n, p.shape[dim] // n, *rest) for p in pieces]
    whole = dtorch.cat(blocks, dim + 1)
    return whole.reshape(*shape[:dim], math.prod(whole.shape[dim:dim + 2]), *rest)


def pipeline(stages, x, microbatches: int = 1, *, dim: int = 0):
    """Runs ``stages`` (callables, each on a stage mesh, see ``stage_mesh``) on ``x`` as
    ``microbatches`` micro-batches along ``dim``. Each micro-batch hops from stage to stage, and
    the outputs are joined on the last stage's mesh. The result equals
    ``stages[-1](...stages[0](x))`` for stages that treat samples independently. Stage ``s + 1``
    computes micro-batch ``i`` while stage ``s`` computes ``i + 1``.

    A batch sharded along ``dim`` (data parallel inside each stage) is split on each device,
    without a gather (``split_microbatches``).
    """
    if microbatches < 1:
        raise ValueError(f"pipeline: microbatches must be >= 1, got {microbatches}")
    runs = [(s[0] if isinstance(s, tuple) else s, stage_mesh(s)) for s in stages]
    if not runs:
        return x
    x = hop(x, runs[0][1])
    pieces, n = split_microbatches(x, microbatches, dim) if microbatches > 1 else ((x,), 1)
    outs = []
    for h in pieces:
        for fn, mesh in runs:
            h = fn(hop(h, mesh))
        outs.append(h)
    return join_microbatches(outs, n, dim)
