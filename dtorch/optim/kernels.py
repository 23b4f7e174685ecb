"""Optimizer updates: one call per parameter and step, run on the hosts by torch's own
single-tensor implementations (``torch.optim.sgd.sgd``, ``torch.optim.adam.adam``), so a dtorch
optimizer's arithmetic is torch's, element for element.

Each update is in place, as torch's: it writes the parameter (operand 0, which it returns) and
its state (``sgd_update_``'s momentum buffer, ``adam_update_``'s moments), and its flags say so
(``protocol.writes``), so the controller orders every other access to those storages around
it (``passes.assign_streams``). The step number and learning rate are operands passed as
numbers, which travel as values: a scheduler changing the rate every step reuses one call
shape.

The layout: parameter, gradient and state are laid out alike (the optimizer makes them so), and
every element's update reads only that element, so any Shard or Replicate layout updates in
place on each device. A Partial parameter stands for a sum, which an elementwise update of its
pieces would not respect: the optimizer updates its Replicate form instead.

``sgd_update_`` and ``adam_update_`` are the fronts the optimizers call (``optim/optimizer.py``).
"""

from __future__ import annotations

import torch
from torch.optim.adam import adam as _torch_adam
from torch.optim.sgd import sgd as _torch_sgd

from ..ops.registry import OpDef, issue, register
from ..ops.rules import Placed, expand
from ..placement import Replicate, Shard
from ..protocol import INPLACE, writes

R = Replicate()


def alike_rule(call) -> Placed:
    """Every tensor operand and result laid out as the parameter (Shard or Replicate)."""
    n_in, n_out = len(call.tensors), len(call.outs)
    dims = len(call.tensors[0].shape)
    rows = [((p,) * n_out, (p,) * n_in) for p in [R, *(Shard(d) for d in range(dims))]]
    return expand(call, rows)


def _sgd_update_(param, grad, momentum_buffer, lr, *, momentum, dampening, weight_decay,
                 nesterov, maximize, first):
    """Without momentum the buffer is the gradient, which torch's update ignores."""
    buffers = [None if first or momentum == 0 else momentum_buffer]
    _torch_sgd([param], [grad], buffers, weight_decay=weight_decay, momentum=momentum, lr=lr,
               dampening=dampening, nesterov=nesterov, maximize=maximize, foreach=False)
    if first and momentum != 0:  # torch made the first buffer (the gradient): it is ours
        momentum_buffer.copy_(buffers[0])
    return param


def _adam_update_(param, grad, exp_avg, exp_avg_sq, step, lr, *, beta1, beta2, eps,
                  weight_decay, maximize, decoupled):
    # torch counts the step before the update: the count of the update being made
    _torch_adam([param], [grad], [exp_avg], [exp_avg_sq], [], [torch.tensor(float(step - 1))],
                foreach=False, decoupled_weight_decay=decoupled, amsgrad=False, beta1=beta1,
                beta2=beta2, lr=lr, weight_decay=weight_decay, eps=eps, maximize=maximize)
    return param


def _update_meta(param, *operands, **static):
    return param


def sgd_update_(param, grad, momentum_buffer, lr: float, *, momentum, dampening, weight_decay,
                nesterov, maximize, first):
    """Issues one SGD step of ``param`` (in place) and returns it; without momentum the buffer
    is ignored (pass the gradient)."""
    return issue("sgd_update_", (param, grad, momentum_buffer, lr),
                 (momentum, dampening, weight_decay, nesterov, maximize, first))


def adam_update_(param, grad, exp_avg, exp_avg_sq, step: float, lr: float, *, beta1, beta2, eps,
                 weight_decay, maximize, decoupled):
    """Issues one Adam (``decoupled``: AdamW) step of ``param`` and its moments (in place) and
    returns ``param``; ``step`` counts this update."""
    return issue("adam_update_", (param, grad, exp_avg, exp_avg_sq, step, lr),
                 (beta1, beta2, eps, weight_decay, maximize, decoupled))


register(OpDef("sgd_update_",
               "sgd_update_(param: Tensor, grad: Tensor, momentum_buffer: Tensor, lr: Tensor, "
               "*, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, "
               "maximize=False, first=False)", _sgd_update_, alike_rule, meta=_update_meta,
               flags=INPLACE | writes(2), function=False, front=sgd_update_))
register(OpDef("adam_update_",
               "adam_update_(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, "
               "step: Tensor, lr: Tensor, *, beta1=0.9, beta2=0.999, eps=1e-8, "
               "weight_decay=0.0, maximize=False, decoupled=False)", _adam_update_,
               alike_rule, meta=_update_meta, flags=INPLACE | writes(2, 3), function=False,
               front=adam_update_))
