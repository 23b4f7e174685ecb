"""Failures: invalid calls raise at the user's line and send nothing; a kernel that fails on a
host raises at the next read or sync with the op's name and the user's ``file:line``; what
depends on it is poisoned (reading it raises the same error), independent work gives its values,
and the runtime stays usable. Every wait here has a timeout, so a hang fails instead of hanging.
"""

from __future__ import annotations

import _thread
import sys
import time

import pytest
import torch

import dtorch
from dtorch import Partial, Replicate, Shard
from dtorch.client import session, sites
import extension_kernels as K
from helpers import assert_close
from processes import CLIENT_PRELUDE, run_client

WAIT_S = 60  # generous: a correct runtime answers in well under a second


def here() -> str:
    """The caller's ``file:line``, as dtorch reports it."""
    f = sys._getframe(1)
    return f"{f.f_code.co_filename}:{f.f_lineno}"


def value(t: dtorch.Tensor) -> torch.Tensor:
    return t.to_torch_async().get(WAIT_S)


def assert_usable(mesh) -> None:
    """Operators and a collective on ``mesh`` still give right values."""
    x = dtorch.from_torch(torch.arange(6.0), device_mesh=mesh, placements=[Shard(0)] * mesh.ndim)
    y = (x * 2).redistribute(placements=[Replicate()] * mesh.ndim)
    assert_close(value(y), torch.arange(6.0) * 2)


# -- invalid calls --------------------------------------------------------------------------------


def test_shape_mismatch_raises_torch_error_at_the_call(mesh1):
    a = dtorch.ones((4, 3), device_mesh=mesh1, placements=[Shard(0)])
    b = dtorch.ones((5, 3), device_mesh=mesh1, placements=[Shard(0)])
    ids = repr(session._tensor_ids)
    with pytest.raises(RuntimeError, match="broadcast|size"):
        a + b
    with pytest.raises(RuntimeError):
        a @ b
    assert repr(session._tensor_ids) == ids  # no operator was issued for the bad calls
    assert_close(value(a + a), torch.full((4, 3), 2.0))
    assert_usable(mesh1)


@pytest.mark.parametrize("bad", [
    lambda m, a: a.redistribute(m, [Shard(0), Shard(1)]),  # two placements, a 1-D mesh
    lambda m, a: dtorch.ones((4, 4), device_mesh=m, placements=[Replicate(), Replicate()]),
    lambda m, a: a @ a,  # S(0) @ S(0): no placement rule; the error names the fix
    lambda m, a: a + dtorch.ones((4, 4), device_mesh=dtorch.DeviceMesh("cpu", [5, 6]),
                                 placements=[Shard(0)]),  # operands on different meshes
])
def test_wrong_placements_raise_value_error(mesh1, bad):
    a = dtorch.ones((4, 4), device_mesh=mesh1, placements=[Shard(0)])
    with pytest.raises(ValueError):
        bad(mesh1, a)
    assert_usable(mesh1)


def test_placement_error_names_the_redistribute_to_add(mesh1):
    a = dtorch.ones((4, 4), device_mesh=mesh1, placements=[Shard(0)])
    with pytest.raises(ValueError, match="matmul") as info:
        a @ a
    assert "edistribute" in str(info.value)


def test_bad_arguments_raise_torch_types(mesh1):
    a = dtorch.ones((4, 4), device_mesh=mesh1, placements=[Shard(0)])
    with pytest.raises(IndexError):
        a.sum(dim=5)
    with pytest.raises(TypeError):
        a.redistribute(mesh1, ["S0"])
    with pytest.raises(RuntimeError):
        a.item()  # 16 elements
    assert_usable(mesh1)


# -- kernels that fail on a host ------------------------------------------------------------------


def test_kernel_error_raises_at_next_read_with_op_and_line():
    x = dtorch.tensor([1, 2]) // 0; line = here()  # the line dtorch must name
    z = dtorch.tensor([3, 4]) * 2  # independent of x
    with pytest.raises(RuntimeError, match="floor_divide") as info:
        value(z)
    assert line in str(info.value), str(info.value)
    assert torch.equal(value(z), torch.tensor([6, 8]))  # told once; independent work is fine
    with pytest.raises(RuntimeError, match="floor_divide"):
        value(x)  # the failed value itself raises whenever it is read
    dtorch.sync()


def test_each_call_site_is_named_however_the_op_is_reached():
    """Sites are looked up by code object and bytecode offset: the same op on two lines of one
    loop, an operator, a function, a method and a call inside dtorch's own code each name the
    user's line."""
    fails = dtorch.local_map(K.fails_on_values, [Replicate()])  # issued by dtorch's own code

    def failing(k):  # each returns (the failed tensor, the line dtorch must name)
        x = dtorch.tensor([1, 2])
        if k == 0:
            return x // 0, here()
        if k == 1:
            return dtorch.floor_divide(x, 0), here()
        if k == 2:
            return x.floor_divide(0), here()
        return fails(x), here()

    for _ in range(2):  # the second round finds every site in the cache
        for k in range(4):
            t, line = failing(k)
            with pytest.raises(RuntimeError, match="floor_divide|boom") as info:
                value(t)
            assert line in str(info.value), (k, str(info.value))
            dtorch.sync()


def test_call_sites_of_code_compiled_again_and_again_stay_right(monkeypatch):
    """The client keeps at most MAX_CODES code objects for its site lookup; past that it starts
    again, and every site is still named right."""
    monkeypatch.setattr(sites, "MAX_CODES", 3)
    s = session.current()
    for k in range(8):  # 8 code objects, of 2 file names
        code = compile("t = dtorch.tensor([1]) // 0", f"<compiled {k % 2}>", "exec")
        scope = {"dtorch": dtorch}
        exec(code, scope)  # noqa: S102
        with pytest.raises(RuntimeError, match=f"<compiled {k % 2}>:1"):
            value(scope["t"])
        dtorch.sync()
        assert len(s.call_sites.codes) <= 3


def test_an_op_called_straight_from_c_is_issued_with_no_site():
    """A front that C calls with no Python frame below it (a bare thread's target) is issued; its
    call site is unknown."""
    x = dtorch.zeros(3)
    _thread.start_new_thread(x.add_, (1.0,))
    deadline = time.monotonic() + 10
    while value(x)[0] != 1.0:  # the thread's add_ lands soon: polled, with a deadline
        assert time.monotonic() < deadline, "the thread's call failed"
    assert session.current().site(10_000) == 0  # "<unknown>"


def test_kernel_error_raises_at_next_sync():
    w = dtorch.tensor([2]) ** -1; line = here()  # ints to a negative power
    with pytest.raises(RuntimeError, match="pow") as info:
        dtorch.sync()
    assert line in str(info.value)
    dtorch.sync()  # reported once
    with pytest.raises(RuntimeError, match="pow"):
        value(w)


def test_dependents_are_poisoned_independents_are_not():
    x = dtorch.tensor([1, 2]) // 0; line = here()
    y = (x + 1).sum()  # depends on x through two kernels
    w = dtorch.tensor([5, 6]).sum()
    with pytest.raises(RuntimeError, match="floor_divide"):
        dtorch.sync()
    for dependent in (x, y, x * 3):  # x * 3: issued after the failure was reported
        with pytest.raises(RuntimeError, match="floor_divide") as info:
            value(dependent)
        assert line in str(info.value)
    assert value(w).item() == 11
    dtorch.sync()


def test_in_place_write_into_a_poisoned_tensor_stays_poisoned():
    x = dtorch.tensor([1, 2]) // dtorch.tensor([1, 0])
    with pytest.raises(RuntimeError, match="floor_divide"):
        dtorch.sync()
    x.add_(1)
    with pytest.raises(RuntimeError, match="floor_divide"):
        value(x)


def test_failure_on_one_device_poisons_a_collective_on_every_device(mesh1):
    # only the last shard divides by zero: its peers must neither hang in the all-gather nor
    # return values computed from a failed block
    a = dtorch.from_torch(torch.tensor([4, 6, 8, 10, 3, 3]), device_mesh=mesh1,
                          placements=[Shard(0)])
    b = dtorch.from_torch(torch.tensor([2, 2, 1, 1, 1, 0]), device_mesh=mesh1,
                          placements=[Shard(0)])
    q = a // b; line = here()
    gathered = q.redistribute(placements=[Replicate()])
    total = gathered.sum()
    moved = q.redistribute(dtorch.DeviceMesh("cpu", [5, 6]), [Replicate()])
    independent = a.redistribute(placements=[Replicate()])
    with pytest.raises(RuntimeError, match="floor_divide"):
        dtorch.sync()
    for dependent in (gathered, total, moved):
        with pytest.raises(RuntimeError, match="floor_divide") as info:
            value(dependent)
        assert line in str(info.value)
    assert torch.equal(value(independent), torch.tensor([4, 6, 8, 10, 3, 3]))
    assert_usable(mesh1)


def test_partial_reduction_of_a_poisoned_block(mesh2):
    t = torch.tensor([[1, 0], [1, 1]])
    d = dtorch.from_torch(t, device_mesh=mesh2, placements=[Shard(0), Shard(1)])
    p = (dtorch.from_torch(torch.ones(2, 2, dtype=torch.int64), device_mesh=mesh2,
                           placements=[Shard(0), Shard(1)]) // d)
    r = p.redistribute(placements=[Partial(), Replicate()]).redistribute(
        placements=[Replicate(), Replicate()])
    with pytest.raises(RuntimeError, match="floor_divide"):
        dtorch.sync()
    with pytest.raises(RuntimeError, match="floor_divide"):
        value(r)
    assert_usable(mesh2)


def test_repeated_failures_are_reported_once():
    # results are kept: an operator whose result is dropped unread is never run
    kept = [dtorch.tensor([k]) ** -1 for k in range(300)]
    kept += [dtorch.tensor([1]) // 0, dtorch.tensor([1]) % 0]
    with pytest.raises(RuntimeError, match=r"pow.*\(2 more kernel errors\)"):
        dtorch.sync()
    assert session._current.errors == [] and len(kept) == 302


def test_many_distinct_failures_are_counted_not_kept():
    s = session.current()  # (the running session, started here if a test before ended it)
    kept = []
    for k in range(40):  # 40 call sites: 40 distinct errors
        site = compile("kept.append(dtorch.tensor([1]) // 0)", f"<site {k}>", "exec")
        exec(site, {"dtorch": dtorch, "kept": kept})  # noqa: S102
    with pytest.raises(RuntimeError, match=r"<site 0>:1.*\(39 more kernel errors\)"):
        dtorch.sync()
    assert s.errors == [] and s.more_errors == 0


def test_a_tensor_from_before_shutdown_is_refused_not_confused():
    # in a subprocess: shutting down the test session's runtime would break its other tests
    result = run_client(CLIENT_PRELUDE + """
old = dtorch.ones(4) * 3
assert old.tolist() == [3.0] * 4
dtorch.shutdown()
new = dtorch.ones(4) * 5   # a fresh runtime
stale = dtorch.ones(4) * 7
del old                    # releasing a stale id must not free a new tensor
new_value = new.tolist()
try:
    (stale + 0).tolist()
    dtorch.shutdown()
    (stale + 1).tolist()
    error = None
except RuntimeError as e:
    error = str(e)
report(new=new_value, error=error, after=(dtorch.ones(2) + 1).tolist())
""", timeout=120)
    assert result["new"] == [5.0] * 4
    assert "not on this runtime" in result["error"]
    assert result["after"] == [2.0, 2.0]
