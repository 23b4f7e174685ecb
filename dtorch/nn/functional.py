"""dtorch.nn.functional: torch.nn.functional's names on distributed tensors.

The functions here are generated from the operator registry (entries with ``functional=True``),
like the ones under ``dtorch.``; this module only gives them torch's namespace.
"""
