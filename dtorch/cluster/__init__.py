"""The user's side of a cluster: this program as its main node (``main_node.py``: ``MainNode``),
node agents started through Ray (``ray.py``), and ``devices()``, the cluster's devices.

The runtime's side, which starts and ties together the processes (on one machine and on many:
the node agents, the ``dtorch`` command, SLURM's defaults), is ``dtorch/launcher/``; it takes
this side's decisions as a value (``launcher/settings.ClusterSettings``) and imports nothing
from here."""


def devices() -> list:
    """The cluster's devices, by global id, with their machine (``main_node.devices``)."""
    from .main_node import devices as listed

    return listed()
