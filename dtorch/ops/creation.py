"""Creation operators: every factory takes ``dtype=, device_mesh=, placements=`` and makes each
device's block of the tensor where it lives.

Host kernels build the block of the Replicate value that the device holds (``ctx.region``) there
(a random or a client's value: on the CPU, then moved), then
``ctx.partition`` turns it into the device's contribution on Partial mesh dims (device 0 keeps the
value, the others hold the reduction's identity), so every factory works with every placement.
Random factories draw the whole tensor from one seeded generator on each device and keep their
block: values are torch's exactly, for a given seed or a given ``torch.Generator``.

The public factories are the entries' fronts (end of the module): they take torch's arguments and
DTorch's (``device=``, a string, ``torch.device`` or mesh; ``graph=``), and resolve the defaults
of the graph (``device_mesh_guard``, ``dtype_guard``) before the call is keyed, so a changed
default is an argument like any other.

>>> import dtorch, torch
>>> mesh = dtorch.DeviceMesh("cpu", [0, 1])
>>> g = torch.Generator().manual_seed(0)
>>> x = dtorch.rand((4, 3), generator=g, device_mesh=mesh, placements=[dtorch.Shard(0)])
>>> torch.equal(x.to_torch(), torch.rand((4, 3), generator=torch.Generator().manual_seed(0)))
True
"""

from __future__ import annotations

import math
import operator
import random

import torch

from .. import current
from .. import protocol as P
from ..blocks import block_of, block_of_whole
from ..mesh import DeviceMesh
from ..placement import as_int, is_int, normalize_placements
from ..tensor import Tensor
from .registry import NO_VALUE_KERNEL, OpDef, issue, lookup, register
from .rules import Placed

# the layout args of an entry (the mesh and placements travel in the output spec, not as static
# args: protocol.CLIENT_ONLY); the fronts take DTorch's ``device=`` and ``graph=`` too
LAYOUT = "dtype=None, device_mesh=None, placements=None"


def creation_rule(call) -> Placed:
    shape = call.outs[0][0]
    return Placed((normalize_placements(call.static.get("placements"), len(call.mesh.shape),
                                        len(shape)),))


SEQUENCES = (tuple, list, torch.Size)


def size_arg(size) -> tuple:
    """``f(2, 3)``, ``f((2, 3))`` and ``f([2, 3])`` all mean the size (2, 3). The entries stay
    as given, for torch's metadata rule to check (2.5 is an error, not a 2)."""
    if len(size) == 1 and isinstance(size[0], SEQUENCES):
        size = size[0]
    return tuple(size)


# the Python types torch reads as dtypes (``zeros(3, dtype=float)`` is float64)
PY_DTYPES = {bool: torch.bool, int: torch.int64, float: torch.float64, complex: torch.complex128}


def check_dtype(op: str, dtype) -> None:
    """torch's TypeError for a dtype that is not one (a Python type such as ``float`` is one)."""
    if not (dtype is None or isinstance(dtype, torch.dtype)
            or isinstance(dtype, type) and dtype in PY_DTYPES):
        raise TypeError(f"{op}(): argument 'dtype' must be torch.dtype, not "
                        f"{type(dtype).__name__}")


def check_size(op: str, sizes: tuple, keyword=None, dtype=None) -> tuple:
    """A factory's size as a tuple of ints, with torch's checks and words: ``TypeError`` for
    what is not a tuple of ints (or a ``dtype`` that is no dtype), then ``RuntimeError`` for a
    negative size. ``sizes`` are the positional sizes (``zeros(2, 3)``, or one sequence:
    ``zeros((2, 3))``), ``keyword`` the size given as one argument (``size=``), which must be a
    sequence; as in torch, not both.

    >>> check_size("zeros", (2, 3)), check_size("zeros", ([2, 3],))
    ((2, 3), (2, 3))
    >>> check_size("zeros", (2.5,))
    Traceback (most recent call last):
    TypeError: zeros(): argument 'size' (position 1) must be tuple of ints, not float
    """
    arg = f"{op}(): argument 'size'"
    if not sizes and keyword is None:
        raise TypeError(f'{op}() missing 1 required positional arguments: "size"')
    if keyword is not None:
        if sizes:
            raise TypeError(f"{op}() got multiple values for argument 'size'")
        if not isinstance(keyword, SEQUENCES):
            raise TypeError(f"{arg} must be tuple of ints, not {type(keyword).__name__}")
        sizes = tuple(keyword)
    elif len(sizes) == 1 and isinstance(sizes[0], SEQUENCES):
        sizes = tuple(sizes[0])
    elif len(sizes) == 1 and not is_int(sizes[0]):
        raise TypeError(f"{arg} (position 1) must be tuple of ints, not {type(sizes[0]).__name__}")
    for pos, n in enumerate(sizes):
        # as torch, which reads a bool after the first entry as 0 or 1 (not as the first: that
        # one picks the overload)
        if not (is_int(n) or pos and isinstance(n, bool)):
            raise TypeError(f"{arg} (position 1) must be tuple of ints, but found element of "
                            f"type {type(n).__name__} at pos {pos}")
    sizes = tuple(operator.index(n) for n in sizes)
    check_dtype(op, dtype)  # torch parses every argument before it looks at a value
    negative = [n for n in sizes if n < 0]
    if negative:
        raise RuntimeError(f"Trying to create tensor with negative dimension {negative[0]}: "
                           f"{list(sizes)}")
    return sizes


def _block(ctx, full: torch.Tensor) -> torch.Tensor:
    """This device's block of a full tensor made for it (its pieces, for a sub-split dim): a
    copy of a part, so that the whole goes."""
    block = block_of(full, ctx.out_specs[0].local_pieces(ctx.out_coord))
    return block if block is full else block.clone()


def factory(make):
    """Kernel for factories whose blocks are made directly: ``make(shape, dtype, device)``."""
    return lambda ctx, *, size, dtype: ctx.partition(make(
        ctx.out_local_shape, dtype=dtype, device=ctx.device.torch_device))


def _full_kernel(ctx, *, size, fill_value, dtype):
    return ctx.partition(torch.full(ctx.out_local_shape, fill_value, dtype=dtype,
                                    device=ctx.device.torch_device))


def _generator(seed) -> torch.Generator:
    g = torch.Generator()
    if isinstance(seed, bytes):  # the state of the user's torch.Generator
        g.set_state(torch.frombuffer(bytearray(seed), dtype=torch.uint8))
    else:
        g.manual_seed(seed)
    return g


def random_kernel(draw):
    """Kernel for random factories: the whole tensor from the seed, this device's block of it
    (``blocks.block_of_whole``: not kept), drawn on the CPU (a CPU generator's) and moved."""

    def kernel(ctx, seed, **static):
        spec, g = ctx.out_specs[0], _generator(seed)
        return ctx.partition(block_of_whole(
            spec.shape, out_dtype(ctx), spec.local_pieces(ctx.out_coord),
            lambda whole: draw(generator=g, out=whole, **static)).to(ctx.device.torch_device))

    return kernel


def _arange(ctx, *, start, end, step, dtype):
    return ctx.partition(_block(ctx, torch.arange(start, end, step, dtype=dtype,
                                                  device=ctx.device.torch_device)))


def _from_data(ctx, data, *, size, dtype):
    device = ctx.device.torch_device
    if not data:  # a tensor with no elements
        return ctx.partition(torch.empty(ctx.out_local_shape, dtype=dtype, device=device))
    full = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(size)
    return ctx.partition(_block(ctx, full).to(device))


def _meta_like(fn):
    return lambda *operands, size, dtype, **_: fn(size, dtype=dtype, device="meta")


def checked(probe, meta):
    """``meta``, then ``probe``: torch's CPU kernel on a tiny input, for the checks meta kernels
    skip (the dtype is supported, the values fit it). Without it ``arange(5, dtype=torch.bool)``
    or ``randint(5, 3, (2,))`` would pass here and fail on every device; with it they raise at
    the user's line, in torch's words and types. torch parses the arguments first (the meta's
    TypeError is torch's); where the meta kernel refuses a value, the CPU kernel may refuse it
    with another type (``randn`` of int64), so the probe speaks first. It runs on a cache miss
    only, like every metadata rule."""

    def rule(*operands, **static):
        try:
            out = meta(*operands, **static)
        except TypeError:
            raise
        except Exception:  # noqa: BLE001 - the CPU kernel's own error, where it has one
            probe(**static)
            raise
        probe(**static)
        return out

    return rule


# the probes of ``checked``, by the static args of each entry
PROBES = {
    "full": lambda size, fill_value, dtype: torch.full((), fill_value, dtype=dtype),
    # (one element, or none where the tensor has none: torch draws nothing then, nor checks)
    "rand": lambda size, dtype: torch.rand(min(math.prod(size), 1), dtype=dtype),
    "randn": lambda size, dtype: torch.randn(min(math.prod(size), 1), dtype=dtype),
    "randint": lambda low, high, size, dtype: torch.randint(low, high, (0,), dtype=dtype),
    "arange": lambda start, end, step, dtype: torch.arange(0, 1, dtype=dtype),
    # (at most 2 steps: one is fine for every dtype, but a bool linspace of 2 is not)
    "linspace": lambda start, end, steps, dtype: torch.linspace(start, end, min(steps, 2),
                                                                dtype=dtype),
    "logspace": lambda start, end, steps, base, dtype: torch.logspace(start, end, min(steps, 2),
                                                                      base, dtype=dtype),
    # the dtype is supported and holds the largest value (randperm's n is an int by now)
    "randperm": lambda n, dtype: (torch.randperm(0, dtype=dtype),
                                  torch.full((), max(n - 1, 0), dtype=dtype)),
}


# -- fronts: the public factories -----------------------------------------------------------------

_seeds = random.Random(0)


def manual_seed(seed: int) -> None:
    """Seeds dtorch's default generator (used by random factories given no ``generator``)."""
    _seeds.seed(seed)


def fresh_seed() -> int:
    """A seed operand from dtorch's default generator (random factories, dropout)."""
    return _seeds.getrandbits(63)


def layout(name: str, dtype, device, device_mesh, graph, floating: bool = True) -> tuple:
    """(dtype, mesh) of a factory call: ``device`` (a mesh, or anything ``DeviceMesh(...)``
    takes: ``"cpu"``, ``torch.device("cuda:1")``) or ``device_mesh``, else the graph's default
    mesh; the graph's default dtype where torch would take its default float dtype
    (``floating``). Resolved before dispatch, so they are part of the call's key."""
    if device is not None:
        if device_mesh is not None:
            raise ValueError(f"dtorch.{name}: give device or device_mesh, not both")
        device_mesh = device if isinstance(device, DeviceMesh) else DeviceMesh(device)
    elif device_mesh is not None and not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"dtorch.{name}: device_mesh must be a dtorch.DeviceMesh, got "
                        f"{device_mesh!r} (a device such as 'cpu:1' goes in device=)")
    if device_mesh is None or dtype is None and floating:
        g = current.graph_or_current(graph, name)
        device_mesh = g.default_device_mesh if device_mesh is None else device_mesh
        if dtype is None and floating and g.default_dtype is not torch.float32:
            dtype = g.default_dtype
    return dtype, device_mesh


def with_grad(t, requires_grad: bool):
    """A factory's result, a leaf that requires grad when asked (``requires_grad=``)."""
    if requires_grad:
        t.requires_grad_(True)
    return t


# factories whose values are arbitrary or random: what parameters are made with, so inside
# ``dtorch.nn.init_empty()`` they make tensors without values (``ops/random_fill.py``)
DEFERRED = frozenset(("empty", "rand", "randn"))


def on_graph(graph, name: str, operands: tuple, static: tuple):
    """Issues the factory ``name`` on ``graph`` when one is given (its result belongs to it),
    else on the current graph; a ``DEFERRED`` one inside ``init_empty`` as ``uninitialized``."""
    if name in DEFERRED and current.deferring():
        name, operands = NO_VALUE_KERNEL, ()
    if graph is None:
        return issue(name, operands, static)
    with current.graph_or_current(graph, name):
        return issue(name, operands, static)


def _constant(name: str):
    def factory(*sizes, size=None, dtype=None, device=None, device_mesh=None, placements=None,
                graph=None, requires_grad=False):
        shape = check_size(name, sizes, size, dtype)
        dtype, mesh = layout(name, dtype, device, device_mesh, graph)
        made = on_graph(graph, name, (), (shape, dtype, mesh, placements))
        return with_grad(made, requires_grad)

    factory.__name__ = factory.__qualname__ = name
    factory.__doc__ = f"``torch.{name}``: each device makes its block; ``size=`` works too."
    return factory


def full(size, fill_value, *, dtype=None, device=None, device_mesh=None, placements=None,
         graph=None, requires_grad=False):
    """``torch.full``: the dtype of ``fill_value`` unless given (a float: the default dtype)."""
    floating = isinstance(fill_value, float)
    dtype, mesh = layout("full", dtype, device, device_mesh, graph, floating)
    made = on_graph(graph, "full", (), (size, fill_value, dtype, mesh, placements))
    return with_grad(made, requires_grad)


def _seed(name, generator, draw, size, dtype, **kw):
    """The seed operand: a fresh 63-bit seed, or the user's generator state, which is advanced
    here exactly as torch would (by drawing the same tensor), so later draws match torch too.
    (Fronts check the layout first: a call that fails must leave the generator as it was.)"""
    if generator is None:
        return fresh_seed()
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"{name}(): argument 'generator' must be torch.Generator, not "
                        f"{type(generator).__name__}")
    state = bytes(P.buffer_of(generator.get_state()))
    draw(size, generator=generator, dtype=dtype, **kw)
    return state


def _random(name: str, draw):
    def factory(*sizes, size=None, generator=None, dtype=None, device=None, device_mesh=None,
                placements=None, graph=None, requires_grad=False):
        size = check_size(name, sizes, size, dtype)
        dtype, mesh = layout(name, dtype, device, device_mesh, graph)
        normalize_placements(placements, mesh.ndim, len(size))  # before the draw
        seed = _seed(name, generator, draw, size, dtype)
        made = on_graph(graph, name, (seed,), (size, dtype, mesh, placements))
        return with_grad(made, requires_grad)

    factory.__name__ = factory.__qualname__ = name
    factory.__doc__ = (f"``torch.{name}``; equal to torch's values for the same "
                       f"``torch.Generator``.")
    return factory


def randint(low, high=None, size=None, *, generator=None, dtype=torch.int64, device=None,
            device_mesh=None, placements=None, graph=None):
    """``randint(high, size)``, ``randint(high, size=size)`` or ``randint(low, high, size)``,
    as torch."""
    if size is None:
        low, high, size = 0, low, high
    elif high is None:
        low, high = 0, low
    low = as_int(low, "randint(): argument 'low'")
    high = as_int(high, "randint(): argument 'high'")
    size = check_size("randint", (), size, dtype)
    dtype, mesh = layout("randint", dtype, device, device_mesh, graph, floating=False)
    normalize_placements(placements, mesh.ndim, len(size))
    seed = _seed("randint", generator, lambda sz, **kw: torch.randint(low, high, sz, **kw), size,
                 dtype)
    return on_graph(graph, "randint", (seed,), (low, high, size, dtype, mesh, placements))


def randperm(n, *, generator=None, dtype=torch.int64, device=None, device_mesh=None,
             placements=None, graph=None):
    """A random permutation of ``range(n)``, as ``torch.randperm``; equal to torch's for the
    same generator."""
    n = as_int(n, "randperm(): argument 'n' (position 1)")
    check_dtype("randperm", dtype)
    dtype, mesh = layout("randperm", dtype, device, device_mesh, graph, floating=False)
    normalize_placements(placements, mesh.ndim, 1)
    seed = _seed("randperm", generator, torch.randperm, n, dtype)
    return on_graph(graph, "randperm", (seed,), (n, dtype, mesh, placements))


def arange(start, end=None, step=1, *, dtype=None, device=None, device_mesh=None,
           placements=None, graph=None, requires_grad=False):
    """``arange(end)`` or ``arange(start, end, step)``, as torch (int64 for ints; a float bound
    or step: the default dtype). ``step=None`` is 1, as in DTorch."""
    if end is None:
        if step not in (1, None):
            raise ValueError("arange: end is None, but step has a value; give start and end")
        start, end = 0, start
    step = 1 if step is None else step
    floating = any(isinstance(v, float) for v in (start, end, step))
    dtype, mesh = layout("arange", dtype, device, device_mesh, graph, floating)
    made = on_graph(graph, "arange", (), (start, end, step, dtype, mesh, placements))
    return with_grad(made, requires_grad)


def linspace(start, end, steps, *, dtype=None, device=None, device_mesh=None, placements=None,
             graph=None, requires_grad=False):
    """``torch.linspace``: the whole range on each device, which keeps its block."""
    dtype, mesh = layout("linspace", dtype, device, device_mesh, graph)
    made = on_graph(graph, "linspace", (), (start, end, steps, dtype, mesh, placements))
    return with_grad(made, requires_grad)


def logspace(start, end, steps, base=10.0, *, dtype=None, device=None, device_mesh=None,
             placements=None, graph=None, requires_grad=False):
    """``torch.logspace``: the whole range on each device, which keeps its block."""
    dtype, mesh = layout("logspace", dtype, device, device_mesh, graph)
    made = on_graph(graph, "logspace", (), (start, end, steps, base, dtype, mesh, placements))
    return with_grad(made, requires_grad)


def eye(n, m=None, *, dtype=None, device=None, device_mesh=None, placements=None, graph=None,
        requires_grad=False):
    """``torch.eye``: each device makes its block of the identity."""
    dtype, mesh = layout("eye", dtype, device, device_mesh, graph)
    made = on_graph(graph, "eye", (), (n, m, dtype, mesh, placements))
    return with_grad(made, requires_grad)


def from_torch(tensor: torch.Tensor, device_mesh=None, placements=None, *, device=None,
               graph=None, requires_grad=False):
    """A distributed tensor whose logical value is ``tensor`` (each device keeps its block;
    on a Partial mesh dim device 0 holds the value and the others the reduction's identity).

    >>> import dtorch, torch
    >>> t = torch.arange(6.).reshape(2, 3)
    >>> mesh = dtorch.DeviceMesh("cpu", [0, 1])
    >>> torch.equal(dtorch.from_torch(t, mesh, [dtorch.Partial()]).to_torch(), t)
    True
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"from_torch expects a torch.Tensor, got {type(tensor).__name__}")
    _, mesh = layout("from_torch", tensor.dtype, device, device_mesh, graph, floating=False)
    data = tensor.detach().to("cpu").contiguous()
    raw = bytes(P.buffer_of(data))
    return with_grad(on_graph(graph, "from_data", (raw,),
                    (tuple(data.shape), data.dtype, mesh, placements)), requires_grad)


def tensor(data, *, dtype=None, device=None, device_mesh=None, placements=None, graph=None,
           requires_grad=False):
    """A tensor whose value is ``data``: a torch tensor, a NumPy array, nested lists or
    numbers (``torch.tensor``'s rules, in the graph's default dtype for floats), or a dtorch
    tensor (then an alias of its blocks, moved to ``device_mesh``/``placements`` when given,
    on ``graph`` when given, else on the data's graph)."""
    if isinstance(data, Tensor):  # cast and moved first, so a layout refused issues nothing
        with torch.no_grad():
            out = data if dtype is None else data.to(dtype)
            if device is not None or device_mesh is not None:
                _, mesh = layout("tensor", None, device, device_mesh, graph, floating=False)
                out = out.redistribute(mesh, placements)
            elif placements is not None:
                out = out.redistribute(placements=placements)
            out = out.detach()
        if graph is not None:  # the alias belongs to ``graph``: operators on it run there
            out._graph = current.graph_or_current(graph, "tensor")
        return with_grad(out, requires_grad)
    if not isinstance(data, torch.Tensor):
        if dtype is None:
            data = torch.tensor(data)
            if data.dtype == torch.float32:  # torch's default float dtype: the graph's instead
                dtype, _ = layout("tensor", None, device, device_mesh, graph)
        data = torch.as_tensor(data, dtype=dtype)
    elif dtype is not None:
        data = data.to(dtype)
    return from_torch(data, device_mesh, placements, device=device, graph=graph,
                      requires_grad=requires_grad)


def from_numpy(array):
    """``dtorch.Tensor(torch.from_numpy(array))``: a Replicate tensor on the default mesh."""
    return from_torch(torch.from_numpy(array))


def _like(name, input, dtype, device, device_mesh, placements, graph):
    """A ``*_like`` factory's (size, dtype, mesh, placements, graph): the input's, unless given
    (a new mesh drops the input's placements)."""
    if not isinstance(input, Tensor):
        raise TypeError(f"{name}(): argument 'input' must be Tensor, not "
                        f"{type(input).__name__}")
    spec = input._spec
    moved = device is not None or device_mesh is not None
    mesh = spec.mesh if not moved else layout(name, None, device, device_mesh, None, False)[1]
    return (tuple(spec.shape), input.dtype if dtype is None else dtype, mesh,
            spec.placements if placements is None and not moved else placements,
            input._graph if graph is None else graph)


def _constant_like(name: str):
    def factory(input, *, dtype=None, device=None, device_mesh=None, placements=None,
                graph=None, requires_grad=False):
        *made, graph = _like(name, input, dtype, device, device_mesh, placements, graph)
        return with_grad(on_graph(graph, name[:-len("_like")], (), tuple(made)), requires_grad)

    factory.__name__ = factory.__qualname__ = name
    factory.__doc__ = f"``torch.{name}``: the input's size, dtype and layout unless given."
    return factory


def full_like(input, fill_value, *, dtype=None, device=None, device_mesh=None, placements=None,
              graph=None, requires_grad=False):
    size, dtype, mesh, placements, graph = _like("full_like", input, dtype, device, device_mesh,
                                                 placements, graph)
    made = on_graph(graph, "full", (), (size, fill_value, dtype, mesh, placements))
    return with_grad(made, requires_grad)


def _random_like(name: str):
    def factory(input, *, generator=None, dtype=None, device=None, device_mesh=None,
                placements=None, graph=None, requires_grad=False):
        size, dtype, mesh, placements, graph = _like(name, input, dtype, device, device_mesh,
                                                     placements, graph)
        return lookup(name[:-len("_like")]).front(size, generator=generator, dtype=dtype,
                                                  device_mesh=mesh, placements=placements,
                                                  graph=graph, requires_grad=requires_grad)

    factory.__name__ = factory.__qualname__ = name
    factory.__doc__ = f"``torch.{name}``: the input's size, dtype and layout unless given."
    return factory


def randint_like(input, low=0, high=None, *, generator=None, dtype=None, device=None,
                 device_mesh=None, placements=None, graph=None):
    """``randint_like(input, high)`` or ``randint_like(input, low, high)``, as torch (the
    input's dtype unless ``dtype=``)."""
    if high is None:
        low, high = 0, low
    size, dtype, mesh, placements, graph = _like("randint_like", input, dtype, device,
                                                 device_mesh, placements, graph)
    return randint(low, high, size, generator=generator, dtype=dtype, device_mesh=mesh,
                   placements=placements, graph=graph)


# -- the entries ----------------------------------------------------------------------------------
# their fronts (above) also take the size as ``size=``, as torch's do
for _name in ("zeros", "ones", "empty"):
    register(OpDef(_name, f"{_name}(*size, {LAYOUT})", factory(getattr(torch, _name)),
                   creation_rule, meta=_meta_like(getattr(torch, _name)), uses_context=True,
                   front=_constant(_name)))
register(OpDef("full", f"full(size, fill_value, *, {LAYOUT})", _full_kernel, creation_rule,
               meta=checked(PROBES["full"], lambda size, fill_value, dtype: torch.full(
                   size, fill_value, dtype=dtype, device="meta")),
               uses_context=True, front=full))
# (the meta kernels of rand and randn refuse an integer dtype even for no elements, where torch
# draws nothing and checks nothing: the probe makes the checks, the meta gives the shape)
for _name in ("rand", "randn"):
    register(OpDef(_name, f"{_name}(seed: Tensor, *size, {LAYOUT})",
                   random_kernel(getattr(torch, _name)), creation_rule,
                   meta=checked(PROBES[_name], _meta_like(torch.empty)),
                   uses_context=True, front=_random(_name, getattr(torch, _name))))
register(OpDef("randint", f"randint(seed: Tensor, low, high, size, *, {LAYOUT})",
               random_kernel(torch.randint), creation_rule,
               meta=checked(PROBES["randint"], lambda seed, low, high, size, dtype: torch.randint(
                   low, high, size, dtype=dtype, device="meta")),
               uses_context=True, front=randint))
register(OpDef("arange", f"arange(start, end, step, *, {LAYOUT})", _arange, creation_rule,
               meta=checked(PROBES["arange"], lambda start, end, step, dtype: torch.arange(
                   start, end, step, dtype=dtype, device="meta")),
               uses_context=True, front=arange))
register(OpDef("from_data", f"from_data(data: Tensor, size, *, {LAYOUT})", _from_data,
               creation_rule,
               meta=lambda data, size, dtype: torch.empty(size, dtype=dtype, device="meta"),
               uses_context=True, function=False))
# composites: fronts made of the entries above
_FRONT_LAYOUT = "dtype=None, device=None, device_mesh=None, placements=None, graph=None"
register(OpDef("from_torch", "from_torch(tensor, device_mesh=None, placements=None, *, "
                             "device=None, graph=None)", None, None, front=from_torch))
register(OpDef("tensor", f"tensor(data, *, {_FRONT_LAYOUT})", None, None, front=tensor))
register(OpDef("from_numpy", "from_numpy(array)", None, None, front=from_numpy))
for _name in ("zeros_like", "ones_like", "empty_like"):
    register(OpDef(_name, f"{_name}(input: Tensor, *, {_FRONT_LAYOUT})", None, None,
                   front=_constant_like(_name)))
register(OpDef("full_like", f"full_like(input: Tensor, fill_value, *, {_FRONT_LAYOUT})", None,
               None, front=full_like))
for _name in ("rand_like", "randn_like"):
    register(OpDef(_name, f"{_name}(input: Tensor, *, generator=None, {_FRONT_LAYOUT})", None,
                   None, front=_random_like(_name)))
register(OpDef("randint_like", f"randint_like(input: Tensor, low=0, high=None, *, "
                               f"generator=None, {_FRONT_LAYOUT})", None, None,
               front=randint_like))


# -- identity and spaced values -------------------------------------------------------------------


def out_dtype(ctx) -> torch.dtype:
    """The result's dtype as the client resolved it (a host's default dtype may differ)."""
    return getattr(torch, ctx.out_specs[0].dtype)


def _eye(ctx, *, n, m, dtype):
    """The block at rows r0.., cols c0.. of the identity: ones where row == col."""
    (rows, cols), (r0, c0) = ctx.out_local_shape, ctx.out_offsets
    device = ctx.device.torch_device
    ones = torch.arange(r0, r0 + rows, device=device).unsqueeze(1) == torch.arange(
        c0, c0 + cols, device=device)
    return ctx.partition(ones.to(out_dtype(ctx)))


def _spaced(fn):
    """linspace/logspace: the whole range (torch's own rounding), this device's block of it."""
    return lambda ctx, *, dtype, **static: ctx.partition(
        _block(ctx, fn(**static, dtype=out_dtype(ctx), device=ctx.device.torch_device)))


register(OpDef("eye", f"eye(n, m=None, *, {LAYOUT})", _eye, creation_rule,
               meta=lambda n, m=None, dtype=None: torch.eye(n, n if m is None else m,
                                                            dtype=dtype, device="meta"),
               uses_context=True, front=eye))
register(OpDef("linspace", f"linspace(start, end, steps, *, {LAYOUT})", _spaced(torch.linspace),
               creation_rule,
               meta=checked(PROBES["linspace"], lambda start, end, steps, dtype: torch.linspace(
                   start, end, steps, dtype=dtype, device="meta")),
               uses_context=True, front=linspace))
register(OpDef("logspace", f"logspace(start, end, steps, base=10.0, *, {LAYOUT})",
               _spaced(torch.logspace), creation_rule,
               meta=checked(PROBES["logspace"],
                            lambda start, end, steps, base, dtype: torch.logspace(
                                start, end, steps, base, dtype=dtype, device="meta")),
               uses_context=True, front=logspace))
register(OpDef("randperm", f"randperm(seed: Tensor, n, *, {LAYOUT})",
               random_kernel(torch.randperm), creation_rule,
               meta=checked(PROBES["randperm"], lambda seed, n, dtype: torch.randperm(
                   n, dtype=dtype, device="meta")),
               uses_context=True, front=randperm))
