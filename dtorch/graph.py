"""DTorch's public module for graphs: ``Graph``, ``GraphOption`` and ``VoidFutureCollect``.

The classes live with the client (``dtorch/client/graph.py``, ``dtorch/future.py``); this
module is where DTorch programs import them from.

>>> from dtorch.graph import Graph, GraphOption
>>> g = Graph(GraphOption(per_device_per_process=True))
>>> g.option, g == Graph.default_graph()
(GraphOption(per_device_per_process=True), False)
"""

from .client.graph import Graph, GraphOption
from .future import VoidFutureCollect

__all__ = ["Graph", "GraphOption", "VoidFutureCollect"]
