"""Activation checkpointing: ``checkpoint(function, *args)`` runs ``function`` without keeping
what its backward needs, and runs it again when the backward reaches it (torch's
``torch.utils.checkpoint.checkpoint``; ``dtorch.nn.checkpoint``).

The forward runs under ``torch.no_grad()``: nothing is recorded, so the hosts keep no graph of
its kernels and free every intermediate value as soon as the program drops it; only the inputs
stay (the region keeps them). Its tensor outputs hang on one tape node (``tape.Recomputed``)
whose VJP, when the backward walk reaches it, runs ``function`` again on the inputs detached
(leaves that require grad where the inputs did) with the tape on, walks that recomputed graph
back from the outputs' gradients, and hands the inputs' ``.grad`` to the outer walk. The
parameters ``function`` reads are leaves of the recomputed graph, so their gradients land in
``.grad`` there, reduced as in any backward (their data-parallel all-reduces run per region:
the region's own backward ends with its buckets). ZeRO-3 layers (``fully_shard``) gather their
shards again in the recompute, as they do in any forward.

The recompute draws what the forward drew: dtorch's seed stream (dropout) and torch's CPU
generator are set back to their states at the forward for the recompute, then restored
(``preserve_rng_state=True``, torch's default). Its outputs must have the forward's shapes and
layouts, or it raises (torch's determinism check).

``context_fn`` is torch's: a function giving two contexts, entered around the forward and
around the recompute. The pair torch's ``create_selective_checkpoint_contexts(policy)`` gives
makes the checkpoint selective: the outputs of the products the policy keeps stay from the
forward and the recompute does not run them again (``selective.py``).

As torch's reentrant checkpoint (``use_reentrant=True``), it supports ``backward()`` and not
``autograd.grad`` through a region (which raises torch's error), and an input's gradient
reaches it only through the tensors passed positionally; unlike it, parameters get their
gradients when no input requires grad, as the non-reentrant one gives them, when
``function`` is a module (or a module's method), whose parameters tell.
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import torch

from ..tensor import Tensor
from . import selective, tape


def checkpoint(function, *args, use_reentrant=None, context_fn=None, determinism_check="default",
               debug=False, preserve_rng_state: bool = True, **kwargs):
    """``function(*args, **kwargs)``, its activations recomputed in the backward (see the
    module doc)."""
    if determinism_check not in ("default", "none"):
        raise ValueError(f"determinism_check should be one of ['default', 'none'], but got "
                         f"{determinism_check}")
    inputs = [a for a in args if isinstance(a, Tensor)]
    if not torch.is_grad_enabled() or not (
            any(t.requires_grad for t in inputs)
            or any(p.requires_grad for p in _parameters(function))):
        if torch.is_grad_enabled():  # torch's warning: nothing to recompute for
            warnings.warn("None of the inputs have requires_grad=True. Gradients will be None",
                          stacklevel=2)
        return function(*args, **kwargs)
    state = _rng_state() if preserve_rng_state else None
    contexts = _contexts(context_fn)
    with torch.no_grad(), contexts[0]:
        outputs = function(*args, **kwargs)
    outs = _differentiable(outputs)
    if not outs:
        return outputs
    specs = [t._spec for t in outs]
    needs = tuple(t.requires_grad for t in inputs)

    def vjp(grads):
        return _recompute(function, args, kwargs, state, contexts[1], specs, needs, grads,
                          determinism_check != "none")

    node = tape.Node(tape.Recomputed(vjp), 0, tuple(inputs), needs, outs)
    for t in outs:
        t._requires_grad, t._node = True, node
    return outputs


def _contexts(context_fn) -> tuple:
    """The context around the forward, and a function giving the one around a recompute: a
    selective region's (``selective``) where ``context_fn`` gives torch's selective-checkpoint
    pair, else the pair as given."""
    if context_fn is None:
        return contextlib.nullcontext(), contextlib.nullcontext
    contexts = context_fn()
    policy = selective.policy_of(contexts)
    if policy is None:
        return contexts[0], lambda: contexts[1]
    region = selective.Region(policy)
    return region.open(recomputing=False), lambda: region.open(recomputing=True)


def _recompute(function, args, kwargs, state, context, specs, needs, grads,
               check: bool) -> list:
    """The inputs' gradients: ``function`` run again with the tape on, and walked back."""
    detached, leaves = [], []
    for a in args:
        if isinstance(a, Tensor):
            a = a.detach().requires_grad_(a.requires_grad and tape.differentiable(a._spec))
            leaves.append(a)
        detached.append(a)
    with _rng(state), torch.enable_grad(), context():
        outs = _differentiable(function(*detached, **kwargs))
    if check and [t._spec for t in outs] != specs:
        raise RuntimeError(f"dtorch.nn.checkpoint: the recomputed outputs are "
                           f"{[tuple(t.shape) for t in outs]}, laid out "
                           f"{[t.placements for t in outs]}; the forward's were "
                           f"{[tuple(s.shape) for s in specs]}, laid out "
                           f"{[list(s.placements) for s in specs]}: the function must compute "
                           f"the same in the backward")
    pairs = [(t, g) for t, g in zip(outs, grads) if g is not None and t.requires_grad]
    if pairs:
        tape.run_backward([t for t, _ in pairs], [g for _, g in pairs], retain_graph=False)
    return [leaf.grad if need else None for leaf, need in zip(leaves, needs)]


def _differentiable(outputs) -> list:
    """The floating tensors among ``outputs`` (a tensor, or a tuple or list of them and other
    values), in order: the ones a gradient can flow back through."""
    items = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    return [t for t in items if isinstance(t, Tensor) and tape.differentiable(t._spec)]


def _parameters(function) -> list:
    """The parameters of ``function`` when it is a module or a module's method, or a partial
    of a module's function with the module first (HF's ``partial(forward, layer)``), else
    none."""
    if isinstance(function, functools.partial):
        function = function.args[0] if function.args else function.func
    owner = getattr(function, "__self__", function)
    return list(owner.parameters()) if isinstance(owner, torch.nn.Module) else []


def _rng_state():
    import dtorch

    return dtorch.get_rng_state(), torch.get_rng_state()


@contextlib.contextmanager
def _rng(state):
    """dtorch's seed stream and torch's CPU generator as they were at the forward, while the
    region runs again; then as they are now."""
    if state is None:
        yield
        return
    import dtorch

    now = _rng_state()
    dtorch.set_rng_state(state[0])
    torch.set_rng_state(state[1])
    try:
        yield
    finally:
        dtorch.set_rng_state(now[0])
        torch.set_rng_state(now[1])
