"""SLURM: ``srun dtorch node`` finds its main node, rank and address in the ``SLURM_*``
variables of its task, so a batch script needs no per-node arguments (``docs/cluster.md`` has
one).

- the main node: ``DTORCH_MAIN_NODE_ADDRESS`` when the script exports it (srun passes the
  environment on), else the node that ran ``srun`` (``SLURM_LAUNCH_NODE_IPADDR``) at a port
  fixed per job (``port``), so two jobs sharing a node do not collide;
- the rank: ``SLURM_PROCID``; the machine's name: ``SLURMD_NODENAME``;
- the address: ``auto`` (the one that routes to the main node): under srun the other machines
  must reach this one, and running under a multi-node step is the explicit request.

>>> env = {"SLURM_JOB_ID": "4242", "SLURM_PROCID": "1", "SLURMD_NODENAME": "gpu07",
...        "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.1"}
>>> defaults(env) == {"main": "10.0.0.1:17242", "rank": 1, "name": "gpu07", "bind": "auto"}
True
>>> defaults({})
{}
"""

from __future__ import annotations

BASE_PORT, PORTS = 13000, 20000  # DTorch's examples listen at 13000


def port(environ) -> int:
    """The main node's port for this job: the same in every task of the job."""
    return BASE_PORT + int(environ["SLURM_JOB_ID"]) % PORTS


def defaults(environ) -> dict:
    """The agent settings a SLURM task's environment gives (none outside SLURM)."""
    if "SLURM_JOB_ID" not in environ:
        return {}
    out = {"bind": "auto"}
    if environ.get("SLURM_LAUNCH_NODE_IPADDR"):
        out["main"] = f"{environ['SLURM_LAUNCH_NODE_IPADDR']}:{port(environ)}"
    if environ.get("SLURM_PROCID", "").isdigit():
        out["rank"] = int(environ["SLURM_PROCID"])
    if environ.get("SLURMD_NODENAME"):
        out["name"] = environ["SLURMD_NODENAME"]
    return {k: out[k] for k in ("main", "rank", "name", "bind") if k in out}
