"""Selective activation checkpointing: a policy picks the calls of a checkpointed region whose
outputs are kept from the forward, and the recompute takes those outputs instead of running
their kernels again (torch's ``create_selective_checkpoint_contexts``; torchtitan keeps the
matmuls' outputs and recomputes the cheap elementwise rest).

torch's contexts work on aten operators below autograd: the recompute's matmul returns the
cached output, and autograd still records a matmul node, whose backward needs only the
operands. dtorch records a kernel's autograd graph on the hosts by running the kernel, so a
kept output cannot be recorded that way. Instead a kept call's tape node (``tape.Formula``) has
its VJP written here in dtorch's operators (``FORMULAS``): ``g @ W`` and ``gᵀ @ x`` for a
linear, the same products torch's own backward of ``mm`` computes, in the same order, so one
device gives torch's bits; on a mesh the operators' placement rules lay each product out (a
contracted sharded dim gives a Partial, the gradients' dual layouts then follow as for any
call). Only the matrix products have formulas: they are most of a layer's time, and their
outputs are what torchtitan's policies keep. Any other operator the policy keeps is
recomputed, with one warning naming it.

The policy is torch's: ``policy_fn(ctx, op, *args)`` for every operator call of the forward
(``ctx.is_recompute`` False, ``ctx.op_output`` the result), ``op`` the aten overload torch's
dispatch would see for it (``aten_of``: a linear is ``aten.mm.default``, as torchtitan's lists
name it), answering a ``CheckpointPolicy``. ``MUST_SAVE``/``PREFER_SAVE`` keep (and so
do the CPU-offload answers: the output stays on its device). The recompute takes kept outputs
by the call's index in the region, as torch does; a recompute that issues other calls than
the forward raises.

A region is open on one thread (``tape.Recorder.local``): ``client/dispatch.issue`` hands it
each operator call that thread issues while it is open.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

from ..buckets import laid_out
from ..client import dispatch
from ..tensor import Tensor
from . import tape

_KEEP = frozenset({CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE,
                   CheckpointPolicy.MUST_CPU_OFFLOAD, CheckpointPolicy.PREFER_CPU_OFFLOAD})
_warned: set = set()


# -- the products' VJPs, in dtorch's operators ----------------------------------------------------
# Each takes the output's gradient, which operands need one, and the operands, and returns the
# operands' gradients (None where not needed); its ``*_applies`` says whether it has a formula
# for these operands (no broadcast batch dims to sum over, no vector).


def _rows(t):
    """``t``'s leading dims flattened: the rows of a product's matrix."""
    return t.flatten(0, -2) if t.ndim > 2 else t


def _linear(g, needs, input, weight, bias=None):
    rows = _rows(g)
    return (g @ weight if needs[0] else None,
            rows.t() @ _rows(input) if needs[1] else None,  # torch's: weight.T is column-major
            rows.sum(0) if len(needs) > 2 and needs[2] else None)


def _matmul(g, needs, a, b):
    if b.ndim == 2:  # a batch of rows times one matrix: torch folds it into one mm
        return (g @ b.t() if needs[0] else None,
                _rows(a).t() @ _rows(g) if needs[1] else None)
    return (g @ b.transpose(-1, -2) if needs[0] else None,
            a.transpose(-1, -2) @ g if needs[1] else None)


def _linear_applies(input, weight, bias=None):
    return input.ndim >= 2 and weight.ndim == 2


def _matmul_applies(a, b):
    if not (isinstance(a, Tensor) and isinstance(b, Tensor)) or a.ndim < 2 or b.ndim < 2:
        return False
    return b.ndim == 2 or a.shape[:-2] == b.shape[:-2]  # no broadcast batch dims to sum over


FORMULAS = {"linear": (_linear, _linear_applies), "matmul": (_matmul, _matmul_applies),
            "mm": (_matmul, _matmul_applies), "bmm": (_matmul, _matmul_applies)}

_aten_cache: dict = {}


def aten_of(name: str, operands):
    """The aten overload torch's dispatch would show a policy for the dtorch operator ``name``
    on ``operands``: a linear is ``mm`` (``addmm`` with a bias), a matmul ``bmm`` when both
    operands are batched and ``mm`` otherwise, as torch folds them; any other operator
    ``aten.<name>.default`` where torch has it, else its name."""
    if name == "linear":
        has_bias = len(operands) > 2 and operands[2] is not None
        return torch.ops.aten.addmm.default if has_bias else torch.ops.aten.mm.default
    if name == "matmul":
        batched = all(getattr(o, "ndim", 0) > 2 for o in operands[:2])
        return torch.ops.aten.bmm.default if batched else torch.ops.aten.mm.default
    op = _aten_cache.get(name)
    if op is None:
        packet = getattr(torch.ops.aten, name, None)
        op = _aten_cache[name] = getattr(packet, "default", name) if packet is not None \
            else name
    return op


# -- the region -----------------------------------------------------------------------------------


class Region:
    """One checkpointed call's selective state: the outputs its forward kept, by call index."""

    def __init__(self, policy_fn):
        self.policy_fn = policy_fn
        self.kept: dict = {}  # call index -> (the operator's name, its kept output)
        self.recomputing = False
        self.calls = 0

    @contextlib.contextmanager
    def open(self, recomputing: bool):
        """The region open on this thread: its operator calls come to ``issue``."""
        local = tape.Recorder.local
        outer, local.region = local.region, self
        self.recomputing, self.calls = recomputing, 0
        try:
            yield
        finally:
            local.region = outer
        if recomputing and self.kept:
            raise RuntimeError(f"dtorch.nn.checkpoint: the recompute issued {self.calls} "
                               f"operator calls, fewer than the forward, which kept outputs "
                               f"of calls {sorted(self.kept)}: the function must compute the "
                               f"same in the backward")

    def issue(self, s, b, operands, site, graph):
        """``dispatch.issue``'s call of ``b`` inside the region."""
        k, self.calls = self.calls, self.calls + 1
        if self.recomputing:
            kept = self.kept.pop(k, None)
            if kept is not None:
                return self._substitute(b, operands, *kept, k)
            return self._issue(s, b, operands, site, graph)
        out = self._issue(s, b, operands, site, graph)
        name = b.op.name
        with self._suspended():
            answer = self.policy_fn(SelectiveCheckpointContext(is_recompute=False, op_output=out),
                                    aten_of(name, operands), *operands)
        if answer not in _KEEP:
            return out
        formula = FORMULAS.get(name)
        if formula is not None and isinstance(out, Tensor) and formula[1](*operands):
            self.kept[k] = (name, out)
        elif name not in _warned:
            _warned.add(name)
            warnings.warn(f"dtorch.nn.checkpoint: the policy keeps {name}'s output, which "
                          f"dtorch recomputes: it keeps the outputs of "
                          f"{', '.join(sorted(FORMULAS))} only", stacklevel=4)
        return out

    def _issue(self, s, b, operands, site, graph):
        with self._suspended():
            return dispatch.issue(s, b, operands, site, graph)

    @staticmethod
    @contextlib.contextmanager
    def _suspended():
        local = tape.Recorder.local
        region, local.region = local.region, None
        try:
            yield
        finally:
            local.region = region

    def _substitute(self, b, operands, name: str, kept, k: int):
        """The kept output in place of call ``k``'s kernel, recorded with its formula's VJP."""
        spec = b.post[0].outs[0] if b.post and b.post[0] else b.outs[0]
        if name != b.op.name or kept._spec != spec:
            raise RuntimeError(f"dtorch.nn.checkpoint: call {k} of the region is {b.op.name} "
                               f"giving {tuple(spec.shape)} laid out {list(spec.placements)} "
                               f"in the recompute, but the forward kept {name}'s "
                               f"{tuple(kept.shape)} laid out {kept.placements}: the function "
                               f"must compute the same in the backward")
        with self._suspended():
            out = kept.detach()  # a tensor of its own: the forward's may be the region's output
        needs = tuple(isinstance(o, Tensor) and o.requires_grad for o in operands)
        if torch.is_grad_enabled() and any(needs) and tape.differentiable(spec):
            formula = FORMULAS[b.op.name][0]
            held = tuple(operands)
            grad_spec = tape.dual_spec(spec, b.op.name)

            def vjp(grads):
                (g,) = grads
                if g is None:
                    return [None] * len(held)
                grads = formula(laid_out(g, grad_spec), needs, *held)
                return [None if d is None else laid_out(d, tape.dual_spec(o._spec, b.op.name))
                        for d, o in zip(grads, held)]

            node = tape.Node(tape.Formula(b.op.name, vjp), 0, held, needs, (out,))
            out._requires_grad, out._node = True, node
        return out


def policy_of(contexts):
    """The policy in a ``context_fn``'s pair of contexts made by torch's
    ``create_selective_checkpoint_contexts``, else None (plain contexts, entered as they are)."""
    forward = contexts[0]
    if isinstance(forward, torch.utils.checkpoint._CachingTorchDispatchMode):
        return forward.policy_fn
    return None
