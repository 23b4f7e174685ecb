"""``dtorch.util`` as DTorch's programs use it: ``TensorChecker``'s comparisons agree with
torch's own (``torch.equal``, ``torch.allclose``) on every mix of torch, dtorch and NumPy
tensors, tag-by-tag checks find the tag that differs and dump what they are told to, the
module hooks register what two runs of a model share, and ``Benchmark.run`` calls and times as
documented."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

import dtorch
from dtorch import Partial, Replicate, Shard
from dtorch.util.benchmark import Benchmark, Metric
from dtorch.util.tensor_checker import (DumpMode, TensorChecker, module_register_tensor_checker,
                                        tensor_checker)
from helpers import sample

R = Replicate()
LAYOUTS = [("one", [R]), ("shard", [Shard(0)]), ("partial", [Partial()])]


def _as(kind, t, mesh1):
    if kind == "numpy":
        return t.numpy()
    if kind == "torch":
        return t.clone()
    return dtorch.from_torch(t, mesh1, dict(LAYOUTS)[kind])


KINDS = ["torch", "numpy", "one", "shard", "partial"]
PAIRS = [  # (id, a, b): torch's answers are the expectation
    ("same", sample((5, 3)), sample((5, 3))),
    ("tiny-gap", sample((5, 3)), sample((5, 3)) + 1e-7),
    ("gap", sample((5, 3)), sample((5, 3)) + 1e-3),
    ("one-element", sample((5, 3)), sample((5, 3)).index_put_((torch.tensor(4), torch.tensor(2)),
                                                              torch.tensor(9.0))),
    ("nan", torch.tensor([1.0, float("nan")]), torch.tensor([1.0, float("nan")])),
    ("ints", torch.arange(6), torch.arange(6)),
    ("ints-off", torch.arange(6), torch.arange(6) + 1),
    ("bools", torch.tensor([True, False]), torch.tensor([True, True])),
]


CASES = [(pair, a_kind, b_kind) for pair in PAIRS for a_kind in ("torch", "shard")
         for b_kind in KINDS if pair[1].is_floating_point() or b_kind != "partial"]


@pytest.mark.parametrize("pair, a_kind, b_kind", CASES,
                         ids=[f"{p[0]}-{a}-{b}" for p, a, b in CASES])
def test_comparisons_agree_with_torchs(pair, a_kind, b_kind, mesh1):
    _, a, b = pair
    x, y = _as(a_kind, a, mesh1), _as(b_kind, b, mesh1)
    assert TensorChecker.tensor_equal(x, y, print_no_equal_msg=False) == torch.equal(a, b)
    wide = (lambda t: t) if a.is_floating_point() else torch.Tensor.double
    for rtol, atol, equal_nan in [(1e-5, 1e-8, False), (0.0, 1e-3, False), (1e-5, 1e-8, True)]:
        expected = torch.allclose(wide(a), wide(b), rtol, atol, equal_nan)
        assert TensorChecker.tensor_allclose(x, y, rtol, atol, equal_nan, False) == expected


def test_dtype_and_shape_must_match_and_a_mismatch_says_where(capsys):
    a = sample((4, 3))
    assert not TensorChecker.tensor_equal(a, a.double())
    assert "dtype differs: torch.float32 vs torch.float64" in capsys.readouterr().out
    assert not TensorChecker.tensor_allclose(a, a.reshape(3, 4))
    assert "shape differs: (4, 3) vs (3, 4)" in capsys.readouterr().out
    b = a.clone()
    b[2, 1] += 5
    b[0, 0] += 1
    assert not TensorChecker.tensor_allclose(a, dtorch.from_torch(b))
    out = capsys.readouterr().out
    assert "2 of 12 elements differ" in out and "the largest at [2, 1]" in out
    assert not TensorChecker.tensor_equal(a, b, print_no_equal_msg=False)
    assert capsys.readouterr().out == ""
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        TensorChecker.tensor_equal(a, [1.0])


def test_meanclose_bounds_the_mean_error():
    b = torch.full((100,), -2.0)  # a negative mean: the bound is on |b|
    a = b.clone()
    a[0] += 1.0  # mean error 0.01
    assert TensorChecker.tensor_meanclose(a, b, rtol=0.006, atol=0.0)  # 0.01 <= 0.012
    assert not TensorChecker.tensor_meanclose(a, b, rtol=0.004, atol=0.0, print_no_equal_msg=False)
    assert TensorChecker.tensor_meanclose(a, b, rtol=0.0, atol=0.011)
    assert TensorChecker.tensor_meanclose(torch.empty(0), torch.empty(0))
    assert not TensorChecker.tensor_meanclose(a, b.half(), print_no_equal_msg=False)


def test_tags_compare_two_runs_and_dump_what_they_are_told(tmp_path, mesh1):
    checker = TensorChecker()
    t = sample((4, 2))
    checker.register_tensor("same", t)
    checker.register_tensor("same", dtorch.from_torch(t, mesh1, [Shard(0)]))
    checker.register_tensor("off", t)
    checker.register_tensor("off", (t + 1).numpy())
    checker.register_tensor("alone", t)
    assert not checker.check_equal(verbose=False)
    assert checker.check_allclose(atol=1.5, verbose=False)
    for mode, files in [(DumpMode.NOT, set()), (DumpMode.NOT_EQUAL, {"off_idx_0", "off_idx_1"}),
                        (DumpMode.FIRST_NOT_EQUAL, {"off_idx_0", "off_idx_1"}),
                        (DumpMode.ALL, {"same_idx_0", "same_idx_1", "off_idx_0", "off_idx_1",
                                        "alone_idx_0"})]:
        where = tmp_path / mode.name
        checker.check_equal(dump_mode=mode, dump_path=str(where), verbose=False)
        dumped = {p.stem for p in where.iterdir()} if where.exists() else set()
        assert dumped == files, mode
    assert np.array_equal(np.load(tmp_path / "ALL" / "off_idx_1.npy"), (t + 1).numpy())
    like = dtorch.zeros(4, 2, device_mesh=mesh1, placements=[Shard(1)])
    back = checker.tensor_from_registered("off", like)
    assert back.placements == [Shard(1)] and torch.equal(back.to_torch(), t)
    assert torch.equal(checker.tensor_from_registered("off", torch.zeros(1)), t)
    checker.clear()
    assert checker.check_equal(verbose=False)


def _twins():
    torch_model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    model = dtorch.nn.Sequential(dtorch.nn.Linear(3, 4), dtorch.nn.ReLU(), dtorch.nn.Linear(4, 2))
    model.load_state_dict(torch_model.state_dict())
    return torch_model, model


def test_module_hooks_register_what_both_models_share():
    torch_model, model = _twins()
    checker = TensorChecker()
    handles = module_register_tensor_checker([torch_model, model], checker)
    x = sample((5, 3))
    torch_model(x)
    torch_model(x)  # a second call gets tags of its own
    model(dtorch.from_torch(x))
    model(dtorch.from_torch(x))
    tags = set(checker.tensor_map)
    assert {"module_checker#_input_0", "module_checker#_output_0", "module_checker#0_weight",
            "module_checker#0_bias", "module_checker#1_output_0",
            "module_checker#2_call_1_output_0"} <= tags
    assert all(len(v) == 2 for v in checker.tensor_map.values())
    assert checker.check_allclose(rtol=1e-5, atol=1e-6, verbose=False)
    for h in handles:
        h.remove()
    torch_model(x)
    assert set(checker.tensor_map) == tags  # removed: nothing more registered
    with torch.no_grad():
        torch_model[0].weight[0, 0] += 1
    checker.clear()
    module_register_tensor_checker([torch_model, model], checker)
    torch_model(x)
    model(dtorch.from_torch(x))
    different = [tag for tag, (a, b) in checker.tensor_map.items() if not torch.equal(a, b)]
    assert "module_checker#0_weight" in different and "module_checker#_input_0" not in different
    assert not checker.check_allclose(verbose=False)
    assert tensor_checker is not checker and isinstance(tensor_checker, TensorChecker)


def test_benchmark_calls_and_times_as_documented():
    calls = []

    def func(benchmark_last_round=False):
        calls.append(benchmark_last_round)
        return dtorch.ones(4) * len(calls)

    metric, out = Benchmark.run(func, warmup=2, count=3)
    assert calls == [False, True, False, False, True]
    assert torch.equal(out.to_torch(), torch.full((4,), 5.0))
    assert isinstance(metric, Metric) and metric.duration > 0 and metric.cpu_memory > 0
    assert metric.dtorch_gpu_memory >= 0 and metric.torch_gpu_memory >= 0
    plain = []
    Benchmark.run(lambda: plain.append(1), warmup=0, count=2)
    assert plain == [1, 1]
    with pytest.raises(ValueError, match="count >= 1"):
        Benchmark.run(lambda: None, count=0)


def test_benchmark_runs_a_coroutine_function_on_one_loop():
    loops = []

    async def func(benchmark_last_round=False):
        loops.append((asyncio.get_running_loop(), benchmark_last_round))
        return await dtorch.ones(2).to_torch_async()

    metric, out = Benchmark.run(func, warmup=1, count=2)
    assert torch.equal(out, torch.ones(2)) and metric.duration > 0
    assert len({id(loop) for loop, _ in loops}) == 1
    assert [last for _, last in loops] == [True, False, True]
