"""dtorch.nn.Module against torch.nn.Module: the call pipeline and torch's hooks, registration,
state dicts loaded into every placement (uneven shards, Partial), torch's errors for missing and
unexpected keys, ``to(mesh, dtype)``, and the containers."""

from __future__ import annotations

import pytest
import torch

import dtorch
from dtorch import nn
from dtorch.distributed_spec import DeviceMesh, Partial, Replicate, Shard, init_device_mesh
from helpers import assert_close, sample

R, S0, S1 = Replicate(), Shard(0), Shard(1)
MESH = init_device_mesh("cpu", (2, 3), ("dp", "tp"))


class Affine(nn.Module):
    """y = x @ w + b with the layouts given: a stand-in for any layer."""

    def __init__(self, w_placements=(R, R), b_placements=(R, R), mesh=MESH):
        super().__init__()
        self.w = nn.Parameter(dtorch.zeros(5, 7, device_mesh=mesh, placements=list(w_placements)))
        self.b = nn.Parameter(dtorch.zeros(7, device_mesh=mesh, placements=list(b_placements)))
        self.register_buffer("scale", dtorch.ones(7, device_mesh=mesh))
        self.register_buffer("scratch", dtorch.zeros(7, device_mesh=mesh), persistent=False)

    def forward(self, x):  # (whole weights: the test is of loading, not of matmul's rules)
        w, b = (t.redistribute(placements=[R, R]) for t in (self.w, self.b))
        return (x @ w + b) * self.scale


class TorchAffine(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(sample((5, 7), seed=1))
        self.b = torch.nn.Parameter(sample((7,), seed=2))
        self.register_buffer("scale", sample((7,), seed=3))
        self.register_buffer("scratch", torch.zeros(7), persistent=False)

    def forward(self, x):
        return (x @ self.w + self.b) * self.scale


LAYOUTS = [((R, R), (R, R)), ((R, S1), (R, S0)), ((S0, S1), (R, R)), ((S1, S0), (Partial(), R)),
           ((R, Partial()), (R, Partial()))]


@pytest.mark.parametrize("w,b", LAYOUTS, ids=[str(i) for i in range(len(LAYOUTS))])
def test_a_torch_state_dict_loads_into_any_layout(w, b):
    """5 rows over 2 and 7 columns over 3: uneven shards; Partial holds the value once."""
    ref = TorchAffine()
    m = Affine(w, b)
    assert str(m.load_state_dict(ref.state_dict())) == "<All keys matched successfully>"
    assert m.w.placements == list(w) and m.b.placements == list(b)  # layouts kept
    for key, value in m.state_dict().items():
        assert isinstance(value, dtorch.Tensor)
        assert_close(value, ref.state_dict()[key], exact=True)
    x = sample((4, 5), seed=4)
    assert_close(m(dtorch.Tensor(x, MESH)), ref(x).detach())


def test_a_dtorch_state_dict_loads_across_layouts_and_meshes():
    src = Affine((S1, S0), (R, S0))
    src.load_state_dict(TorchAffine().state_dict())
    dst = Affine((R, R), (R, R), mesh=DeviceMesh("cpu", [[5], [4]]))
    dst.load_state_dict(src.state_dict())
    for key, value in dst.state_dict().items():
        assert_close(value, src.state_dict()[key].to_torch(), exact=True)


def test_load_errors_are_torchs():
    m, ref = Affine(), TorchAffine()
    sd = ref.state_dict()
    del sd["b"]
    sd["extra"] = torch.zeros(1)
    with pytest.raises(RuntimeError) as ours:
        m.load_state_dict(sd)
    with pytest.raises(RuntimeError) as theirs:
        TorchAffine().load_state_dict(sd)
    assert str(ours.value).replace("Affine", "X") == str(theirs.value).replace("TorchAffine", "X")
    result = m.load_state_dict(sd, strict=False)
    assert tuple(result) == tuple(TorchAffine().load_state_dict(sd, strict=False)) == (
        ["b"], ["extra"])
    wrong = {**ref.state_dict(), "w": torch.zeros(7, 5)}
    with pytest.raises(RuntimeError, match=r"size mismatch for w: .*\(7, 5\).*\(5, 7\)"):
        m.load_state_dict(wrong)
    ints = {**ref.state_dict(), "b": torch.zeros(7, dtype=torch.int64)}
    with pytest.raises(RuntimeError, match="dtype mismatch for b"):
        m.load_state_dict(ints)
    halves = {k: v.half() for k, v in ref.state_dict().items()}  # floats cast, as torch
    m.load_state_dict(halves)
    assert m.w.dtype == torch.float32
    assert_close(m.w, halves["w"].float(), exact=True)


def test_call_runs_the_pipeline_between_torchs_hooks():
    events = []

    class Logged(nn.Module):
        def redistribute_input(self, x):
            events.append("in")
            return (x.redistribute(placements=[S0, R]),), {}

        def forward(self, x):
            events.append(("forward", tuple(map(repr, x.placements))))
            return x + 1

        def redistribute_output(self, out):
            events.append("out")
            return out.redistribute(placements=[R, R])

    m = Logged()
    m.register_forward_pre_hook(lambda mod, args: events.append("pre") or (args[0] * 2,))
    m.register_forward_hook(lambda mod, args, out: events.append("post") or out * 10)
    m.register_forward_pre_hook(lambda mod, args, kwargs: events.append("pre-kw"),
                                with_kwargs=True)
    y = m(dtorch.Tensor(torch.ones(4, 3), MESH))
    assert events == ["pre", "pre-kw", "in", ("forward", ("Shard(dim=0)", "Replicate()")),
                      "out", "post"]
    assert y.placements == [R, R]
    assert_close(y, torch.full((4, 3), 30.0), exact=True)

    class Bad(nn.Module):
        def redistribute_input(self, x):
            return x

        def forward(self, x):
            return x

    with pytest.raises(TypeError, match="redistribute_input must return"):
        Bad()(dtorch.ones(2))


def test_registration_and_moves():
    m = Affine()
    assert [n for n, _ in m.named_parameters()] == ["w", "b"]
    assert [n for n, _ in m.named_buffers()] == ["scale", "scratch"]
    assert list(m.state_dict()) == ["w", "b", "scale"]  # a non-persistent buffer is left out
    assert all(isinstance(p, nn.Parameter) and p.requires_grad for p in m.parameters())
    assert not nn.Parameter(dtorch.ones(1), requires_grad=False).requires_grad
    m.b = dtorch.ones(7, device_mesh=MESH)  # a tensor assigned to a parameter is one
    assert isinstance(m.b, nn.Parameter)
    with pytest.raises(TypeError, match="Parameter or None"):
        m.register_parameter("c", dtorch.ones(1))
    m.kept = nn.Buffer(dtorch.ones(2, device_mesh=MESH), persistent=False)  # as torch.nn.Buffer
    assert "kept" not in m.state_dict()
    other = DeviceMesh("cpu", [[7, 6, 5], [4, 3, 2]], mesh_dim_names=["dp", "tp"])
    m.to(other, torch.float64)
    assert all(t.device_mesh == other and t.dtype == torch.float64
               for t in [*m.parameters(), *m.buffers()])
    assert m.first_param_device_mesh() == other
    assert nn.Sequential().first_param_device_mesh() is None
    with pytest.raises(TypeError, match="floating point"):
        m.to(torch.int64)


def test_containers_and_qualified_names():
    seen = {}

    class Probe(nn.Module):
        def forward(self, x):
            seen[id(self)] = self.qualified_name()
            return x

    inner = nn.ModuleList([Probe(), Probe()])
    model = nn.Sequential(nn.Identity(), nn.ModuleDict({"block": nn.Sequential(*inner)}))

    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = model

        def forward(self, x):
            return self.body[1]["block"](self.body[0](x))

    root = Root()
    assert_close(root(dtorch.ones(2)), torch.ones(2), exact=True)
    assert sorted(seen.values()) == ["body.1.block.0", "body.1.block.1"]
    assert inner[0].qualified_name() == "Probe"  # outside a call
    assert isinstance(model, torch.nn.Module) and len(inner) == 2
    # a new module, its children and torch containers over them start in eval mode (DTorch's
    # default); train()/eval() reach every module below, as in torch
    assert not any(m.training for m in root.modules() if isinstance(m, nn.Module))
    assert all(m.training for m in root.train().modules())
    assert not any(m.training for m in root.eval().modules())
