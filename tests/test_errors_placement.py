"""Placement errors: an op whose inputs match no row of its placement table raises ValueError at
the call, naming the op, the placements and the ``redistribute()`` to add; the suggested fix
works when applied as written; and a failed call leaves the runtime usable."""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading

import pytest
import torch

import dtorch
from dtorch import Partial, Replicate, Shard
from dtorch.future import TensorFuture
from helpers import assert_close, distribute

R, S0, S1, S2, P = Replicate(), Shard(0), Shard(1), Shard(2), Partial()


def sample(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def lib(t):
    """dtorch for a dtorch tensor, torch for a torch one: each case runs on both."""
    return dtorch if isinstance(t, dtorch.Tensor) else torch


def join(name: str, dim: int = 0):
    return lambda tensors_0, tensors_1: getattr(lib(tensors_0), name)([tensors_0, tensors_1], dim)


def run(fn, ops: dict):
    """``fn`` on operands named as in the error messages (``input``, ``other``, ``tensors[i]``)."""
    return fn(**{k.replace("[", "_").replace("]", ""): v for k, v in ops.items()})


# name: (mesh fixture, fn, {operand name: (torch value, placements)}, text the message shows)
CASES = {
    "relu(P)": ("mesh1", lambda input: input.relu(), {"input": (sample(5, 7), [P])}, "input=P"),
    "P+R": ("mesh1", lambda input, other: input + other,
            {"input": (sample(5, 7), [P]), "other": (sample(5, 7, seed=1), [R])},
            "input=P, other=R"),
    "P+1": ("mesh1", lambda input: input + 1, {"input": (sample(5, 7), [P])}, "input=P"),
    "P*P": ("mesh2", lambda input, other: input * other,
            {"input": (sample(5, 7), [S0, P]), "other": (sample(5, 7, seed=1), [S0, P])},
            "mesh dim 1"),
    "S(0)+S(1)": ("mesh1", lambda input, other: input + other,
                  {"input": (sample(5, 7), [S0]), "other": (sample(5, 7, seed=1), [S1])},
                  "input=S(0), other=S(1)"),
    "S(1)@R": ("mesh1", lambda input, other: input @ other,
               {"input": (sample(5, 4), [S1]), "other": (sample(4, 6, seed=1), [R])},
               "dtorch.matmul"),
    "mm S(0)S(0)": ("mesh1", lambda input, other: lib(input).mm(input, other),
                    {"input": (sample(5, 4), [S0]), "other": (sample(4, 6, seed=1), [S0])},
                    "dtorch.mm"),
    "bmm S(0)R": ("mesh2", lambda input, other: lib(input).bmm(input, other),
                  {"input": (sample(3, 5, 4), [S0, R]), "other": (sample(3, 4, 6, seed=1), [R, R])},
                  "dtorch.bmm"),
    "cat S(0),R": ("mesh1", join("cat", 1),
                   {"tensors[0]": (sample(5, 7), [S0]), "tensors[1]": (sample(5, 3, seed=1), [R])},
                   "tensors[1]=R"),
    # (cat along its shard is a sub-split, tests/test_sub_split.py); a sub-split beside a plain
    # Shard, or under an op that cannot follow its elements
    "sub-split+S(0)": ("mesh1", lambda input, other: input + other,
                       {"input": (sample(5, 7), [Shard(0, (3, 2))]),
                        "other": (sample(5, 7, seed=1), [S0])}, "input=S(0)[3,2], other=S(0)"),
    "cumsum sub-split": ("mesh1", lambda input: input.cumsum(1),
                         {"input": (sample(2, 7), [Shard(1, (4, 3))])}, "input=S(1)[4,3]"),
    "reshape sub-split": ("mesh2", lambda input: input.reshape(14),
                          {"input": (sample(2, 7), [R, Shard(1, (4, 3))])}, "dtorch.reshape"),
    "stack P,R": ("mesh1", join("stack"),
                  {"tensors[0]": (sample(5, 7), [P]), "tensors[1]": (sample(5, 7, seed=1), [R])},
                  "dtorch.stack"),
    "reshape uneven": ("mesh1", lambda input: input.reshape(35), {"input": (sample(5, 7), [S0])},
                       "dtorch.reshape"),
    "view inner shard": ("mesh2", lambda input: input.view(-1),
                         {"input": (sample(6, 4), [S0, S1])}, "dtorch.view"),
    "flatten uneven": ("mesh3", lambda input: input.flatten(),
                       {"input": (sample(3, 5, 2), [S1, R, R])}, "dtorch.flatten"),
    "amax(P)": ("mesh1", lambda input: input.amax(dim=0), {"input": (sample(5, 7), [P])},
                "dtorch.amax"),
    "sum(P(max))": ("mesh2", lambda input: input.sum(),
                    {"input": (sample(5, 7), [Partial("max"), S0])}, "P(max)"),
    "long(P)": ("mesh1", lambda input: input.long(), {"input": (sample(5, 7) * 9, [P])},
                "dtorch.long"),
    "exp(S(0),P)": ("mesh2", lambda input: input.exp(), {"input": (sample(5, 7), [S0, P])},
                    "mesh dim 1"),
    "R += S(0)": ("mesh1", lambda input, other: input.add_(other),
                  {"input": (sample(5, 7), [R]), "other": (sample(5, 7, seed=1), [S0])},
                  "dtorch.add_"),
    "R *= P": ("mesh2", lambda input, other: input.mul_(other),
               {"input": (sample(5, 7), [S0, R]), "other": (sample(5, 7, seed=1), [S0, P])},
               "dtorch.mul_"),
}
FIX = re.compile(r"([\w\[\]]+) = \1\.redistribute\(placements=(\[[^\]]*\])\)")


@pytest.mark.parametrize("name", CASES)
def test_error_names_op_and_fix(name, request):
    mesh_name, fn, operands, shows = CASES[name]
    mesh = request.getfixturevalue(mesh_name)
    ops = {k: distribute(t, mesh, pl) for k, (t, pl) in operands.items()}
    with pytest.raises(ValueError) as info:
        run(fn, ops)
    message = str(info.value)
    assert message.startswith("dtorch.") and shows in message, message
    assert ".redistribute(placements=" in message, message
    # the suggested fix, applied as written, makes the call work and give torch's value
    fixes = FIX.findall(message)
    assert fixes, message
    for operand, placements in fixes:
        ops[operand] = ops[operand].redistribute(
            placements=eval(placements, {"Shard": Shard, "Replicate": Replicate,
                                         "Partial": Partial}))
    expected = run(fn, {k: t.clone() for k, (t, _) in operands.items()})
    assert_close(run(fn, ops), expected)


def test_error_names_the_op_the_user_called(mesh1):
    x = distribute(sample(5, 7), mesh1, [P])
    for fn, op in ((lambda: x.relu(), "relu"), (lambda: x > 0, "gt"),
                   (lambda: x.sigmoid(), "sigmoid"), (lambda: dtorch.maximum(x, x), "maximum"),
                   (lambda: x.amin(), "amin")):
        with pytest.raises(ValueError, match=rf"^dtorch\.{op}: .*redistribute"):
            fn()


def test_torch_tensor_operands_are_taken_replicate(mesh1):
    """A torch tensor operand is made Replicate on the call's mesh (the default graph's mesh
    where no operand is a dtorch tensor), as torch's functions on dtorch tensors take one."""
    x = dtorch.ones(4, device_mesh=mesh1)
    y = x + torch.arange(4.0)
    assert y.device_mesh == mesh1 and y.placements == [Replicate()]
    assert_close(y, torch.arange(4.0) + 1)
    z = dtorch.mm(torch.ones(2, 3), torch.ones(3, 2))
    assert isinstance(z, dtorch.Tensor) and z.device_mesh == dtorch.get_default_device_mesh()
    assert_close(z, torch.full((2, 2), 3.0))


def test_operands_on_different_meshes(mesh1, mesh2):
    x, y = dtorch.ones(4, device_mesh=mesh1), dtorch.ones(4, device_mesh=mesh2)
    with pytest.raises(ValueError, match=r"dtorch\.add: .*different meshes.*redistribute"):
        x + y
    assert_close(x + y.redistribute(device_mesh=mesh1), torch.full((4,), 2.0))


def test_failed_calls_leave_the_runtime_usable(mesh1):
    t = sample(5, 7)
    x = distribute(t, mesh1, [P])
    for _ in range(2):  # a refused call is refused again (nothing half-cached) ...
        with pytest.raises(ValueError):
            x.relu()
        with pytest.raises(ValueError):
            x + distribute(t, mesh1, [S0])
        with pytest.raises(RuntimeError):  # torch's own shape error, at the call
            x + distribute(sample(5, 6), mesh1, [P])
    # ... and everything else still runs, the same call shapes included
    assert_close(x.redistribute(placements=[R]).relu(), t.relu())
    assert_close((x + x).sum(), (t + t).sum())
    dtorch.sync()


def test_kernel_error_is_reported_and_the_runtime_survives(mesh1):
    """``int ** negative`` is refused by torch's kernel on the hosts (a check of a value, not
    of types, so the client's metadata rule leaves it there): the error comes back tagged with
    the user's line, and later work runs."""
    i = torch.arange(6).reshape(3, 2)
    x = distribute(i, mesh1, [S0])
    assert_close(x ** 2, i ** 2)
    bad = x ** -1
    with pytest.raises(RuntimeError, match=r"pow.*test_errors_placement\.py:\d+"):
        bad.to_torch()
    # every device reported it before its block's answer (a host sends in stream order), and
    # the client tells a failure once: the next sync has nothing to raise; reading the poisoned
    # value again raises again
    dtorch.sync()
    with pytest.raises(RuntimeError, match="pow"):
        bad.to_torch()
    del bad
    assert_close((x * 3).sum(dim=0), (i * 3).sum(dim=0))
    dtorch.sync()


def test_a_late_failure_after_an_await_timed_out_leaves_the_runtime_usable(mesh1):
    """asyncio.wait_for gives up on a TensorFuture and its loop closes; the value fails later.
    Completing it must not raise on the receiver thread (a closed loop takes no callback), which
    would end the thread that completes every future."""
    fut = TensorFuture()

    async def give_up():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(fut, 0.001)

    asyncio.run(give_up())  # the loop is closed now, the future's callback still registered
    errors = []
    previous, threading.excepthook = threading.excepthook, errors.append
    try:
        finisher = threading.Thread(target=fut._finish, kwargs={"error": RuntimeError("late")})
        finisher.start()
        finisher.join()
    finally:
        threading.excepthook = previous
    assert not errors
    with pytest.raises(RuntimeError, match="late"):
        fut.get()
    # and on the runtime: a failing value awaited too briefly (it may fail before the timeout
    # or after the loop closed: either way its future fails, once read, and the runtime answers)
    x = distribute(torch.arange(6).reshape(3, 2), mesh1, [S0])
    late = (x ** -1).to_torch_async()

    async def too_brief():
        with contextlib.suppress(asyncio.TimeoutError, RuntimeError):
            await asyncio.wait_for(late, 1e-4)

    asyncio.run(too_brief())
    assert late.wait(60)
    with pytest.raises(RuntimeError, match="pow"):
        late.get()
    dtorch.sync()
    assert_close((x * 3).sum(), torch.tensor(45))
