"""``dtorch.replayed_step``: a step that issues the same records call after call is sent again
from its records. Every call's values -- the returned loss of each step, the weights, the
gradients and the optimizer's state between steps -- equal the same loop run as Python each
step, bit for bit (the same records reach the devices), and torch's where a model is compared
with torch; the guards send a changed step back to learning, and a step that cannot replay
runs as Python and says why."""

import gc
import threading
import warnings

import pytest
import torch

import dtorch
from dtorch import Replicate, Shard
from dtorch.profiler import CONTROLLER_PID
from dtorch.step_replay import LEARN_CALLS

R, S0 = Replicate(), Shard(0)
STEPS = 10  # of the Llama: 4 learn, 1 is seen by the controller, 1 cached, 4 bound at once


@pytest.fixture(scope="module")
def grid():
    return dtorch.DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=["dp", "tp"])


def data(n, rows=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, 6, generator=g), torch.randn(rows, 3, generator=g))
            for _ in range(n)]


def mlp_loop(grid, replayed: bool, steps: int = 9, zero_first: bool = False, change=None,
             zero_stage: int = 0, adam: bool = False, spans: list | None = None):
    """The MLP of test_training (column- then row-parallel on tp) trained on dp with SGD
    (momentum, weight decay), gradients clipped, and a step-decay schedule; per step: the loss
    the step returned, and the weights, gradients and momentum buffers after it (as torch
    tensors). ``spans``: gets the controller's spans of each step's batches."""
    from test_training import MLP, TorchMLP

    model = MLP(grid)
    model.load_state_dict(TorchMLP().state_dict())
    if zero_stage == 3:
        dtorch.nn.fully_shard(model)
    if adam:  # OneCycleLR: the rate and AdamW's first beta change every step
        opt = dtorch.optim.AdamW(model.parameters(), lr=0.01, zero_stage=zero_stage)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.01, total_steps=steps)
    else:
        opt = dtorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01,
                               zero_stage=zero_stage)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    def step(x, y):
        if zero_first:  # the gradients of a step live until the next one drops them
            opt.zero_grad()
        loss = dtorch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        dtorch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # a norm over the mesh
        opt.step()
        if not zero_first:
            opt.zero_grad()
        return loss

    if replayed:
        step = dtorch.replayed_step(step)
    seen = []
    for k, (x, y) in enumerate(data(steps)):
        if change is not None:
            change(k, opt)
        x = dtorch.from_torch(x, device_mesh=grid, placements=[S0, R])
        y = dtorch.from_torch(y, device_mesh=grid, placements=[S0, R])
        if spans is None:
            loss = step(x, y)
        else:
            with dtorch.profiler.profile() as prof:
                loss = step(x, y)
            spans.append([e["name"] for e in prof.events if e.get("pid") == CONTROLLER_PID
                          and e["name"].startswith("passes: ")])
        sched.step()
        seen.append({"loss": loss,
                     **{n: p.to_torch() for n, p in model.named_parameters()},
                     **{"grad " + n: p.grad.to_torch() for n, p in model.named_parameters()
                        if p.grad is not None},
                     **{f"{name} {i}": opt.state[p][name].to_torch()
                        for i, p in enumerate(model.parameters())
                        for name in ("momentum_buffer", "exp_avg", "exp_avg_sq")
                        if name in opt.state[p]}})
    for s in seen:  # read at the end: each step's returned tensor holds its own step's loss
        s["loss"] = s["loss"].to_torch()
    return seen, getattr(step, "replays", 0)


def assert_same(a, b):
    assert len(a) == len(b)
    for k, (x, y) in enumerate(zip(a, b)):
        assert x.keys() == y.keys(), k
        for name in x:
            assert torch.equal(x[name], y[name]), (k, name)


@pytest.mark.parametrize("zero_first,zero_stage,adam", [
    (False, 0, False), (True, 0, False), (False, 2, False), (True, 3, False), (False, 1, True)],
    ids=["zero_grad_last", "zero_grad_first", "ZeRO-2", "ZeRO-3", "AdamW-OneCycleLR-ZeRO-1"])
def test_data_and_tensor_parallel_steps_replay_with_the_values_of_python(grid, zero_first,
                                                                         zero_stage, adam):
    plain, _ = mlp_loop(grid, replayed=False, zero_first=zero_first, zero_stage=zero_stage,
                        adam=adam)
    replayed, replays = mlp_loop(grid, replayed=True, zero_first=zero_first,
                                 zero_stage=zero_stage, adam=adam)
    assert replays >= 9 - 4, replays  # learnt within 4 calls (the first makes the momenta)
    assert_same(replayed, plain)


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_steps_with_collectives_are_lowered_from_their_record(grid, zero_stage):
    """Once the client replays and the controller has seen two Steps lowered alike, each
    Step is one record to the hosts (its lowering learnt, ``controller/step_lowering.py``);
    every step's values still equal the loop run as Python, bit for bit."""
    plain, _ = mlp_loop(grid, replayed=False, steps=12, zero_stage=zero_stage)
    spans: list = []
    replayed, replays = mlp_loop(grid, replayed=True, steps=12, zero_stage=zero_stage,
                                 spans=spans)
    assert_same(replayed, plain)
    lowered = ["a step lowered from its record" in " ".join(names) for names in spans]
    # the client learns in 4 calls (the first makes the momenta), the controller watches
    # two Steps lowered alike
    assert replays == 12 - 4 and lowered == [False] * 6 + [True] * 6, spans


def test_replayed_mlp_trains_as_torch(grid):
    from test_training import TorchMLP

    replayed, replays = mlp_loop(grid, replayed=True)
    assert replays > 0
    model = TorchMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for (x, y), got in zip(data(9), replayed):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        sched.step()
        torch.testing.assert_close(got["loss"], loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(replayed[-1]["up.weight"], model.up.weight.detach(),
                               rtol=1e-5, atol=1e-6)


def test_llama_steps_replay_with_the_values_of_python_and_hf(one):
    """AdamW's step counts and a scheduler's learning rate change every step: the replays
    take them from the optimizer (its state's counts advance as torch's do)."""
    pytest.importorskip("transformers")
    import test_llama as L

    def run(replayed: bool):
        hf = L.hf_model(L.config())
        mesh = dtorch.init_device_mesh("cpu", (1, 1, 1, 1, 1), mesh_dim_names=L.DIMS)
        model = L.LlamaForCausalLM(hf.config, device_mesh=mesh)
        model.load_state_dict(hf.state_dict())
        opt = dtorch.optim.AdamW(model.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1 / (1 + k))

        def step(inputs, target):
            loss = dtorch.nn.functional.cross_entropy(model(inputs).transpose(1, 2), target)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        step = dtorch.replayed_step(step) if replayed else step
        g, losses = torch.Generator().manual_seed(3), []
        for k in range(STEPS):
            ids = torch.randint(0, 96, (4, 9), generator=g)
            labels = torch.randint(0, 96, (4, 9), generator=g)
            inputs = model.place_tokens(ids)
            target = dtorch.from_torch(labels, device_mesh=inputs.device_mesh,
                                       placements=inputs.placements)
            dtorch.sync()
            with dtorch.profiler.profile() as prof:
                losses.append(step(inputs, target))
            spans.append([e["name"] for e in prof.events if e.get("pid") == CONTROLLER_PID
                          and e["name"].startswith("passes: ")])
            sched.step()
        weights = {n: p.to_torch() for n, p in model.named_parameters()}
        counts = [float(s["step"]) for s in opt.state.values()]
        return [x.item() for x in losses], weights, counts, getattr(step, "replays", 0), hf

    spans: list = []
    losses, weights, counts, replays, hf = run(True)
    # the controller's last steps: the Step record alone, bound to the step's program
    # (beside the trace's own: its start, and its stop with a sync)
    for names in spans[-4:]:
        assert "passes: 1 records -> 1, 1 windows replayed" in names, spans
        assert all(int(n.split()[1]) <= 2 for n in names), spans
    plain_losses, plain_weights, plain_counts, _, _ = run(False)
    assert replays >= STEPS - 4, replays
    assert losses == plain_losses and counts == plain_counts == [STEPS] * len(counts)
    for name, w in weights.items():
        assert torch.equal(w, plain_weights[name]), name
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1 / (1 + k))
    g, expected = torch.Generator().manual_seed(3), []
    for _ in range(STEPS):
        ids = torch.randint(0, 96, (4, 9), generator=g)
        labels = torch.randint(0, 96, (4, 9), generator=g)
        loss = torch.nn.functional.cross_entropy(hf(ids).logits.transpose(1, 2), labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        expected.append(loss.item())
    assert losses == pytest.approx(expected, rel=1e-5)


def test_a_changed_optimizer_option_or_state_sends_the_step_back_to_learning(grid):
    """A weight decay changed between steps, then the optimizer's state loaded from another:
    the guards see both (the records of the old template would use the old decay and the
    dropped moments), and the values stay those of Python."""
    saved = {}

    def change(k, opt):
        if k == 6:
            opt.param_groups[0]["weight_decay"] = 0.5
        if k == 5:
            saved["state"] = opt.state_dict()
        if k == 8:
            opt.load_state_dict(saved["state"])

    plain, _ = mlp_loop(grid, replayed=False, steps=12, change=change)
    replayed, replays = mlp_loop(grid, replayed=True, steps=12, change=change)
    assert_same(replayed, plain)
    assert replays > 0


def test_each_call_returns_tensors_of_its_own(one):
    w = dtorch.ones(3, device_mesh=one)

    @dtorch.replayed_step
    def step(x, scale):
        w.add_(x)
        return {"sum": (w * scale).sum(), "w": w, "note": "kept"}

    outs = [step(dtorch.full((3,), float(k), device_mesh=one), 2.0) for k in range(6)]
    assert step.replays == 4
    assert [o["sum"].item() for o in outs] == [6.0, 12.0, 24.0, 42.0, 66.0, 96.0]
    assert all(o["w"] is w and o["note"] == "kept" for o in outs)
    # a Python scalar argument is part of what a template was learnt for: another one learns
    assert step(dtorch.zeros(3, device_mesh=one), 3.0)["sum"].item() == 144.0
    assert step.replays == 4


def test_arguments_a_replay_could_not_see_change_are_refused(one):
    step = dtorch.replayed_step(lambda x, table: x + 1)
    with pytest.raises(TypeError, match="replayed step's arguments"):
        step(dtorch.ones(2, device_mesh=one), torch.ones(2))
    assert (step(dtorch.ones(2, device_mesh=one), [1, 2.0]) == 2).all().item()


def test_returned_history_is_dropped_and_shapes_relearn(one):
    w = dtorch.ones(4, device_mesh=one).requires_grad_()

    @dtorch.replayed_step
    def step(x):
        loss = (w * x).sum()
        loss.backward()
        with torch.no_grad():
            w.sub_(w.grad * 0.5)
        w.grad = None
        return loss

    values = [step(dtorch.full((4,), 1.0, device_mesh=one)) for _ in range(4)]
    assert not any(v.requires_grad for v in values)
    assert [v.item() for v in values] == [4.0, 2.0, 0.0, -2.0]
    assert step.replays == 2
    longer = step(dtorch.ones(4, 1, device_mesh=one))  # another shape: learnt anew
    assert step.replays == 2 and longer.item() == -16.0


def _never_replays(step, make_args, reason: str):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = [step(*make_args(k)) for k in range(LEARN_CALLS + 2)]
    assert step.replays == 0
    told = [str(w.message) for w in caught if "replayed_step" in str(w.message)]
    assert len(told) == 1 and reason in told[0], told
    return out


def test_a_step_that_reads_a_value_runs_as_python_and_says_why(one):
    w = dtorch.zeros(2, device_mesh=one)
    seen = []

    def step(x):
        w.add_(x)
        seen.append(w.sum().item())  # data the Python needs: no replay can give it
        return w

    out = _never_replays(dtorch.replayed_step(step), lambda k: (dtorch.ones(2, device_mesh=one),),
                         "reads a value")
    assert seen == [2.0 * (k + 1) for k in range(LEARN_CALLS + 2)] and out[-1] is w


def test_a_step_that_draws_random_numbers_never_replays(one):
    """A dropout's seed is a scalar of its record, new each call: no two calls are alike,
    where a replay would draw the same mask every step."""
    dtorch.manual_seed(0)
    step = dtorch.replayed_step(lambda x: dtorch.nn.functional.dropout(x, 0.5))
    masks = _never_replays(step, lambda k: (dtorch.ones(64, device_mesh=one),), "differ")
    assert len({tuple(m.to_torch().tolist()) for m in masks}) == len(masks)


def test_operators_from_another_thread_while_learning_keep_it_learning(one):
    x = dtorch.ones(2, device_mesh=one)

    def step(y):
        other = threading.Thread(target=lambda: x * 3)
        other.start()
        other.join()
        return y + 1

    _never_replays(dtorch.replayed_step(step), lambda k: (dtorch.ones(2, device_mesh=one),),
                   "another thread")


def test_a_kernel_error_in_a_replay_names_the_line_of_the_step(one):
    table = dtorch.arange(5.0, device_mesh=one)

    @dtorch.replayed_step
    def step(index):
        return table[index] * 2  # the line the error names

    for k in range(4):
        assert step(dtorch.tensor([k], device_mesh=one)).item() == 2.0 * k
    assert step.replays == 2
    bad = step(dtorch.tensor([7], device_mesh=one))
    assert step.replays == 3
    with pytest.raises(RuntimeError, match=r"test_step_replay.py:\d+") as caught:
        bad.item()
    assert "index" in str(caught.value)
    assert step(dtorch.tensor([4], device_mesh=one)).item() == 8.0  # still usable


def test_a_new_runtime_learns_again():
    with_first = dtorch.DeviceMesh("cpu", [0])
    w = dtorch.zeros(2, device_mesh=with_first)
    step = dtorch.replayed_step(lambda x: w.add_(x).sum())
    for _ in range(3):
        step(dtorch.ones(2, device_mesh=with_first))
    assert step.replays == 1
    dtorch.shutdown()
    w = dtorch.zeros(2, device_mesh=with_first)
    assert step(dtorch.ones(2, device_mesh=with_first)).item() == 2.0  # learning: the new w
    assert step.replays == 1


def test_a_tensor_the_step_reads_replaced_between_calls_sends_it_back_to_learning(one):
    """The step reads its weight through Python: a replay would read the dropped tensor's id.
    One still held elsewhere the guards cannot tell from the one the step reads: ``reset()``."""
    holder = {"w": dtorch.ones(2, device_mesh=one)}
    step = dtorch.replayed_step(lambda x: (holder["w"] * x).sum())
    x = dtorch.ones(2, device_mesh=one)
    assert [step(x).item() for _ in range(3)] == [2.0] * 3 and step.replays == 1
    holder["w"] = dtorch.full((2,), 5.0, device_mesh=one)  # the old one dies
    assert [step(x).item() for _ in range(2)] == [10.0] * 2 and step.replays == 1  # learning
    assert step(x).item() == 10.0 and step.replays == 2
    kept = holder["w"]
    holder["w"] = dtorch.full((2,), 7.0, device_mesh=one)
    step.reset()
    assert step(x).item() == 14.0 and kept is not None


def test_a_tensor_returned_twice_is_one_tensor(one):
    w = dtorch.zeros(2, device_mesh=one)

    @dtorch.replayed_step
    def step(x):
        total = w.add_(x).sum()
        return total, [total]

    outs = [step(dtorch.ones(2, device_mesh=one)) for _ in range(4)]
    assert step.replays == 2
    for k, (total, (again,)) in enumerate(outs):
        assert total is again and total.item() == 2.0 * (k + 1)


def test_steps_learning_on_two_threads_at_once_give_their_values():
    """One session has one watch: a call that would learn while another thread's does runs
    as Python; each thread's values are its own."""
    mesh = dtorch.DeviceMesh("cpu", [0])
    results, errors = {}, []

    def train(name: int):
        try:
            w = dtorch.zeros(3, device_mesh=mesh)
            step = dtorch.replayed_step(lambda x: w.add_(x * name).sum())
            results[name] = ([step(dtorch.ones(3, device_mesh=mesh)).item() for _ in range(12)],
                             step.replays)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=train, args=(n,)) for n in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for name, (values, replays) in results.items():
        assert values == [3.0 * name * (k + 1) for k in range(12)], name
    assert any(replays for _, replays in results.values())


def test_a_step_called_while_another_thread_learns_runs_as_python():
    """Thread B calls its step three times while thread A's step is in the middle of a
    learning call: B's calls run as Python (the session has one watch, A's), and A's call,
    which saw B's operators, does not count."""
    mesh = dtorch.DeviceMesh("cpu", [0])
    inside, done = threading.Event(), threading.Event()
    a_w, b_w = dtorch.zeros(2, device_mesh=mesh), dtorch.zeros(2, device_mesh=mesh)

    def a_body(x):
        a_w.add_(x)
        if not inside.is_set():
            inside.set()
            done.wait(60)
        return a_w.sum()

    step_a = dtorch.replayed_step(a_body)
    step_b = dtorch.replayed_step(lambda x: b_w.add_(x).sum())
    values = []

    def b():
        inside.wait(60)
        values.extend(step_b(dtorch.ones(2, device_mesh=mesh)).item() for _ in range(3))
        done.set()

    other = threading.Thread(target=b)
    other.start()
    first = step_a(dtorch.ones(2, device_mesh=mesh))
    other.join()
    assert values == [2.0, 4.0, 6.0] and step_b.replays == 0
    assert [first.item()] + [step_a(dtorch.ones(2, device_mesh=mesh)).item()
                             for _ in range(3)] == [2.0, 4.0, 6.0, 8.0]
    assert step_a.replays == 1  # its first call saw B's operators: it learnt from calls 2, 3


def test_flow_control_counts_a_replay_as_its_records(one, monkeypatch):
    """A Step record stands for its step's records: 300 replays of a step of 40 records,
    never read, are 12,000 records in flight, which a bound of 4,000 marks every 1,000 (as it
    would the steps run as Python); counted as one record each they would never be marked,
    and a loop without reads would run unboundedly ahead of the devices."""
    from dtorch.client import session as _session

    s = _session.current()
    w = dtorch.zeros(4, device_mesh=one)

    @dtorch.replayed_step
    def step(x):
        for _ in range(20):
            x = x * 1.0 + 1.0  # (two records each)
        w.add_(x)

    marks = []
    plain_mark = s._mark
    monkeypatch.setattr(s, "_mark", lambda: marks.append(1) or plain_mark())
    with dtorch.config.Context(max_inflight_ops=4000):
        dtorch.sync()
        x = dtorch.zeros(4, device_mesh=one)
        for _ in range(3):
            step(x)  # learning
        marks.clear()
        for _ in range(300):
            step(x)
        assert step.replays == 301  # (learnt in two calls)
        assert len(marks) >= 300 * 40 // 1000 - 1, len(marks)
    assert torch.equal(w.to_torch(), torch.full((4,), 303 * 20.0))


def test_a_pipeline_step_replays_and_is_lowered_from_its_record():
    """1F1B on dp2 x pp3 (stage-to-stage moves, each stage's gradients reduced once over dp
    after its micro-batches accumulate) with AdamW: every step's losses and the weights after
    equal the loop run as Python bit for bit, and the last steps are one record to the
    hosts."""
    from test_schedules import data as stage_data, dtorch_stages, loss_fn, torch_stages

    meshes = dtorch.init_device_mesh("cpu", (2, 3), mesh_dim_names=["dp", "pp"]).unbind("pp")

    def run(replayed: bool):
        stages = dtorch_stages(meshes, torch_stages())
        opt = dtorch.optim.AdamW([p for s in stages for p in s.parameters()], lr=0.05)
        schedule = dtorch.nn.Schedule1F1B(stages, 4, loss_fn=loss_fn)

        def step(x, t):
            losses = []
            schedule.step(x, target=t, losses=losses)
            opt.step()
            opt.zero_grad()
            return losses

        if replayed:
            step = dtorch.replayed_step(step)
        seen, lowered = [], []
        for k in range(10):
            x, t = stage_data(10 + k)
            with dtorch.profiler.profile() as prof:
                losses = step(dtorch.from_torch(x, meshes[0], [S0]),
                              dtorch.from_torch(t, meshes[-1], [S0]))
            lowered.append(any("a step lowered from its record" in e["name"]
                               for e in prof.events if e.get("pid") == CONTROLLER_PID))
            seen.append([v.to_torch() for v in losses])
        weights = [p.to_torch() for s in stages for p in s.parameters()]
        return seen, weights, lowered, getattr(step, "replays", 0)

    plain, plain_weights, _, _ = run(False)
    seen, weights, lowered, replays = run(True)
    assert replays == 10 - 4 and lowered == [False] * 6 + [True] * 4, lowered
    for k, (a, b) in enumerate(zip(seen, plain)):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), k
    assert all(torch.equal(x, y) for x, y in zip(weights, plain_weights))


def test_a_collected_step_tells_the_runtime_to_forget_it(one):
    """When a ReplayedStep is collected its template id is queued for the controller, which
    drops the template and the hosts' definition (``test_step_templates``); the runtime goes
    on, and a new step learns again."""
    from dtorch.client import session

    x = dtorch.from_torch(torch.arange(6.0), device_mesh=one, placements=[R])
    step = dtorch.replayed_step(lambda t: t * 2.0 + 1.0)
    for _ in range(4):
        step(x)
    assert step.replays == 2
    _, release, args, _ = step._drop.peek()
    assert release is session.release_step and args == (step.template_id,)
    drop = step._drop
    del step
    gc.collect()
    assert not drop.alive  # (it ran)
    again = dtorch.replayed_step(lambda t: t * 2.0 + 1.0)
    got = [again(x).to_torch() for _ in range(4)]
    assert again.replays == 2 and all(torch.equal(g, torch.arange(6.0) * 2 + 1) for g in got)
