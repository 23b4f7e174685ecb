"""``parallelize(module, mesh, plan)``: an unported ``torch.nn.Module`` laid out on a mesh.

Every parameter and buffer of ``module`` becomes a dtorch tensor on ``mesh`` in place (the
module stays a torch module: its ``forward`` runs unchanged, and torch's functions on the dtorch
tensors it now holds run dtorch's operators: ``client/overrides.py``). The layout of each is
the plan's, by the qualified name of the module that holds it (``fnmatch`` patterns, first
match wins; DTensor's ``parallelize_module`` styles, as objects or by name):

- ``ColwiseParallel()`` or ``"colwise"``: an ``nn.Linear``'s output features split on the tp
  dim: weight ``Shard(0)``, bias ``Shard(0)``; its input is made Replicate there first, its
  output stays sharded on the last dim. An ``nn.Embedding``'s columns (``Shard(1)``), its
  output made Replicate.
- ``RowwiseParallel()`` or ``"rowwise"``: an ``nn.Linear``'s input features split: weight
  ``Shard(1)``, bias Replicate; its input is made ``Shard(-1)`` there first, its output (a
  Partial sum) reduced to Replicate. An ``nn.Embedding``'s rows, the vocabulary
  (``Shard(0)``): each device looks up the indices its block holds
  (``vocab_parallel_embedding``), the Partial sum reduced to Replicate.
- ``SequenceParallel()`` or ``"sequence"``: any module (a norm), its parameters Replicate, its
  input made ``Shard(1)`` (``sequence_dim``) on the tp dim, so it runs on its share of the
  sequence.
- ``"replicate"`` and everything the plan does not name: Replicate on every mesh dim, so a
  mesh's ``dp`` dim is data parallelism by the batch's placement alone.

``output_layouts=`` lays a colwise or rowwise module's output out otherwise on the tp dim:
``RowwiseParallel(output_layouts=Shard(1))`` reduce-scatters along the sequence where Megatron's
sequence parallelism keeps the residual stream sharded, ``ColwiseParallel(output_layouts=
Replicate())`` gathers an LM head's vocabulary. ``input_layouts`` is taken and not needed:
an input is a dtorch tensor, whose layout is its own.

The tp dim is the mesh's ``"tp"`` (``tp_dim=`` names another). Values are copied from the
module's torch tensors, each device receiving its block; a module built on torch's meta
device (no values) gets its layouts without values (``dtorch.nn.init_empty``'s) for
``load_checkpoint`` to fill; its non-persistent buffers, which no checkpoint holds (a rotary
embedding's frequencies), are named in a warning, to be given their values with ``copy_``.

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
import warnings
from dataclasses import dataclass

import torch

import dtorch

from ..autograd.checkpoint import checkpoint
from ..mesh import DeviceMesh
from ..ops.random_fill import init_empty
from ..placement import Replicate, Shard
from ..tensor import Tensor
from . import functional
from .parameter import Buffer, Parameter



@dataclass(frozen=True)
class ColwiseParallel:
    """DTensor's style of that name (see the module doc)."""

    input_layouts: object = None
    output_layouts: object = None  # on the tp dim; None: a Linear's Shard(-1), an Embedding's R
    use_local_output: bool = True  # (DTensor's: dtorch's outputs are dtorch tensors anyway)


@dataclass(frozen=True)
class RowwiseParallel:
    """DTensor's style of that name (see the module doc)."""

    input_layouts: object = None
    output_layouts: object = None  # on the tp dim; None: Replicate
    use_local_output: bool = True


@dataclass(frozen=True)
class SequenceParallel:
    """DTensor's style of that name (see the module doc)."""

    sequence_dim: int = 1
    use_local_output: bool = False


STYLES = {"colwise": ColwiseParallel(), "rowwise": RowwiseParallel(),
          "sequence": SequenceParallel(), "replicate": None}


def parallelize(module: torch.nn.Module, mesh: DeviceMesh, plan: dict | None = None, *,
                tp_dim: str = "tp") -> torch.nn.Module:
    """Lays ``module``'s parameters and buffers out on ``mesh`` in place, as ``plan`` says
    (see the module doc); returns ``module``."""
    plan = {pattern: _style(pattern, style) for pattern, style in (plan or {}).items()}
    tp = mesh.dim_name_index(tp_dim) if mesh.has_dim_name(tp_dim) else None
    if tp is None and any(s is not None for s in plan.values()):
        raise ValueError(f"parallelize: the plan shards on {tp_dim!r}, which the mesh "
                         f"{mesh!r} lacks; name the tp dim with tp_dim=")
    made: dict = {}  # id of a torch tensor -> (its dtorch tensor, where): tied ones stay tied
    unloadable: list = []  # non-persistent buffers without values: no checkpoint holds them
    for name, sub in module.named_modules():
        style = next((s for p, s in plan.items() if fnmatch.fnmatchcase(name, p)), None)
        _check_fits(name, sub, style)
        for pname, p in list(sub._parameters.items()):
            if p is not None and not isinstance(p, Tensor):
                placements = _placements(sub, pname, style, mesh, tp)
                sub._parameters[pname] = _once(made, p, f"{name}.{pname}", placements, lambda: (
                    Parameter(_laid_out(p, mesh, placements), p.requires_grad)))
        for bname, b in list(sub._buffers.items()):
            if b is not None and not isinstance(b, Tensor):
                persistent = bname not in sub._non_persistent_buffers_set
                if b.is_meta and not persistent:
                    unloadable.append(f"{name}.{bname}".lstrip("."))
                placements = [Replicate()] * mesh.ndim
                sub._buffers[bname] = _once(made, b, f"{name}.{bname}", placements, lambda: (
                    Buffer(_laid_out(b, mesh, placements), persistent=persistent)))
        if style is not None:
            _hook(sub, style, tp)
    if unloadable:
        warnings.warn(f"parallelize: {', '.join(unloadable)} are non-persistent buffers on "
                      f"torch's meta device: no checkpoint holds them, so they have no values "
                      f"until given some (copy_ a value computed on a real device into each)",
                      stacklevel=2)
    _checkpointing(module)
    return module


def _style(pattern: str, style):
    """A plan entry's style object (None: replicate)."""
    if isinstance(style, str) and style in STYLES:
        return STYLES[style]
    if isinstance(style, (ColwiseParallel, RowwiseParallel, SequenceParallel)):
        return style
    raise ValueError(f"parallelize: plan[{pattern!r}] = {style!r}; the styles are "
                     f"{tuple(STYLES)} or ColwiseParallel(), RowwiseParallel(), "
                     f"SequenceParallel()")


def _check_fits(name: str, sub, style) -> None:
    if isinstance(style, (ColwiseParallel, RowwiseParallel)) and not isinstance(
            sub, (torch.nn.Linear, torch.nn.Embedding)):
        raise ValueError(f"parallelize: {name!r} is a {type(sub).__name__}; 'colwise' and "
                         f"'rowwise' lay out an nn.Linear or an nn.Embedding")
    if isinstance(style, RowwiseParallel) and isinstance(sub, torch.nn.Embedding) and (
            sub.max_norm is not None or sub.sparse):
        raise ValueError(f"parallelize: {name!r}: a vocabulary-parallel embedding takes no "
                         f"max_norm and no sparse gradients")


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


def _placements(sub, pname: str, style, mesh, tp) -> list:
    placements = [Replicate()] * mesh.ndim
    embedding = isinstance(sub, torch.nn.Embedding)
    if isinstance(style, ColwiseParallel):
        placements[tp] = Shard(1 if embedding else 0)
    elif isinstance(style, RowwiseParallel) and pname == "weight":
        placements[tp] = Shard(0 if embedding else 1)
    return placements


def _laid_out(t: torch.Tensor, mesh, placements) -> Tensor:
    """A dtorch tensor of ``t``'s value in ``placements`` (each device gets its block); one
    without a value where ``t`` has none (torch's meta device)."""
    if t.is_meta:
        with init_empty():
            return dtorch.empty(tuple(t.shape), dtype=t.dtype, device_mesh=mesh,
                                placements=placements)
    return dtorch.from_torch(t.detach(), mesh, placements)


def _hook(sub, style, tp: int) -> None:
    """The input and output laid out as the style takes and gives them on the tp dim (and a
    vocabulary-parallel embedding's lookup)."""
    if isinstance(style, SequenceParallel):
        sub.register_forward_pre_hook(lambda m, args: (
            _on_tp(args[0], tp, Shard(style.sequence_dim % args[0].ndim)), *args[1:]))
        return
    embedding = isinstance(sub, torch.nn.Embedding)
    if isinstance(style, ColwiseParallel) and not embedding:
        sub.register_forward_pre_hook(lambda m, args: (_on_tp(args[0], tp, Replicate()),
                                                       *args[1:]))
    elif isinstance(style, RowwiseParallel) and not embedding:
        sub.register_forward_pre_hook(
            lambda m, args: (_on_tp(args[0], tp, Shard(args[0].ndim - 1)), *args[1:]))
    elif isinstance(style, RowwiseParallel):  # each device looks up its own rows
        sub.forward = functools.partial(_vocab_lookup, sub)
    out = style.output_layouts
    if out is None and (embedding or isinstance(style, RowwiseParallel)):
        out = Replicate()
    if out is not None:
        sub.register_forward_hook(lambda m, args, y: _on_tp(y, tp, out))


def _vocab_lookup(sub, input):
    return functional.vocab_parallel_embedding(input, sub.weight, sub.padding_idx)


def _on_tp(x, tp: int, placement):
    if not isinstance(x, Tensor) or x.placements[tp] == placement:
        return x
    placements = list(x.placements)
    placements[tp] = placement
    return x.redistribute(placements=placements)
