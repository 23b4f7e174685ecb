"""Vector-Jacobian products on local blocks: the backward of any recorded kernel, by torch's own
autograd, so that no derivative formula is written twice.

A VJP call (``protocol.VJP_PREFIX`` + the forward call's id) takes the forward's operands (the
blocks the forward kernel read, which the client kept alive) followed by one gradient block per
forward result, and returns the gradient blocks of the operands ``needs`` marks. The kernel runs
the forward again on those blocks with autograd on (the same static args, the same context: a
random kernel draws the same values from its seed), then ``torch.autograd.grad``. Recomputing
costs a forward kernel per backward kernel and keeps nothing between the two passes but the
operands themselves.

Why local blocks suffice: the client lays the gradient out in the dual of each layout
(``autograd/tape.py``): a device's block of the result's gradient, passed back through its own
kernel, is its block of the operand's gradient, or its contribution to it (a Partial sum)
where the operand was Replicate.
"""

from __future__ import annotations

import torch


def vjp_kernel(forward):
    """The kernel ``(ctx, *operands, *grads, needs)`` of the VJP of HostCall ``forward``."""
    n_in = len(forward.in_specs)

    def vjp(ctx, *args, needs):
        inputs, grads = args[:n_in], args[n_in:]
        leaves = [x.detach().requires_grad_(True) if need else x
                  for x, need in zip(inputs, needs)]
        with torch.enable_grad():
            if forward.uses_context:
                out = forward.fn(forward.context(ctx.device), *leaves, **forward.kwargs)
            else:
                out = forward.fn(*leaves, **forward.kwargs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads)
                 if isinstance(o, torch.Tensor) and o.requires_grad]
        wrt = [x for x, need in zip(leaves, needs) if need]
        found = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs],
                                    allow_unused=True) if pairs else [None] * len(wrt)
        result = tuple(torch.zeros_like(x) if g is None else g for g, x in zip(found, wrt))
        return result[0] if len(result) == 1 else result

    return vjp
