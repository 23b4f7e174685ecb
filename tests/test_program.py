"""A host's replayed program (``runtime/program.py``) without a runtime: the generated function
(``straight_line``) a hot lowering runs does what the loop does, failures included: the same
values, the same blobs, the same errors reported once each."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dtorch.runtime.execute import KernelRun
from dtorch.runtime.failures import Failure
from dtorch.runtime.program import (
    MADE,
    OUTSIDE,
    SCALAR,
    STRAIGHT_AFTER,
    Lowering,
    ProgramRun,
    ProgramStep,
    mark_frees,
    straight_line,
)
from dtorch.runtime.stream import Blob


def kernel(name, fn, overwrites=False, **kwargs):
    """A HostCall as a program's steps read it (``overwrites``: protocol.OVERWRITES)."""
    return SimpleNamespace(name=name, fn=fn, kwargs=kwargs, overwrites=overwrites, comm=False,
                           saves=False)


def fail(x, y):
    raise ValueError("no such thing")


ADD = kernel("add", torch.add)
MUL = kernel("mul", torch.mul)
SPLIT = kernel("split", lambda x: tuple(torch.split(x, 2)))
ADD_ALPHA = kernel("add", torch.add, alpha=2)
FAIL = kernel("fail", fail)
ADD_ = kernel("add_", lambda x, y: x.add_(y))
WITH_CTX = kernel("scale", lambda ctx, x: x * ctx)


def program(failing: bool = False) -> tuple:
    """``(steps, reads, survivors)``: outside inputs 0 and 1, scalar 0; results 0..6."""
    steps = [
        ProgramStep(ADD, None, ((OUTSIDE, 0), (SCALAR, 0)), 1, (0,)),          # r0 = o0 + s0
        ProgramStep(FAIL if failing else MUL, None, ((MADE, 0), (OUTSIDE, 1)), 2, (1,)),  # r1
        ProgramStep(SPLIT, None, ((MADE, 1),), 3, (2, 3)),                      # r2, r3 = r1
        ProgramStep(ADD_ALPHA, None, ((MADE, 2), (MADE, 3)), 4, (4,)),          # r4 = r2 + 2 r3
        ProgramStep(ADD_, None, ((OUTSIDE, 1), (MADE, 0)), 5, (-2,)),           # o1 += r0
        ProgramStep(WITH_CTX, 3.0, ((OUTSIDE, 1),), 6, (5,)),                   # r5 = 3 o1
        ProgramStep(ADD, None, ((OUTSIDE, 0), (OUTSIDE, 0)), 7, (6,)),          # r6: none failed
    ]
    mark_frees(steps)
    return steps, [0, 1], {4, 5, 6}


class Host:
    log_kernels = False  # (Host's, read once at its start from config.debug)
    cuda = False

    def __init__(self):
        self.sent = []

    def send(self, message):
        self.sent.append(tuple(message))


def run(fast: bool, failing=False, outside_error=None) -> tuple:
    """One run, through the generated function or the loop: (survivor blobs, outside blobs,
    what the host sent)."""
    steps, reads, survivors = program(failing)
    lowering = Lowering(steps, reads, survivors)
    if fast:
        lowering.fast = straight_line(steps, reads, survivors)
    outside = [Blob(None, torch.arange(4.0)), Blob(None, torch.ones(4))]
    outside[0].error = outside_error
    blobs = {k: Blob(None) for k in survivors}
    host = Host()
    ProgramRun(lowering, outside, blobs, ([10, 11], [20 + k for k in range(7)]), [0.5],
               host)()
    assert (lowering.fast is not None) == fast
    return blobs, outside, host.sent


def state(blobs) -> dict:
    return {k: b.error if b.error is not None else b.tensor.tolist() for k, b in blobs.items()}


@pytest.mark.parametrize("failing", [False, True])
def test_generated_function_does_what_the_loop_does(failing):
    fast_blobs, fast_outside, fast_sent = run(True, failing)
    loop_blobs, loop_outside, loop_sent = run(False, failing)
    assert state(fast_blobs) == state(loop_blobs)
    assert state(dict(enumerate(fast_outside))) == state(dict(enumerate(loop_outside)))
    assert fast_sent == loop_sent
    if not failing:
        o0, o1 = torch.arange(4.0), torch.ones(4)
        r1 = (o0 + 0.5) * o1
        assert fast_blobs[4].tensor.tolist() == (r1[:2] + 2 * r1[2:]).tolist()
        assert fast_outside[1].tensor.tolist() == (o1 + o0 + 0.5).tolist()
        assert fast_blobs[5].tensor.tolist() == (3 * (o1 + o0 + 0.5)).tolist()
        assert fast_sent == []
    else:
        # the kernel's error is told once, naming its site and first result; what depends on
        # it carries it, what does not (the in-place add, r5, r6) ran
        assert len(fast_sent) == 1 and fast_sent[0][1:] == (2, "fail", "ValueError: no such "
                                                                        "thing", 21)
        assert fast_blobs[4].error == (2, "fail", "ValueError: no such thing")
        assert fast_blobs[5].error is None and fast_blobs[6].error is None
        assert fast_blobs[6].tensor.tolist() == [0.0, 2.0, 4.0, 6.0]


def test_an_outside_input_that_failed_hands_the_run_to_the_loop():
    error = Failure(9, "earlier", "RuntimeError: boom")
    fast_blobs, _, fast_sent = run(True, outside_error=error)
    loop_blobs, _, loop_sent = run(False, outside_error=error)
    assert state(fast_blobs) == state(loop_blobs)
    assert fast_sent == loop_sent == []
    assert fast_blobs[4].error == fast_blobs[6].error == error
    assert fast_blobs[5].error == error  # o1 += r0, and r0 failed


def test_temporaries_are_dropped_after_their_last_use():
    """The values list holds no temporary once the run is over: each was dropped after the
    step that read it last (survivors live on in their blobs)."""
    steps, reads, survivors = program()
    lowering = Lowering(steps, reads, survivors)
    lowering.fast = straight_line(steps, reads, survivors)
    values = [None] * 7
    outside = [Blob(None, torch.arange(4.0)), Blob(None, torch.ones(4))]
    task = ProgramRun(lowering, outside, {k: Blob(None) for k in survivors}, ([0, 1], [0] * 7),
                      [0.5], Host())
    task._run_all(values)
    assert lowering.fast is not None
    assert [v is None for v in values] == [True, True, True, True, False, False, False]
    assert not any(type(v) is Failure for v in values)


def test_a_lowering_is_generated_once_it_has_run_often():
    steps, reads, survivors = program()
    lowering = Lowering(steps, reads, survivors)
    for _ in range(STRAIGHT_AFTER - 1):
        assert lowering.fast_function() is None
    fast = lowering.fast_function()
    assert fast is not None and lowering.fast_function() is fast


# -- a full write over a failure: the kernel loop and replays share one rule --------------------

COPY_ = kernel("copy_", lambda ctx, x, y: x.copy_(y), overwrites=True)
ADD_CTX_ = kernel("add_", lambda ctx, x, y: x.add_(y))
EARLIER = Failure(9, "earlier", "RuntimeError: boom")
# outside blobs: (tensor it holds, its failure, a view): a value, failures with and without a
# tensor, a view never made, a failed source
OUTSIDE_BLOBS = [(torch.arange(4.0), None, False), (torch.ones(4), EARLIER, False),
                 (None, EARLIER, False), (None, EARLIER, True), (torch.ones(4), EARLIER, False),
                 (torch.zeros(4), None, False), (None, EARLIER, False)]
# (call, operand 0, operand 1): o1, o2 overwritten (repaired); o3 stays failed (a view's storage
# is its base's); o4 is added to, which reads it (stays failed); o5 is overwritten from a
# failed source (fails)
WRITES = [(COPY_, 1, 0), (COPY_, 2, 0), (COPY_, 3, 0), (ADD_CTX_, 4, 0), (COPY_, 5, 6)]


def outside_blobs() -> list:
    spec = SimpleNamespace(dtype="float32")
    blobs = []
    for tensor, error, view in OUTSIDE_BLOBS:
        b = Blob(spec, None if tensor is None else tensor.clone(), view=view)
        b.error = error
        blobs.append(b)
    return blobs


def context():
    return SimpleNamespace(out_local_shape=(4,), device=SimpleNamespace(
        torch_device=torch.device("cpu")))


def write_one_by_one() -> tuple:
    """Each write as a kernel of its own (``execute.KernelRun``, how the passes' lowering runs)."""
    outside, host = outside_blobs(), Host()
    for site, (call, dst, src) in enumerate(WRITES):
        KernelRun([(call, context(), [outside[dst], outside[src]], site)], [outside[dst]], None,
                  host, 100 + dst)()
    return outside, host.sent


def write_replayed(fast: bool) -> tuple:
    """The same writes as one replayed program, by the loop or by the generated function."""
    steps = [ProgramStep(call, context(), ((OUTSIDE, dst), (OUTSIDE, src)), site, (-1 - dst,))
             for site, (call, dst, src) in enumerate(WRITES)]
    mark_frees(steps)
    reads = list(range(len(OUTSIDE_BLOBS)))
    lowering = Lowering(steps, reads, set())
    if fast:
        lowering.fast = straight_line(steps, reads, set())
    outside, host = outside_blobs(), Host()
    ProgramRun(lowering, outside, {}, ([100 + k for k in reads], []), [], host)()
    return outside, host.sent


@pytest.mark.parametrize("replayed", ["loop", "generated"])
def test_a_full_write_clears_a_failure_alike_in_kernels_and_replays(replayed):
    """``Blob.overwritable`` is the one rule: a full write (``protocol.OVERWRITES``) over a
    failed blob writes its storage, or a fresh block where it has none, and the blob holds a
    value again; a view never made stays failed, and so does a blob a kernel reads (``add_``)
    or one written from a failed source. Kernel by kernel and replayed, the same blobs, and
    nothing told (each failure was told when it happened)."""
    one, one_sent = write_one_by_one()
    replay, replay_sent = write_replayed(replayed == "generated")
    assert state(dict(enumerate(one))) == state(dict(enumerate(replay)))
    assert one_sent == replay_sent == []
    assert [b.error for b in one] == [None, None, None, EARLIER, EARLIER, EARLIER, EARLIER]
    assert one[1].tensor.tolist() == one[2].tensor.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_kernel_that_raises_fails_alike_in_kernels_and_replays():
    """The one step runner (``execute.Runner.run_step``): a kernel record and a replay of the
    same kernel tell the same error once, naming the kernel's first result, and leave the same
    Failure in its result, which a later kernel passes on without telling."""
    def operands():
        return [Blob(None, torch.arange(4.0)), Blob(None, torch.ones(4))]

    host, first, then = Host(), Blob(None), Blob(None)
    outside = operands()
    KernelRun([(FAIL, None, outside, 2)], [first], None, host, 20)()
    KernelRun([(ADD, None, [first, outside[1]], 3)], [then], None, host, 21)()
    steps = [ProgramStep(FAIL, None, ((OUTSIDE, 0), (OUTSIDE, 1)), 2, (0,)),
             ProgramStep(ADD, None, ((MADE, 0), (OUTSIDE, 1)), 3, (1,))]
    mark_frees(steps)
    blobs, replay = {0: Blob(None), 1: Blob(None)}, Host()
    ProgramRun(Lowering(steps, [0, 1], {0, 1}), operands(), blobs, ([10, 11], [20, 21]), [],
               replay)()
    assert host.sent == replay.sent and len(host.sent) == 1
    assert host.sent[0][1:] == (2, "fail", "ValueError: no such thing", 20)
    assert first.error == then.error == blobs[0].error == blobs[1].error
    assert type(blobs[1].error) is Failure and blobs[1].error == host.sent[0][1:4]
