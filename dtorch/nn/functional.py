"""dtorch.nn.functional: torch.nn.functional's names on distributed tensors.

Every function here comes from the operator registry (entries with ``functional=True``): the
client installs each entry's front, generated from its signature or written beside the entry
(dropout, the norms, conv2d, DTorch's ``_pooling2d`` ...), as it does under ``dtorch.``. Only
``SdpaOption``, the argument type of ``scaled_dot_product_attention``, is defined elsewhere
(``dtorch/type.py``).
"""

import torch

from ..type import SdpaOption  # noqa: F401


def __getattr__(name: str):
    """``_function_names``: DTorch's list of this module's functions, torch.nn.functional's
    names and DTorch's own private forms (``_apply_rotary_emb``). dtorch's own operators
    (``moe_experts``, ``vocab_parallel_embedding``) are left out: DTorch has none such, and
    its list holds no public name that torch.nn.functional lacks."""
    if name == "_function_names":
        return sorted(n for n, v in globals().items()
                      if callable(v) and not isinstance(v, type) and not n.startswith("__")
                      and (n.startswith("_") or hasattr(torch.nn.functional, n)))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
