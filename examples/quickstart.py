"""The main example: a 2x2 CPU mesh, data + tensor parallel layouts, values and futures."""

import asyncio

import torch

import dtorch

mesh = dtorch.DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=["dp", "tp"])
x = dtorch.randn((11, 6), device_mesh=mesh, placements=[dtorch.Shard(0), dtorch.Replicate()])
w = dtorch.from_torch(torch.randn(6, 8), device_mesh=mesh,
                      placements=[dtorch.Replicate(), dtorch.Shard(1)])
y = (x @ w).relu() + 1.0  # returns immediately: y is a symbol
print("y.placements:", y.placements)
z = y.redistribute(placements=[dtorch.Replicate(), dtorch.Replicate()])
print(z)  # the first wait: value, shape, dtype, mesh, placements
t = z.to_torch()  # the full logical value as a torch.Tensor
assert torch.allclose(t, (x.to_torch() @ w.to_torch()).relu() + 1.0)
fut = y.sum().to_torch_async()  # a TensorFuture
async def main():
    return await fut


print(asyncio.run(main()), fut.is_ready())
dtorch.default_graph.sync()
