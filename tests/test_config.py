"""The knobs (``dtorch/config.py``): declared, read from the environment with errors naming the
variable, scoped per thread by ``config.Context`` (nesting, restoring also after an exception);
the runtime facts a launcher hands its roles; the loggers (``dtorch/logs.py``), one per role, a
runtime process's on its stderr. Needs no runtime, but for the one test that starts one."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import threading

import pytest

import dtorch
from dtorch import config
from dtorch.future import TensorFuture

pytestmark = pytest.mark.no_runtime  # the one runtime runs in a process of its own
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(dtorch.__file__)))


def test_every_knob_is_declared_with_its_type_and_doc():
    for knob in config.KNOBS:
        assert knob.doc and knob.type in config.PARSERS
        value = getattr(config, knob.name)
        assert value is None and knob.optional or isinstance(value, config.ACCEPTED[knob.type])


def test_a_context_scopes_knobs_to_its_thread():
    """Two threads inside scopes of their own, at the same time, each read its own value; a
    thread without a scope reads the process's."""
    before = config.flush_records
    inside = threading.Barrier(3)
    seen = {}

    def scoped(value):
        with config.Context(flush_records=value):
            inside.wait()  # every scope is open now
            seen[value] = config.flush_records
            inside.wait()

    def plain():
        inside.wait()
        seen["plain"] = config.flush_records
        inside.wait()

    threads = [threading.Thread(target=scoped, args=(8,)), threading.Thread(target=scoped,
               args=(16,)), threading.Thread(target=plain)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen == {8: 8, 16: 16, "plain": before}
    assert config.flush_records == before


def test_contexts_nest_and_restore_also_after_an_exception():
    before = config.debug, config.bucket_bytes
    outer = config.Context(debug=1, bucket_bytes=4096)
    with outer:
        with pytest.raises(RuntimeError), config.Context(debug=2):
            assert (config.debug, config.bucket_bytes) == (2, 4096)
            raise RuntimeError("inside")
        assert (config.debug, config.bucket_bytes) == (1, 4096)
        with outer:  # the same scope again, nested in itself
            assert config.debug == 1
        assert config.bucket_bytes == 4096
    assert (config.debug, config.bucket_bytes) == before


def test_the_process_value_reaches_every_context_but_a_scope_of_that_knob(monkeypatch):
    monkeypatch.setattr(config, "flush_delay_s", 0.25)  # as the tests set knobs
    seen = []
    t = threading.Thread(target=lambda: seen.append(config.flush_delay_s))
    t.start()
    t.join(10)
    assert seen == [0.25]
    with config.Context(flush_delay_s=1.0):
        config.flush_delay_s = 0.5
        assert config.flush_delay_s == 1.0
    assert config.flush_delay_s == 0.5


def test_unknown_knobs_are_refused_naming_the_close_ones():
    with pytest.raises(AttributeError, match="'flush_record'.*did you mean flush_records"):
        config.Context(flush_record=8)
    with pytest.raises(AttributeError, match="did you mean heartbeat_timeout_s"):
        config.heartbeat_timeout  # noqa: B018 - the read is the test
    with pytest.raises(AttributeError, match="no knob 'zzz' \\(the knobs: debug"):
        config.Context(zzz=1)


def test_a_value_of_another_type_is_refused():
    with pytest.raises(TypeError, match="flush_records is a int, not '8'"):
        config.Context(flush_records="8")
    with pytest.raises(TypeError, match="bind_host is a str"):
        config.bind_host = None
    config.Context(graph_dir=None, flush_delay_s=1, replay=False)  # None where optional, int


@pytest.mark.parametrize(("variable", "raw", "why"), [
    ("DTORCH_FUSION_AFTER", "ten", "invalid literal"),
    ("DTORCH_FUSION", "maybe", "not a flag"),
    ("DTORCH_COLLECTIVE_TIMEOUT", "soon", "could not convert"),
    ("DTORCH_DEBUG", "verbose", "invalid literal"),
])
def test_a_bad_variable_is_refused_naming_it(variable, raw, why):
    knob = next(k for k in config.KNOBS if k.env == variable)
    with pytest.raises(ValueError, match=f"{variable}='{raw}': {why}.*config.{knob.name}"):
        knob.read({variable: raw})


def test_variables_give_the_values():
    read = {k.name: k.read for k in config.KNOBS}
    assert read["fusion"]({"DTORCH_FUSION": "0"}) is False
    assert read["replay"]({"DTORCH_REPLAY": "yes"}) is True
    assert read["debug"]({"DTORCH_DEBUG": "graph"}) == 0
    assert read["graph_dir"]({"DTORCH_DEBUG": "graph"}) == "dtorch-graphs"
    assert read["graph_dir"]({}) is None
    assert read["cpu_hosts"]({"DTORCH_CPU_HOSTS": "3"}) == 3
    assert read["cpu_hosts"]({"DTORCH_CPU_HOSTS": "0"}) == read["cpu_hosts"]({}) >= 1
    assert read["heartbeat_timeout_s"]({"DTORCH_GRPC_TIMEOUT_SECOND": "7"}) == 7.0
    assert read["heartbeat_timeout_s"]({"DTORCH_GRPC_TIMEOUT_SECOND": "7",
                                        "DTORCH_HEARTBEAT_TIMEOUT": "2"}) == 2.0


def test_a_bad_variable_fails_the_import():
    """In a fresh interpreter importing dtorch.config alone."""
    code = ("import sys, types; p = types.ModuleType('dtorch'); "
            f"p.__path__ = [{os.path.dirname(dtorch.__file__)!r}]; sys.modules['dtorch'] = p; "
            "import dtorch.config")
    failed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, env={**os.environ, "DTORCH_MAX_INFLIGHT_OPS": "many"},
                            check=False)
    assert failed.returncode != 0 and "DTORCH_MAX_INFLIGHT_OPS='many'" in failed.stderr


# -- runtime facts ---------------------------------------------------------------------------------
def test_runtime_facts_travel_on_the_command_line():
    parser = argparse.ArgumentParser()
    config.RuntimeFacts.add_arguments(parser)
    for facts in (config.RuntimeFacts(3), config.RuntimeFacts(2, (4, 2))):
        assert config.RuntimeFacts.from_args(parser.parse_args(map(str, facts.argv()))) == facts


def test_which_host_serves_a_device():
    one_machine, second_machine = config.RuntimeFacts(3), config.RuntimeFacts(2, (4, 4))
    assert [one_machine.host_index("cpu", d) for d in range(5)] == [0, 1, 2, 0, 1]
    assert [one_machine.host_index("cuda", d) for d in range(2)] == [3, 4]
    assert [second_machine.host_index("cpu", d) for d in (3, 4, 5, 7, 8)] == [-1, 0, 1, 1, -1]
    assert second_machine.first_device() == 4 and one_machine.first_device() == 0


# -- logs ------------------------------------------------------------------------------------------
def test_a_failing_future_callback_logs_at_the_clients_logger(caplog):
    future = TensorFuture()

    def callback(_):
        raise ValueError("the user's bug")

    future.add_done_callback(callback)
    with caplog.at_level(logging.ERROR, logger="dtorch"):
        future._finish(value=1)
    [record] = caplog.records
    assert record.name == "dtorch.client" and record.exc_info[0] is ValueError
    assert future.get() == 1


def test_a_runtime_process_logs_on_its_stderr_at_debug():
    """``DTORCH_DEBUG=1``: the controller's log of each batch reaches the stderr it shares with
    the user's process."""
    code = "import dtorch; print((dtorch.ones(3) + 1).to_torch().tolist())"
    env = {**os.environ, "DTORCH_DEBUG": "1", "DTORCH_CPU_HOSTS": "1",
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env, cwd=ROOT, check=True)
    assert done.stdout.strip() == "[2.0, 2.0, 2.0]"
    assert "[dtorch controller] batch: " in done.stderr
