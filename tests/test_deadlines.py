"""Collective deadlines: a collective that some of its members never join raises in the client
once ``config.collective_timeout_s`` passes, as the failure of the op that waited, at its call
site, rather than hanging the program.

A kernel registered with ``uses_context`` may use its mesh's process groups (``ctx.group``), so
the honest way to make a collective a peer never joins is such a kernel that all-reduces on the
mesh's first device only (``extension_kernels.allreduce_on_first_device``). Once its group
exists (a redistribute made it on every member), its all-reduce waits for peers that never
come; on a group not yet made, the first device waits in the rendezvous instead. Both must end
at the deadline.

The deadline is set to 2 s in the environment of a client run in a subprocess (hosts read
their config from the environment they inherit), and the client's own waits are bounded too.
"""

from __future__ import annotations

import re

import pytest

from processes import CLIENT_PRELUDE, run_client

DEADLINE_S = 2.0
SLACK_S = 8.0  # runtime start-up excluded; a 2-core machine shared by three processes

LONELY = CLIENT_PRELUDE + """
import extension_kernels as K

def lonely(x):
    return K.lonely_allreduce(x)

def failure_and_latency(x):
    dtorch.sync()
    t0 = time.monotonic()
    future = lonely(x).to_torch_async()
    if not future.wait(30):
        return "hung", None
    try:
        future.get()
        return "no error", None
    except RuntimeError as e:
        return str(e), time.monotonic() - t0

pair = dtorch.DeviceMesh("cpu", [0, 1])
x = dtorch.from_torch(torch.arange(4.0), device_mesh=pair, placements=[Shard(0)])
r = x.redistribute(placements=[Replicate()])  # makes the group (0, 1) on both devices
collective = failure_and_latency(r)
fresh = dtorch.DeviceMesh("cpu", [2, 3])  # no group of (2, 3) exists yet
rendezvous = failure_and_latency(
    dtorch.from_torch(torch.arange(4.0), device_mesh=fresh, placements=[Replicate()]))
after = (x * 2).to_torch().tolist()  # work that needs no collective still runs
dtorch.shutdown()
again = dtorch.DeviceMesh("cpu", [0, 1])
y = dtorch.from_torch(torch.arange(4.0), device_mesh=again, placements=[Shard(0)])
report(collective=collective, rendezvous=rendezvous, after=after,
       restarted=y.redistribute(placements=[Replicate()]).to_torch().tolist())
"""

SITE = next(i + 1 for i, line in enumerate(LONELY.splitlines())
            if "return K.lonely_allreduce(x)" in line)


@pytest.fixture(scope="module")
def lonely_run():
    return run_client(LONELY, timeout=150, env={"DTORCH_COLLECTIVE_TIMEOUT": str(DEADLINE_S)})


@pytest.mark.parametrize("where", ["collective", "rendezvous"])
def test_a_collective_a_peer_never_joins_fails_at_the_deadline(lonely_run, where):
    error, latency = lonely_run[where]
    print(f"\n{where}: raised {latency} s after the call: {error}")
    assert latency is not None, error  # "hung" or "no error"
    # the client raises RuntimeError; the text names the kernel's own exception (gloo's
    # RuntimeError, or the store's DistStoreError in a rendezvous)
    assert re.search(rf"dtorch.custom_op failed \(called at <string>:{SITE}\): \w*Error: ",
                     error), error
    assert re.search(r"(?i)time(d)? ?out", error), error
    assert DEADLINE_S * 0.75 <= latency < DEADLINE_S + SLACK_S


def test_the_runtime_goes_on_after_a_deadline(lonely_run):
    """Local work still runs; the timed-out group's pairs are closed, so the program shuts the
    runtime down and a fresh one runs collectives again."""
    assert lonely_run["after"] == [0.0, 2.0, 4.0, 6.0]
    assert lonely_run["restarted"] == [0.0, 1.0, 2.0, 3.0]
