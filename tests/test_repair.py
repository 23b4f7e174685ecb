"""A failed value is repaired by a full write, never by a partial one, and a load that fails
says so: a tensor whose kernel failed (in place, keeping its storage, or a result never made)
is usable again after ``copy_``, ``fill_``, ``zero_``, ``load_state_dict`` or
``load_checkpoint``; an indexing assignment, an ``add_`` or a full write into a view never made
leaves it failed, raising the first failure; a load that leaves a value failed raises naming
the key; a failed optimizer step names the ``opt.step()`` line."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from safetensors.torch import save_file

import dtorch
from dtorch import Partial, Replicate, Shard
from helpers import assert_close

R, S0 = Replicate(), Shard(0)
LAYOUTS = [[R], [S0], [Partial()]]


@pytest.fixture(scope="module")
def pair():
    return dtorch.DeviceMesh("cpu", [0, 1])


def here() -> str:
    f = sys._getframe(1)
    return f"{f.f_code.co_filename}:{f.f_lineno}"


def failed_value(mesh) -> tuple:
    """An int tensor (Replicate) whose kernel failed, and the line that failure names."""
    bad = dtorch.from_torch(torch.arange(6), device_mesh=mesh) // 0; line = here()
    return bad, line


def failed_in_place(mesh, placements) -> tuple:
    """A tensor whose in-place kernel did not run (its operand failed): it keeps its
    storage."""
    bad, line = failed_value(mesh)
    x = dtorch.from_torch(torch.arange(6), device_mesh=mesh, placements=placements)
    x.mul_(bad)
    with pytest.raises(RuntimeError, match="floor_divide"):
        dtorch.sync()
    return x, line


def failed_result(mesh, placements) -> tuple:
    """A tensor that was never made (its kernel's operand failed): it has no storage."""
    bad, line = failed_value(mesh)
    x = bad.redistribute(placements=placements)
    with pytest.raises(RuntimeError, match="floor_divide"):
        dtorch.sync()
    return x, line


def assert_failed(x, line) -> None:
    with pytest.raises(RuntimeError, match="floor_divide") as info:
        x.to_torch()
    assert line in str(info.value)


FULL_WRITES = {  # name -> (write, the value after it)
    "copy_": (lambda x, mesh: x.copy_(dtorch.from_torch(torch.arange(6) * 7, device_mesh=mesh)),
              torch.arange(6) * 7),
    "copy_ broadcast": (lambda x, mesh: x.copy_(dtorch.tensor(3, device_mesh=mesh)),
                        torch.full((6,), 3)),
    "fill_": (lambda x, mesh: x.fill_(5), torch.full((6,), 5)),
    "fill_ tensor": (lambda x, mesh: x.fill_(dtorch.tensor(4, device_mesh=mesh)),
                     torch.full((6,), 4)),
    "zero_": (lambda x, mesh: x.zero_(), torch.zeros(6, dtype=torch.int64)),
}


@pytest.mark.parametrize("placements", LAYOUTS, ids=str)
@pytest.mark.parametrize("failed", [failed_in_place, failed_result])
@pytest.mark.parametrize("name", sorted(FULL_WRITES))
def test_a_full_write_makes_a_failed_tensor_usable_again(name, failed, placements, pair):
    write, expected = FULL_WRITES[name]
    x, line = failed(pair, placements)
    assert_failed(x, line)
    write(x, pair)
    assert torch.equal(x.to_torch(), expected)
    assert x.placements == placements
    assert torch.equal((x * 2).to_torch(), expected * 2)  # and what is computed from it
    dtorch.sync()  # nothing more to tell


PARTIAL_WRITES = {
    "setitem": lambda x, mesh: x.__setitem__(slice(0, 3), 1),
    "setitem all": lambda x, mesh: x.__setitem__(slice(None), 1),
    "add_": lambda x, mesh: x.add_(1),
    "view": lambda x, mesh: x[1:4].fill_(2),  # a view of a failed tensor: never made
}


@pytest.mark.parametrize("failed", [failed_in_place, failed_result])
@pytest.mark.parametrize("name", sorted(PARTIAL_WRITES))
def test_a_partial_write_leaves_a_failed_tensor_failed(name, failed, pair):
    """A write of part of it (an indexing assignment, even of every element, is one), or one
    that reads it, or a full write of a view of it: the first failure stands, named at its
    line, and nothing new is told."""
    x, line = failed(pair, [R])
    PARTIAL_WRITES[name](x, pair)
    assert_failed(x, line)
    dtorch.sync()


def test_a_view_never_made_stays_failed_after_its_base_is_repaired(pair):
    """The view's storage would have been its base's, which it never shared: repairing the base
    does not make it, and writing all of it does not either (its writes could not reach the
    base)."""
    x, line = failed_result(pair, [R])
    view = x[2:4]
    x.copy_(dtorch.from_torch(torch.arange(6), device_mesh=pair))
    view.fill_(9)
    assert_failed(view, line)
    assert torch.equal(x.to_torch(), torch.arange(6))  # the base holds its own value
    assert torch.equal(x[2:4].to_torch(), torch.tensor([2, 3]))  # a new view of it is fine


class Model(dtorch.nn.Module):
    def __init__(self, mesh):
        super().__init__()
        self.w = dtorch.nn.Parameter(dtorch.from_torch(torch.arange(8.0).reshape(4, 2),
                                                       device_mesh=mesh, placements=[S0]))


def fail_a_step(model, opt) -> str:
    """The update kernel fails (a gradient of another shape, set past the assignment's check,
    as ``w.grad = ...`` let through before it checked): ``w`` is failed."""
    mesh = model.w.device_mesh
    model.w._grad = dtorch.from_torch(torch.ones(2, 4), device_mesh=mesh, placements=[S0])
    opt.step(); line = here()
    model.w._grad = None
    return line


def save(tmp_path, kind: str, value: torch.Tensor) -> str:
    path = os.path.join(tmp_path, f"w.{kind}")
    if kind == "safetensors":
        save_file({"w": value}, path)
    else:
        torch.save({"w": value}, path)
    return path


REPAIRS = {
    "copy_": lambda m, tmp, v: m.w.copy_(dtorch.from_torch(v, device_mesh=m.w.device_mesh)),
    "load_state_dict": lambda m, tmp, v: m.load_state_dict({"w": v}),
    "load_state_dict dtorch": lambda m, tmp, v: m.load_state_dict(
        {"w": dtorch.from_torch(v, device_mesh=m.w.device_mesh, placements=[R])}),
    "load_checkpoint safetensors": lambda m, tmp, v: dtorch.load_checkpoint(
        m, save(tmp, "safetensors", v)),
    "load_checkpoint pt": lambda m, tmp, v: dtorch.load_checkpoint(m, save(tmp, "pt", v)),
}


@pytest.mark.parametrize("repair", sorted(REPAIRS))
def test_a_failed_step_names_its_line_and_a_load_repairs_the_parameter(repair, pair, tmp_path):
    """The step's kernel error names the ``opt.step()`` line (not torch's ``no_grad``
    wrapper); the parameter raises that error on every use until a full write or a load
    replaces its value, after which training goes on as torch's."""
    model = Model(pair)
    opt = dtorch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    line = fail_a_step(model, opt)
    with pytest.raises(RuntimeError, match="sgd_update_ failed") as info:
        dtorch.sync()
    assert f"(called at {line})" in str(info.value) and "_contextlib" not in str(info.value)
    with pytest.raises(RuntimeError, match="sgd_update_ failed"):
        (model.w * 2).to_torch()
    value = torch.full((4, 2), 3.0)
    loaded = REPAIRS[repair](model, tmp_path, value)
    if repair.startswith("load"):
        assert not loaded.missing_keys and not loaded.unexpected_keys
    assert torch.equal(model.w.to_torch(), value) and model.w.placements == [S0]
    ref = value.clone().requires_grad_()
    ref_opt = torch.optim.SGD([ref], lr=0.5, momentum=0.9)
    for _ in range(2):  # the optimizer's state (its momentum) did not fail either
        (ref * ref).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        (model.w * model.w).sum().backward()
        opt.step()
        opt.zero_grad()
    assert_close(model.w.to_torch(), ref.detach())


def test_a_load_of_a_failed_value_raises_naming_the_key(pair, tmp_path):
    """A state dict holding a failed dtorch value, or a parameter a checkpoint cannot repair
    (a view never made): ``load_state_dict`` and ``load_checkpoint`` raise torch's error naming
    the key and the failure, not "All keys matched"; the runtime goes on."""
    model = Model(pair)
    bad = dtorch.from_torch(torch.arange(8).reshape(4, 2), device_mesh=pair) // 0; line = here()
    with pytest.raises(RuntimeError, match="floor_divide"):
        dtorch.sync()
    with pytest.raises(RuntimeError, match=r"(?s)Error\(s\) in loading state_dict for Model:.*"
                                           r"parameter named \"w\".*floor_divide") as info:
        model.load_state_dict({"w": bad.float()})
    assert line in str(info.value)
    model.w.data = bad.float()  # w now views a value never made
    with pytest.raises(RuntimeError, match=r"(?s)for Model:.*\"w\".*floor_divide"):
        dtorch.load_checkpoint(model, save(tmp_path, "safetensors", torch.ones(4, 2)))
    model.w.data = dtorch.zeros(4, 2, device_mesh=pair, placements=[S0])
    dtorch.load_checkpoint(model, save(tmp_path, "safetensors", torch.ones(4, 2)))
    assert torch.equal(model.w.to_torch(), torch.ones(4, 2))


def test_a_load_does_not_take_an_earlier_failure_for_its_own(pair):
    """An unrelated kernel error, reported while the load's values are read back, is raised as
    itself (a sync would raise it too), and the load's values are fine."""
    model = Model(pair)
    other = dtorch.tensor([1]) // 0; line = here()
    with pytest.raises(RuntimeError, match="floor_divide") as info:
        model.load_state_dict({"w": torch.ones(4, 2)})
    assert line in str(info.value) and "loading state_dict" not in str(info.value)
    assert torch.equal(model.w.to_torch(), torch.ones(4, 2))
    del other


def test_zero_grad_zeroes_in_place_as_torch(pair):
    """``zero_grad(set_to_none=False)`` writes zeros over every gradient, as torch's ``zero_``:
    an inf or NaN becomes 0 (a product by 0 would keep NaN), and a failed gradient is usable
    again."""
    model = Model(pair)
    opt = dtorch.optim.SGD(model.parameters(), lr=0.1)
    model.w.grad = dtorch.from_torch(torch.tensor([[1.0, float("inf")], [float("nan"), 2.0],
                                                   [0.0, -1.0], [3.0, 4.0]]),
                                     device_mesh=pair, placements=[S0])
    opt.zero_grad(set_to_none=False)
    assert torch.equal(model.w.grad.to_torch(), torch.zeros(4, 2))
    bad, line = failed_value(pair)
    with pytest.raises(RuntimeError, match="floor_divide"):
        dtorch.sync()
    model.w.grad = dtorch.ones(4, 2, device_mesh=pair, placements=[S0]) * bad.float().sum()
    with pytest.raises(RuntimeError, match="floor_divide"):
        model.w.grad.to_torch()
    opt.zero_grad(set_to_none=False)
    assert torch.equal(model.w.grad.to_torch(), torch.zeros(4, 2))
    opt.zero_grad()
    assert model.w.grad is None


def test_a_load_of_many_parameters_reads_back_one_token(pair):
    """More parameters than an autograd record can name (64) on one mesh: the token that reads
    them back is no recorded call (it has no gradient), so it is sent and read."""
    model = dtorch.nn.Module()
    for k in range(70):
        model.register_parameter(f"p{k}", dtorch.nn.Parameter(
            dtorch.zeros(3, device_mesh=pair, placements=[S0])))
    state = {f"p{k}": torch.full((3,), float(k)) for k in range(70)}
    assert not model.load_state_dict(state).missing_keys
    assert torch.equal(model.p69.to_torch(), torch.full((3,), 69.0))
