"""``dtorch.nn.Module``: a ``torch.nn.Module`` whose parameters and buffers are dtorch tensors.

A call runs ``redistribute_input`` (the layout the module wants its inputs in), ``forward`` and
``redistribute_output``, between torch's forward pre-hooks and forward hooks (DTorch runs no
hooks). Everything else is torch's: ``named_parameters``, ``modules``, ``apply``,
``train()``/``eval()``, ``state_dict()`` (dtorch tensors, aliases of the parameters), but for one
default: a new module starts in eval mode, as DTorch's do (programs written for DTorch never call
``eval()``, and in training mode their dropout would drop); call ``train()`` before training.

``load_state_dict`` takes torch or dtorch tensors and puts each value in its parameter's layout:
a full torch state dict loads into any mesh, with no manual sharding (Shard slices, uneven
too; Replicate copies; a Partial parameter holds the value once). Missing and unexpected keys
are torch's errors; a shape mismatch, or a value of another kind of dtype (a float into an
integer parameter), raises naming the key. A float value of another width is cast, as torch does.

>>> import dtorch, torch
>>> class Scale(dtorch.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.w = dtorch.nn.Parameter(dtorch.ones(3))
...     def forward(self, x):
...         return x * self.w
>>> m = Scale()
>>> m.load_state_dict({"w": torch.tensor([1., 2., 3.])})
<All keys matched successfully>
>>> m(dtorch.ones(3)).to_torch()
tensor([1., 2., 3.])
"""

from __future__ import annotations

import threading

import torch
from torch.nn.modules import module as _torch_module

from ...autograd import grad_sync
from ...mesh import DeviceMesh
from ...ops.conversion import source_placements, to_arguments
from ...ops.creation import from_torch
from ...checkpoint.kernels import failure_token
from ...tensor import Tensor
from ..parameter import Buffer, Parameter


_calls = threading.local()  # the modules being called, outermost first (for qualified_name)


class Module(torch.nn.Module):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.training = False  # DTorch's default (see the module docstring)

    # -- the call -------------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        stack = _calls.__dict__.setdefault("stack", [])
        stack.append(self)
        try:
            if not (self._forward_pre_hooks or self._forward_hooks
                    or _torch_module._global_forward_pre_hooks
                    or _torch_module._global_forward_hooks):
                return self._pipeline(args, kwargs)
            return self._with_hooks(args, kwargs)
        finally:
            stack.pop()

    def qualified_name(self) -> str:
        """This module's name in the outermost module being called (``layers.3.mlp.up``), for
        errors raised inside a call; its class name outside one, or when it is the outermost."""
        stack = getattr(_calls, "stack", None)
        if stack and stack[0] is not self:
            for name, module in stack[0].named_modules():
                if module is self:
                    return name
        return type(self).__name__

    def _pipeline(self, args, kwargs):
        moved = self.redistribute_input(*args, **kwargs)
        try:
            args, kwargs = moved
            args, kwargs = tuple(args), dict(kwargs)
        except (TypeError, ValueError):
            raise TypeError(f"{type(self).__name__}.redistribute_input must return (args, "
                            f"kwargs), got {moved!r}") from None
        return self.redistribute_output(self.forward(*args, **kwargs))

    def _with_hooks(self, args, kwargs):
        """torch's forward pre-hooks and forward hooks (global ones first, each with or without
        kwargs as registered) around the pipeline."""
        pre = {**_torch_module._global_forward_pre_hooks, **self._forward_pre_hooks}
        for hook_id, hook in pre.items():
            if hook_id in self._forward_pre_hooks_with_kwargs:
                result = hook(self, args, kwargs)
                if result is not None:
                    args, kwargs = result
            else:
                result = hook(self, args)
                if result is not None:
                    args = result if isinstance(result, tuple) else (result,)
        out = self._pipeline(args, kwargs)
        post = {**_torch_module._global_forward_hooks, **self._forward_hooks}
        for hook_id, hook in post.items():
            if hook_id in self._forward_hooks_with_kwargs:
                result = hook(self, args, kwargs, out)
            else:
                result = hook(self, args, out)
            if result is not None:
                out = result
        return out

    def redistribute_input(self, *args, **kwargs):
        """The inputs in the layout ``forward`` takes: ``(args, kwargs)``. Default: as given."""
        return args, kwargs

    def redistribute_output(self, output):
        """The output in the layout callers get. Default: as ``forward`` made it."""
        return output

    # -- registration ---------------------------------------------------------------------------
    def __setattr__(self, name: str, value) -> None:
        """torch's rules, for dtorch tensors too: a Parameter replaces a plain attribute, a
        buffer or a child module of its name (``self.w = None; self.w = Parameter(...)``); a
        Buffer is refused over a plain attribute (``KeyError``) or a parameter (``TypeError``).
        One leniency: a dtorch tensor
        assigned to a parameter's name becomes a Parameter (torch raises ``TypeError``)."""
        if isinstance(value, Parameter):
            self._forget(name)
            self.register_parameter(name, value)
        elif isinstance(value, Buffer):
            if name in self.__dict__.get("_parameters", {}):
                raise TypeError(f"cannot assign 'dtorch.nn.Buffer' as parameter '{name}' "
                                f"(dtorch.nn.Parameter or None expected)")
            self.register_buffer(name, value, persistent=value.persistent)
        elif isinstance(value, Tensor) and name in self.__dict__.get("_parameters", {}):
            self.register_parameter(name, Parameter(value))  # torch: a tensor there is refused
        elif isinstance(value, Tensor) and name in self.__dict__.get("_buffers", {}):
            self._buffers[name] = value
        else:
            super().__setattr__(name, value)

    def _forget(self, name: str) -> None:
        """Drops ``name`` as a plain attribute, buffer or child module (what torch's
        ``__setattr__`` does before it registers a parameter)."""
        self.__dict__.pop(name, None)
        for table in ("_buffers", "_modules"):
            self.__dict__.get(table, {}).pop(name, None)
        self.__dict__.get("_non_persistent_buffers_set", set()).discard(name)

    def no_sync(self):
        """DDP's ``no_sync()``: backwards inside it sum this module's data-parallel gradients on
        their devices without reducing them; the first backward after it reduces the sum once
        (``autograd/grad_sync.py``). Reading ``.grad`` meanwhile reduces what is summed so far:
        dtorch's ``.grad`` is always the whole gradient, not a device's share."""
        return grad_sync.no_sync(self.parameters())

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *,
                                   recurse: bool = True) -> None:
        """FSDP2's switch, the same mechanism as ``no_sync`` for this module's parameters
        (``recurse=False``: its own only) until switched back on."""
        grad_sync.switch(("module", id(self), recurse), self.parameters(recurse=recurse),
                         requires_gradient_sync)

    def get_parameter(self, target: str):
        """torch's ``get_parameter`` (``"layers.0.weight"``), for dtorch Parameters too: HF's
        loaders call it."""
        module_path, _, name = target.rpartition(".")
        param = getattr(self.get_submodule(module_path), name, None)
        if isinstance(param, Parameter):
            return param
        return super().get_parameter(target)  # a torch Parameter, or torch's error

    def register_parameter(self, name: str, param) -> None:
        if param is None or isinstance(param, torch.nn.Parameter):
            return super().register_parameter(name, param)
        if not isinstance(param, Parameter):
            raise TypeError(f"cannot assign {type(param).__name__} object to parameter "
                            f"{name!r} (dtorch.nn.Parameter or None required)")
        self._check_new_name(name, "_parameters")
        self._parameters[name] = param

    def register_buffer(self, name: str, tensor, persistent: bool = True) -> None:
        if tensor is None or isinstance(tensor, torch.Tensor):
            return super().register_buffer(name, tensor, persistent)
        if not isinstance(tensor, Tensor):
            raise TypeError(f"cannot assign {type(tensor).__name__} object to buffer {name!r} "
                            f"(dtorch.Tensor or None required)")
        self._check_new_name(name, "_buffers")
        self._buffers[name] = tensor
        if persistent:
            self._non_persistent_buffers_set.discard(name)
        else:
            self._non_persistent_buffers_set.add(name)

    def _check_new_name(self, name: str, table: str) -> None:
        """torch's checks of a name before it registers a parameter or buffer."""
        if "_parameters" not in self.__dict__:
            raise AttributeError("cannot assign parameters or buffers before "
                                 "Module.__init__() call")
        if not isinstance(name, str) or not name or "." in name:
            raise KeyError(f"parameter or buffer name must be a non-empty string without "
                           f"'.', got {name!r}")
        if hasattr(self, name) and name not in getattr(self, table):
            raise KeyError(f"attribute '{name}' already exists")

    def first_param_device_mesh(self) -> DeviceMesh | None:
        """The mesh of the first parameter, or None for a module without parameters."""
        for p in self.parameters():
            return p.device_mesh if isinstance(p, Tensor) else None
        return None

    # -- moving and casting ---------------------------------------------------------------------
    def to(self, *args, device_mesh=None, dtype=None, device=None, non_blocking=False):
        """Moves parameters and buffers to ``device_mesh`` (each keeps its placements: the mesh
        must have as many dims) and casts the floating ones to a floating ``dtype``, as
        torch's ``Module.to``; ``x.to``'s argument forms (a mesh, a dtype, ``device=``)."""
        dtype, device_mesh, device, _, _ = to_arguments(args, dtype, device_mesh, device,
                                                        non_blocking)
        if dtype is not None and not (dtype.is_floating_point or dtype.is_complex):
            raise TypeError(f"nn.Module.to only accepts floating point or complex dtypes, but "
                            f"got desired dtype={dtype}")

        def convert(t: Tensor) -> Tensor:
            cast = dtype if dtype is not None and t.dtype.is_floating_point else None
            return t.to(dtype=cast, device_mesh=device_mesh, device=device)

        for module in self.modules():
            for name, p in list(module._parameters.items()):
                if isinstance(p, Tensor):
                    module._parameters[name] = Parameter(convert(p), p.requires_grad)
            for name, b in list(module._buffers.items()):
                if isinstance(b, Tensor):
                    module._buffers[name] = convert(b)
        return self

    # -- state dicts ----------------------------------------------------------------------------
    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """torch's; then the values loaded are read back as one token per mesh
        (``check_loaded``), so a value that failed on the devices raises here, naming its key,
        instead of reporting every key matched."""
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        targets = self.state_dict(keep_vars=True)
        check_loaded(self, {k: targets[k] for k in state_dict
                            if isinstance(targets.get(k), Tensor)})
        return result

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:
        """Copies each value into its parameter's (buffer's) layout; torch's own keys
        bookkeeping (``load_state_dict`` reports missing and unexpected keys)."""
        persistent = {k: v for k, v in self._buffers.items()
                      if k not in self._non_persistent_buffers_set}
        for name, target in {**self._parameters, **persistent}.items():
            key = prefix + name
            if target is None:
                continue
            if key not in state_dict:
                if strict:
                    missing_keys.append(key)
                continue
            if not isinstance(target, Tensor):  # a torch parameter in a dtorch module
                continue
            error = load_into(target, state_dict[key], key)
            if error:
                error_msgs.append(error)
        if strict:
            for key in state_dict:
                if key.startswith(prefix) and key != prefix + "_extra_state":
                    rest = key[len(prefix):].split(".", 1)[0]
                    if rest not in self._modules and rest not in self._parameters and (
                            rest not in self._buffers):
                        unexpected_keys.append(key)


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    return "complex" if dtype.is_complex else "float" if dtype.is_floating_point else "int"


def mismatch(key: str, target, value) -> str | None:
    """What keeps ``value`` (anything with a shape and dtype: a tensor, a checkpoint entry) out
    of ``target``, in torch's words where torch has them; None when it fits."""
    if tuple(value.shape) != tuple(target.shape):
        return (f"size mismatch for {key}: copying a param with shape {tuple(value.shape)} from "
                f"checkpoint, the shape in current model is {tuple(target.shape)}.")
    if _kind(value.dtype) != _kind(target.dtype):
        return (f"dtype mismatch for {key}: copying a {value.dtype} value into a "
                f"{target.dtype} parameter; cast the value first if that is meant")
    return None


def check_loaded(module, targets: dict) -> None:
    """torch's ``load_state_dict`` error, naming each key of ``targets`` (key -> tensor) whose
    value carries a failure on any device (the copy of a failed value, or a read that failed).
    One ``failure_token`` read per mesh; only a mesh whose token fails is asked tensor by
    tensor."""
    by_mesh: dict = {}
    for key, t in targets.items():
        by_mesh.setdefault(t.device_mesh, []).append((key, t))
    reads = [(group, failure_token([t for _, t in group]).to_torch_async())
             for group in by_mesh.values()]
    messages = []
    for group, read in reads:
        try:
            read.get()
        except RuntimeError:
            failed = [(key, _failure(t)) for key, t in group]
            failed = [f'While copying the parameter named "{key}": {error}'
                      for key, error in failed if error]
            if not failed:  # an earlier kernel's error, reported by this read
                raise
            messages += failed
    if messages:
        raise RuntimeError("Error(s) in loading state_dict for {}:\n\t{}".format(
            type(module).__name__, "\n\t".join(messages)))


def _failure(t: Tensor) -> str | None:
    try:
        failure_token([t]).to_torch()
    except RuntimeError as e:
        return str(e)
    return None


def load_into(target: Tensor, value, key: str) -> str | None:
    """Copies ``value`` (a torch or dtorch tensor) into ``target``'s blocks, each device only its
    own: the message of what is wrong with it, or None."""
    if not isinstance(value, (torch.Tensor, Tensor)):
        return (f'While copying the parameter named "{key}", expected torch.Tensor or '
                f'dtorch.Tensor from checkpoint but received {type(value).__name__}')
    error = mismatch(key, target, value)
    if error:
        return error
    if isinstance(value, torch.Tensor):  # straight to each device's block, no full copy there
        spec = target._spec
        value = from_torch(value.to(target.dtype), spec.mesh, source_placements(spec, spec))
    target.copy_(value)
    return None
