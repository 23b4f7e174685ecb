"""The optimizers (see the package docstring)."""

from __future__ import annotations

import collections

import torch

from ..buckets import Buckets
from ..nn.fsdp import dp_sharded
from ..placement import Replicate
from ..step_replay import Stale, scalars_from
from ..tensor import Tensor
from .kernels import adam_update_, sgd_update_


# a group's entries an update takes as values, not in its call's shape (``optim/kernels.py``)
_VALUES = ("params", "lr", "betas")


class Optimizer(torch.optim.Optimizer):
    """``torch.optim.Optimizer`` over dtorch parameters: param groups, hooks, ``state_dict``
    and schedulers are torch's; ``zero_grad`` and the checks on parameters are dtorch's."""

    def add_param_group(self, param_group: dict) -> None:
        params = param_group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        for p in params:
            if not isinstance(p, Tensor):
                raise TypeError(f"{type(self).__name__} optimizes dtorch tensors, but one of "
                                f"the params is {type(p).__name__}")
            if not p.is_leaf:
                raise ValueError("can't optimize a non-leaf Tensor")
            if self.zero_stage == 3 and dp_sharded(p.placements, p.dim(), p.device_mesh,
                                                   self.dp_dim) != p.placements:
                raise ValueError(f"{type(self).__name__}(zero_stage=3) updates parameters "
                                 f"stored sharded on {self.dp_dim!r}, but one of shape "
                                 f"{tuple(p.shape)} is {p.placements}; apply "
                                 f"dtorch.nn.fully_shard to the model (each layer, then the "
                                 f"root) before building the optimizer")
        for name, default in self.defaults.items():
            param_group.setdefault(name, default)
        param_group["params"] = params
        seen = {id(p) for group in self.param_groups for p in group["params"]}
        if any(id(p) in seen for p in params):
            raise ValueError("some parameters appear in more than one parameter group")
        self.param_groups.append(param_group)
        for p in params:  # ZeRO-2: backward reduce-scatters the gradient into its chunks
            p.grad_placements = self.update_layout(p) if self.zero_stage >= 2 else None

    def state_dict(self) -> dict:
        """torch's format: state keyed by the parameter's index over all groups (torch maps
        only torch tensors to indices)."""
        saved = super().state_dict()
        index: dict = {}
        for group in self.param_groups:
            for p in group["params"]:
                index.setdefault(id(p), len(index))
        saved["state"] = {index[id(k)] if isinstance(k, Tensor) else k: v
                          for k, v in saved["state"].items()}
        return saved

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's ``load_state_dict``; each state tensor (dtorch, on any layout, or torch) is
        laid out as its parameter is updated, in a copy of its own: the updates write the
        state in place, and loading one optimizer's ``state_dict`` into another must not make
        their steps write the same moments (torch's keeps a tensor whose dtype and device
        already fit, so two torch optimizers would share it)."""
        groups, saved = self.param_groups, state_dict["param_groups"]
        if len(groups) != len(saved):
            raise ValueError("loaded state dict has a different number of parameter groups")
        if any(len(g["params"]) != len(sg["params"]) for g, sg in zip(groups, saved)):
            raise ValueError("loaded state dict contains a parameter group that doesn't match "
                             "the size of optimizer's group")
        params = {old: p for g, sg in zip(groups, saved)
                  for old, p in zip(sg["params"], g["params"])}
        self.state = collections.defaultdict(dict)
        for key, values in state_dict["state"].items():
            if key in params:
                p = params[key]
                self.state[p] = {name: self._laid_out(p, v) for name, v in values.items()}
        # (an option the saved groups lack, such as foreach from an older save: the current one)
        self.param_groups = [{**g, **sg, "params": g["params"]} for g, sg in zip(groups, saved)]

    def _laid_out(self, p: Tensor, value):
        """A saved state value for parameter ``p``: a tensor laid out as ``_state_like(p)``
        (the step count, a torch scalar, stays one)."""
        like = self.update_layout(p)
        if isinstance(value, Tensor):  # (a redistribute's result may view value's blocks)
            if value.device_mesh != p.device_mesh or list(value.placements) != like:
                value = value.redistribute(device_mesh=p.device_mesh, placements=like)
            return value.clone()
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            import dtorch

            dtype = torch.float32 if self._keeps_master(p) else p.dtype
            return dtorch.from_torch(value.to(dtype), p.device_mesh, like)
        return value.clone() if isinstance(value, torch.Tensor) else value

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's: the gradients dropped, or zeroed in place (a full write: an inf or NaN
        becomes 0, and a failed gradient a usable one)."""
        for group in self.param_groups:
            for p in group["params"]:
                if set_to_none:  # (assigned without a read: a gradient held unreduced
                    p.grad = None  # while its sync was off is dropped, not reduced first)
                elif p.grad is not None:
                    with torch.no_grad():
                        p.grad.zero_()

    @torch.no_grad()
    def step(self, closure=None):
        """torch's ``step``: the parameters with a gradient, updated by one call per group and
        mesh (``foreach`` and ``fused``: torch's implementations on each device's list of
        blocks), or with ``foreach=False`` one call per parameter (torch's single-tensor one).
        The update runs in each parameter's update layout (``update_layout``): on the
        parameter itself when that is its layout; else on a copy laid out so, copied back into
        it: under ZeRO each device updates its chunk (a local slice of the parameter and
        gradient) and the chunks are all-gathered, those of many parameters in one collective
        (``buckets.Buckets``); a Partial parameter is updated whole and split back. With
        master weights, a low-precision parameter is updated through its float32 copy
        ``state["master"]`` (the gradient cast up), then rounded."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        back = Buckets(lambda p, new: p.copy_(new))
        for group in self.param_groups:
            one_call = group["foreach"] is not False or group["fused"]
            batches: dict = {}
            for p in group["params"]:
                if p.grad is not None:
                    batches.setdefault(p.device_mesh if one_call else id(p), []).append(p)
            for params in batches.values():
                targets = [self._target(p, self.state[p]) for p in params]
                self.update(params, targets, group)
                for p, (param, _) in zip(params, targets):
                    if self._keeps_master(p):
                        back.add(p, param.to(p.dtype), p._spec)
                    elif param is not p:
                        back.add(p, param, p._spec)
        back.flush()
        return loss

    def _replayed(self, group: dict, params: list, values):
        """How a replayed step (``step_replay``) gets an update's scalars: ``values(states)``
        (after what ``update`` does to them), from the same group and states; stale once the
        group, its options other than those that travel as values (``_VALUES``), or a state
        was replaced."""
        options = {k: v for k, v in group.items() if k not in _VALUES}
        states = [self.state[p] for p in params]

        def check():
            if (not any(g is group for g in self.param_groups)
                    or {k: v for k, v in group.items() if k not in _VALUES} != options
                    or any(self.state.get(p) is not s for p, s in zip(params, states))):
                raise Stale

        return check, lambda: values(states)

    def update(self, params: list, targets: list, group: dict) -> None:
        """Issues the update of ``params`` (one mesh's, of ``group``): ``targets`` holds the
        (parameter, gradient) pair each is updated as (``_target``), in place."""
        raise NotImplementedError

    def _target(self, p: Tensor, state: dict) -> tuple:
        """``(param, grad)``: ``p`` and its gradient laid out as ``p`` is updated, or under
        master weights the float32 copy and the gradient cast up."""
        layout = self.update_layout(p)

        def laid_out(t):
            return t if list(t.placements) == layout else t.redistribute(placements=layout)

        grad = laid_out(p.grad)
        if self._keeps_master(p):
            if "master" not in state:
                state["master"] = laid_out(p).to(torch.float32)
            return state["master"], grad.to(torch.float32)
        return laid_out(p), grad

    @staticmethod
    def _implementation(group: dict) -> dict:
        """The group's torch implementation, as the update kernels take it."""
        return dict(foreach=group["foreach"] is not False, fused=bool(group["fused"]))

    def _keeps_master(self, p: Tensor) -> bool:
        return self.master_weights and p.dtype in (torch.bfloat16, torch.float16)

    def update_layout(self, p: Tensor) -> list:
        """Where ``p`` is updated and its state lives: its placements, Replicate where it is
        Partial, and under ZeRO (``zero_stage`` >= 1) sharded on the data-parallel dim as
        ``fully_shard`` shards a parameter (``dp_sharded``: along the first tensor dim no other
        mesh dim shards; kept Replicate if there is none). A parameter stored sharded
        (``fully_shard``) is updated where it is."""
        layout = [Replicate() if q.is_partial() else q for q in p.placements]
        if not self.zero_stage:
            return layout
        return dp_sharded(layout, p.dim(), p.device_mesh, self.dp_dim)

    def _state_like(self, p: Tensor) -> Tensor:
        """A zero state tensor laid out as ``p`` is updated (float32 beside master weights)."""
        import dtorch

        dtype = torch.float32 if self._keeps_master(p) else p.dtype
        return dtorch.zeros(tuple(p.shape), dtype=dtype, device_mesh=p.device_mesh,
                            placements=self.update_layout(p))

    def _options(self, zero_stage: int, dp_dim: str, master_weights: bool, foreach,
                 fused) -> None:
        """ZeRO through placements: stage 1 shards the state on ``dp_dim``, stage 2 the
        gradients too (``backward`` reduce-scatters them into ``.grad`` instead of
        all-reducing them), stage 3 the parameters: it takes them stored sharded by
        ``dtorch.nn.fully_shard`` (the optimizer sees parameters, not the layers whose forward
        gathers them), refuses one that ZeRO would shard but is not, and keeps the state and
        gradients laid out as they are. ``master_weights``: bfloat16/float16 parameters are
        updated through float32 copies, with float32 state. ``foreach``/``fused``: torch's
        (``step``); the default (None) is foreach, which on one device is bit for bit torch's
        ``foreach=True`` (and on CPU its single-tensor result too); ``fused`` may differ from
        both in the last bits, as torch's does."""
        self.master_weights = bool(master_weights)
        if fused and foreach:
            raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
        if zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
        self.zero_stage, self.dp_dim = zero_stage, dp_dim


def _check(value: float, name: str, low: float = 0.0) -> None:
    if not value >= low:
        raise ValueError(f"Invalid {name}: {value}")


class SGD(Optimizer):
    """torch's ``SGD``: momentum, dampening, nesterov, weight decay, maximize."""

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, fused: bool | None = None,
                 zero_stage: int = 0, dp_dim: str = "dp", master_weights: bool = False):
        _check(lr, "learning rate")
        _check(momentum, "momentum value")
        _check(weight_decay, "weight_decay value")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        self._options(zero_stage, dp_dim, master_weights, foreach, fused)  # before the groups
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                      weight_decay=weight_decay, nesterov=nesterov,
                                      maximize=maximize, foreach=foreach, fused=fused))

    def update(self, params: list, targets: list, group: dict) -> None:
        states = [self.state[p] for p in params]
        firsts = [bool(group["momentum"]) and "momentum_buffer" not in s for s in states]
        for p, state, first in zip(params, states, firsts):
            if first:
                state["momentum_buffer"] = self._state_like(p)
        buffers = [s["momentum_buffer"] for s in states] if group["momentum"] else []
        with scalars_from(*self._replayed(group, params, lambda _: [float(group["lr"])])):
            sgd_update_([t for t, _ in targets], [g for _, g in targets], buffers,
                        float(group["lr"]), momentum=group["momentum"],
                        dampening=group["dampening"], weight_decay=group["weight_decay"],
                        nesterov=group["nesterov"], maximize=group["maximize"], firsts=firsts,
                        **self._implementation(group))


class Adam(Optimizer):
    """torch's ``Adam`` (``amsgrad`` not supported yet); ``AdamW`` decouples the decay."""

    decoupled = False

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, fused: bool | None = None,
                 zero_stage: int = 0, dp_dim: str = "dp", master_weights: bool = False):
        _check(lr, "learning rate")
        _check(eps, "epsilon value")
        _check(weight_decay, "weight_decay value")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Invalid beta parameters: {betas}")
        if amsgrad:
            raise NotImplementedError(f"dtorch.optim.{type(self).__name__}: amsgrad=True is "
                                      f"not supported yet")
        self._options(zero_stage, dp_dim, master_weights, foreach, fused)  # before the groups
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay, amsgrad=amsgrad,
                                      maximize=maximize, foreach=foreach, fused=fused))

    def update(self, params: list, targets: list, group: dict) -> None:
        states = [self.state[p] for p in params]
        for p, state in zip(params, states):
            if "step" not in state:  # (``_target`` may have made the master copy)
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = self._state_like(p)
                state["exp_avg_sq"] = self._state_like(p)
            state["step"] += 1
        beta1, beta2 = group["betas"]

        def counted(states):  # a replay's step counts: each one more, as above
            for state in states:
                state["step"] += 1
            return [float(s["step"]) for s in states] + [float(group["lr"]),
                                                         *map(float, group["betas"])]

        with scalars_from(*self._replayed(group, params, counted)):
            adam_update_([t for t, _ in targets], [g for _, g in targets],
                         [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                         [float(s["step"]) for s in states], float(group["lr"]), beta1=beta1,
                         beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                         maximize=group["maximize"], decoupled=self.decoupled,
                         **self._implementation(group))


class AdamW(Adam):
    """torch's ``AdamW``: Adam with decoupled weight decay (default 1e-2)."""

    decoupled = True

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, fused: bool | None = None,
                 zero_stage: int = 0, dp_dim: str = "dp", master_weights: bool = False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize,
                         foreach=foreach, fused=fused, zero_stage=zero_stage, dp_dim=dp_dim,
                         master_weights=master_weights)
