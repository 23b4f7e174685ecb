"""dtorch.Graph: a stream of operators with its own compute streams on every device.

Operators issued inside ``with graph:`` run on that graph's compute streams, so work of two
graphs can run concurrently on one device (inter-graph parallelism); collectives of all graphs
share each device's communication stream, which keeps them in one order on every device.

>>> import dtorch
>>> g = dtorch.Graph()
>>> with g:
...     y = dtorch.ones(3).sum()
>>> g.sync()
"""

from __future__ import annotations

import itertools

from . import session as _session

_ids = itertools.count(0)
_stack: list = []


class Graph:
    def __init__(self):
        self.id = next(_ids)

    def sync(self) -> None:
        """Waits until every operator issued so far has run; raises kernel errors reported
        since the last wait."""
        _session.current().sync()

    def __enter__(self) -> Graph:
        _stack.append(self)
        _session.current().set_graph(self.id)
        return self

    def __exit__(self, *exc) -> None:
        _stack.pop()
        _session.current().set_graph(_stack[-1].id if _stack else default_graph.id)

    def __repr__(self) -> str:
        return f"dtorch.Graph({self.id})"


default_graph = Graph()
