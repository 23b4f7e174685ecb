"""``dtorch.register_op``: a user's operator, registered at run time.

It makes an ordinary registry entry (``ops.registry.OpDef``, through ``register``, as every
operator of dtorch is made) whose front the client generates and places (``frontend``), and
which runs on the hosts through the ``custom_op`` carrier (``ops/extension.py``: why a user's
function must be importable by name, and how its results are checked).
"""

from __future__ import annotations

from ..ops.extension import function_ref, resolve
from ..ops.registry import REGISTRY, OpDef, issue, register
from ..ops.rules import replicate_only
from . import frontend


def register_op(signature: str, fn, placement=None, *, meta=None, methods=(), function=True,
                functional=False, uses_context=False, doc=""):
    """Registers an operator: ``signature`` (torch's style: tensor operands marked
    ``: Tensor``, every other parameter static), its kernel ``fn`` (run on each device's local
    blocks: ``fn(*local_operands, **static)``, or ``fn(ctx, ...)`` with ``uses_context``), and
    its placement rule for one mesh dim. Returns the new function, also installed as
    ``dtorch.<name>`` (unless ``function=False``), as the Tensor ``methods`` named, and in
    ``dtorch.nn.functional`` with ``functional=True``.

    - ``placement``: rows ``[(outputs, inputs), ...]`` of placements for one mesh dim (each a
      tuple: one per output, one per tensor operand); the all-Replicate row is always added and
      N-D meshes are matched one mesh dim at a time; a call matching no row raises
      ``ValueError`` naming the ``redistribute()`` to add. It may also be a function of the call
      (``ops.rules.Call``) returning rows or an ``ops.rules.Placed``. Default: Replicate only.
    - ``meta``: the metadata rule, called like ``fn`` on meta tensors of the global shapes;
      default: ``fn`` itself (memoized per call shape, as for every built-in op). On each
      device ``fn`` must return the blocks of what it promises (dtype, local shape, the device);
      any other result fails the call like an error raised in ``fn``.
    - ``fn`` must be importable by name on the hosts (see the module's doc).

    >>> import torch, dtorch
    >>> from dtorch import Shard
    >>> cumsum = dtorch.register_op("my_cumsum(input: Tensor, dim)", torch.cumsum,
    ...                             [((Shard(1),), (Shard(1),))])  # dims other than ``dim``
    >>> mesh = dtorch.DeviceMesh("cpu", [0, 1])
    >>> x = dtorch.ones((2, 3), device_mesh=mesh, placements=[Shard(1)])
    >>> cumsum(x, 0).to_torch()
    tensor([[1., 1., 1.],
            [2., 2., 2.]])
    """
    ref = function_ref(fn, "register_op")
    if uses_context and meta is None:
        raise TypeError("dtorch.register_op: a kernel that uses_context needs a meta= rule "
                        "(fn(ctx, ...) cannot run on the client)")
    rule = placement if callable(placement) else _rows_rule(placement or [])
    op = OpDef(signature.split("(", 1)[0].strip(), signature, resolve(ref), rule, meta=meta,
               methods=tuple(methods), function=function, functional=functional,
               uses_context=uses_context, doc=doc, origin=ref[0])
    if any(p.kind == "tensors" for p in op.params):
        raise NotImplementedError("dtorch.register_op: TensorList parameters are not supported "
                                  "yet; give each tensor its own parameter")
    if op.name in REGISTRY:
        raise ValueError(f"operator {op.name!r} is already registered")
    op.front = frontend.generate(op, _router(op, ref, uses_context))
    register(op)
    frontend.place_late(op)
    return op.front


def _rows_rule(rows):
    return replicate_only if not rows else (lambda call: list(rows))


def _router(op, ref, uses_context):
    """What the generated front calls instead of the op itself: the ``custom_op`` carrier,
    with the user's static args by name (hosts know no user signature)."""

    def route(_op, operands, static):
        kwargs = tuple(zip(op.static_names, static))
        return issue("custom_op", operands, (op.name, ref, kwargs, uses_context))

    return route
