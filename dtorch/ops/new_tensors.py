"""torch's ``Tensor.new_*`` methods: a new tensor of a given size with the tensor's dtype, on
its mesh (Replicate) and graph, as torch's takes the tensor's dtype and device. HF's generation
code calls them on its inputs (``attention_mask.new_ones(...)``).

>>> import dtorch
>>> x = dtorch.ones((2, 3), device_mesh=dtorch.DeviceMesh("cpu", [0, 1]),
...                 placements=[dtorch.Shard(0)])
>>> y = x.new_full((4,), 7.0)
>>> y.to_torch(), y.placements, y.dtype
(tensor([7., 7., 7., 7.]), [Replicate()], torch.float32)
"""

from __future__ import annotations

from ..tensor import Tensor
from .creation import size_arg, with_grad
from .registry import OpDef, lookup, register


def _new(name: str, factory: str):
    def method(self: Tensor, *size, dtype=None, device=None, requires_grad=False, **kwargs):
        if device is not None and str(device).split(":")[0] != self.device_mesh.device_type:
            raise NotImplementedError(f"Tensor.{name}: device={device!r} is not this tensor's "
                                      f"mesh kind ({self.device_mesh.device_type}); moving "
                                      f"between device types is not supported")
        # new_full(size, fill_value); the others' arguments are the size, spread out or not
        args = (size[0], *size[1:]) if factory == "full" else (size_arg(size),)
        made = lookup(factory).front(*args, dtype=self.dtype if dtype is None else dtype,
                                     device_mesh=self.device_mesh, graph=self._graph, **kwargs)
        return with_grad(made, requires_grad)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = (f"torch's ``Tensor.{name}``: ``dtorch.{factory}`` with this tensor's "
                      f"dtype (unless given), on its mesh (Replicate) and graph.")
    return method


def new_tensor(self: Tensor, data, *, dtype=None, device=None, requires_grad=False):
    """torch's ``Tensor.new_tensor``: ``data``'s value with this tensor's dtype (unless given),
    Replicate on its mesh."""
    made = lookup("tensor").front(data, dtype=self.dtype if dtype is None else dtype,
                                  device_mesh=self.device_mesh, graph=self._graph)
    return with_grad(made, requires_grad)


for _name, _factory in (("new_ones", "ones"), ("new_zeros", "zeros"), ("new_empty", "empty"),
                        ("new_full", "full")):
    register(OpDef(_name, f"{_name}(input: Tensor, *size)", None, None, function=False,
                   methods=(_name,), front=_new(_name, _factory)))
register(OpDef("new_tensor", "new_tensor(input: Tensor, data)", None, None, function=False,
               methods=("new_tensor",), front=new_tensor))
