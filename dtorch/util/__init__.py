"""DTorch's ``dtorch.util``: helpers for programs that check and time dtorch against torch.

- ``tensor_checker``: compare torch, dtorch and NumPy tensors (``TensorChecker.tensor_equal``,
  ``tensor_allclose``, ``tensor_meanclose``), or register tensors under tags from two runs of
  a model and compare them tag by tag (``module_register_tensor_checker`` registers every
  submodule's parameters, buffers, inputs and outputs).
- ``benchmark``: ``Benchmark.run(func, warmup, count)`` times a function, waiting for the
  devices, and reports its memory.
"""
