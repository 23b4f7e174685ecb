"""DTorch's import path for meshes and placements: ``from dtorch.distributed_spec import ...``.

The names are defined in ``dtorch/mesh.py`` (DeviceMesh and the functions that build one),
``dtorch/placement.py`` (placements and ``get_placements_from_dict``) and ``graph.py``
(``get_default_device_mesh``, a graph's default); this module only gathers them where DTorch
programs import them from.

>>> from dtorch.distributed_spec import DeviceMesh, Placement, Shard
>>> Placement("S0") == Shard(0), DeviceMesh("cpu").shape
(True, (1,))
"""

from .graph import get_default_device_mesh
from .mesh import DeviceMesh, assign_layers_to_stages, init_device_mesh
from .placement import Partial, Placement, Replicate, Shard, get_placements_from_dict

__all__ = [
    "DeviceMesh",
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
    "assign_layers_to_stages",
    "get_default_device_mesh",
    "get_placements_from_dict",
    "init_device_mesh",
]
