"""The stream rule is written once (``controller/streams.py``), and replay keeps to it: no
runtime.

For random programs (``test_replay_lowering.program_of``: variables on two meshes and two
graphs' compute streams, collectives on the communication stream, in-place writes of one and of
several operands, views made and written through, dead code, fetches, releases), every window the
controller looks up in its cache is also passed through the passes, from a copy of the stream
state before it. A window replayed (``StreamOrder.replay``) must leave the very state the passes
leave (``StreamOrder.state``: positions, storages, views, waits) and the passes must emit no WAIT
for it, as a replay emits none; a window replay refuses must leave the state as it was.
"""

from __future__ import annotations

import copy
import random
from collections import Counter

import pytest
from replay_lowering import make_graph
from test_replay_lowering import WINDOW, program_of

from dtorch import config
from dtorch import protocol as P
from dtorch.controller import replay
from dtorch.controller.main import Controller
from dtorch.controller.passes import run_passes
from dtorch.controller.replay import Replayer

pytestmark = pytest.mark.no_runtime  # (conftest syncs after the other tests)


class Checked(Replayer):
    """A Replayer that passes each window it looks up through the passes too (``advance``)."""

    def __init__(self, g, seen: Counter):
        super().__init__(g, lambda nodes: run_passes(g, nodes), Controller.encode)
        self.seen = seen
        self.window = None  # the records of the window last looked up (``shape_of``)

    def advance(self, program, outside, made):
        window, before = copy.deepcopy(self.window), copy.deepcopy(self.graph.streams)
        replayed = super().advance(program, outside, made)
        passed, waits = self.through_the_passes(window, copy.deepcopy(before))
        if replayed:
            assert waits == [], "a replay emits no WAIT, the passes emit these"
            assert self.graph.streams.state() == passed.state()
            self.seen["replayed"] += 1
        else:
            assert self.graph.streams.state() == before.state(), "a refusal changed the state"
            self.seen["refused, the passes wait" if waits else "refused, no wait needed"] += 1
        return replayed

    def through_the_passes(self, window: list, streams) -> tuple:
        """The stream state and the WAIT records the passes leave for ``window`` from
        ``streams`` (which they move on)."""
        g = copy.copy(self.graph)
        g.streams = streams
        records = Controller.encode(run_passes(g, self.nodes(window)))
        return streams, [r for r in records if type(r) is not int and r[0] == P.WAIT]


@pytest.fixture
def checked(monkeypatch):
    """Small windows, replay on, and each Checked replayer told the window it looks up."""
    monkeypatch.setattr(replay, "MIN_WINDOW", WINDOW)
    monkeypatch.setattr(config, "replay", True)
    shape_of, replayers = replay.shape_of, []

    def recorded(calls, records):
        replayers[-1].window = records
        return shape_of(calls, records)

    monkeypatch.setattr(replay, "shape_of", recorded)

    def make(seen: Counter) -> Checked:
        replayers.append(Checked(make_graph(), seen))
        return replayers[-1]
    return make


def test_a_replay_leaves_the_state_and_the_waits_of_the_passes(checked):
    """300 random programs (seeds 0-299: the same in every run). A failure names its seed:
    ``program_of(random.Random(seed))`` is the program."""
    seen = Counter()
    for seed in range(300):
        batches, hold = program_of(random.Random(seed))
        replayer, out = checked(seen), []
        try:
            for batch in copy.deepcopy(batches):
                replayer.run(batch, out, hold)
            replayer.run([], out)
        except AssertionError as e:
            raise AssertionError(f"seed {seed}: {e}") from None
    # most windows replay, and refusals where the passes wait were exercised too
    assert seen["replayed"] > 3000 and seen["refused, the passes wait"] > 20, seen
