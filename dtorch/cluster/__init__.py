"""Launching the runtime's processes and keeping their lifetimes tied together: on one machine
(``local.py``) and on many (``node.py``, the agent each machine runs; ``machines.py``, the main
node's side; launchers ``slurm.py`` and ``ray.py``). ``devices()`` lists the cluster's devices."""


def devices() -> list:
    """The cluster's devices, by global id, with their machine (``main_node.devices``)."""
    from .main_node import devices as listed

    return listed()
