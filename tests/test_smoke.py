import torch

import dtorch
from helpers import assert_close


def test_one_device_bit_identical():
    t = torch.randn(5, 7, generator=torch.Generator().manual_seed(0))
    x = dtorch.from_torch(t)
    assert_close((x * 2 + 1).exp().sum(dim=0), (t * 2 + 1).exp().sum(dim=0), exact=True)


def test_issue_example(mesh2):
    g = torch.Generator().manual_seed(0)
    x = dtorch.randn((11, 6), generator=g, device_mesh=mesh2,
                     placements=[dtorch.Shard(0), dtorch.Replicate()])
    wt = torch.randn(6, 8)
    w = dtorch.from_torch(wt, device_mesh=mesh2, placements=[dtorch.Replicate(), dtorch.Shard(1)])
    y = (x @ w).relu() + 1.0
    assert y.placements == [dtorch.Shard(0), dtorch.Shard(1)]
    xt = torch.randn((11, 6), generator=torch.Generator().manual_seed(0))
    assert_close(y, (xt @ wt).relu() + 1.0)
    z = y.redistribute(placements=[dtorch.Replicate(), dtorch.Replicate()])
    assert z.placements == [dtorch.Replicate(), dtorch.Replicate()]
    assert_close(z, (xt @ wt).relu() + 1.0)
    assert_close(y.sum().to_torch_async().get(), ((xt @ wt).relu() + 1.0).sum())


def test_thousands_of_small_batches_lose_nothing():
    """More frames than a socket's default queue limit, sent while the host is busy: a ROUTER
    socket would drop them silently unless told not to."""
    from dtorch.client import session

    mesh = dtorch.DeviceMesh("cpu", [0])
    x = dtorch.ones(8, device_mesh=mesh)
    busy = dtorch.ones((800, 800), device_mesh=mesh)
    for _ in range(4):
        busy = busy @ busy / 800.0
    for _ in range(3000):
        x = x + 1.0
        session.current().flush()  # one frame per operator
    assert x.to_torch()[0].item() == 3001.0
