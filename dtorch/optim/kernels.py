"""Optimizer updates: one call updates a list of parameters (a parameter group's on one mesh,
or a single one), run on the hosts by torch's own implementations (``torch.optim.sgd.sgd``,
``torch.optim.adam.adam``) on the device's blocks, with torch's ``foreach`` and ``fused``
switches: a dtorch optimizer's arithmetic is torch's, element for element.

An operand list is laid out by kind, then by parameter: the n parameters, their n gradients,
their state tensors (SGD's momentum buffers if it has momentum; Adam's first then second
moments), then the numbers: Adam's n step counts, the learning rate, and Adam's two betas. Each update is in
place, as torch's: it writes the parameters and their state, returns the first parameter
(operand 0), and its flags say which operands it writes (``protocol.writes``, per call:
``OpDef.written``), so the controller orders every other access to those storages around it
(``passes.assign_streams``). Step counts, the learning rate and Adam's betas are operands
passed as numbers, which travel as values: a scheduler changing the rate (or, as OneCycleLR
does, the momentum) every step reuses one call shape, and a replayed step takes them from the
optimizer (``step_replay.scalars_from``).

The layout: each parameter's gradient and state are laid out as it is (the optimizer makes them
so), and every element's update reads only that element, so any Shard or Replicate layout
updates in place on each device. A Partial parameter stands for a sum, which an elementwise
update of its pieces would not respect: the optimizer updates its Replicate form instead.

``sgd_update_`` and ``adam_update_`` are the fronts the optimizers call (``optim/optimizer.py``).
"""

from __future__ import annotations

import torch
from torch.optim.adam import adam as _torch_adam
from torch.optim.sgd import sgd as _torch_sgd

from ..ops.registry import OpDef, issue, register
from ..ops.rules import Placed
from ..protocol import INPLACE


def _lists(operands, n: int, k: int) -> list:
    """The first ``k`` lists of ``n`` operands each."""
    return [list(operands[i * n:(i + 1) * n]) for i in range(k)]


def alike_rule(call) -> Placed:
    """Each parameter's gradient and state laid out as the parameter (Shard or Replicate, on
    the call's mesh); the result, the first parameter, as it is."""
    specs = call.tensors
    n = _parameters(call.op.name, len(specs), call.static)
    for k, spec in enumerate(specs):
        param = specs[k % n]
        if spec.mesh != call.mesh or spec.placements != param.placements or any(
                p.is_partial() for p in spec.placements):
            raise ValueError(f"dtorch.optim: {call.op.name} updates tensors laid out as their "
                             f"parameter (Shard or Replicate), but operand {k} is "
                             f"{list(spec.placements)} and its parameter "
                             f"{list(param.placements)}")
    return Placed((specs[0].placements,))


def _parameters(name: str, n_tensors: int, static: dict) -> int:
    """How many parameters a call with ``n_tensors`` tensor operands updates."""
    if name == "adam_update_":
        return n_tensors // 4
    return n_tensors // (2 if static["momentum"] == 0 else 3)


def _sgd_update_(*operands, momentum, dampening, weight_decay, nesterov, maximize, firsts,
                 foreach, fused):
    """Without momentum there is no buffer; a first step's buffer is made by torch (from the
    gradient) and copied into ours."""
    n = len(firsts)
    params, grads = _lists(operands, n, 2)
    buffers = list(operands[2 * n:3 * n]) if momentum else [None] * n
    given = [None if first or not momentum else b for b, first in zip(buffers, firsts)]
    _torch_sgd(params, grads, given, weight_decay=weight_decay, momentum=momentum,
               lr=operands[-1], dampening=dampening, nesterov=nesterov, maximize=maximize,
               foreach=foreach and not fused, fused=fused)
    for ours, made, first in zip(buffers, given, firsts):
        if first and momentum:  # torch made the first buffer: it is ours
            ours.copy_(made)
    return params[0]


def _adam_update_(*operands, eps, weight_decay, maximize, decoupled, foreach, fused):
    n = (len(operands) - 3) // 5
    lr, beta1, beta2 = operands[-3:]
    params, grads, exp_avgs, exp_avg_sqs, steps = _lists(operands, n, 5)
    # torch counts the step before the update: the count of the update being made. Its fused
    # kernels read the counts on the device, the others on the CPU (as torch.optim.Adam keeps
    # them)
    where = params[0].device if fused else "cpu"
    counts = [torch.tensor(float(s - 1), device=where) for s in steps]
    _torch_adam(params, grads, exp_avgs, exp_avg_sqs, [], counts, foreach=foreach and not fused,
                fused=fused, decoupled_weight_decay=decoupled, amsgrad=False, beta1=beta1,
                beta2=beta2, lr=lr, weight_decay=weight_decay, eps=eps,
                maximize=maximize)
    return params[0]


def _update_meta(param, *operands, **static):
    return param


def _sgd_written(n_operands: int, static: dict) -> range:
    n = len(static["firsts"])
    return range(1, n) if not static["momentum"] else (*range(1, n), *range(2 * n, 3 * n))


def _adam_written(n_operands: int, static: dict) -> tuple:
    n = (n_operands - 3) // 5
    return (*range(1, n), *range(2 * n, 4 * n))


def sgd_update_(params, grads, momentum_buffers, lr: float, *, momentum, dampening,
                weight_decay, nesterov, maximize, firsts, foreach, fused):
    """Issues one SGD step of ``params`` (in place; their ``momentum_buffers`` too, unless
    ``momentum`` is 0: pass none) and returns the first; ``firsts``: whether each buffer is
    made by this step."""
    return issue("sgd_update_", (*params, *grads, *momentum_buffers, lr),
                 (momentum, dampening, weight_decay, nesterov, maximize, tuple(firsts),
                  bool(foreach), bool(fused)))


def adam_update_(params, grads, exp_avgs, exp_avg_sqs, steps, lr: float, *, beta1, beta2, eps,
                 weight_decay, maximize, decoupled, foreach, fused):
    """Issues one Adam (``decoupled``: AdamW) step of ``params`` and their moments (in place)
    and returns the first; ``steps`` count this update of each."""
    return issue("adam_update_", (*params, *grads, *exp_avgs, *exp_avg_sqs, *steps, lr,
                                  float(beta1), float(beta2)),
                 (eps, weight_decay, maximize, decoupled, bool(foreach), bool(fused)))


register(OpDef("sgd_update_",
               "sgd_update_(operands: TensorList, *, momentum=0.0, dampening=0.0, "
               "weight_decay=0.0, nesterov=False, maximize=False, firsts=(), foreach=True, "
               "fused=False)", _sgd_update_, alike_rule, meta=_update_meta, flags=INPLACE,
               written=_sgd_written, function=False, front=sgd_update_))
register(OpDef("adam_update_",
               "adam_update_(operands: TensorList, *, eps=1e-8, weight_decay=0.0, "
               "maximize=False, decoupled=False, foreach=True, fused=False)",
               _adam_update_, alike_rule, meta=_update_meta, flags=INPLACE,
               written=_adam_written, function=False, front=adam_update_))
