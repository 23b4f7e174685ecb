"""Fusion's last guard (runtime/fusion.py, ``Fuser._compile``): a segment's compiled code is
swapped in only if its every result has the kernels' dtype, shape, strides and bits. No runtime:
a ``Fuser`` runs in this process on a program lowered by hand, made hot by replaying it (its
runs really copy the segment's inputs), with inductor's ``compile`` replaced by a stub that is
exactly right, one ulp off, wrong in a sign of zero, a NaN payload, a dtype, a shape or strides,
or raises; ``make_fx`` traces the segment as it does for inductor. The fused lowering is then
run, and its values compared with the unfused one's and with torch's, bit for bit.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch._inductor

from dtorch import config
from dtorch.runtime.failures import Failure
from dtorch.runtime.fusion import Fused, Fuser
from dtorch.runtime.program import (MADE, OUTSIDE, SCALAR, Lowering, ProgramRun,
                                    ProgramStep)
from dtorch.runtime.stream import Blob


pytestmark = pytest.mark.no_runtime  # (conftest syncs after the other tests)


@pytest.fixture(autouse=True)
def hot_at_once(monkeypatch):
    monkeypatch.setattr(config, "fusion", True)
    monkeypatch.setattr(config, "fusion_after", 3)
    monkeypatch.setattr(config, "fusion_after_s", 0.0)
    monkeypatch.setattr(config, "cuda_graphs", False)


def kernel(name, fn):
    return SimpleNamespace(name=name, fn=fn, kwargs={}, inplace=False, saves=False,
                           overwrites=False)


MUL, ADD, DIV, EXP = (kernel("mul", torch.mul), kernel("add", torch.add),
                      kernel("div", torch.div), kernel("exp", torch.exp))


def steps():
    """r0 = o0 * s0; r1 = r0 + o1; r2 = r1 / o2 (a segment), r3 = exp(r2) (not fused), then
    r4 = r3 * s1; r5 = r4 + r2 (another segment, leaving two results). Survivors: r2, r4, r5."""
    return [
        ProgramStep(MUL, None, ((OUTSIDE, 0), (SCALAR, 0)), 1, (0,)),
        ProgramStep(ADD, None, ((MADE, 0), (OUTSIDE, 1)), 2, (1,)),
        ProgramStep(DIV, None, ((MADE, 1), (OUTSIDE, 2)), 3, (2,)),
        ProgramStep(EXP, None, ((MADE, 2),), 4, (3,)),
        ProgramStep(MUL, None, ((MADE, 3), (SCALAR, 1)), 5, (4,)),
        ProgramStep(ADD, None, ((MADE, 4), (MADE, 2)), 6, (5,)),
    ]


SURVIVORS = (2, 4, 5)


def inputs():
    """2-D inputs (so strides can differ) whose results hold a -0.0 and a NaN."""
    g = torch.Generator().manual_seed(0)
    o0, o1, o2 = (torch.randn(4, 3, generator=g) for _ in range(3))
    o0[0, 0], o1[0, 0], o2[0, 0] = 1.0, -0.0, 2.0  # r0 = -0.0 (s0 = -0.0 there), r2 = -0.0
    o0[1, 1], o1[1, 1], o2[1, 1] = 0.0, 0.0, 0.0  # r2 = 0 / 0: NaN
    return o0, o1, o2


def expected(scalars):
    """The program's survivors as torch computes them, kernel by kernel."""
    o0, o1, o2 = inputs()
    r2 = (o0 * scalars[0] + o1) / o2
    r4 = r2.exp() * scalars[1]
    return {2: r2, 4: r4, 5: r4 + r2}


class Host:
    tracer = None
    cuda = False

    def __init__(self):
        self.sent = []

    def send(self, message):
        self.sent.append(tuple(message))


class Hot:
    """A program on one device and its host's Fuser, replayed as a host replays it."""

    def __init__(self, monkeypatch, compile_stub, program=steps, inputs=inputs,
                 survivors=SURVIVORS):
        self.host = Host()
        self.fuser = Fuser(self.host)
        self.fuser._start = lambda: None  # no compiler thread: ``compile`` runs here
        monkeypatch.setattr(torch._inductor, "compile", compile_stub)
        self.inputs, self.survivors = inputs, survivors
        self.program = SimpleNamespace(
            definition=SimpleNamespace(id=7),
            lower=lambda dev: Lowering(program(), list(range(len(inputs()))), survivors))
        self.dev = SimpleNamespace(index=0, torch_device=torch.device("cpu"))

    def replay(self, scalars, errors=()):
        """One replay, the outside inputs numbered in ``errors`` carrying an error: (its
        survivors' tensors or errors, its lowering, its probe)."""
        lowering, probe, hot = self.fuser.lowering(self.program, self.dev, scalars,
                                                   Fuser.scalars_key(scalars))
        outside = [Blob(None, t) for t in self.inputs()]
        for j in errors:
            outside[j].error = Failure(9, "earlier", f"input {j} failed")
        blobs = {k: Blob(None) for k in self.survivors}
        ProgramRun(lowering, outside, blobs, ([10, 11, 12], list(range(20, 30))), scalars,
                   self.host, probe, hot)()
        values = {k: b.error if b.error is not None else b.tensor for k, b in blobs.items()}
        return values, lowering, probe

    def compile(self, scalars, want=expected):
        """Replays until the program is hot, compiles, and returns the next replay's lowering
        (the fused one if the guard took the compiled code)."""
        for _ in range(config.fusion_after):
            values, _, probe = self.replay(scalars)
            assert_bits(values, want(scalars))
            if probe is not None:
                break
        assert probe is not None and probe.captured and all(probe.captured)
        self.fuser._compile(probe)
        values, lowering, _ = self.replay(scalars)
        return values, lowering


def same(a, b) -> bool:
    """Bit-identical (any NaN is any NaN, as for ``same_bits``, but the sign of a zero counts)."""
    return (a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            and torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
            and torch.equal(a.signbit() | a.isnan(), b.signbit() | b.isnan()))


def assert_bits(values, want):
    for k, t in want.items():
        assert same(values[k], t), (k, values[k], t)


def fused_segments(lowering) -> list:
    return [len(s.original) for s in lowering.steps if type(s) is Fused]


SCALARS = [-0.0, 0.5]


def exact(gm, args):
    return lambda *a: gm(*a)


def off(change, where=lambda gm: True):
    """A compiler whose code applies ``change`` to each result (of the graphs ``where``
    selects)."""
    def compile_(gm, args):
        if not where(gm):
            return exact(gm, args)
        return lambda *a: [change(r) for r in gm(*a)]
    return compile_


def one_ulp_up(r):
    r = r.clone()
    r[2, 2] = torch.nextafter(r[2, 2], torch.tensor(float("inf"), dtype=r.dtype))
    return r


def has_div(gm) -> bool:
    return any(n.target is torch.ops.aten.div.Tensor for n in gm.graph.nodes)


def test_exact_code_is_taken_and_gives_the_kernels_bits(monkeypatch):
    hot = Hot(monkeypatch, exact)
    values, lowering = hot.compile(SCALARS)
    assert fused_segments(lowering) == [3, 2]
    assert_bits(values, expected(SCALARS))
    assert values[2][0, 0].signbit()  # (the -0.0 the guard checks is there)


REFUSED = {
    "one ulp": one_ulp_up,
    "a dtype": lambda r: r.double(),  # (the same values: torch.equal would take them)
    "a shape": lambda r: r.reshape(1, *r.shape),
    "strides": lambda r: r.t().contiguous().t(),
    # (only the first segment's results hold a zero)
    "the sign of a zero": lambda r: torch.where(r == 0, torch.zeros_like(r), r),
}


@pytest.mark.parametrize("wrong", list(REFUSED))
def test_code_wrong_in_any_bit_or_layout_is_refused(monkeypatch, wrong):
    """The program then runs unfused (values bit-identical to torch), for good."""
    hot = Hot(monkeypatch, off(REFUSED[wrong]))
    values, lowering = hot.compile(SCALARS)
    assert fused_segments(lowering) == ([2] if wrong == "the sign of a zero" else [])
    assert_bits(values, expected(SCALARS))
    assert hot.fuser.hot[(7, 0)].asked  # not compiled again


def test_a_segment_off_by_one_ulp_is_refused_and_the_other_taken(monkeypatch):
    hot = Hot(monkeypatch, off(one_ulp_up, where=has_div))
    values, lowering = hot.compile(SCALARS)
    assert fused_segments(lowering) == [2]  # r4 = r3 * s1; r5 = r4 + r2
    assert_bits(values, expected(SCALARS))


def test_a_wrong_second_result_is_refused(monkeypatch):
    """The second segment leaves two results (r4 and r5): each is checked."""
    def second_off(gm, args):
        def run(*a):
            first, second = gm(*a)
            return [first, one_ulp_up(second)]
        return run if not has_div(gm) else exact(gm, args)

    hot = Hot(monkeypatch, second_off)
    values, lowering = hot.compile(SCALARS)
    assert fused_segments(lowering) == [3]
    assert_bits(values, expected(SCALARS))


def test_code_that_returns_fewer_results_is_refused(monkeypatch):
    hot = Hot(monkeypatch, lambda gm, args: lambda *a: list(gm(*a))[:-1])
    values, lowering = hot.compile(SCALARS)
    assert fused_segments(lowering) == []
    assert_bits(values, expected(SCALARS))


def test_a_compiler_that_raises_leaves_the_program_unfused(monkeypatch):
    def raises(gm, args):
        raise RuntimeError("the compiler failed")

    hot = Hot(monkeypatch, raises)
    values, lowering = hot.compile(SCALARS)
    assert fused_segments(lowering) == []
    assert_bits(values, expected(SCALARS))


def test_a_segment_whose_compile_raises_leaves_the_others_fused(monkeypatch):
    def compile_(gm, args):
        if has_div(gm):
            raise RuntimeError("the compiler failed")
        return exact(gm, args)

    hot = Hot(monkeypatch, compile_)
    values, lowering = hot.compile(SCALARS)
    assert fused_segments(lowering) == [2]
    assert_bits(values, expected(SCALARS))


def test_code_that_raises_when_run_leaves_the_program_unfused(monkeypatch):
    def compile_(gm, args):
        def run(*a):
            raise RuntimeError("the fused code failed")
        return run

    hot = Hot(monkeypatch, compile_)
    values, lowering = hot.compile(SCALARS)
    assert fused_segments(lowering) == []
    assert_bits(values, expected(SCALARS))
    assert hot.host.sent == []


def test_another_nan_payload_is_taken(monkeypatch):
    """(``same_bits``: any NaN is any NaN, as the module says.)"""
    hot = Hot(monkeypatch, off(lambda r: torch.where(r.isnan(), -r.abs(), r)))
    values, lowering = hot.compile(SCALARS)
    assert fused_segments(lowering) == [3, 2]
    assert values[2][1, 1].isnan() and values[2][1, 1].signbit()  # the fused code's NaN
    assert_bits(values, expected(SCALARS))


def test_fused_code_runs_only_for_the_scalars_it_was_compiled_with(monkeypatch):
    """The scalars are constants in the fused code: a replay with other scalars, even ones
    equal as numbers (0.0 and -0.0 give other bits: x * 0.0 and x * -0.0, and 1 / x of
    those; 1 and 1.0 other dtypes, for integer tensors), runs unfused with its own."""
    hot = Hot(monkeypatch, exact)
    _, lowering = hot.compile(SCALARS)
    assert fused_segments(lowering) == [3, 2]
    for scalars in ([0.0, 0.5], [-0.0, 1], [-0.0, 0.5]):
        values, lowering, _ = hot.replay(scalars)
        assert fused_segments(lowering) == ([3, 2] if repr(scalars) == repr(SCALARS) else [])
        assert_bits(values, expected(scalars))


def chains():
    """One segment of two independent chains over three outside inputs: r0 = o0 * s0,
    r1 = o1 * s1, r2 = o2 + o2, r3 = r0 + r1. Survivors: r2, r3."""
    return [
        ProgramStep(MUL, None, ((OUTSIDE, 0), (SCALAR, 0)), 1, (0,)),
        ProgramStep(MUL, None, ((OUTSIDE, 1), (SCALAR, 1)), 2, (1,)),
        ProgramStep(ADD, None, ((OUTSIDE, 2), (OUTSIDE, 2)), 3, (2,)),
        ProgramStep(ADD, None, ((MADE, 0), (MADE, 1)), 4, (3,)),
    ]


def chain_inputs():
    g = torch.Generator().manual_seed(1)
    return tuple(torch.randn(5, generator=g) for _ in range(3))


def chain_values(scalars):
    o0, o1, o2 = chain_inputs()
    return {2: o2 + o2, 3: o0 * scalars[0] + o1 * scalars[1]}


@pytest.mark.parametrize("failed", [0, 1, 2])
def test_each_failed_input_of_a_fused_segment_fails_only_what_depends_on_it(monkeypatch,
                                                                            failed):
    """The fused step then runs its kernels one by one: the results of the failed input
    carry its error, quietly (no kernel raised), the others are right."""
    hot = Hot(monkeypatch, exact, program=chains, inputs=chain_inputs, survivors=(2, 3))
    _, lowering = hot.compile(SCALARS, want=chain_values)
    assert fused_segments(lowering) == [4]
    values, lowering, _ = hot.replay(SCALARS, errors=[failed])
    assert fused_segments(lowering) == [4]
    error = (9, "earlier", f"input {failed} failed")
    want = chain_values(SCALARS)
    assert values[3] == error if failed < 2 else same(values[3], want[3])
    assert values[2] == error if failed == 2 else same(values[2], want[2])
    assert hot.host.sent == []
    values, _, _ = hot.replay(SCALARS)  # and the next replay is right again
    assert_bits(values, want)
