"""Autograd on distributed tensors: ``Tensor.backward``, ``dtorch.autograd.grad``, and torch's
grad modes.

The client records a tape of the calls it issues (``tape.py``) and the backward issues their
vector-Jacobian products as ordinary calls, which the hosts run with torch's own autograd on
their blocks (``runtime/vjp.py``). Gradients follow the duality of the forward layouts (Shard
stays Shard, Replicate and Partial swap), so a data-parallel weight's gradient is all-reduced
on its way into ``.grad``.

Grad mode is torch's: ``torch.no_grad()``, ``torch.enable_grad()``, ``torch.inference_mode()``
and ``torch.set_grad_enabled`` (as context managers or decorators) switch recording off and
on; ``dtorch.no_grad`` and the others are the same objects.

>>> import dtorch, torch
>>> mesh = dtorch.DeviceMesh("cpu", [0, 1])
>>> w = dtorch.ones(3, device_mesh=mesh, requires_grad=True)
>>> x = dtorch.arange(12.0, device_mesh=mesh, placements=[dtorch.Shard(0)]).view(4, 3)
>>> (x * w).sum().backward()
>>> w.grad.to_torch(), w.grad.placements
(tensor([18., 22., 26.]), [Replicate()])
"""

from __future__ import annotations

import torch

from . import tape

no_grad = torch.no_grad
enable_grad = torch.enable_grad
inference_mode = torch.inference_mode
set_grad_enabled = torch.set_grad_enabled
is_grad_enabled = torch.is_grad_enabled
# parameters gathered for the layer at hand, recorded so that the backward gathers them again
# rather than keeping them (ZeRO-3: ``nn/fsdp.py``); see ``tape.gathered``
gathered = tape.gathered

__all__ = ["backward", "grad", "no_grad", "enable_grad", "inference_mode", "set_grad_enabled",
           "is_grad_enabled"]


def _as_list(tensors) -> list:
    return list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]


def _root_grads(outputs, grad_outputs, what: str) -> list:
    """Each output's gradient: given, or 1 for a scalar (torch's rule)."""
    grads = _as_list(grad_outputs) if grad_outputs is not None else [None] * len(outputs)
    if len(grads) != len(outputs):
        raise RuntimeError(f"{what}: got {len(grads)} gradients for {len(outputs)} outputs")
    out = []
    for t, g in zip(outputs, grads):
        if not t.requires_grad:
            raise RuntimeError("element 0 of tensors does not require grad and does not have "
                               "a grad_fn")
        if g is None:
            if t.numel() != 1:
                raise RuntimeError("grad can be implicitly created only for scalar outputs")
            import dtorch

            g = dtorch.ones_like(t)
        elif isinstance(g, torch.Tensor):
            import dtorch

            g = dtorch.from_torch(g.to(t.dtype), device_mesh=t.device_mesh,
                                  placements=t.placements)
        elif tuple(g.shape) != tuple(t.shape):
            raise RuntimeError(f"{what}: a gradient of shape {tuple(g.shape)} for an output "
                               f"of shape {tuple(t.shape)}")
        out.append(g)
    return out


def backward(tensors, grad_tensors=None, retain_graph=None, create_graph=False,
             inputs=None) -> None:
    """torch's ``autograd.backward``: accumulates the gradients of ``tensors`` (weighted by
    ``grad_tensors``) into the ``.grad`` of the leaves they depend on."""
    if create_graph:
        raise NotImplementedError("dtorch autograd: create_graph=True (gradients of "
                                  "gradients) is not supported")
    if inputs is not None:
        raise NotImplementedError("dtorch autograd: backward(inputs=...) is not supported; "
                                  "use dtorch.autograd.grad(outputs, inputs)")
    roots = _as_list(tensors)
    tape.run_backward(roots, _root_grads(roots, grad_tensors, "backward"),
                      retain_graph=bool(retain_graph))


def grad(outputs, inputs, grad_outputs=None, retain_graph=None, create_graph=False,
         allow_unused=None, materialize_grads=False) -> tuple:
    """torch's ``autograd.grad``: the gradients of ``outputs`` with respect to ``inputs``
    (leaves or not), laid out as the inputs, without touching any ``.grad``."""
    if create_graph:
        raise NotImplementedError("dtorch autograd: create_graph=True (gradients of "
                                  "gradients) is not supported")
    outputs, inputs = _as_list(outputs), _as_list(inputs)
    found = tape.run_backward(outputs, _root_grads(outputs, grad_outputs, "grad"),
                              retain_graph=bool(retain_graph),
                              wanted={t._id: t for t in inputs})
    result = []
    for t in inputs:
        g = found.get(t._id)
        if g is None and materialize_grads:
            import dtorch

            g = dtorch.zeros_like(t)
        elif g is None and not allow_unused:
            raise RuntimeError("One of the differentiated Tensors appears to not have been "
                               "used in the graph. Set allow_unused=True if this is the "
                               "desired behavior.")
        result.append(g)
    return tuple(result)


def tensor_backward(self, gradient=None, retain_graph=None, create_graph=False,
                    inputs=None) -> None:
    """``Tensor.backward``."""
    backward([self], None if gradient is None else [gradient], retain_graph, create_graph,
             inputs)


def _starts_recording(tensor) -> None:
    """``Tensor._starts_recording``: a tensor requires grad, so the tape records from now on."""
    tape.start()


# the methods autograd adds to Tensor (``client/frontend.install`` puts them there)
TENSOR_METHODS = {"backward": tensor_backward, "_starts_recording": _starts_recording}
