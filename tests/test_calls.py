"""Typed calls and the recorder: a DefineCall says its kind and carries a target of that kind's
type; a host builds a call from the table of its kind and refuses a redistribute, which the
controller lowers; a call autograd records is announced by a Recorded record of its own, and its
Op carries exactly the operator's operands; the client and the symbol import nothing from
autograd, which the session holds as its recorder."""

from __future__ import annotations

import ast
import pathlib
import types

import pytest
import torch

import dtorch
from dtorch import protocol as P
from dtorch.client import session
from dtorch.controller.logical_graph import LogicalGraph
from dtorch.runtime.calls import BUILDERS, HostCall

PACKAGE = pathlib.Path(dtorch.__file__).parent


@pytest.mark.no_runtime
def test_a_call_kind_and_its_target_survive_the_wire():
    rec = P.DefineCall(P.DEFINE_CALL, 7, 3, [1, 2], [1], b"", 0, P.CallKind.VJP)
    back = P.DefineCall(*P.unpack(P.pack([rec]))[0])
    assert back.kind == P.CallKind.VJP and back.target == 3 and type(back.target) is int
    # an operator's record may leave its kind out
    assert P.DefineCall(P.DEFINE_CALL, 1, "mul", [1, 0], [1], b"", 0).kind == P.CallKind.OPERATOR
    names = [P.call_name(P.CallKind.OPERATOR, "mul"), P.call_name(P.CallKind.STEP, "all_gather"),
             P.call_name(P.CallKind.REDISTRIBUTE, None)]
    assert names == ["mul", "step:all_gather", "redistribute"]


@pytest.mark.no_runtime
def test_the_controller_lowers_a_redistribute_into_calls_of_kind_step():
    g = LogicalGraph()
    g.define([P.DEFINE_MESH, 1, "cpu", [2], [0, 1]])
    g.define([P.DEFINE_SPEC, 1, [4], "float32", 1, ["S0"]])
    g.define([P.DEFINE_SPEC, 2, [4], "float32", 1, ["R"]])
    g.define([P.DEFINE_CALL, 1, None, [1], [2], b"", 0, P.CallKind.REDISTRIBUTE])
    assert g.definitions[-1][0] == P.DEFINE_SPEC  # kept from the hosts
    sent = []
    step = g.step_call("all_gather", 1, 2, P.pack((0,)), P.COMM, sent)
    assert step.kind == P.CallKind.STEP and step.op == "step:all_gather"
    assert P.DefineCall(*sent[0]).target == "all_gather"


@pytest.mark.no_runtime
def test_a_host_has_no_builder_for_a_redistribute_and_says_so():
    assert set(BUILDERS) == set(P.CallKind) - {P.CallKind.REDISTRIBUTE}
    host = types.SimpleNamespace(index=3, specs={}, calls={})
    rec = [P.DEFINE_CALL, 9, None, [1], [2], b"", 0, P.CallKind.REDISTRIBUTE]
    with pytest.raises(RuntimeError, match=r"internal error: host 3 was sent call 9 of kind "
                                           r"REDISTRIBUTE, which the controller lowers"):
        HostCall(host, rec)


def _issued(s, fn):
    """The records ``fn`` appends to the session's buffer, and its result."""
    seen, real = [], s.append
    s.append = lambda record: (seen.append(record), real(record))
    try:
        return seen, fn()
    finally:
        del s.append


def test_a_recorded_call_is_announced_by_a_record_of_its_own(mesh1):
    w = dtorch.ones(3, device_mesh=mesh1, requires_grad=True)
    x = dtorch.arange(3.0, device_mesh=mesh1)
    s = session.current()
    assert s.recorder is not None  # held since a tensor required grad
    seen, y = _issued(s, lambda: x * w)
    tags = [r[0] for r in seen if r[0] in (P.RECORDED, P.OP)]
    assert tags == [P.RECORDED, P.OP]
    announced = P.Recorded(*next(r for r in seen if r[0] == P.RECORDED))
    op = seen[-1]
    assert announced.kernel == y._id == P.op_outs(op, 1)[0]
    assert P.op_operands(op, 1) == (x._id, w._id)  # no key nor bits among them
    assert announced.needs == 0b10 and announced.gathered == 0
    assert announced.key == y.grad_fn.key
    y.sum().backward()
    assert torch.equal(w.grad.to_torch(), torch.arange(3.0))
    with torch.no_grad():
        seen, _ = _issued(s, lambda: x * w)
    assert [r[0] for r in seen if r[0] in (P.RECORDED, P.OP)] == [P.OP]


def test_calls_of_many_operands_announce_their_bits_as_bytes(mesh1):
    """``stack`` of 70 needs more bits than an int on the wire holds (``wire_bits``)."""
    parts = [dtorch.ones(2, device_mesh=mesh1, requires_grad=True) for _ in range(70)]
    seen, y = _issued(session.current(), lambda: dtorch.stack(parts))
    announced = P.Recorded(*next(r for r in seen if r[0] == P.RECORDED))
    assert P.bits_of(announced.needs) == (1 << 70) - 1
    y.sum().backward()
    assert all(torch.equal(p.grad.to_torch(), torch.ones(2)) for p in parts)


def _autograd_imports(path: pathlib.Path) -> list:
    """The imports of dtorch's autograd anywhere in ``path``, function-level ones too."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and not (node.module or "").startswith("torch"):
            found += [f"{node.module}.{a.name}" for a in node.names
                      if "autograd" in f"{node.module}.{a.name}".split(".")]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("dtorch.autograd")]
    return found


@pytest.mark.no_runtime
def test_the_client_and_the_symbol_import_nothing_from_autograd():
    paths = [*sorted((PACKAGE / "client").glob("*.py")), PACKAGE / "tensor.py"]
    assert {p.name: _autograd_imports(p) for p in paths if _autograd_imports(p)} == {}
