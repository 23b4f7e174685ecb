"""Random fills in place, and tensors made without values: how parameters are initialized.

``uniform_`` and ``normal_`` are torch's in-place draws (``Tensor.uniform_(from, to, *,
generator)``, ``Tensor.normal_(mean, std, *, generator)``), which ``torch.nn.init``'s functions
(``dtorch.nn.init``) and every module's ``reset_parameters`` call. Each device draws the whole
tensor from the call's seed and keeps its block (``blocks.block_of_whole``, which does not keep
the whole), so the values are torch's for the same ``torch.Generator`` on every layout, and a
parameter is initialized with no temporary of its size left beside it. They write every element
and read none (``OVERWRITES``).

**Deferred initialization.** Inside ``dtorch.nn.init_empty()`` (or torch's ``with
torch.device("meta"):``) the factories of arbitrary or random values (``creation.DEFERRED``:
``empty``, ``rand``, ``randn``) issue ``uninitialized`` instead: a tensor with its shape, dtype
and layout and no value. Its kernel allocates nothing and raises ``NoValue``, so its blocks carry
a failure that no one is told of; an operator on it gives the same, allocating nothing either;
reading it raises ``NO_VALUE``. The fills draw nothing inside the context (nor do
``dtorch.nn.init``'s functions, which call them), so a model's own initialization
(``reset_parameters``) leaves its parameters without values, in no memory. A
full write gives a tensor its value, in its own layout: ``load_checkpoint``, ``load_state_dict``,
``copy_``, ``fill_``, ``zero_``, or a fill outside the context. Factories of computed values
(``zeros``, ``ones``, ``full``, ``arange``, ``from_torch``) still make them: buffers such as a
rotary table are computed as usual (as accelerate's ``init_empty_weights`` keeps buffers).

>>> import dtorch, torch
>>> g = torch.Generator().manual_seed(0)
>>> mesh = dtorch.DeviceMesh("cpu", [0, 1])
>>> w = dtorch.empty((4, 3), device_mesh=mesh, placements=[dtorch.Shard(0)])
>>> torch.equal(w.uniform_(-1, 1, generator=g).to_torch(),
...             torch.empty(4, 3).uniform_(-1, 1, generator=torch.Generator().manual_seed(0)))
True
"""

from __future__ import annotations

import contextlib

import torch

from .. import current
from ..blocks import block_of_whole
from ..tensor import Tensor
from .conversion import same_layout
from .creation import LAYOUT, _generator, _meta_like, _seed, _seeds, creation_rule, fresh_seed
from .registry import INPLACE, NO_VALUE_KERNEL, OVERWRITES, NoValue, OpDef, issue, register

NO_VALUE = ("this tensor has no value: it was made inside dtorch.nn.init_empty() (or torch's "
            "meta device), which allocates and draws nothing. Give it its values outside that "
            "context: dtorch.load_checkpoint, load_state_dict, copy_, or an init function "
            "(dtorch.nn.init, the module's reset_parameters())")


deferring = current.deferring  # whether the calling thread is inside ``init_empty``


@contextlib.contextmanager
def init_empty():
    """Builds models without allocating or drawing their parameters (see the module doc): the
    parameters get their layouts and no values, which ``load_checkpoint`` (or an init) gives
    them later, each in its own layout. Per thread; contexts nest."""
    state = current.per_thread
    state.deferring += 1
    try:
        yield
    finally:
        state.deferring -= 1


def get_rng_state():
    """The state of dtorch's seed stream (``dtorch.manual_seed``), which gives the seeds of
    dropout and of random draws without a ``generator``: ``set_rng_state`` restores it, so that
    the same calls draw the same values again (activation checkpointing's recompute)."""
    return _seeds.getstate()


def set_rng_state(state) -> None:
    """Restores a state ``get_rng_state`` returned."""
    _seeds.setstate(state)


def _uninitialized(ctx, *, size, dtype):
    raise NoValue(NO_VALUE)


# a deferred factory's stand-in: ``creation.on_graph`` issues it with the factory's static args
register(OpDef(NO_VALUE_KERNEL, f"{NO_VALUE_KERNEL}(*size, {LAYOUT})", _uninitialized,
               creation_rule, meta=_meta_like(torch.empty), uses_context=True, function=False))


# -- the fills ------------------------------------------------------------------------------------


def _uniform(t, a, b, generator):
    return t.uniform_(a, b, generator=generator)


def _normal(t, mean, std, generator):
    return t.normal_(mean, std, generator=generator)


def _fill_kernel(draw):
    """This device's block of the whole tensor ``draw`` fills from the seed, written in place."""

    def kernel(ctx, input, seed, **args):
        if not ctx.holds_value():  # a Partial sum's other blocks: zeros, nothing to draw
            return input.zero_()
        a, b = args.values()
        spec, g = ctx.out_specs[0], _generator(seed)
        return block_of_whole(spec.shape, input.dtype, spec.local_pieces(ctx.out_coord),
                              lambda whole: draw(whole, a, b, g), out=input)

    return kernel


def _fill_front(name: str, draw, first: str, second: str, defaults: tuple):
    def fill(input, a=defaults[0], b=defaults[1], *, generator=None):
        if not isinstance(input, Tensor):
            raise TypeError(f"{name}(): argument 'input' must be Tensor, not "
                            f"{type(input).__name__}")
        draw(torch.empty(1, dtype=input.dtype), a, b, None)  # torch's checks, before any draw
        if deferring():
            return input
        size, dtype = tuple(input.shape), input.dtype
        seed = fresh_seed() if generator is None else _seed(
            name, generator, lambda size, generator, dtype: draw(
                torch.empty(size, dtype=dtype), a, b, generator), size, dtype)
        return issue(name, (input, seed), (a, b))

    fill.__name__ = fill.__qualname__ = name
    fill.__doc__ = (f"torch's ``Tensor.{name}({first}={defaults[0]}, {second}={defaults[1]}, *, "
                    f"generator=None)``, in every layout: torch's values for the same "
                    f"``torch.Generator``. Nothing is drawn inside ``init_empty``.")
    return fill


for _name, _draw, _args, _defaults in (("uniform_", _uniform, ("from_", "to"), (0.0, 1.0)),
                                       ("normal_", _normal, ("mean", "std"), (0.0, 1.0))):
    register(OpDef(_name, f"{_name}(input: Tensor, seed: Tensor, {_args[0]}, {_args[1]})",
                   _fill_kernel(_draw), same_layout, meta=lambda input, seed, **_: input,
                   function=False, flags=INPLACE | OVERWRITES, uses_context=True,
                   methods=(_name,), front=_fill_front(_name, _draw, *_args, _defaults)))
