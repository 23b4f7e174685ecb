"""``fully_shard``: ZeRO-3 (FSDP) through placements. Parameters are stored ``Shard`` on the
data-parallel mesh dim and gathered whole only while the layer that reads them runs.

**Storage.** ``fully_shard(module)`` re-lays each parameter of ``module`` that is Replicate on
``dp_dim`` (of more than one device) as Shard on it, along the first tensor dim that no other
mesh dim shards (``dp_sharded``: the rule by which ZeRO-1/2 shard the optimizer state; uneven
sizes too, the first devices holding one more). A parameter with no such dim stays Replicate (its
gradient is all-reduced, as without ZeRO). The Parameter objects stay: each takes over the
blocks of its re-laid copy, so ties, ``model.parameters()`` and an optimizer see the sharded
parameters; the replicated blocks are freed. Cast or move the model (``Module.to``, which makes
new Parameters) before ``fully_shard``, and build the optimizer after it.

**When what is gathered.** A forward pre-hook puts, at each slot that registers a managed
parameter, what ``autograd.gathered`` makes of the group: each parameter laid out as before
``fully_shard``, the group's parameters joined in one all-gather on ``dp``
(``all_gather_coalesced``, one per 4 MB of shards), issued as the module is called; the forward
hook puts the sharded Parameters back, so the client drops the gathered tensors once the
forward is done. With grad off (``torch.no_grad``, ``generate``) their blocks are freed then;
with grad on, the hosts' saved graphs keep what the backward needs, and the backward gathers
the group again, in one go, before the first VJP that reads it (``gathered``'s doc). The client
issues both ahead of the devices, so each gather runs on the communication stream while the
layer before computes: that is the prefetch. Backward: the dual of the all-gather is a
reduce-scatter, so each gradient lands in ``.grad`` Shard on ``dp``, laid out as its
parameter (the group's gradients joined in one reduce-scatter per bucket), and the optimizer
updates each device's shard where it is (``zero_stage=3``, which checks this layout).

**Nesting**, as torch's FSDP2: bottom-up. Apply it to each layer, then to the root; a call
manages the parameters of ``module`` and its submodules down to (not into) those already
managed, so the root's group is the rest (Llama: the embedding, the final norm and the head),
gathered for the root's whole forward. Applying it to a module inside one already managed
raises; applying it twice to one module does nothing. A parameter registered in two groups
(tied) is sharded once and gathered by each group, in its own forward; its gradients from both
sum. Llama's ``tie_word_embeddings`` head reads the embedding's ``weight`` attribute, so it sees
what the root's group shows there: the gathered table.

**state_dict** (outside a forward) holds the sharded Parameters, as ever their aliases:
``to_torch()`` reads the whole value, ``load_state_dict`` and ``load_checkpoint`` read into the
shards, and ``save_checkpoint`` has each device write its shard, which loads into any layout.
An exception that escapes a managed module's forward skips torch's forward hooks, so the
gathered tensors stay in that module until its next call puts the Parameters back.

>>> import dtorch
>>> mesh = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["dp"])
>>> layer = dtorch.nn.fully_shard(dtorch.nn.Linear(4, 3, device_mesh=mesh))
>>> layer.weight.placements
[Shard(dim=0)]
>>> layer(dtorch.ones((2, 4), device_mesh=mesh, placements=[dtorch.Shard(0)])).sum().backward()
>>> layer.weight.grad.placements
[Shard(dim=0)]
"""

from __future__ import annotations

import weakref

import torch

from ..autograd import gathered
from ..placement import Replicate, Shard
from ..tensor import Tensor

__all__ = ["fully_shard"]

# id of a parameter fully_shard sharded -> its group (which holds it, so the id stays its)
_OWNERS = weakref.WeakValueDictionary()


def dp_sharded(placements, ndim: int, mesh, dp_dim: str) -> list:
    """``placements`` with ``dp_dim`` made Shard along the first of the ``ndim`` tensor dims
    that no other mesh dim shards, where it is Replicate on more than one device; as given
    otherwise (and when every dim is taken). How ``fully_shard`` stores a parameter and ZeRO-1/2
    its optimizer state."""
    layout = list(placements)
    dp = mesh.dim_name_index(dp_dim)
    if dp is None or mesh.shape[dp] == 1 or layout[dp] != Replicate():
        return layout
    taken = {q.dim for q in layout if isinstance(q, Shard)}
    free = [d for d in range(ndim) if d not in taken]
    if free:
        layout[dp] = Shard(free[0])
    return layout


class _Group:
    """The parameters one ``fully_shard`` call manages: ``entries`` maps a parameter's id to
    (the sharded parameter, its gathered placements, the ``(module, name)`` slots that register
    it)."""

    def __init__(self, module, entries: dict):
        self.module, self.entries = module, entries

    def unshard(self, *_) -> None:  # the forward pre-hook
        entries = list(self.entries.values())
        fulls = gathered([p for p, _, _ in entries], [whole for _, whole, _ in entries])
        for (_, _, slots), full in zip(entries, fulls):
            for owner, name in slots:
                owner._parameters[name] = full

    def reshard(self, *_) -> None:  # the forward hook
        for p, _, slots in self.entries.values():
            for owner, name in slots:
                owner._parameters[name] = p


def fully_shard(module, dp_dim: str = "dp"):
    """Stores ``module``'s parameters sharded on the mesh dim ``dp_dim`` and gathers them around
    its forward (see the module doc: apply it to each layer, then to the root). Returns
    ``module``."""
    if getattr(module, "_fsdp_group", None) is not None:
        return module
    if any(p.grad is not None for p in module.parameters()):
        raise ValueError(f"fully_shard({type(module).__name__}): a parameter already has a "
                         f"gradient, laid out unsharded; call fully_shard before the backward, "
                         f"or after opt.zero_grad()")
    entries: dict = {}
    for owner in _members(module, set()):
        for name, p in owner._parameters.items():
            if not isinstance(p, Tensor):
                continue
            if id(p) not in entries:
                whole = _shard(p, module, dp_dim)
                if whole is None:
                    continue
                entries[id(p)] = (p, whole, [])
            entries[id(p)][2].append((owner, name))
    group = module._fsdp_group = _Group(module, entries)
    for key in entries:
        _OWNERS.setdefault(key, group)
    if entries:
        module.register_forward_pre_hook(group.unshard)
        module.register_forward_hook(group.reshard)
    return module


def _members(module, seen: set):
    """``module`` and its submodules, down to (not into) those ``fully_shard`` manages."""
    if id(module) in seen:
        return
    seen.add(id(module))
    yield module
    for child in module.children():
        if getattr(child, "_fsdp_group", None) is None:
            yield from _members(child, seen)


def _shard(p: Tensor, module, dp_dim: str):
    """Re-lays ``p`` sharded on ``dp_dim`` in place; its placements gathered, or None when
    there is nothing to shard. One that an earlier call sharded (a parameter tied across groups)
    is gathered as that call gathers it."""
    owner = _OWNERS.get(id(p))
    if owner is not None:
        if any(m is module for m in owner.module.modules()):
            raise ValueError(f"fully_shard({type(module).__name__}): its parameters are already "
                             f"managed by the fully_shard of an enclosing "
                             f"{type(owner.module).__name__}; apply fully_shard bottom-up, to "
                             f"each layer first and then to the root")
        return owner.entries[id(p)][1]
    whole = list(p.placements)
    sharded = dp_sharded(whole, p.dim(), p.device_mesh, dp_dim)
    if sharded == whole:
        return None
    with torch.no_grad():
        p.data = p.redistribute(placements=sharded)
    return whole
