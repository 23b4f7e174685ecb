"""The client from several threads at once: definitions published only after their records,
each thread's operators on its own graph, every value torch's under a stress of new shapes, and
the last flush at exit independent of pyzmq's garbage-collector thread."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import torch

import dtorch
from dtorch import protocol as P
from dtorch.client import session
from dtorch.spec import intern_spec
from processes import TESTS_DIR

WAIT_S = 10.0  # a deadline for a thread that should have got there long before


def test_threads_issuing_at_once_get_torch_values():
    """``thread_stress.py`` (4 threads of new shapes, half inside graphs of their own, and a
    data-loading thread) in a fresh runtime of its own; without the definitions' lock the
    controller died of an undefined spec id, or zmq aborted the process, within a run."""
    proc = subprocess.run([sys.executable, os.path.join(TESTS_DIR, "thread_stress.py"),
                           "--ops", "2000"], capture_output=True, text=True, timeout=240, check=False,
                          cwd=TESTS_DIR)
    assert proc.returncode == 0 and "torch values" in proc.stdout, proc.stdout + proc.stderr


def test_an_id_is_published_only_after_the_record_that_defines_it(one):
    """A thread defining a spec is held just before its record enters the buffer while a
    second thread uses the same spec: the second must wait for the first (the lock), so the
    definition precedes the use. (Publishing the id first let the use overtake it: the
    controller then met a spec id it did not know.)"""
    s = session.current()
    spec = intern_spec((3, 5, 7, 11, 13), "float32", one, (dtorch.Replicate(),))
    assert spec not in s.spec_ids
    seen, held, used = [], threading.Event(), threading.Event()
    real_append = s.append

    def append(record):
        if isinstance(record, tuple) and record[0] == P.DEFINE_SPEC and \
                threading.current_thread().name == "definer":
            held.set()
            used.wait(1.0)  # the user, given the chance to overtake (it cannot: it waits)
        seen.append(record)
        real_append(record)

    def use():
        assert held.wait(WAIT_S)
        s.define_call("neg", (spec,), (spec,), (), 0)
        used.set()

    s.append = append
    try:
        threads = [threading.Thread(target=s.spec_id, args=(spec,), name="definer"),
                   threading.Thread(target=use, name="user")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT_S)
    finally:
        del s.append
    spec_id = s.spec_ids[spec]
    defined = next(k for k, r in enumerate(seen) if r[0] == P.DEFINE_SPEC and r[1] == spec_id)
    used_at = next(k for k, r in enumerate(seen)
                   if r[0] == P.DEFINE_CALL and spec_id in r.inputs)
    assert defined < used_at
    dtorch.sync()  # and the controller took both


def test_with_graph_in_one_thread_moves_only_its_operators(one):
    """One thread stays inside ``with g:`` while another issues: the tensor the first makes
    belongs to g and its operator runs on g's compute stream (stream = graph id + 1); the other
    thread's tensor belongs to that thread's own default graph, and so does its operator; an
    operator on a tensor of the importing thread's graph runs there, in either thread."""
    g = dtorch.Graph()
    x = dtorch.ones((4,), device_mesh=one)
    entered, issued, out = threading.Event(), threading.Event(), {}

    def inside():
        with g:
            entered.set()
            assert issued.wait(WAIT_S)
            y = dtorch.full((4,), 2.0, device_mesh=one)
            out["inside"], out["shared"] = y * 3.0, x.exp()
            out["y graph"] = y.graph

    def outside():
        assert entered.wait(WAIT_S)
        z = dtorch.full((4,), 1.0, device_mesh=one)
        out["outside"] = z - 5.0
        out["graph"] = dtorch.Graph.default_graph()
        issued.set()

    with dtorch.profiler.profile() as prof:
        threads = [threading.Thread(target=inside), threading.Thread(target=outside)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT_S)
        assert out["inside"].tolist() == [6.0] * 4 and out["outside"].tolist() == [-4.0] * 4
        assert torch.equal(out["shared"].to_torch(), torch.ones(4).exp())
    streams = {name: e["tid"] for e in prof.kernels()  # (a fused kernel: "full+mul")
               for name in e["name"].removeprefix("step:").split("+")
               if name in ("mul", "sub", "exp")}
    own = out["graph"]
    assert own not in (g, dtorch.default_graph)
    assert out["y graph"] == g and out["inside"].graph == g and out["outside"].graph == own
    assert out["shared"].graph == dtorch.default_graph
    assert streams == {"mul": g.id + 1, "sub": own.id + 1, "exp": dtorch.default_graph.id + 1}


EXIT_PROGRAM = """
import sys, torch, dtorch
import exit_kernels
path = sys.argv[1]
record_sum = dtorch.register_op("record_sum(input: Tensor, path)", exit_kernels.record_sum)
x = dtorch.from_torch(torch.arange(40_000))  # a 320 kB frame: pyzmq sends it without a copy
assert x.sum().item() == 799_980_000         # (and starts its garbage collector for it)
dtorch.config.flush_delay_s = 60.0  # the records below wait for the exit's flush
y = dtorch.from_torch(torch.arange(40_000) * 2)
z = record_sum(y, path)
print("RESULT {}")
"""


def test_what_was_issued_before_exit_runs_and_the_exit_is_quiet(tmp_path):
    """The last flush happens in the exit hook, after pyzmq's garbage collector (which tracks
    frames sent without a copy) has been told to stop: it must still send everything, and say
    nothing (it raised ``zmq gc socket requested during shutdown`` and lost the batch)."""
    marker = tmp_path / "sum"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([TESTS_DIR] + sys.path)}
    proc = subprocess.run([sys.executable, "-c", EXIT_PROGRAM, str(marker)],
                          capture_output=True, text=True, timeout=120, cwd=TESTS_DIR, env=env,
                          check=False)
    assert proc.returncode == 0 and "RESULT" in proc.stdout, proc.stderr
    assert "Traceback" not in proc.stderr and "zmq" not in proc.stderr, proc.stderr
    assert marker.read_text() == "1599960000"
