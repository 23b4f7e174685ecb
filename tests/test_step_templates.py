"""The controller's side of replayed steps (``controller/step_templates.py``): a step's Step
records lower to what the hosts would get from its records lowered by the passes alone --
compared record for record, waits and releases included, each REPLAY expanded by its program
-- and leave the same stream state; from its third replay the controller binds the program
from the Step record without expanding it, and declines to where ids repeat or the stream
state would need a wait."""

import pytest

from dtorch import config, protocol as P
from dtorch.controller.main import Controller
from dtorch.controller.replay import Replayer
from dtorch.controller.step_templates import StepTemplate
from replay_lowering import (call_id, expand, make_graph, normalized, run_passes,
                             stream_state)

W, OTHER = 10, 11  # a parameter, and a tensor written elsewhere, made before the steps
MADE = 5  # per step: the tape key, the kept forward's result, its product, the gradient, loss
KEY, H, Y, GRAD, LOSS = range(MADE)
PREV, ARG = MADE, 2 * MADE  # the previous step's made ids, then the argument


def op(kind, site, out, *operands):
    return [P.OP, call_id(kind, 1), site, 0, out, *operands]


def template() -> list:
    """A training step's records with holes: a recorded forward on W and its VJP, the
    previous step's gradient dropped, W scaled in place by a learning rate that changes every
    step, and a loss read from the argument."""
    hole = 0  # (the value a hole holds in the template)
    return [
        [[P.RECORDED, hole, hole, 1, 0], [[1, H], [2, KEY]], []],
        [op("fwd", 1, hole, W), [[4, H]], []],
        [op("mul", 2, hole, hole, 2.0), [[4, Y], [5, H]], []],
        [op("vjp", 3, hole, hole, hole), [[4, GRAD], [5, KEY], [6, Y]], []],
        PREV + GRAD, KEY, H, Y,
        [op("mul_", 4, W, W, 0.1), [], [6]],
        [op("add", 5, hole, hole, hole), [[4, LOSS], [5, ARG], [6, GRAD]], []],
    ]


def steps(n: int, first: int = 1000):
    """``n`` Step records' ids and learning rates: fresh made ids each step, the previous
    step's made ones, a new argument."""
    out, prev = [], list(range(first - MADE, first))
    for k in range(n):
        made = list(range(first + 10 * k, first + 10 * k + MADE))
        out.append(([*made, *prev, first + 10 * k + 9], [0.1 / (k + 1)]))
        prev = made
    return out


def lowered(records_of_steps, before=()):
    """The real controller's output for a DefineStep and these steps (``before``: batches
    of plain records ahead of given steps, by index), with how many steps it expanded, and
    the reference: each step's records expanded and lowered by the passes alone."""
    g, h = make_graph(), make_graph()
    real = Replayer(g, run_passes(g), Controller.encode)
    t = StepTemplate([P.DEFINE_STEP, 1, 2 * MADE + 1, template()])
    expanded = []
    plain_expand = t.expand
    t.expand = lambda ids, dynamic: expanded.append(1) or plain_expand(ids, dynamic)
    out, expected = [], []
    reference = Replayer(h, run_passes(h), Controller.encode)
    for k, (ids, rates) in enumerate(records_of_steps):
        for batch in dict(before).get(k, []):
            real.run([list(r) if type(r) is not int else r for r in batch], out)
            reference.run([list(r) if type(r) is not int else r for r in batch], expected)
        real.run_step(t, [P.STEP, 1, *ids, *rates], out)
        with config.Context(replay=False):
            reference.run(StepTemplate([P.DEFINE_STEP, 1, 2 * MADE + 1, template()]).expand(
                ids, rates), expected)
    return out, expected, g, h, len(expanded)


def assert_alike(out, expected, g, h):
    initial = {W, OTHER, *range(1000 - MADE, 1000), *range(1009, 2000, 10)}  # + arguments
    assert normalized(g, expand(g, out), initial) == normalized(h, expected, initial)
    assert stream_state(g) == stream_state(h)


def test_steps_bind_their_program_from_the_step_record():
    out, expected, g, h, n_expanded = lowered(steps(7))
    assert_alike(out, expected, g, h)
    # seen (lowered), cached (lowered, a program defined, its binding learnt), then bound
    # from the record alone
    assert n_expanded == 2
    assert sum(1 for r in out if type(r) is not int and r[0] == P.REPLAY) == 5
    assert [r for r in out if type(r) is not int and r[0] == P.DEFINE_PROGRAM]


def test_repeated_ids_are_expanded_not_bound():
    """A step whose argument is the parameter itself: one id where the program has two."""
    records = steps(7)
    ids, rates = records[5]
    records[5] = (ids[:-1] + [W], rates)
    out, expected, g, h, n_expanded = lowered(records)
    assert_alike(out, expected, g, h)
    assert n_expanded == 3


def test_a_step_that_must_wait_is_expanded_and_lowered_with_the_wait():
    """Before step 5 a collective writes W in place on the communication stream: the step
    must wait for it, which a replay cannot (its program has no wait)."""
    collective = [[P.OP, call_id("all_reduce_", 1), 9, 0, W, W]]
    out, expected, g, h, n_expanded = lowered(steps(7), before={5: [collective]})
    assert_alike(out, expected, g, h)
    assert n_expanded == 3
    assert any(type(r) is not int and r[0] == P.WAIT for r in expected)


@pytest.mark.parametrize("at", range(2, 9))
def test_a_step_that_cannot_be_one_window_lowers_as_any_batch(at):
    """A collective inside the step: no program; every step is expanded."""
    t = template()
    t.insert(at, [[P.OP, call_id("all_reduce_", 1), 8, 0, W, W], [], []])
    g, h = make_graph(), make_graph()
    real = Replayer(g, run_passes(g), Controller.encode)
    st = StepTemplate([P.DEFINE_STEP, 1, 2 * MADE + 1, t])
    out, expected = [], []
    reference = Replayer(h, run_passes(h), Controller.encode)
    for ids, rates in steps(5):
        real.run_step(st, [P.STEP, 1, *ids, *rates], out)
        with config.Context(replay=False):
            reference.run(StepTemplate([P.DEFINE_STEP, 1, 2 * MADE + 1, t]).expand(ids, rates),
                          expected)
    assert_alike(out, expected, g, h)
    assert st.whole is False and st.fast is None
