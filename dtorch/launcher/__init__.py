"""The launcher, a runtime role: starts the controller and hosts and ties their lifetimes
together, on one machine (``local.py``) and on many (``node.py``, the agent each machine runs;
``machines.py``, the main node's side; ``store.py``, the cluster's rendezvous store; ``cli.py``,
the ``dtorch`` command; ``slurm.py``, an agent's defaults under SLURM). Every socket is
authenticated (``auth.py``). A main node's settings come in as a value (``settings.py``); the
user's API that decides them is ``dtorch/cluster/``, which this package never imports."""
