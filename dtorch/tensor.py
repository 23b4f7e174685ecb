"""dtorch.Tensor: a symbol for a distributed tensor, and nothing else.

A Tensor holds only metadata (an interned TensorSpec: global shape, dtype, mesh, placements) and
an integer id; its value lives on the hosts. This module knows nothing of the runtime: the
client's installer (``client/frontend.py``) adds the methods that talk to it (operators such as
``x.sum()`` and ``x + y`` from the registry; ``to_torch_async``, ``redistribute`` and the release
in ``__del__`` from the client), so the hosts and the controller can use the types here without
the client role.

The constructor is DTorch's: ``dtorch.Tensor(data, device_mesh=None, placements=None)`` lays out
a torch tensor, a NumPy array, nested lists or numbers, or another dtorch tensor (then an alias
of its blocks, moved if a layout is given). The typed classes (``dtorch.FloatTensor`` ...) check
the dtype in ``isinstance``.

>>> import dtorch, torch
>>> mesh = dtorch.DeviceMesh("cpu", [0, 1])
>>> x = dtorch.Tensor(torch.ones(4, 2), mesh, [dtorch.Shard(0)])
>>> (x * 3).sum().item(), isinstance(x, dtorch.FloatTensor)
(24.0, True)
"""

from __future__ import annotations

import torch

from .placement import get_placements_from_dict, placements_str

# leaf id -> ``settle(leaf, read)`` for a gradient a backward holds unreduced while the leaf's
# sync is off (``autograd/grad_sync.py``): a read of ``.grad`` reduces it in, an assignment
# drops it
DEFERRED_GRADS: dict = {}
DTYPES = {str(d)[6:]: d for d in vars(torch).values() if isinstance(d, torch.dtype)}


class Tensor:
    __slots__ = ("_id", "_spec", "_graph", "_name", "_requires_grad", "_node", "_grad",
                 "_grad_placements", "__weakref__")
    # NumPy's operators defer to ours (``np.float32(2) + x`` calls ``x.__radd__``), as for torch
    __array_ufunc__ = None

    def __new__(cls, *args, device_mesh=None, placements=None, device=None, graph=None,
                dtype=None):
        """``Tensor(data, device_mesh=None, placements=None)``: a tensor whose value is ``data``
        (``dtorch.tensor``'s rules), laid out on ``device_mesh`` (default: the graph's) with
        ``placements`` (default: Replicate). As torch's legacy constructor, ``Tensor()`` is an
        empty tensor, and ``Tensor(2, 3)`` or ``Tensor(torch.Size([2, 3]))`` one of that size
        whose values are not set (``dtorch.empty``)."""
        from .ops.registry import lookup  # (ops import this module, for the type)

        layout = {"device": device, "device_mesh": device_mesh, "placements": placements,
                  "graph": graph, "dtype": _TYPED_DTYPES.get(cls, dtype)}
        if all(type(a) is int for a in args) or len(args) == 1 and isinstance(args[0],
                                                                             torch.Size):
            size = tuple(args[0]) if args and isinstance(args[0], torch.Size) else args or (0,)
            return lookup("empty").front(size, **layout)
        data, *where = args
        if len(where) > 2:
            raise TypeError(f"Tensor() takes data, device_mesh and placements, or sizes as ints; "
                            f"got {len(args)} positional arguments")
        for name, value in zip(("device_mesh", "placements"), where):
            if layout[name] is not None:
                raise TypeError(f"Tensor() got multiple values for argument '{name}'")
            layout[name] = value
        return lookup("tensor").front(data, **layout)

    # -- metadata -------------------------------------------------------------------------------
    def set_name(self, name: str) -> None:
        """A name for messages and traces (DTorch's ``set_name``)."""
        self._name = str(name)

    def get_name(self) -> str:
        return getattr(self, "_name", "")

    # -- metadata -------------------------------------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._spec.shape)

    def size(self, dim: int | None = None):
        return torch.Size(self._spec.shape) if dim is None else self._spec.shape[dim]

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self._spec.dtype]

    @property
    def device_mesh(self):
        return self._spec.mesh

    @property
    def graph(self):
        """The ``dtorch.Graph`` this tensor belongs to: where it was made (a factory's
        ``graph=``, else the current graph), or where the operator that made it ran; operators
        on it run there (``dtorch/graph.py``)."""
        return self._graph

    @property
    def placements(self) -> list:
        return list(self._spec.placements)

    @property
    def ndim(self) -> int:
        return len(self._spec.shape)

    def dim(self) -> int:
        return len(self._spec.shape)

    def numel(self) -> int:
        n = 1
        for s in self._spec.shape:
            n *= s
        return n

    is_meta = False  # (its blocks live on its mesh's devices; torch's loaders ask)

    @property
    def device(self) -> torch.device:
        return torch.device(self._spec.mesh.device_type)

    @property
    def is_dtensor(self) -> bool:
        return True

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def __len__(self) -> int:
        if not self._spec.shape:
            raise TypeError("len() of a 0-d tensor")
        return self._spec.shape[0]

    # -- autograd (``dtorch/autograd``) ----------------------------------------------------------
    @property
    def grad(self):
        """The gradient ``backward`` accumulated into this leaf, laid out as it; None before.
        One held unreduced while its sync was off (``autograd/grad_sync.py``) is reduced in
        first."""
        if DEFERRED_GRADS:
            settle = DEFERRED_GRADS.get(self._id)
            if settle is not None:
                settle(self, True)
        return getattr(self, "_grad", None)

    @grad.setter
    def grad(self, value) -> None:
        if value is not None:
            check_grad(self, value)
        if DEFERRED_GRADS:  # what is held is replaced, as torch's local gradient would be
            settle = DEFERRED_GRADS.get(self._id)
            if settle is not None:
                settle(self, False)
        self._grad = value

    @property
    def grad_placements(self):
        """How ``backward`` lays this leaf's ``.grad`` out (None: as the leaf). ZeRO-2 shards
        it on the data-parallel dim."""
        return getattr(self, "_grad_placements", None)

    @grad_placements.setter
    def grad_placements(self, placements) -> None:
        self._grad_placements = None if placements is None else list(placements)
    @property
    def requires_grad(self) -> bool:
        """Whether autograd records the ops on this tensor: set on leaves (a ``Parameter`` is
        one unless told otherwise), True on the results of recorded ops."""
        return getattr(self, "_requires_grad", False)

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        if not value and getattr(self, "_node", None) is not None:
            raise RuntimeError("you can only change requires_grad flags of leaf variables; "
                               "use .detach() for a tensor without history")
        if value and not self.dtype.is_floating_point and not self.dtype.is_complex:
            raise RuntimeError("only Tensors of floating point and complex dtype can require "
                               "gradients")
        self._requires_grad = bool(value)
        if value:
            self._starts_recording()

    def _starts_recording(self) -> None:
        """What ``requires_grad = True`` also does: here nothing, as this module is below
        autograd; autograd's method (``autograd.TENSOR_METHODS``, put here by
        ``client/frontend.install``) makes every session record its calls from then on."""

    def requires_grad_(self, requires_grad: bool = True) -> Tensor:
        self.requires_grad = requires_grad
        return self

    @property
    def is_leaf(self) -> bool:
        """True unless the tensor is the result of an op autograd recorded."""
        return getattr(self, "_node", None) is None

    @property
    def grad_fn(self):
        """The recorded op that made this tensor (``None`` on a leaf)."""
        return getattr(self, "_node", None)

    @property
    def data(self) -> Tensor:
        """The value without autograd history, as torch's ``.data`` (``detach``, an op that
        aliases the blocks)."""
        return self.detach() if getattr(self, "_requires_grad", False) else self

    @data.setter
    def data(self, value: Tensor) -> None:
        """As torch's ``p.data = value``: this tensor (its identity, its autograd state) now
        aliases ``value``'s blocks, with ``value``'s shape and layout; its old blocks go."""
        if not isinstance(value, Tensor):
            raise TypeError(f"data must be a dtorch.Tensor, got {type(value).__name__}")
        alias = value.detach()  # takes this tensor's old id, and releases it as it goes
        self._id, self._spec, alias._id, alias._spec = alias._id, alias._spec, self._id, \
            self._spec
        self._graph = alias._graph

    @property
    def T(self) -> Tensor:
        """The dims reversed (``permute``), as torch's ``.T``."""
        return self.permute(*reversed(range(self.dim())))

    @property
    def mT(self) -> Tensor:
        """The last two dims swapped, as torch's ``.mT``."""
        return self.transpose(-2, -1)

    def is_contiguous(self, memory_format=None) -> bool:
        """Always True: every block is stored contiguously on its device."""
        return True

    def check_placement(self, dim: int, expect, skip_when_dim_size_equal_one: bool = True):
        """Whether mesh dim ``dim`` holds placement ``expect`` (True for a mesh dim of one
        device, where every placement is the same, unless told not to skip it)."""
        if skip_when_dim_size_equal_one and self._spec.mesh.shape[dim] == 1:
            return True
        return self._spec.placements[dim] == expect

    def redistribute_like(self, other: Tensor) -> Tensor:
        """This value in ``other``'s layout (its mesh and placements)."""
        return self.redistribute(other.device_mesh, other.placements)

    def redistribute_by_dict(self, device_mesh=None, placements_dict=None, *,
                             default_placement_mode: str = "raise_error",
                             convert_shard_size_one_to_replicate: bool = True) -> Tensor:
        """``redistribute`` with placements named by mesh dim (``{"dp": Shard(0)}``): dims the
        dict leaves out are Replicate, kept, or an error (``default_placement_mode``), and names
        the mesh lacks are ignored (see ``get_placements_from_dict``)."""
        mesh = self._spec.mesh if device_mesh is None else device_mesh
        if not placements_dict:  # as DTorch: no dict keeps the placements (the mesh may move)
            return self.redistribute(mesh, self.placements)
        placements = get_placements_from_dict(
            mesh, placements_dict, self.placements, default_placement_mode,
            convert_shard_size_one_to_replicate=convert_shard_size_one_to_replicate,
            shape=self._spec.shape)
        return self.redistribute(mesh, placements)

    # -- values (the only waits) ----------------------------------------------------------------
    # -- values (the only waits) ----------------------------------------------------------------
    def to_torch(self) -> torch.Tensor:
        """The full logical value as a torch.Tensor on the CPU."""
        return self.to_torch_async().get()

    def numpy(self):
        return self.to_torch().numpy()

    def tolist(self):
        return self.to_torch().tolist()

    def item(self):
        if self.numel() != 1:
            raise RuntimeError(
                f"a Tensor with {self.numel()} elements cannot be converted to Scalar"
            )
        return self.to_torch().item()

    def __bool__(self) -> bool:
        return bool(self.item())

    def __float__(self) -> float:
        return float(self.item())

    def __int__(self) -> int:
        return int(self.item())

    def __index__(self) -> int:
        return int(self.item())

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        try:
            value = repr(self.to_torch())
        except Exception as e:  # a poisoned tensor still prints its metadata
            value = f"<error: {e}>"
        return (
            f"dtorch.Tensor({value}, shape={list(self._spec.shape)}, dtype={self.dtype}, "
            f"device_mesh={self._spec.mesh!r}, placements={self.placements})"
        )

    def __str__(self) -> str:
        return self.__repr__()

    def __format__(self, spec: str) -> str:
        if self.numel() == 1 and spec:
            return format(self.item(), spec)
        return str(self)

    def __reduce__(self):
        raise TypeError("a dtorch.Tensor is a handle to remote memory; use to_torch() to save it")

    def __iter__(self):
        """The sub-tensors along dim 0, as torch iterates (``x[0]``, ``x[1]``, ...)."""
        if not self._spec.shape:
            raise TypeError("iteration over a 0-d tensor")
        return (self[i] for i in range(self._spec.shape[0]))

    def _short(self) -> str:
        return f"Tensor#{self._id}{list(self._spec.shape)}{placements_str(self._spec.placements)}"


def check_grad(tensor: Tensor, grad) -> None:
    """What torch checks when a ``.grad`` is assigned, with its exception types and words: a
    tensor (a dtorch one), not the tensor itself, of its shape and dtype, on its device (its
    mesh). Any placements pass: the optimizers and ``clip_grad_norm_`` lay a gradient out as
    they need it, and ``backward`` accumulates into the layout it finds."""
    if not isinstance(grad, Tensor):
        fix = ("; lay it out first: dtorch.from_torch(grad, device_mesh=..., placements=...)"
               if isinstance(grad, torch.Tensor) else "")
        raise TypeError(f"assigned grad expected to be a dtorch.Tensor or None but got grad of "
                        f"type {type(grad).__name__}{fix}")
    if grad is tensor:
        raise RuntimeError("can't assign Variable as its own grad")
    spec, other = tensor._spec, grad._spec
    if other.shape != spec.shape:
        raise RuntimeError(f"attempting to assign a gradient of size '{list(other.shape)}' to "
                           f"a tensor of size '{list(spec.shape)}'. Please ensure that the "
                           f"gradient and the tensor are the same size")
    if other.dtype != spec.dtype:
        raise RuntimeError(f"attempting to assign a gradient with dtype '{other.dtype}' to a "
                           f"tensor with dtype '{spec.dtype}'. Please ensure that the gradient "
                           f"and the tensor have the same dtype (grad.to(torch.{spec.dtype}))")
    if other.mesh != spec.mesh:
        raise RuntimeError(f"attempting to assign a gradient on {other.mesh!r} to a tensor on "
                           f"{spec.mesh!r}. Please ensure that the gradient and the tensor are "
                           f"on the same mesh (grad.redistribute(device_mesh=..., "
                           f"placements=...))")


def tensors_redistribute_by_dict(tensors, device_mesh=None, placements_dict=None, **options):
    """``redistribute_by_dict`` of each tensor of a list, tuple or dict (other values pass as
    they are), in the same structure: a model's inputs in one call."""
    def move(t):
        return t.redistribute_by_dict(device_mesh, placements_dict, **options) if isinstance(
            t, Tensor) else t

    if isinstance(tensors, dict):
        return {k: move(v) for k, v in tensors.items()}
    if isinstance(tensors, (list, tuple)):
        return type(tensors)(move(t) for t in tensors)
    return move(tensors)


def symbol(tensor_id: int, spec, graph) -> Tensor:
    """The Tensor for an id the client has issued on ``graph`` (how the client makes every
    result)."""
    t = _new(Tensor)
    t._id = tensor_id
    t._spec = spec
    t._graph = graph
    return t


_new = object.__new__


# -- typed classes --------------------------------------------------------------------------------


class _TypedTensorMeta(type):
    """``isinstance(x, dtorch.FloatTensor)`` is whether ``x`` is a dtorch tensor of that dtype
    (DTorch's check compares nothing: its ``__instancecheck__`` is not on a metaclass)."""

    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, Tensor) and obj.dtype == _TYPED_DTYPES[cls]

    def __subclasscheck__(cls, sub) -> bool:
        return sub is cls


def get_data_type_tensor(dtype: torch.dtype) -> type:
    """The typed class of ``dtype`` (``FloatTensor`` for float32): calling it makes a tensor of
    that dtype, ``isinstance`` checks the dtype."""
    for cls, d in _TYPED_DTYPES.items():
        if d == dtype:
            return cls
    raise ValueError(f"dtorch has no typed tensor class for {dtype}")


_TYPED_DTYPES: dict = {}
TYPED = {"FloatTensor": torch.float32, "DoubleTensor": torch.float64, "HalfTensor": torch.float16,
         "BFloat16Tensor": torch.bfloat16, "ByteTensor": torch.uint8, "CharTensor": torch.int8,
         "ShortTensor": torch.int16, "IntTensor": torch.int32, "LongTensor": torch.int64,
         "BoolTensor": torch.bool}
for _name, _dtype in TYPED.items():
    _TYPED_DTYPES[_TypedTensorMeta(_name, (Tensor,), {"__slots__": ()})] = _dtype
globals().update({cls.__name__: cls for cls in _TYPED_DTYPES})
