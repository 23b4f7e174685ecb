"""A replayed window is lowered exactly as the passes lower it (controller/replay.py), record for
record: no runtime.

Every batch goes through the controller's Replayer, and again through a reference Replayer that
takes the same decisions except that where the first replayed a window, the reference runs the
passes on that window alone (as the first window of a shape is lowered; ``replay_lowering.py``).
Expanding each REPLAY by its program's definition must then give the reference's records: the
same WAIT records, the same kernels (call, site, stream, results, operands, scalars to the bit),
the same fetch streams, and the same releases of what the hosts hold. Since the records after a
replay are lowered by the passes from the stream state the replay left (``Replayer.advance``), a
replay that moved the state on wrongly shows as a wait missing or added later: each program ends
with probes that read and write every live tensor from the other streams.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from dtorch import config, protocol as P
from dtorch.controller import replay
from replay_lowering import (BETWEEN_KINDS, BODY_KINDS, IN_PLACE, Builder, assert_lowered_alike,
                             between, cut, make_graph, probe_and_release, statement)

WINDOW = 8  # replay.MIN_WINDOW here: loops of a few dozen iterations make many windows


pytestmark = pytest.mark.no_runtime  # (conftest syncs after the other tests)


@pytest.fixture(autouse=True)
def small_windows(monkeypatch):
    monkeypatch.setattr(replay, "MIN_WINDOW", WINDOW)
    monkeypatch.setattr(config, "replay", True)


# -- programs by hand ------------------------------------------------------------------------------


def loop(b: Builder, body, iterations, scalars=lambda k: 0.5):
    """``body``: ``(kind, variable names)`` per statement; scalar of iteration k."""
    for k in range(iterations):
        for n, (kind, names) in enumerate(body):
            statement(b, kind, names, 10 * (n + 1), scalars(k))


def variables(b: Builder, *names, mesh=1, graph=0):
    b.on(graph)
    for name in names:
        b.vars[name] = [b.op("ones", 1, mesh), mesh]
    b.on(0)


def test_a_loop_with_in_place_writes_has_one_shape_wherever_the_batch_cuts_it():
    """An in-place call's result is its operand, made before the loop: ``replay.phase`` must
    not count it as made in the loop, or the windows' phase follows where the batch began."""
    shapes = set()
    for offset in range(6):
        b = Builder()
        variables(b, "p", "g", "s")
        start = len(b.records)
        loop(b, [("update", ["p", "g", "s"]), ("scale", ["g"])], 40)
        batch = b.records[:start] + b.records[start + offset:]
        g = make_graph()
        for first, end, is_window in replay.windows(batch, g.calls):
            if is_window:
                shapes.add(replay.shape_of(g.calls, batch[first:end])[0])
    assert len(shapes) == 1


def test_an_input_only_dead_code_reads_is_not_accessed_by_a_replay():
    """A loop whose only read of x is dead code: the passes drop it, so a later write of x on
    another stream waits for nothing, replayed or not."""
    b = Builder()
    variables(b, "x", graph=1)
    variables(b, "y")
    loop(b, [("dead", ["x"]), ("scale", ["y"])], 30)
    between(b, "write B", "x", 90)
    probe_and_release(b, 95)
    seen = assert_lowered_alike(cut(b.records, [len(b.records) - 40]))
    assert seen["replayed"] >= 5


def resumed(b: Builder, body, *accesses, iterations=30, scalars=lambda k: 0.5,
            waits=True) -> Counter:
    """The loop ``body``, then for each of ``accesses`` (``[(between kind, variable)]``) those
    accesses from other streams and the loop again; probes; batches cut where a loop resumes.
    Asserts both lowerings agree and (``waits``) that a resumed loop's first window needed a
    wait, which a replay cannot make: a program replayed there would leave out a WAIT.

    The body begins with ``pad = -pad``: a window begins at the least rotation of the loop's
    keys (``replay.phase``), here the release of the old pad (neg's call id is the largest),
    so the statements after it run in the first window, not before it through the passes.
    Each loop ends with one more ``pad = -pad``, so that its last window ends it: a tail
    after it would go through the passes, whose accesses would hide a replay's."""
    b.vars["pad"] = [b.op("ones", 1, 1), 1]
    body = [("negate", ["pad"]), *body]

    def run():
        loop(b, body, iterations, scalars)
        statement(b, "negate", ["pad"], 10, 0.5)

    run()
    cuts = []
    for group in accesses:
        for n, (kind, name) in enumerate(group):
            between(b, kind, name, 90 + 2 * n)
        cuts.append(len(b.records))
        run()
    probe_and_release(b, 99)
    seen = assert_lowered_alike(cut(b.records, cuts))
    assert seen["replayed"] >= 10 and seen["lowered with its neighbours"] >= waits, seen
    return seen


def test_an_update_whose_state_a_collective_read_waits_for_that_read():
    """``update_(p, g, s)`` writes s too (``protocol.writes(2)``, as an optimizer's step
    writes its state): after a collective read s, the loop's window must wait for the read
    (write after read), and the program that replayed before must not."""
    b = Builder()
    variables(b, "p", "g", "s")
    resumed(b, [("scale", ["g"]), ("update", ["p", "g", "s"])], [("read comm", "s")])


def test_an_update_after_its_parameter_was_written_elsewhere_waits():
    b = Builder()
    variables(b, "p", "g", "s")
    resumed(b, [("scale", ["g"]), ("update", ["p", "g", "s"])], [("write B", "p")])


def test_a_collective_reading_a_windows_results_waits_for_them():
    """The loop's last x (a result a replayed window left alive) and results kept from early
    windows, read by a collective: each read waits for the compute stream."""
    b = Builder()
    variables(b, "x", "y")
    loop(b, [("chain", ["x", "y"]), ("keep", ["x"])], 40, scalars=lambda k: 0.25 * k)
    end = len(b.records)  # (a batch's windows are found from its middle: the loop's batch)
    between(b, "read comm", "x", 90)
    between(b, "read comm", "y", 91)  # read by every window, written before them
    b.vars["k"] = list(b.kept[5])  # a result kept from an early window
    between(b, "read comm", "k", 92)
    seen = assert_lowered_alike(cut(b.records, [end]))
    assert seen["replayed"] >= 5


def test_an_input_a_collective_wrote_is_waited_for_before_a_replay():
    """x + a, where a collective wrote a: the window after the collective must wait for it;
    the windows after that replay (the compute stream has waited)."""
    b = Builder()
    variables(b, "x", "a")
    between(b, "gather", "a", 80)
    resumed(b, [("axpy", ["x", "a"])], [("all_reduce", "a")])


def test_a_view_made_on_another_stream_is_waited_for_before_a_replay():
    """x + w, where w is a view the other graph made: its handle is made on that stream, so
    the window reading a new one must wait, though its storage was written long before."""
    b = Builder()
    variables(b, "x", "w")
    resumed(b, [("axpy", ["x", "w"])], [("view B", "w")])


def test_an_input_written_through_a_view_after_a_read_elsewhere_waits():
    """x.t().add_(y) writes x's storage: after the other graph read x, the window must wait
    for that read (write after read), though the write is to a view made in the window."""
    b = Builder()
    variables(b, "x", "y", "z")
    resumed(b, [("view_write", ["x", "y"]), ("scale", ["z"])], [("read B", "x")])


def test_signed_zeros_and_views_dropped_in_windows():
    b = Builder()
    variables(b, "x", "y", "z")
    body = [("view_write", ["x", "y"]), ("imul", ["z"]), ("view", ["y"]), ("dead", ["z"])]
    resumed(b, body, [("read B", "z"), ("fetch", "z")], scalars=lambda k: (0.0, -0.0)[k % 2])


def test_a_window_over_two_meshes_replays_once_the_mesh_reading_a_collective_waited():
    """The collective wrote a, on mesh 1; the window's kernels on mesh 2 read nothing it
    wrote, so once the compute stream has waited on mesh 1 the windows replay."""
    b = Builder()
    variables(b, "x", "a")
    variables(b, "u", mesh=2)
    between(b, "gather", "a", 80)
    start = len(b.records)
    loop(b, [("axpy", ["x", "a"]), ("scale", ["u"])], 40)
    probe_and_release(b, 95)
    seen = assert_lowered_alike(cut(b.records, [start]))
    assert seen["replayed"] >= 10, seen


def test_a_loop_resumed_on_its_graph_after_running_on_another_waits_for_it():
    """Each graph has its compute stream (and its programs): back on the first graph, the
    loop must wait for what it ran on the second."""
    b = Builder()
    variables(b, "x", "y")
    resumed(b, [("axpy", ["x", "y"]), ("iadd", ["y", "x"])], [("switch", "x")],
            [("switch", "x")])


def test_a_replayed_write_orders_later_reads_elsewhere_after_it():
    """x.add_(y) in replayed windows, then a collective that waits for the compute stream
    for another tensor, the loop again, and a collective reading x: that read must wait for
    the last replayed write, which came after the first collective's wait."""
    b = Builder()
    variables(b, "x", "y", "z")
    resumed(b, [("iadd", ["x", "y"]), ("scale", ["z"])], [("read comm", "z")],
            [("read comm", "x")])


def test_a_replayed_read_orders_later_writes_elsewhere_after_it():
    """Windows read x, made on the other graph (and y, made here); between the loops that
    graph and a collective wait for this stream for other tensors; then they write x (and
    y): each write must wait for the last replayed read."""
    b = Builder()
    variables(b, "x", graph=1)
    variables(b, "y", "z")
    resumed(b, [("axpy", ["z", "x"]), ("axpy", ["z", "y"])], [("read B", "z"), ("read comm", "z")],
            [("write B", "x"), ("all_reduce", "y")])


def test_a_base_released_in_a_window_while_its_view_lives_keeps_its_storage_ordered():
    """v, a view of x made between the loops, lives on while a replayed window writes x and
    then replaces it (releasing the base): the storage's record must stay for v, so that a
    collective reading v waits for that write (the collective waited for the compute stream
    since the view's making, for z)."""
    b = Builder()
    variables(b, "x", "y", "z")
    resumed(b, [("iadd", ["x", "y"]), ("scale", ["x"])],
            [("view here", "x"), ("read comm", "z")], [("read comm", "v90")], waits=False)


@pytest.mark.parametrize("first", [1, 2])
def test_a_wait_on_one_mesh_does_not_cover_the_other(first):
    """A window over both meshes whose inputs a collective wrote on each: the compute stream
    then waits on mesh ``first`` only (a kernel there reads what the collective wrote last),
    so the window must still wait on the other mesh."""
    b = Builder()
    variables(b, "x", "y")
    variables(b, "u", "w", mesh=2)
    mine, other = ("y", "w") if first == 1 else ("w", "y")
    resumed(b, [("axpy", ["x", "y"]), ("axpy", ["u", "w"])],
            [("all_reduce", other), ("gather", mine), ("read A", mine)])


# -- random programs -------------------------------------------------------------------------------


def body_of(rng, b: Builder) -> list:
    """A loop body over ``b``'s variables: ``(kind, variables, scalars)`` per statement."""
    body = []
    for _ in range(rng.randint(1, 4)):
        kind = rng.choice(sorted(BODY_KINDS))
        if kind == "gather" and rng.randint(0, 3):
            kind = "axpy"  # windows with a collective (never replayed): seldom
        x = rng.choice(sorted(set(b.vars) - {"pad"}))
        same = [n for n in sorted(set(b.vars) - {"pad", x}) if b.mesh(n) == b.mesh(x)]
        if len(same) < BODY_KINDS[kind] - 1:
            kind = "scale"
        others = rng.sample(same, len(same))[:BODY_KINDS[kind] - 1]
        body.append((kind, [x, *others], rng.choice(sorted(SCALARS))))
    if rng.random() < 0.5:  # its windows then begin after this (see ``resumed``)
        body.insert(0, ("negate", ["pad"], "fixed"))
    return body


SCALARS = {  # a statement's scalar in iteration k
    "fixed": lambda k: 0.5, "changing": lambda k: 0.5 + k,
    "signed zero": lambda k: (0.0, -0.0)[k % 2],
}


def program_of(rng) -> tuple:
    """Random programs: variables made on either graph's stream or by a collective, loops of
    one or two random bodies, each loop stopped anywhere in its body and resumed after
    accesses from other streams (a program cached before them must then wait, or not replay),
    probes; cut into batches anywhere."""
    b = Builder()
    for k in range(rng.randint(2, 5)):
        name, mesh = f"x{k}", rng.choice([1, 1, 2])
        # (not a tensor of an earlier runtime: the hosts refuse to read one, and the passes
        # do not follow a write through a view of one)
        made = rng.choice(["A", "B", "collective"])
        b.on(0 if made != "B" else 1)
        b.vars[name] = [b.op("ones", 1, mesh), mesh]
        if made == "collective":
            b.replace(name, b.op("gather", 2, mesh, b.id(name)))
    b.on(0)
    names = sorted(b.vars)
    b.vars["pad"] = [b.op("ones", 1, 1), 1]
    loops = [body_of(rng, b) for _ in range(rng.randint(1, 2))]
    written = sorted({v for body in loops for kind, vars_, _ in body if kind in IN_PLACE
                      for v in vars_[::2]} - {"pad"})  # (update_ writes operands 0 and 2)
    site, done = 1000, [0] * len(loops)  # statements of each loop run so far
    resumes = []  # where loops begin: a batch's windows are found from its middle only
    for _ in range(rng.randint(1, 5)):
        # a loop runs on from where it stopped: it stops and resumes anywhere in its body
        n = rng.randint(0, len(loops) - 1)
        body = loops[n]
        resumes.append(len(b.records))
        for _ in range(rng.randint(12, 40) * len(body) + rng.randint(0, 3)):
            k, j = divmod(done[n], len(body))
            kind, vars_, scalars = body[j]
            statement(b, kind, vars_, 100 * (n + 1) + 10 * j, SCALARS[scalars](k))
            done[n] += 1
        for _ in range(rng.randint(0, 3)):
            # often a tensor the loops write in place (those that outlive their windows)
            pool = written if written and rng.random() < 0.5 else names
            between(b, rng.choice(BETWEEN_KINDS), rng.choice(pool), site)
            site += 2
    probe_and_release(b, site)
    points = [rng.randint(0, len(b.records)) for _ in range(rng.randint(0, 3))]
    points += [r for r in resumes if rng.randint(0, 3)]
    return cut(b.records, points), rng.random() < 0.5


def test_random_programs_are_lowered_alike_replayed_or_not():
    """300 random programs (seeds 0-299: the same in every run). A failure names its seed:
    ``program_of(random.Random(seed))`` is the program."""
    seen = Counter()
    for seed in range(300):
        batches, hold = program_of(random.Random(seed))
        try:
            seen.update(assert_lowered_alike(batches, hold))
        except AssertionError as e:
            raise AssertionError(f"seed {seed}: {e}") from None
    # most windows replay, and the rest were exercised too
    assert seen["replayed"] > 3000 and seen["lowered alone"] > 300, seen
    assert seen["lowered with its neighbours"] > 20, seen


def test_recorded_calls_and_vjps_replay_as_the_passes_lower_them():
    """A training-shaped loop (a recorded call announced by its Recorded record, its VJP reading
    the tape key, the key released) in periodic windows, and the same stretch as a batch of its
    own repeated (``replay.segment``: seen, cached, then replayed): the Recorded records, keys
    and kernels as the passes emit them."""
    b = Builder()
    variables(b, "x", "y")
    loop(b, [("train", ["x"]), ("scale", ["y"]), ("train", ["y"])], 30)
    probe_and_release(b, 90)
    decisions = assert_lowered_alike(cut(b.records, [40, 200]))
    assert decisions["replayed"] > 0, decisions
    steps = []
    for _ in range(4):  # one step per batch, no period inside: a segment each
        s = Builder()
        s.ids = 1000 + 100 * len(steps)
        variables(s, "x")
        for k, kind in enumerate(["train", "scale", "train", "negate"]):
            statement(s, kind, ["x"], 10 * (k + 1), 0.5)
        s.records.append([P.FETCH, s.id("x"), 99])
        steps.append(s.records)
    decisions = assert_lowered_alike(steps)
    assert decisions["replayed"] == 2 and decisions["lowered alone"] == 1, decisions
