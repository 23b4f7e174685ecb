"""Training steps replayed: on one device a steady-state step (forward recorded calls, backward
VJPs, the optimizer's update) is one batch of one shape, cached the second time it is seen and
replayed from then on (``controller/replay.segment``). Every step's loss and the final weights
equal those of a runtime that lowers every record (DTORCH_REPLAY=0), bit for bit, and HF's."""

import pytest
import torch

import dtorch
from dtorch.profiler import CONTROLLER_PID
from helpers import runtime_with

STEPS = 8


def train(profiled: bool):
    """Every step's loss, the final weights, and the windows each step's batches replayed."""
    import test_llama as L

    hf = L.hf_model(L.config())
    mesh = dtorch.init_device_mesh("cpu", (1, 1, 1, 1, 1), mesh_dim_names=L.DIMS)
    model = L.LlamaForCausalLM(hf.config, device_mesh=mesh)
    model.load_state_dict(hf.state_dict())
    opt = dtorch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(3)
    losses, replayed = [], []
    for _ in range(STEPS):
        ids = torch.randint(0, 96, (4, 9), generator=g)
        labels = torch.randint(0, 96, (4, 9), generator=g)
        with dtorch.profiler.profile() as prof:
            inputs = model.place_tokens(ids)
            target = dtorch.from_torch(labels, device_mesh=inputs.device_mesh,
                                       placements=inputs.placements)
            loss = dtorch.nn.functional.cross_entropy(model(inputs).transpose(1, 2), target)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        replayed.append(sum(int(e["name"].split(", ")[1].split()[0]) for e in prof.events
                            if e.get("pid") == CONTROLLER_PID
                            and "windows replayed" in e.get("name", "")))
    weights = {n: p.to_torch() for n, p in model.named_parameters()}
    return losses, weights, replayed, hf


def hf_losses(hf):
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-3)
    g, out = torch.Generator().manual_seed(3), []
    for _ in range(STEPS):
        ids = torch.randint(0, 96, (4, 9), generator=g)
        labels = torch.randint(0, 96, (4, 9), generator=g)
        loss = torch.nn.functional.cross_entropy(hf(ids).logits.flatten(0, 1), labels.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def test_steady_training_steps_replay_with_the_values_of_lowering_each(monkeypatch):
    """(A batch is a step when the client sends it at the loss's read, not on its timer: where
    the timer cuts a step depends on the machine's load, and a cut elsewhere is a new shape.)"""
    pytest.importorskip("transformers")
    monkeypatch.setattr(dtorch.config, "flush_delay_s", 10.0)
    with runtime_with(DTORCH_REPLAY="1"):
        losses, weights, replayed, hf = train(True)
    with runtime_with(DTORCH_REPLAY="0"):
        plain_losses, plain_weights, plain_replayed, _ = train(True)
    # the step's batch is seen (step 2 or 3: the optimizer's state is made in step 1), then
    # cached, then replayed: the last steps are replayed, not lowered anew
    assert replayed[-1] > 0 and replayed[-2] > 0 and not any(replayed[:2]), replayed
    assert not any(plain_replayed), plain_replayed
    assert losses == plain_losses  # every step's, bit for bit: values made inside replays
    for name, w in weights.items():
        assert torch.equal(w, plain_weights[name]), name
    assert losses == pytest.approx(hf_losses(hf), rel=1e-5)
