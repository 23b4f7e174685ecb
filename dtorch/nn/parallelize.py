"""``parallelize(module, mesh, plan)``: an unported ``torch.nn.Module`` laid out on a mesh.

Every parameter and buffer of ``module`` becomes a dtorch tensor on ``mesh`` in place (the
module stays a torch module: its ``forward`` runs unchanged, and torch's functions on the dtorch
tensors it now holds run dtorch's operators: ``client/overrides.py``). The layout of each is
the plan's, by the qualified name of the module that holds it (``fnmatch`` patterns, first
match wins; DTensor's ``parallelize_module`` styles):

- ``"colwise"``: an ``nn.Linear``'s output features split on the tp dim: weight ``Shard(0)``,
  bias ``Shard(0)``; its input is made Replicate there first, its output stays sharded on the
  last dim. An ``nn.Embedding``'s columns (``Shard(1)``), its output made Replicate.
- ``"rowwise"``: an ``nn.Linear``'s input features split: weight ``Shard(1)``, bias
  Replicate; its input is made ``Shard(-1)`` there first, its output (a Partial sum) reduced to
  Replicate.
- ``"replicate"`` and everything the plan does not name: Replicate on every mesh dim, so a
  mesh's ``dp`` dim is data parallelism by the batch's placement alone.

The tp dim is the mesh's ``"tp"`` (``tp_dim=`` names another). Values are copied from the
module's torch tensors, each device receiving its block; a module built on torch's meta
device (no values) gets its layouts without values (``dtorch.nn.init_empty``'s) for
``load_checkpoint`` to fill.

HF's gradient checkpointing (``gradient_checkpointing_enable``, before or after) recomputes
through ``dtorch.nn.checkpoint``, with the arguments HF gives torch's (``_checkpointing``).

>>> import dtorch, torch
>>> mesh = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["tp"])
>>> torch.manual_seed(0)
<torch._C.Generator object at ...>
>>> mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
>>> x = torch.randn(3, 4)
>>> want = mlp(x)
>>> _ = dtorch.nn.parallelize(mlp, mesh, {"0": "colwise", "2": "rowwise"})
>>> mlp[0].weight.placements, mlp[2].weight.placements
([Shard(dim=0)], [Shard(dim=1)])
>>> torch.allclose(mlp(dtorch.from_torch(x, mesh)).to_torch(), want, atol=1e-6)
True
"""

from __future__ import annotations

import fnmatch
import functools

import torch

import dtorch

from ..autograd.checkpoint import checkpoint
from ..mesh import DeviceMesh
from ..ops.random_fill import init_empty
from ..placement import Replicate, Shard
from ..tensor import Tensor
from .parameter import Buffer, Parameter

STYLES = ("colwise", "rowwise", "replicate")


def parallelize(module: torch.nn.Module, mesh: DeviceMesh, plan: dict | None = None, *,
                tp_dim: str = "tp") -> torch.nn.Module:
    """Lays ``module``'s parameters and buffers out on ``mesh`` in place, as ``plan`` says
    (see the module doc); returns ``module``."""
    plan = dict(plan or {})
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ValueError(f"parallelize: plan[{pattern!r}] = {style!r}; the styles are "
                             f"{STYLES}")
    tp = mesh.dim_name_index(tp_dim) if mesh.has_dim_name(tp_dim) else None
    if tp is None and any(s != "replicate" for s in plan.values()):
        raise ValueError(f"parallelize: the plan shards on {tp_dim!r}, which the mesh "
                         f"{mesh!r} lacks; name the tp dim with tp_dim=")
    made: dict = {}  # id of a torch tensor -> (its dtorch tensor, where): tied ones stay tied
    for name, sub in module.named_modules():
        style = next((s for p, s in plan.items() if fnmatch.fnmatchcase(name, p)), "replicate")
        kinds = (torch.nn.Linear, torch.nn.Embedding) if style == "colwise" else torch.nn.Linear
        if style != "replicate" and not isinstance(sub, kinds):
            raise ValueError(f"parallelize: {name!r} is a {type(sub).__name__}; 'colwise' lays "
                             f"out an nn.Linear or an nn.Embedding, 'rowwise' an nn.Linear")
        for pname, p in list(sub._parameters.items()):
            if p is not None and not isinstance(p, Tensor):
                placements = _placements(sub, pname, style, mesh, tp)
                sub._parameters[pname] = _once(made, p, f"{name}.{pname}", placements, lambda: (
                    Parameter(_laid_out(p, mesh, placements), p.requires_grad)))
        for bname, b in list(sub._buffers.items()):
            if b is not None and not isinstance(b, Tensor):
                persistent = bname not in sub._non_persistent_buffers_set
                placements = [Replicate()] * mesh.ndim
                sub._buffers[bname] = _once(made, b, f"{name}.{bname}", placements, lambda: (
                    Buffer(_laid_out(b, mesh, placements), persistent=persistent)))
        if style != "replicate":
            _hook(sub, style, tp)
    _checkpointing(module)
    return module


def _checkpointing(module) -> None:
    """HF's layers checkpoint through the function ``_set_gradient_checkpointing`` hands them,
    a partial of ``torch.utils.checkpoint.checkpoint``. Its reentrant form runs the layer under
    ``no_grad`` inside a torch ``autograd.Function``, which dtorch tensors do not pass through
    (the layer gets no gradients), and its non-reentrant one keeps everything (torch's
    saved-tensor hooks do not see dtorch's tape). So every layer's function becomes
    ``dtorch.nn.checkpoint`` with the partial's arguments, now and whenever HF sets it again."""
    for sub in module.modules():
        if sub.__dict__.get("_gradient_checkpointing_func") is not None:
            sub._gradient_checkpointing_func = _dtorch_checkpoint(
                sub._gradient_checkpointing_func)
        setter = getattr(sub, "_set_gradient_checkpointing", None)
        if setter is not None and not getattr(setter, "through_dtorch", False):
            def through_dtorch(enable=True, gradient_checkpointing_func=None, _set=setter,
                               **kwargs):
                return _set(enable, _dtorch_checkpoint(gradient_checkpointing_func), **kwargs)

            through_dtorch.through_dtorch = True
            sub._set_gradient_checkpointing = through_dtorch


def _dtorch_checkpoint(function):
    """``dtorch.nn.checkpoint`` with the arguments of ``function``, HF's partial of torch's."""
    return functools.partial(checkpoint, **getattr(function, "keywords", {}))


def _once(made: dict, t: torch.Tensor, where: str, placements: list, lay_out):
    """The dtorch tensor of ``t``, laid out once however many modules hold it (a tied
    embedding and head, T5's shared embedding): they keep holding one tensor, whose gradient
    sums theirs. A second holder whose plan lays it out otherwise raises."""
    if id(t) not in made:
        made[id(t)] = (lay_out(), where, t)  # (t kept alive: its id stays its own)
    laid, first, _ = made[id(t)]
    if placements != list(laid.placements):
        raise ValueError(f"parallelize: {where!r} is the tensor {first!r} holds (tied), and "
                         f"the plan lays it out as {placements} there but as "
                         f"{list(laid.placements)} at {first!r}; plan both holders alike")
    return laid


def _placements(sub, pname: str, style: str, mesh, tp) -> list:
    placements = [Replicate()] * mesh.ndim
    if style == "colwise":
        placements[tp] = Shard(1 if isinstance(sub, torch.nn.Embedding) else 0)
    elif style == "rowwise" and pname == "weight":
        placements[tp] = Shard(1)
    return placements


def _laid_out(t: torch.Tensor, mesh, placements) -> Tensor:
    """A dtorch tensor of ``t``'s value in ``placements`` (each device gets its block); one
    without a value where ``t`` has none (torch's meta device)."""
    if t.is_meta:
        with init_empty():
            return dtorch.empty(tuple(t.shape), dtype=t.dtype, device_mesh=mesh,
                                placements=placements)
    return dtorch.from_torch(t.detach(), mesh, placements)


def _hook(sub, style: str, tp: int) -> None:
    """The input (and, rowwise, the output) laid out as the style takes them on the tp dim."""
    def whole(x):
        return _on_tp(x, tp, Replicate())

    if style == "colwise" and isinstance(sub, torch.nn.Linear):
        sub.register_forward_pre_hook(lambda m, args: (whole(args[0]), *args[1:]))
    elif style == "colwise":  # an embedding's columns: its output made whole
        sub.register_forward_hook(lambda m, args, out: whole(out))
    else:
        sub.register_forward_pre_hook(
            lambda m, args: (_on_tp(args[0], tp, Shard(args[0].ndim - 1)), *args[1:]))
        sub.register_forward_hook(lambda m, args, out: whole(out))


def _on_tp(x, tp: int, placement):
    if not isinstance(x, Tensor) or x.placements[tp] == placement:
        return x
    placements = list(x.placements)
    placements[tp] = placement
    return x.redistribute(placements=placements)
