"""Comparing tensors of torch, dtorch and NumPy, one pair at a time or by tags.

The static comparisons take any mix of ``torch.Tensor``, ``dtorch.Tensor`` (its full value is
fetched) and ``numpy.ndarray``, and are False when the dtypes or shapes differ; values are
compared on the CPU, so a CUDA torch tensor and a dtorch tensor compare by value. With
``print_no_equal_msg`` a mismatch prints where it is.

A ``TensorChecker`` keeps tensors by tag: two runs (torch's and dtorch's) register under the
same tags, then ``check_equal``/``check_allclose`` compare each tag's tensors with its first.
``module_register_tensor_checker`` does the registering for every submodule that the models
share by name, through forward hooks: its parameters and buffers, its inputs and its outputs
at each call; a module called again gets tags of its own (``..._call_1``).

>>> import torch, dtorch
>>> from dtorch.util.tensor_checker import TensorChecker
>>> TensorChecker.tensor_allclose(torch.ones(3), dtorch.ones(3) + 1e-9)
True
>>> checker = TensorChecker()
>>> checker.register_tensor("x", torch.arange(3))
>>> checker.register_tensor("x", dtorch.arange(3))
>>> checker.check_equal(verbose=False)
True
"""

from __future__ import annotations

import enum
import os

import numpy as np
import torch

import dtorch


class DumpMode(enum.Enum):
    """Which tags' tensors a check saves (as ``<tag>_idx_<i>.npy`` under ``dump_path``)."""

    NOT = 1  # none
    ALL = 2  # every tag's
    NOT_EQUAL = 3  # the tags whose tensors differ
    FIRST_NOT_EQUAL = 4  # the first tag whose tensors differ


def _as_torch(value) -> torch.Tensor:
    if isinstance(value, dtorch.Tensor):
        return value.to_torch()
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.copy())
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    raise TypeError(f"expected a torch.Tensor, dtorch.Tensor or numpy.ndarray, got "
                    f"{type(value).__name__}")


def _comparable(a, b, report: bool):
    """(a, b) as CPU torch tensors when their dtypes and shapes agree, else None."""
    a, b = _as_torch(a), _as_torch(b)
    for what, x, y in (("dtype", a.dtype, b.dtype), ("shape", tuple(a.shape), tuple(b.shape))):
        if x != y:
            if report:
                print(f"TensorChecker: {what} differs: {x} vs {y}")
            return None
    return a, b


def _report(a: torch.Tensor, b: torch.Tensor, differs: torch.Tensor) -> None:
    """Where ``a`` and ``b`` differ (``differs``: the elements that do), the worst first."""
    n = int(differs.sum())
    gap = (a.double() - b.double()).abs().nan_to_num(float("inf")) if a.numel() else a.double()
    worst = int(torch.where(differs, gap, torch.zeros_like(gap)).flatten().argmax()) if n else 0
    where = list(np.unravel_index(worst, tuple(a.shape))) if a.dim() else []
    print(f"TensorChecker: {n} of {a.numel()} elements differ ({a.dtype}, shape "
          f"{list(a.shape)}); the largest at {[int(i) for i in where]}: "
          f"{a.flatten()[worst].item()} vs {b.flatten()[worst].item()}")


def _wide(t: torch.Tensor) -> torch.Tensor:
    """Floats and complex as they are, everything else as float64 (exact for ints to 2**53),
    so tolerances apply to every dtype."""
    return t if t.is_floating_point() or t.is_complex() else t.double()


class TensorChecker:
    """Tensors by tag, to compare two runs; and the comparisons themselves (static)."""

    def __init__(self) -> None:
        self.tensor_map: dict = {}

    def clear(self) -> None:
        self.tensor_map.clear()

    def register_tensor(self, tag: str, tensor) -> None:
        """Keeps a CPU copy of ``tensor``'s value under ``tag``."""
        self.tensor_map.setdefault(tag, []).append(_as_torch(tensor).clone())

    def tensor_from_registered(self, tag: str, like):
        """The first value registered under ``tag``, as ``like`` is: a torch tensor on its
        device, or a dtorch tensor in its layout (for feeding one run's value to the other)."""
        value = self.tensor_map[tag][0]
        if value.dtype != like.dtype:
            raise TypeError(f"TensorChecker: {tag!r} holds {value.dtype}, not {like.dtype}")
        if isinstance(like, dtorch.Tensor):
            return dtorch.Tensor(value, like.device_mesh, like.placements)
        return value.to(like.device)

    def check_equal(self, dump_mode: DumpMode = DumpMode.NOT, dump_path: str = "",
                    verbose: bool = True) -> bool:
        """Whether every tag's tensors equal its first (``tensor_equal``)."""
        return self._check(lambda a, b: self.tensor_equal(a, b, verbose), dump_mode, dump_path,
                           verbose)

    def check_allclose(self, rtol: float = 1e-05, atol: float = 1e-08, equal_nan: bool = False,
                       dump_mode: DumpMode = DumpMode.NOT, dump_path: str = "",
                       verbose: bool = True) -> bool:
        """Whether every tag's tensors are close to its first (``tensor_allclose``)."""
        return self._check(lambda a, b: self.tensor_allclose(a, b, rtol, atol, equal_nan,
                                                             verbose),
                           dump_mode, dump_path, verbose)

    def _check(self, same, dump_mode: DumpMode, dump_path: str, verbose: bool) -> bool:
        if dump_mode != DumpMode.NOT:
            os.makedirs(dump_path, exist_ok=True)
        ok, first_failure = True, True
        for tag, tensors in self.tensor_map.items():
            agree = True
            for other in tensors[1:]:  # each compared, so that each mismatch is reported
                agree = same(tensors[0], other) and agree
            if verbose:
                print(f"TensorChecker: {tag}: {len(tensors)} tensors "
                      f"{'agree' if agree else 'differ'}")
            dump = (dump_mode == DumpMode.ALL or not agree and (
                dump_mode == DumpMode.NOT_EQUAL or dump_mode == DumpMode.FIRST_NOT_EQUAL
                and first_failure))
            if dump:
                for i, t in enumerate(tensors):
                    np.save(os.path.join(dump_path, f"{tag}_idx_{i}.npy"), t.numpy())
            first_failure = first_failure and agree
            ok = ok and agree
        return ok

    @staticmethod
    def tensor_equal(a, b, print_no_equal_msg: bool = True) -> bool:
        """Same dtype, shape and elements (``torch.equal``: NaN differs from NaN)."""
        pair = _comparable(a, b, print_no_equal_msg)
        if pair is None:
            return False
        a, b = pair
        equal = torch.equal(a, b)
        if not equal and print_no_equal_msg:
            _report(a, b, a != b)
        return equal

    @staticmethod
    def tensor_allclose(a, b, rtol: float = 1e-05, atol: float = 1e-08,
                        equal_nan: bool = False, print_no_equal_msg: bool = True) -> bool:
        """Same dtype and shape, and ``torch.allclose`` (``|a - b| <= atol + rtol * |b|``)."""
        pair = _comparable(a, b, print_no_equal_msg)
        if pair is None:
            return False
        a, b = map(_wide, pair)
        close = torch.isclose(a, b, rtol, atol, equal_nan)
        if not bool(close.all()) and print_no_equal_msg:
            _report(a, b, ~close)
        return bool(close.all())

    @staticmethod
    def tensor_meanclose(a, b, rtol: float = 1e-05, atol: float = 1e-08,
                         print_no_equal_msg: bool = True) -> bool:
        """Same dtype and shape, and close on average: ``mean|a - b| <= atol + rtol *
        mean|b|`` (for low-precision runs whose elements stray but whose mean does not)."""
        pair = _comparable(a, b, print_no_equal_msg)
        if pair is None:
            return False
        a, b = (t.double() if not t.is_complex() else t for t in pair)
        error = (a - b).abs().mean().item() if a.numel() else 0.0
        bound = atol + rtol * (b.abs().mean().item() if b.numel() else 0.0)
        if not error <= bound and print_no_equal_msg:
            print(f"TensorChecker: mean error {error:.3g} exceeds {bound:.3g} (shape "
                  f"{list(a.shape)})")
        return error <= bound


tensor_checker = TensorChecker()  # the shared checker, as DTorch's


def module_register_tensor_checker(modules, checker: TensorChecker | None = None) -> list:
    """Registers, at each call of every submodule the ``modules`` (one module or several:
    torch's and dtorch's) share by name, its parameters and buffers, inputs and outputs under
    ``module_checker#<name>_<what>`` (a second call of a module: ``..._call_1_<what>``).
    Returns the hooks' handles (``handle.remove()`` stops it)."""
    checker = tensor_checker if checker is None else checker
    modules = list(modules) if isinstance(modules, (list, tuple)) else [modules]
    named = [dict(m.named_modules()) for m in modules]
    shared = set.intersection(*(set(n) for n in named))
    handles = []
    for by_name in named:
        for name, module in by_name.items():
            if name in shared:
                handles.append(module.register_forward_hook(
                    _registering_hook(checker, f"module_checker#{name}"), with_kwargs=True))
    return handles


def _registering_hook(checker: TensorChecker, base: str):
    calls = [0]

    def hook(module, args, kwargs, output):
        tag = base if calls[0] == 0 else f"{base}_call_{calls[0]}"
        calls[0] += 1
        state = {**dict(module.named_parameters(recurse=False)),
                 **dict(module.named_buffers(recurse=False))}
        inputs = {**{f"input_{i}": a for i, a in enumerate(args)},
                  **{f"input_{k}": v for k, v in kwargs.items()}}
        outputs = output if isinstance(output, (list, tuple)) else [output]
        for what, value in [*state.items(), *inputs.items(),
                            *((f"output_{i}", o) for i, o in enumerate(outputs))]:
            if isinstance(value, (torch.Tensor, dtorch.Tensor)):
                checker.register_tensor(f"{tag}_{what}", value)

    return hook
