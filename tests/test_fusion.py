"""Kernel fusion of hot replayed programs (runtime/fusion.py).

Without a runtime: which kernels make a segment, what a segment reads and leaves, and the bit
comparison that guards every swap. With the runtime: hot loops get fused code (the trace says
so) and stay bit-identical to torch eager and to the same program with fusion off, in every
iteration's values and after their scalars change; a failed input of a fused stretch poisons only
what depends on it; what may not fuse (changing scalars, bfloat16, transcendental functions) runs
unfused; hosts whose compiler is a stub (``tests/stub_compiler``) keep only code with the
kernels' bits. The guard itself, fed wrong code: ``tests/test_fusion_guard.py``.
"""

import inspect
import os
import re
from types import SimpleNamespace

import pytest
import torch

import dtorch
from dtorch.ops import registry
from dtorch.runtime.fusion import EXACT, fusable, same_bits, segments
from dtorch.runtime.program import MADE, OUTSIDE, SCALAR, ProgramStep
from helpers import runtime_with


def step(name, sources, outs, **kwargs):
    call = SimpleNamespace(name=name, inplace=False, saves=False, kwargs=kwargs)
    return ProgramStep(call, None, tuple(sources), 0, tuple(outs))


def test_segments_are_stretches_of_fusable_kernels_with_their_boundaries():
    steps = [
        step("mul", [(OUTSIDE, 0), (SCALAR, 0)], [0]),
        step("add", [(MADE, 0), (OUTSIDE, 1)], [1]),
        step("sum", [(MADE, 1)], [2]),  # a reduction: not fused, ends the first segment
        step("mul", [(MADE, 2), (MADE, 1)], [3]),
        step("neg", [(MADE, 3)], [4]),
        step("gt", [(MADE, 4), (SCALAR, 1)], [5]),
        step("exp", [(MADE, 4)], [6]),
        step("mul", [(MADE, 6), (SCALAR, 2)], [7]),  # alone between unfusable ones: no segment
    ]
    assert segments(steps, survivors={5, 7}) == [
        (0, 2, [(OUTSIDE, 0), (OUTSIDE, 1)], [1]),  # r0 is read only inside
        (3, 6, [(MADE, 2), (MADE, 1)], [4, 5]),  # r4: read later; r5: outlives the program
    ]


def test_what_may_fuse():
    assert EXACT <= set(registry.REGISTRY)  # every name is an operator's
    assert fusable(step("add", [], [0]))
    assert not fusable(step("add", [], [0], alpha=2))  # x + 2 * y in one rounding
    assert not fusable(step("div", [], [0], rounding_mode="floor"))
    assert not fusable(step("tanh", [], [0]))
    assert not fusable(step("add", [], [-1]))  # writes an outside input in place
    inplace = step("add_", [], [0])
    inplace.call.inplace = True
    assert not fusable(inplace)


def test_same_bits():
    x = torch.tensor([1.0, float("nan"), -0.0])
    assert same_bits(x, x.clone())
    assert same_bits(x, torch.tensor([1.0, -float("nan"), -0.0]))  # any NaN is any NaN
    assert not same_bits(x, torch.tensor([1.0, float("nan"), 0.0]))  # the sign of a zero
    assert not same_bits(x, x.double())
    m = torch.arange(6.0).reshape(2, 3)
    assert not same_bits(m, m.t().contiguous().t())  # equal values, other strides


# -- with the runtime ------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def hot_soon():
    """This module's runtime replays, fuses, and makes a program hot after 32 replays (not 256)
    and no time (not 2 s), so that its loops are short (whatever mode the suite runs in)."""
    with runtime_with(DTORCH_REPLAY="1", DTORCH_FUSION="1", DTORCH_FUSION_AFTER="32",
                      DTORCH_FUSION_AFTER_S="0"):
        yield


def body(a, b, lib):
    """A loop body of exact kernels: tensor-scalar and tensor-tensor, comparisons, a choice and
    a rounding."""
    a = a * 0.999 + b
    a = lib.where(a > 100.0, a - 50.0, a)
    a = lib.maximum(a, b * 0.5)
    n = (a * 4.0).floor() > b
    return a, n


def run_loop(mesh, lib, iterations, a=None):
    if lib is torch:
        b = torch.arange(10.0)
        a = torch.ones(10) if a is None else a
    else:
        place = [dtorch.Shard(0)]  # uneven on three devices: blocks of 4, 3 and 3
        b = dtorch.arange(10.0, device_mesh=mesh, placements=place)
        a = dtorch.ones(10, device_mesh=mesh, placements=place) if a is None else a
    n = None
    for _ in range(iterations):
        a, n = body(a, b, lib)
    return a, n


def fused_runs(prof) -> int:
    return sum(bool(re.search(r"\d+ fused\)", e["name"])) for e in prof.kernels())


def compiles(prof) -> list:
    """The kernels each compile fused, from its span on the compiler's track."""
    return [int(m[1]) for e in prof.kernels() if (m := re.match(r"fused (\d+) kernels", e["name"]))]


@pytest.mark.parametrize("layout", ["one", "mesh1"])
def test_hot_loops_fuse_and_stay_bit_identical(layout, request):
    mesh = request.getfixturevalue(layout)
    with dtorch.profiler.profile() as warm:
        a, _ = run_loop(mesh, dtorch, 1200)
        dtorch.sync(compiles=True)
    assert compiles(warm) and all(k > 0 for k in compiles(warm)), compiles(warm)
    with dtorch.profiler.profile() as hot:
        a, n = run_loop(mesh, dtorch, 1200, a)
        got = a.to_torch(), n.to_torch()
    assert fused_runs(hot) > 0
    ta, _ = run_loop(None, torch, 1200)
    expected = run_loop(None, torch, 1200, ta)
    for g, e in zip(got, expected):
        assert torch.equal(g, e)


def test_loops_equal_with_fusion_off(fusion_off):
    one = dtorch.DeviceMesh("cpu", [0])
    with dtorch.profiler.profile() as prof:
        a, _ = run_loop(one, dtorch, 1200)
        dtorch.sync(compiles=True)
        a, n = run_loop(one, dtorch, 1200, a)
        got = a.to_torch(), n.to_torch()
    assert fused_runs(prof) == 0 and not compiles(prof)
    ta, _ = run_loop(None, torch, 1200)
    for g, e in zip(got, run_loop(None, torch, 1200, ta)):
        assert torch.equal(g, e)


STUB_COMPILER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stub_compiler")


@pytest.mark.parametrize("stub", ["ulp", "raise", "exact"])
def test_hosts_keep_compiled_code_only_if_it_has_the_kernels_bits(stub):
    """Hosts whose inductor is a stub (``tests/stub_compiler``): code one ulp off, or a
    compile that raises, must be refused (the loop runs unfused and bit-identical to torch);
    code that is exactly right must be taken."""
    path = os.pathsep.join(filter(None, [STUB_COMPILER, os.environ.get("PYTHONPATH")]))
    with runtime_with(DTORCH_TEST_COMPILER=stub, PYTHONPATH=path):
        one = dtorch.DeviceMesh("cpu", [0])
        with dtorch.profiler.profile() as warm:
            a, _ = run_loop(one, dtorch, 1200)
            dtorch.sync(compiles=True)
        with dtorch.profiler.profile() as hot:
            a, n = run_loop(one, dtorch, 1200, a)
            got = a.to_torch(), n.to_torch()
    if stub == "exact":
        assert compiles(warm) and all(k > 0 for k in compiles(warm)), compiles(warm)
        assert fused_runs(hot) > 0
    else:
        assert compiles(warm) == [0] and fused_runs(hot) == 0  # compiled, and refused
    ta, _ = run_loop(None, torch, 1200)
    for g, e in zip(got, run_loop(None, torch, 1200, ta)):
        assert torch.equal(g, e)


def test_a_failed_input_of_a_fused_stretch_poisons_only_what_depends_on_it(one):
    """Two independent chains fused into one stretch: when one chain's input has failed, the
    stretch runs kernel by kernel, so the other chain's result is still read."""
    def loop(a, c, b, d, iterations):
        for _ in range(iterations):
            a = a * 3 + b
            c = c * 2 - d
        return a, c

    b = dtorch.arange(4, device_mesh=one)
    d = dtorch.ones(4, dtype=torch.int64, device_mesh=one)
    zero = dtorch.zeros(4, dtype=torch.int64, device_mesh=one)
    a = c = dtorch.zeros(4, dtype=torch.int64, device_mesh=one)
    with dtorch.profiler.profile() as warm:
        a, c = loop(a, c, b, d, 1500)
        dtorch.sync(compiles=True)
    assert compiles(warm)
    bad = d // zero; line = inspect.currentframe().f_lineno
    with pytest.raises(RuntimeError, match="floor_divide"):
        dtorch.sync()  # the failure is reported here, once
    with dtorch.profiler.profile() as prof:
        a, c = loop(a, c, b, bad, 1500)
        got = a.to_torch()
    assert fused_runs(prof) > 0
    ta = tc = torch.zeros(4, dtype=torch.int64)
    ta, _ = loop(*loop(ta, tc, torch.arange(4), torch.ones(4, dtype=torch.int64), 1500),
                 torch.arange(4), torch.ones(4, dtype=torch.int64), 1500)
    assert torch.equal(got, ta)
    with pytest.raises(RuntimeError, match="floor_divide") as info:
        c.to_torch()
    assert f"test_fusion.py:{line}" in str(info.value)
    dtorch.sync()


def test_what_may_not_fuse_runs_unfused(one):
    """Scalars that change every iteration and transcendental kernels never make a compile;
    a bfloat16 chain is compiled but refused (its fused code rounds otherwise). The results
    equal torch's."""
    def loops(lib, a, b, h):
        for k in range(3000):
            a = a * (1.0 + k * 1e-7) + b  # its scalar new each time
        e = a
        for _ in range(3000):
            e = lib.tanh(e).exp()
        for _ in range(3000):
            h = h * 0.5 + 1.0
        return a, e, h

    b = dtorch.arange(8.0, device_mesh=one)
    with dtorch.profiler.profile() as prof:
        got = loops(dtorch, dtorch.ones(8, device_mesh=one), b,
                    dtorch.ones(8, dtype=torch.bfloat16, device_mesh=one))
        dtorch.sync(compiles=True)
        got = [t.to_torch() for t in got]
    assert compiles(prof) == [0] and fused_runs(prof) == 0  # the bfloat16 chain's, refused
    expected = loops(torch, torch.ones(8), torch.arange(8.0), torch.ones(8, dtype=torch.bfloat16))
    for g, e in zip(got, expected):
        assert torch.equal(g, e)


# -- values made inside replayed and fused windows -------------------------------------------------
# A loop's last value comes from the records after its last window, lowered by the passes and run
# unfused; these tests keep every iteration's values, made inside replayed (and fused) windows.


def signed_zero_loop(lib, x, b, scalars, kept):
    """``y = x * s`` for s = 0.0 or -0.0 (the sign of zero), its reciprocal (+inf or -inf),
    whose sign chooses the next x; every iteration's y, 1 / y and x kept."""
    for s in scalars:
        y = x * s
        z = y.reciprocal()
        x = lib.where(z > 0, x * 0.5 + b, x * 0.5 - b)
        kept += [y, z, x]
    return x


def stacked(kept):
    return dtorch.stack(kept).to_torch()


def assert_bits(got, expected):
    """Bit-identical: equal values, NaN where NaN, and the sign of every zero and inf."""
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert torch.equal(got.isnan(), expected.isnan())
    assert torch.equal(got.nan_to_num(), expected.nan_to_num())
    assert torch.equal(got.signbit() | got.isnan(), expected.signbit() | expected.isnan())


def test_every_value_of_a_fused_loop_is_torchs_after_its_scalars_change(one):
    """A loop made hot and fused with s = 0.0, then run on with s = -0.0 and with both in
    turn: the code fused for 0.0 must not run for -0.0, though 0.0 == -0.0 (x * -0.0 is -0.0,
    its reciprocal -inf). Every iteration's values are compared, not the last only."""
    b = dtorch.arange(8.0, device_mesh=one) - 4.0
    x, kept = dtorch.ones(8, device_mesh=one), []
    phases = [[0.0] * 1200, [0.0] * 300, [-0.0] * 600, [0.0, -0.0] * 300]
    with dtorch.profiler.profile() as warm:
        x = signed_zero_loop(dtorch, x, b, phases[0], kept)
        dtorch.sync(compiles=True)
    assert compiles(warm) and all(k > 0 for k in compiles(warm)), compiles(warm)
    with dtorch.profiler.profile() as prof:
        for scalars in phases[1:]:
            x = signed_zero_loop(dtorch, x, b, scalars, kept)
        got = stacked(kept)
    assert fused_runs(prof) > 0
    tb, tx, expected = torch.arange(8.0) - 4.0, torch.ones(8), []
    for scalars in phases:
        tx = signed_zero_loop(torch, tx, tb, scalars, expected)
    expected = torch.stack(expected)
    assert expected[3 * 1500:][0::3].signbit().any()  # -0.0 and -inf are there to be lost
    assert_bits(got, expected)


def three_chains(a, c, d, u, v, w, iterations, kept):
    """Three chains, each reading one of the window's outside inputs u, v, w."""
    for _ in range(iterations):
        a = a * 3 + u
        c = c * 2 - v
        d = (d + w) * 5
        kept.append((a, c, d))
    return a, c, d


@pytest.mark.parametrize("failed", [0, 1, 2])
def test_each_failed_input_of_a_hot_window_fails_only_its_chain(one, failed):
    """A hot (fused) window reading three outside inputs, each failed in turn: the chain that
    reads it fails (named at the line that failed, told once), the other two run right in
    every iteration."""
    def ints(*values):
        return dtorch.from_torch(torch.tensor(values), device_mesh=one)

    zero = ints(0, 0, 0, 0)
    inputs = [ints(1, 2, 3, 4), ints(5, 6, 7, 8), ints(-1, 0, 1, 2)]
    start = [ints(0, 0, 0, 1), ints(1, 1, 1, 1), ints(2, 0, 2, 0)]
    three_chains(*start, *inputs, 1200, [])  # hot and compiled (by an earlier test, maybe)
    dtorch.sync(compiles=True)
    bad = inputs[failed] // zero; line = inspect.currentframe().f_lineno
    with pytest.raises(RuntimeError, match="floor_divide"):
        dtorch.sync()  # told here, once
    used = [bad if j == failed else t for j, t in enumerate(inputs)]
    kept = []
    with dtorch.profiler.profile() as prof:
        # (windows enough for the fused lowering to run as generated code: STRAIGHT_AFTER)
        last = three_chains(*start, *used, 1000, kept)
        good = [dtorch.stack([k[j] for k in kept]).to_torch() for j in range(3) if j != failed]
    assert fused_runs(prof) > 0
    t_inputs = [t.to_torch() for t in inputs]
    t_kept = []
    three_chains(*(t.to_torch() for t in start), *t_inputs, 1000, t_kept)
    expected = [torch.stack([k[j] for k in t_kept]) for j in range(3) if j != failed]
    for g, e in zip(good, expected):
        assert torch.equal(g, e)
    for t in (last[failed], kept[0][failed]):
        with pytest.raises(RuntimeError, match="floor_divide") as info:
            t.to_torch()
        assert f"test_fusion.py:{line}" in str(info.value)
    dtorch.sync()
