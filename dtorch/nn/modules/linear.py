"""``Linear`` and DTorch's tensor-parallel variants.

Every layer takes torch's arguments plus ``device_mesh=`` (default: the graph's mesh, which
``device_mesh_guard`` sets), ``tp_dim`` (a mesh dim name or index) and ``tp_shard_type``. On
``tp_dim`` the parameters are sharded, Replicate on every other mesh dim (data parallel):

| class | weight, bias on tp | input on tp | output on tp |
|---|---|---|---|
| ``ColumnParallelLinear`` | ``S(0)``, ``S(0)`` | ``R`` | ``S(-1)`` |
| ``ColumnParallelLinearWithReplicateOutput`` | ``S(0)``, ``S(0)`` | ``R`` | ``R`` (all-gather) |
| ``ColumnParallelLinearWithReplicateInputOutput`` | ``S(0)``, ``S(0)`` | any (to ``R``) | ``R`` |
| ``RowParallelLinear`` | ``S(1)``, ``P`` | ``S(-1)`` | ``P`` |
| ``RowParallelLinearWithReplicateOutput`` | ``S(1)``, ``P`` | ``S(-1)`` | ``R`` (all-reduce) |
| ``Linear``, ``ReplicateParallelLinear`` | ``R``, ``R`` | (linear's rules) | (linear's) |

The row-parallel bias is Partial: device 0 of the tp dim holds it, the others zeros, so the
Partial product ``x @ W.T`` plus it adds it once. A tp dim that the mesh lacks (by name) or of
one device means no tensor parallelism. A Column layer feeding a Row one needs no communication
in between; the Row layer's output reduction is the MLP's only collective.

>>> import dtorch, torch
>>> mesh = dtorch.DeviceMesh("cpu", [0, 1], mesh_dim_names=["tp"])
>>> up = ColumnParallelLinear(4, 6, device_mesh=mesh)
>>> down = RowParallelLinearWithReplicateOutput(6, 4, device_mesh=mesh)
>>> up.weight.placements, down.weight.placements, down.bias.placements
([Shard(dim=0)], [Shard(dim=1)], [Partial(reduce_op='sum')])
>>> y = down(up(dtorch.ones((3, 4), device_mesh=mesh)))
>>> y.shape, y.placements
(torch.Size([3, 4]), [Replicate()])
"""

from __future__ import annotations

import math

import dtorch

from ...mesh import DeviceMesh
from ...placement import Partial, Replicate, Shard, is_int
from ...tensor import Tensor
from .. import functional as F
from .. import init
from ..parameter import Parameter
from .module import Module

__all__ = ["Linear", "ColumnParallelLinear", "ColumnParallelLinearWithReplicateOutput",
           "ColumnParallelLinearWithReplicateInputOutput", "RowParallelLinear",
           "RowParallelLinearWithReplicateOutput", "ReplicateParallelLinear"]

# placements on the tp dim: (weight, bias, what the input must be)
_TP_LAYOUT = {"col": (Shard(0), Shard(0), "replicate"), "row": (Shard(1), Partial(), "last")}


# -- shared by the tensor-parallel layers (Embedding too) ---------------------------------------


def resolve_tp_dim(mesh: DeviceMesh, tp_dim) -> int | None:
    """The mesh dim index of ``tp_dim`` (a name or an index), or None for no tensor
    parallelism: no such name on the mesh, None, or a dim of one device."""
    if tp_dim is None:
        return None
    if isinstance(tp_dim, str):
        index = mesh.dim_name_index(tp_dim)
    elif is_int(tp_dim):
        index = int(tp_dim)
        if not -mesh.ndim <= index < mesh.ndim:
            raise IndexError(f"tp_dim={index} is out of range for a {mesh.ndim}-D device mesh")
        index %= mesh.ndim
    else:
        raise TypeError(f"tp_dim must be a mesh dim name (str), an index (int) or None, got "
                        f"{tp_dim!r}")
    return None if index is None or mesh.shape[index] == 1 else index


def tp_placements(mesh: DeviceMesh, tp_dim: int | None, placement) -> list:
    """``placement`` on ``tp_dim``, Replicate on every other mesh dim."""
    return [placement if i == tp_dim else Replicate() for i in range(mesh.ndim)]


def check_tp_input(module: Module, input, tp_dim: int | None, expect) -> None:
    """Raises ValueError naming ``module`` (its qualified name in the model being called), the
    placements it got and the ``redistribute`` to add, unless ``input`` is ``expect`` on
    ``tp_dim``."""
    if not isinstance(input, Tensor):
        raise TypeError(f"{_layer_name(module)}: expects a dtorch.Tensor input, got "
                        f"{type(input).__name__}; make one with dtorch.from_torch(t, "
                        f"device_mesh=..., placements=...)")
    mesh = module.weight.device_mesh
    if input.device_mesh != mesh:
        fix = input.placements if input.device_mesh.ndim == mesh.ndim else None
        raise ValueError(f"{_layer_name(module)}: the input is on {input.device_mesh!r}, the "
                         f"layer's weights on {mesh!r}; move it first, e.g. x = "
                         f"x.redistribute(device_mesh=mesh, placements={fix!r})")
    if tp_dim is None or input.check_placement(tp_dim, expect):
        return
    fix = list(input.placements)
    fix[tp_dim] = expect
    name = mesh.dim_names[tp_dim] if mesh.dim_names else None
    where = f"mesh dim {tp_dim}" + (f" ({name!r})" if name else "")
    raise ValueError(f"{_layer_name(module)}: input placements {input.placements} on {where}, "
                     f"expected {expect!r} there; add x = x.redistribute(placements={fix!r}) "
                     f"before the call")


def _layer_name(module: Module) -> str:
    name, kind = module.qualified_name(), type(module).__name__
    return kind if name == kind else f"{name} ({kind})"


def redistribute_on(x: Tensor, tp_dim: int | None, placement) -> Tensor:
    """``x`` with ``placement`` on ``tp_dim`` (the other mesh dims kept); as given when there is
    no tp dim or no placement."""
    if tp_dim is None or placement is None:
        return x
    return x.redistribute_by_dict(None, {tp_dim: placement}, default_placement_mode="keep")


def reset_linear(weight: Tensor, bias) -> None:
    """torch's init of ``nn.Linear`` and ``_ConvNd``, in place: ``kaiming_uniform_(a=sqrt(5))``
    for the weight (uniform within ``1 / sqrt(fan_in)``) and the bias uniform within that bound."""
    init.kaiming_uniform_(weight, a=math.sqrt(5))
    if bias is not None:
        fan_in, _ = init._calculate_fan_in_and_fan_out(weight)
        bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
        init.uniform_(bias, -bound, bound)


# -- the layers -----------------------------------------------------------------------------------


class Linear(Module):
    """torch's ``nn.Linear`` (``y = x @ W.T + b``) with its parameters laid out for tensor
    parallelism on ``tp_dim`` when ``tp_shard_type`` is ``"col"`` or ``"row"`` (see the module
    docstring). Without a shard type the layer is replicated: unlike DTorch's, a plain Linear
    on a mesh with a tp dim works."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 dtype=None, device_mesh=None, *, tp_dim="tp", tp_shard_type=None):
        super().__init__()
        if tp_shard_type not in (None, "col", "row"):
            raise ValueError(f"Linear: tp_shard_type must be 'col', 'row' or None, got "
                             f"{tp_shard_type!r}")
        mesh = dtorch.get_default_device_mesh(device, device_mesh)
        self.in_features, self.out_features = in_features, out_features
        self.tp_shard_type = tp_shard_type
        self.tp_dim = resolve_tp_dim(mesh, tp_dim) if tp_shard_type else None
        w, b = _TP_LAYOUT[tp_shard_type][:2] if tp_shard_type else (Replicate(), Replicate())
        self.weight = Parameter(dtorch.empty(
            (out_features, in_features), dtype=dtype, device_mesh=mesh,
            placements=tp_placements(mesh, self.tp_dim, w)))
        if bias:
            self.bias = Parameter(dtorch.empty(
                (out_features,), dtype=dtype, device_mesh=mesh,
                placements=tp_placements(mesh, self.tp_dim, b)))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """torch's initialisation, in place: ``kaiming_uniform_(a=sqrt(5))`` for the weight and
        ``uniform_`` for the bias, both within ``1 / sqrt(in_features)``."""
        reset_linear(self.weight, self.bias)

    def expected_input_placement(self, input: Tensor):
        """What the input must be on the tp dim: ``R`` (column), ``S(-1)`` (row)."""
        if _TP_LAYOUT[self.tp_shard_type][2] == "replicate":
            return Replicate()
        return Shard(input.dim() - 1)

    def redistribute_input(self, input, input_placement=None):
        """``input`` on the tp dim as ``input_placement`` when given, then checked: a column
        layer takes it ``R`` there, a row layer ``S(-1)``."""
        if self.tp_dim is None:
            return (input,), {}
        if isinstance(input, Tensor):
            input = redistribute_on(input, self.tp_dim, input_placement)
        expect = self.expected_input_placement(input) if isinstance(input, Tensor) else None
        check_tp_input(self, input, self.tp_dim, expect)
        return (input,), {}

    def redistribute_output(self, output, output_placement=None):
        """``output`` with ``output_placement`` on the tp dim when given."""
        return redistribute_on(output, self.tp_dim, output_placement)

    def forward(self, input: Tensor) -> Tensor:
        return F.linear(input, self.weight, self.bias)

    def extra_repr(self) -> str:
        text = (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")
        if self.tp_dim is not None:
            text += f", tp_dim={self.tp_dim}, tp_shard_type={self.tp_shard_type!r}"
        return text


class ColumnParallelLinear(Linear):
    """Output features sharded on ``tp_dim``: input ``R``, output ``S(-1)`` there."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 dtype=None, device_mesh=None, *, tp_dim="tp"):
        super().__init__(in_features, out_features, bias, device, dtype, device_mesh,
                         tp_dim=tp_dim, tp_shard_type="col")


class ColumnParallelLinearWithReplicateOutput(ColumnParallelLinear):
    """``ColumnParallelLinear`` whose output is gathered to ``R`` on ``tp_dim``."""

    def redistribute_output(self, output, output_placement=Replicate()):
        return super().redistribute_output(output, output_placement)


class ColumnParallelLinearWithReplicateInputOutput(ColumnParallelLinearWithReplicateOutput):
    """``ColumnParallelLinearWithReplicateOutput`` that first makes its input ``R`` on
    ``tp_dim`` (from any placement there)."""

    def redistribute_input(self, input, input_placement=Replicate()):
        return super().redistribute_input(input, input_placement)


class RowParallelLinear(Linear):
    """Input features sharded on ``tp_dim``: input ``S(-1)`` (a column layer's output), output
    a Partial sum there."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 dtype=None, device_mesh=None, *, tp_dim="tp"):
        super().__init__(in_features, out_features, bias, device, dtype, device_mesh,
                         tp_dim=tp_dim, tp_shard_type="row")


class RowParallelLinearWithReplicateOutput(RowParallelLinear):
    """``RowParallelLinear`` whose Partial output is all-reduced to ``R`` on ``tp_dim``."""

    def redistribute_output(self, output, output_placement=Replicate()):
        return super().redistribute_output(output, output_placement)


class ReplicateParallelLinear(Linear):
    """A replicated ``Linear`` (no tensor parallelism), as DTorch names it."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 dtype=None, device_mesh=None):
        super().__init__(in_features, out_features, bias, device, dtype, device_mesh,
                         tp_dim=None)

