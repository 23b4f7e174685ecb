"""dtorch.nn.functional: torch.nn.functional's names on distributed tensors.

Every function here comes from the operator registry (entries with ``functional=True``): the
client installs each entry's front, generated from its signature or written beside the entry
(dropout, the norms, conv2d, DTorch's ``_pooling2d`` ...), as it does under ``dtorch.``. Only
``SdpaOption``, the argument type of ``scaled_dot_product_attention``, is defined elsewhere
(``dtorch/type.py``).
"""

from ..type import SdpaOption  # noqa: F401
