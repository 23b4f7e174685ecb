"""The controller role: the LogicalGraph of the incremental subgraph, its passes, dispatch."""
