"""Ray: one node agent per Ray node, as actors, for a program that already runs on Ray.

``start(num_nodes, cpu_devices_per_node)`` (``pip install dtorch[ray]``) reserves one bundle on
each of ``num_nodes`` distinct nodes (a STRICT_SPREAD placement group, so two agents never share
a machine), starts a node agent actor in each (``launcher/node.py``: the agent runs on a thread
of the actor, and its hosts are the actor's children, so they end with it), and returns once all
have joined this program, the main node. Unless the program set them, the main node's address
is this node's Ray address at a free port and the token a new one, handed to the actors through
Ray (whose own channels only the Ray cluster's members use); each agent listens on its node's
Ray address. Launching on a Ray cluster is the explicit request to listen beyond loopback.

``RayCluster.shutdown()`` ends the actors (their hosts with them) and frees the bundles; they
also end with the Ray job. The agents serve one runtime after another, as by hand: after a
``dtorch.shutdown()`` the next runtime finds them joining again.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading

from .. import config
from ..launcher import auth, node
from . import main_node
from .main_node import MainNode, cluster_settings


class AgentActor:
    """The actor body (``ray.remote`` wraps it in ``start``): a node agent on its own thread."""

    def __init__(self, main: str, token: bytes, cpu_devices: int | None, rank: int):
        import ray

        fd, self.token_file = tempfile.mkstemp(prefix="dtorch-token-")  # mode 0600
        with os.fdopen(fd, "wb") as f:
            f.write(token)
        keys = auth.read_token(self.token_file)
        bind = ray.util.get_node_ip_address()
        self.agent = node.Agent(main, keys, bind, cpu_devices or config.cpu_hosts, rank,
                                name=f"ray node {rank} ({socket.gethostname()})")
        self.thread = threading.Thread(target=self.agent.serve_forever, name="dtorch-agent",
                                       daemon=True)
        self.thread.start()

    def address(self) -> str:
        return self.agent.bind


class RayCluster:
    def __init__(self, actors: list, group, token_dir: str | None):
        self.actors, self.placement_group, self._token_dir = actors, group, token_dir

    def shutdown(self) -> None:
        """Ends the agents (and their hosts) and frees their bundles."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            ray.kill(actor)
        remove_placement_group(self.placement_group)
        if self._token_dir:
            shutil.rmtree(self._token_dir, ignore_errors=True)


def start(num_nodes: int, cpu_devices_per_node: int | None = None,
          timeout_second: float = 600) -> RayCluster:
    """Starts ``num_nodes`` node agents on distinct Ray nodes and waits for them to join (see
    the module doc). Call it before the runtime starts (the first operator), as
    ``MainNode.set_address``; ``ray.init`` first to pick a cluster (else it starts a local one)."""
    try:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    except ImportError:
        raise ImportError("dtorch.cluster.ray needs Ray: pip install 'dtorch[ray]'") from None
    if not ray.is_initialized():
        ray.init()
    token_dir = None
    if not main_node.is_main_node():
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        MainNode.set_address(f"{ray.util.get_node_ip_address()}:{port}")
    if not main_node.has_token_file():
        token_dir = tempfile.mkdtemp(prefix="dtorch-ray-")
        auth.write_token(os.path.join(token_dir, "token"))
        MainNode.set_token_file(os.path.join(token_dir, "token"))
    settings = cluster_settings()
    with open(settings.token_file, "rb") as f:
        token = f.read()
    group = placement_group([{"CPU": 1}] * num_nodes, strategy="STRICT_SPREAD")
    if not group.wait(timeout_second):
        raise TimeoutError(f"dtorch.cluster.ray.start: Ray found no {num_nodes} distinct nodes "
                           f"with a free CPU within {timeout_second} s")
    actor_class = ray.remote(num_cpus=1)(AgentActor)
    actors = [actor_class.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
        group, placement_group_bundle_index=i)).remote(settings.address, token,
                                                       cpu_devices_per_node, i)
              for i in range(num_nodes)]
    cluster = RayCluster(actors, group, token_dir)
    try:
        ray.get([a.address.remote() for a in actors], timeout=timeout_second)
        if not MainNode.wait_cluster_ready(num_nodes, timeout_second):
            raise TimeoutError(f"dtorch.cluster.ray.start: {num_nodes} node agents did not "
                               f"join within {timeout_second} s")
    except BaseException:
        cluster.shutdown()
        raise
    return cluster

