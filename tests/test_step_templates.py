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


def lowered_steps(t, records_of_steps, before=(), graph=make_graph, n_ids=2 * MADE + 1):
    """The real controller's output for a DefineStep of ``t`` and these steps, and the
    reference's (each step expanded and lowered by the passes alone, no replay)."""
    g, h = graph(), graph()
    real = Replayer(g, run_passes(g), Controller.encode)
    st = StepTemplate([P.DEFINE_STEP, 1, n_ids, t])
    out, expected = [], []
    reference = Replayer(h, run_passes(h), Controller.encode)
    for k, (ids, rates) in enumerate(records_of_steps):
        for batch in dict(before).get(k, []):
            real.run([list(r) if type(r) is not int else r for r in batch], out)
            reference.run([list(r) if type(r) is not int else r for r in batch], expected)
        real.run_step(st, [P.STEP, 1, *ids, *rates], out)
        with config.Context(replay=False):
            reference.run(StepTemplate([P.DEFINE_STEP, 1, n_ids, t]).expand(ids, rates),
                          expected)
    return out, expected, g, h, real, st


def tagged(records, tag) -> int:
    return sum(1 for r in records if type(r) is not int and r[0] == tag)


def with_collective(at: int) -> list:
    t = template()
    t.insert(at, [[P.OP, call_id("all_reduce_", 1), 8, 0, W, W], [], []])
    return t


@pytest.mark.parametrize("at", range(2, 9))
def test_a_step_with_a_collective_is_lowered_once_then_made_from_its_record(at):
    """A collective inside the step, at each place: no program; the step's lowering is
    watched for two steps alike (the first two differ: no previous step, a first wait), then
    each Step is one HostStep record, the stream state moved on as the passes would."""
    out, expected, g, h, real, st = lowered_steps(with_collective(at), steps(8))
    assert_alike(out, expected, g, h)
    assert st.whole is False and st.fast is None
    assert real.replayed_steps == 4 and tagged(out, P.HOST_STEP) == 4
    assert tagged(out, P.DEFINE_HOST_STEP) == 1
    assert [r for r in g.definitions if r[0] == P.DEFINE_HOST_STEP]  # for hosts that start late
    assert any(type(r) is not int and r[0] == P.WAIT for r in expected)


def test_a_stream_state_of_another_shape_lowers_that_step_with_its_waits():
    """Before step 6 a collective writes W on the communication stream: the step must wait
    for it first, which the learnt lowering does not; that step alone is expanded."""
    collective = [[P.OP, call_id("all_reduce_", 1), 9, 0, W, W]]
    out, expected, g, h, real, _ = lowered_steps(with_collective(4), steps(9),
                                                  before={6: [collective]})
    assert_alike(out, expected, g, h)
    assert real.replayed_steps == 9 - 4 - 1
    assert tagged(out, P.WAIT) > tagged(lowered_steps(with_collective(4), steps(9))[0],
                                        P.WAIT)


def test_a_state_that_changes_for_good_is_learnt_again_under_the_same_definition():
    """From step 6 on a collective writes W before every step: steps 6 and 7 lower alike (with
    the wait), so the lowering is learnt again, replacing the hosts' definition (one id; one
    definition kept for hosts that start later), and steps 8 and 9 are made from it."""
    collective = [[P.OP, call_id("all_reduce_", 1), 9, 0, W, W]]
    out, expected, g, h, real, _ = lowered_steps(
        with_collective(4), steps(10), before={k: [collective] for k in range(6, 10)})
    assert_alike(out, expected, g, h)
    assert real.replayed_steps == 4
    defined = [r[1] for r in out if type(r) is not int and r[0] == P.DEFINE_HOST_STEP]
    assert len(defined) == 2 and len(set(defined)) == 1
    assert [r[1] for r in g.definitions if r[0] == P.DEFINE_HOST_STEP] == defined[:1]
    assert [type(r) is not int and r[0] == P.HOST_STEP for r in out].count(True) == 4


def test_an_id_a_step_fixes_given_again_is_expanded():
    """A step whose argument is the parameter itself: the lowering names W once. That step
    reads W last, so the next one finds W's storage in another state and is expanded too."""
    records = steps(10)
    ids, rates = records[6]
    records[6] = (ids[:-1] + [W], rates)
    out, expected, g, h, real, _ = lowered_steps(with_collective(4), records)
    assert_alike(out, expected, g, h)
    assert real.replayed_steps == 10 - 4 - 2


GRID, S0_R, R_S0 = 3, 60, 61  # a 2 x 2 mesh; a spec sharded on its first dim, one on its second
REDISTRIBUTE, SCALE, SCALE_ = 70, 71, 72


def grid_graph():
    g = make_graph()
    g.define([P.DEFINE_MESH, GRID, "cpu", [2, 2], [0, 1, 2, 3]])
    g.define([P.DEFINE_SPEC, S0_R, [4, 4], "float32", GRID, ["S0", "R"]])
    g.define([P.DEFINE_SPEC, R_S0, [4, 4], "float32", GRID, ["R", "S0"]])
    g.define([P.DEFINE_CALL, REDISTRIBUTE, None, [S0_R], [R_S0], b"", 0,
              P.CallKind.REDISTRIBUTE])
    g.define([P.DEFINE_CALL, SCALE, "mul", [R_S0, 0], [R_S0], b"", 0, P.CallKind.OPERATOR])
    g.define([P.DEFINE_CALL, SCALE_, "mul_", [S0_R, 0], [S0_R], b"", P.INPLACE,
              P.CallKind.OPERATOR])
    return g


def test_a_redistribute_in_a_step_gets_fresh_temporaries_each_step():
    """W laid out again (an all-gather into a temporary the controller makes, then a chunk),
    scaled by a rate that changes, W written in place: each HostStep brings new temporaries,
    and the records equal the passes' with the reference's own temporaries."""
    hole = 0
    t = [
        [[P.OP, REDISTRIBUTE, 1, 0, hole, W], [[4, 0]], []],
        [[P.OP, SCALE, 2, 0, hole, hole, hole], [[4, 1], [5, 0]], [6]],
        0,
        [[P.OP, SCALE_, 3, 0, W, W, 0.5], [], []],
        2,  # the previous step's product
    ]
    records, prev = [], 999
    for k in range(8):
        records.append(([1000 + 10 * k, 1001 + 10 * k, prev], [0.1 * (k + 1)]))
        prev = 1001 + 10 * k
    out, expected, g, h, real, _ = lowered_steps(t, records, graph=grid_graph, n_ids=3)
    assert real.replayed_steps == 4
    temps = [r[2 + 3 + 1:] for r in out if type(r) is not int and r[0] == P.HOST_STEP]
    assert all(len(x) == 1 for x in temps) and len({x[0] for x in temps}) == 4
    assert g.next_temp == h.next_temp  # the same temporaries: the records compare as they are
    initial = {W, 999}
    assert normalized(g, expand(g, out), initial) == normalized(h, expected, initial)
    assert stream_state(g) == stream_state(h)


def test_a_view_kept_to_the_next_step_and_released_there():
    """Each step makes Y and a view V of it, both kept to the next step (Y's storage counts
    V), which reads the previous V and releases both: the state restored holds the views and
    drops them with their storage as the passes do."""
    hole = 0
    y, v, prev_y, prev_v, arg = range(5)
    t = [
        [[P.OP, call_id("mul", 1), 1, 0, hole, W, 2.0], [[4, y]], []],
        [[P.OP, call_id("t", 1), 2, 0, hole, hole], [[4, v], [5, y]], []],
        [[P.OP, call_id("add_", 1), 3, 0, hole, hole, hole], [[4, arg], [5, arg], [6, prev_v]],
         []],
        prev_v,
        prev_y,
        [[P.OP, call_id("all_reduce_", 1), 4, 0, W, W], [], []],
    ]
    records, prev = [], [998, 999]
    for k in range(8):
        made = [1000 + 10 * k, 1001 + 10 * k]
        records.append(([*made, *prev, 1009 + 10 * k], []))
        prev = made
    out, expected, g, h, real, _ = lowered_steps(t, records, n_ids=5)
    assert real.replayed_steps >= 3
    initial = {W, 998, 999, *range(1009, 2000, 10)}  # (the first step's previous Y and V)
    assert normalized(g, expand(g, out), initial) == normalized(h, expected, initial)
    assert stream_state(g) == stream_state(h)
    assert g.streams.roots and any(m.views for m in g.streams.storages.values())


def test_a_dropped_step_is_forgotten_by_the_controller_and_the_hosts():
    """``DROP_STEP`` (a ReplayedStep collected): the controller drops the template, the
    lowering's definition kept for late hosts, and passes the drop on to the hosts in the
    batch's order; a host forgets the definition. A template never learnt sends nothing."""
    from types import SimpleNamespace

    from dtorch.controller.main import Batch
    from dtorch.runtime.host import Host

    out, _, g, _, real, st = lowered_steps(with_collective(4), steps(6))
    assert st.lowering.learnt is not None
    other = StepTemplate([P.DEFINE_STEP, 2, 2 * MADE + 1, template()])
    controller = SimpleNamespace(step_templates={1: st, 2: other}, graph=g)
    batch = Batch()
    Controller.take_drop_step(controller, [P.DROP_STEP, 1], batch)
    assert controller.step_templates == {2: other} and batch.nodes == [[P.DROP_STEP, 1]]
    assert not [d for d in g.definitions if d[0] == P.DEFINE_HOST_STEP]
    batch = Batch()
    Controller.take_drop_step(controller, [P.DROP_STEP, 2], batch)
    Controller.take_drop_step(controller, [P.DROP_STEP, 3], batch)  # (unknown: nothing)
    assert controller.step_templates == {} and batch.nodes == []
    host = SimpleNamespace(host_steps={1: "entries", 5: "others"})
    Host.HANDLERS[P.DROP_STEP](host, [P.DROP_STEP, 1])
    Host.HANDLERS[P.DROP_STEP](host, [P.DROP_STEP, 1])  # (twice: no error)
    assert host.host_steps == {5: "others"}
