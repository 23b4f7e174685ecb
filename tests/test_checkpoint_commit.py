"""``save_checkpoint`` commits as a database does: killed at any point (SIGKILL of the program
while its devices write), the directory loads as exactly the old checkpoint or exactly the new
one, never a mix; a first save killed before its commit is refused as incomplete; a failed
write (a device's, the client's, a full disk) raises ``OSError`` naming the directory, frees
what it wrote and leaves the old checkpoint and the runtime as they were; the next save removes
what killed saves left."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
from processes import CLIENT_PRELUDE, TESTS_DIR, alive, read_result, start_client, wait_until

import dtorch
from dtorch import Replicate, Shard
from dtorch.checkpoint import commit, load_checkpoint, save_checkpoint

OLD, NEW = 1, 2  # the seeds of the two states a directory may hold

# key -> (shape, the devices of its mesh, placement); a torch tensor ("client") is the
# client's to write: four files of mesh 0, two of mesh 1, one of the client
LAYOUT = {
    "a": ((256, 512), (0, 1, 2, 3), Shard(0)),
    "b": ((512, 256), (0, 1, 2, 3), Shard(1)),
    "c": ((128, 256), (0, 1, 2, 3), Replicate()),
    "d": ((256, 256), (0, 1), Shard(0)),
    "client": ((1000,), None, None),
}


def values(seed: int) -> dict:
    """Every element differs between two seeds, so a file of the other state shows."""
    g = torch.Generator().manual_seed(seed)
    return {k: torch.rand(shape, generator=g) + seed for k, (shape, _, _) in LAYOUT.items()}


def module_of(state: dict) -> dtorch.nn.Module:
    m = dtorch.nn.Module()
    meshes = {}
    for key, value in state.items():
        _, devices, placement = LAYOUT[key]
        if devices is None:
            m.register_parameter(key, torch.nn.Parameter(value.clone()))
            continue
        mesh = meshes.setdefault(devices, dtorch.DeviceMesh("cpu", list(devices)))
        m.register_parameter(key, dtorch.nn.Parameter(dtorch.from_torch(value, mesh,
                                                                        [placement])))
    return m


def outcome(directory) -> tuple:
    """What the directory loads as: "old", "new" or "incomplete" (a mix fails the test), and
    the module it loaded into."""
    m = module_of({k: torch.zeros(s) for k, (s, _, _) in LAYOUT.items()})
    try:
        load_checkpoint(m, directory)
    except ValueError as e:
        assert "incomplete dtorch checkpoint" in str(e), e
        return "incomplete", m
    got = {k: v.to_torch() if isinstance(v, dtorch.Tensor) else v.detach()
           for k, v in m.state_dict().items()}
    for name, seed in (("old", OLD), ("new", NEW)):
        if all(torch.equal(got[k], v) for k, v in values(seed).items()):
            return name, m
    from_old = sorted(k for k, v in values(OLD).items() if torch.equal(got[k], v))
    raise AssertionError(f"a mix: {from_old} hold the old state, the others not")


def assert_only_the_index_and_its_files(directory) -> None:
    index = json.loads((directory / "dtorch.index.json").read_text())
    assert sorted(os.listdir(directory)) == sorted(["dtorch.index.json", *index["files"]])


def test_a_save_replaces_the_previous_and_removes_what_others_left(tmp_path):
    save_checkpoint(module_of(values(OLD)), tmp_path)
    old_files = set(os.listdir(tmp_path))
    leftovers = ["rank00007-mesh0-feedfacecafe.safetensors", "rank00000-mesh0.safetensors",
                 "client-feedfacecafe.safetensors", "dtorch.index.json.feedfacecafe.partial",
                 "rank00001-mesh0.safetensors.4242.partial"]
    mine = ["notes.txt", "model.safetensors", "client.safetensors"]  # not dtorch's to remove
    for name in leftovers + mine:
        (tmp_path / name).write_bytes(b"x")
    save_checkpoint(module_of(values(NEW)), tmp_path)
    index = json.loads((tmp_path / "dtorch.index.json").read_text())
    assert sorted(os.listdir(tmp_path)) == sorted(["dtorch.index.json", *index["files"], *mine])
    assert not old_files & set(index["files"])  # new names: nothing of the old was overwritten
    assert all(index["save_id"] in f for f in index["files"])
    assert len(index["files"]) == 4 + 2 + 1
    for name in mine:
        os.remove(tmp_path / name)
    assert outcome(tmp_path)[0] == "new"


@pytest.mark.parametrize("writer", ["rank00001-mesh0", "client"])
def test_a_failed_write_raises_oserror_and_keeps_the_old(tmp_path, monkeypatch, writer):
    """A directory where one file of the save must go (device 1's or the client's): that write
    fails (EISDIR), the others succeed; save_checkpoint raises OSError naming the directory,
    removes every file of the save, and the old checkpoint and the runtime are as they were."""
    save_checkpoint(module_of(values(OLD)), tmp_path)
    before = sorted(os.listdir(tmp_path))
    monkeypatch.setattr(commit, "new_save_id", lambda: "0123456789ab")
    blocker = f"{writer}-0123456789ab.safetensors"
    (tmp_path / blocker).mkdir()
    with pytest.raises(IsADirectoryError, match=f"could not write the checkpoint {tmp_path}"):
        save_checkpoint(module_of(values(NEW)), tmp_path)
    os.rmdir(tmp_path / blocker)
    assert sorted(os.listdir(tmp_path)) == before
    assert outcome(tmp_path)[0] == "old"
    monkeypatch.undo()  # the runtime is usable: the next save works
    save_checkpoint(module_of(values(NEW)), tmp_path)
    assert outcome(tmp_path)[0] == "new"


def test_a_failure_before_the_writes_leaves_no_files(tmp_path):
    save_checkpoint(module_of(values(OLD)), tmp_path)
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(TypeError, match="'x' is a str"):
        save_checkpoint({"a": module_of(values(NEW)).a, "x": "not a tensor"}, tmp_path)
    assert sorted(os.listdir(tmp_path)) == before


# -- killed mid-save (the program, in a subprocess of its own) -------------------------------

CHILD = CLIENT_PRELUDE + """
from dtorch.checkpoint import commit, save as save_module
from dtorch.checkpoint import save_checkpoint
from dtorch.client import session
from test_checkpoint_commit import NEW, OLD, module_of, values

directory, point, has_old = {directory!r}, {point!r}, {has_old!r}
new, old = module_of(values(NEW)), module_of(values(OLD))
dtorch.sync()  # the runtime is up: what follows is the save alone
t0 = time.perf_counter()
if has_old:
    save_checkpoint(old, directory)
seconds = time.perf_counter() - t0
controller, hosts = runtime_pids()

def stop_here(*_):  # the test kills the program here
    report(at=point)
    sys.stdin.readline()
    os._exit(3)

def after(function):
    def wrapped(*args):
        function(*args)
        stop_here()
    return wrapped

def sent(function):
    def wrapped(*args):
        function(*args)
        session._current.flush()  # on its way to the hosts, which write as the test kills
        stop_here()
    return wrapped

def on_second_call(function):  # remove_unnamed: first the leftovers', then the old save's
    calls = []
    def wrapped(*args):
        calls.append(args)
        if len(calls) == 2:
            stop_here()
        return function(*args)
    return wrapped

if point == "issued":  # the first mesh's writes sent to the hosts
    save_module.write_blocks = sent(save_module.write_blocks)
elif point == "written":  # every file written, no index yet
    commit.publish = lambda *a: stop_here()
elif point == "drafted":  # the new index written beside, not renamed
    real_replace = os.replace
    os.replace = lambda src, dst: (stop_here() if dst.endswith("dtorch.index.json")
                                   else real_replace(src, dst))
elif point == "published":  # renamed: the previous save's files not yet removed
    commit.remove_unnamed = on_second_call(commit.remove_unnamed)
elif point == "cleaning":  # one of the previous save's files removed
    commit._remove = after(commit._remove)  # (none before: the directory has no leftovers)
report(pids=[controller, *hosts], seconds=seconds)
sys.stdin.readline()  # "go"
save_checkpoint(new, directory)
report(at="done")
"""


def kill_mid_save(directory, point: str, has_old: bool = True, delay: float | None = None):
    """Runs a program that saves the old state into ``directory`` (``has_old``), then the new
    one, and SIGKILLs it at ``point`` (or ``delay`` x the old save's time after the new save
    began); returns once its runtime is gone."""
    proc = start_client(CHILD.format(directory=str(directory), point=point, has_old=has_old))
    try:
        ready = read_result(proc, timeout=120)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        if delay is None:
            assert read_result(proc, timeout=120) == {"at": point}
        else:
            time.sleep(delay * ready["seconds"])  # the kill's moment, not a synchronization
    finally:
        proc.kill()
        proc.wait(30)
        for pipe in (proc.stdin, proc.stdout, proc.stderr_file):
            pipe.close()
    wait_until(lambda: not any(alive(p) for p in ready["pids"]), 15)


@pytest.mark.parametrize("point, expected", [
    ("issued", "old"), ("written", "old"), ("drafted", "old"), ("published", "new"),
    ("cleaning", "new")])
def test_killed_at_a_point_of_the_save_loads_old_or_new(tmp_path, point, expected):
    """Before the index's rename the old checkpoint, after it the new; then the next save
    leaves nothing of the killed one."""
    kill_mid_save(tmp_path, point)
    got, m = outcome(tmp_path)
    assert got == expected
    save_checkpoint(m, tmp_path)  # the next save removes what the killed one left
    assert_only_the_index_and_its_files(tmp_path)
    assert outcome(tmp_path)[0] == expected


@pytest.mark.parametrize("point", ["written", "drafted"])
def test_a_first_save_killed_before_its_commit_is_refused(tmp_path, point):
    kill_mid_save(tmp_path, point, has_old=False)
    got, m = outcome(tmp_path)
    assert got == "incomplete"
    assert any(f.startswith("rank") for f in os.listdir(tmp_path))  # its files are there
    save_checkpoint(m, tmp_path)
    assert_only_the_index_and_its_files(tmp_path)


def test_a_save_over_an_unreadable_index_replaces_it(tmp_path):
    """An index this save cannot read: nothing is removed before the commit, all after."""
    save_checkpoint(module_of(values(OLD)), tmp_path)
    (tmp_path / "dtorch.index.json").write_text("{nope")
    save_checkpoint(module_of(values(NEW)), tmp_path)
    assert_only_the_index_and_its_files(tmp_path)
    assert outcome(tmp_path)[0] == "new"


@pytest.mark.parametrize("delay", [0.0, 0.5, 1.0])
def test_killed_after_a_delay_loads_old_or_new(tmp_path, delay):
    """(The delay: that many times an earlier save's duration after the new one began.)"""
    kill_mid_save(tmp_path, "go", delay=delay)
    assert outcome(tmp_path)[0] in ("old", "new")


# -- a full disk (a tiny tmpfs in a mount namespace of its own) -------------------------------

FULL_DISK = CLIENT_PRELUDE + """
import errno
from dtorch.checkpoint import load_checkpoint, save_checkpoint
from test_checkpoint_commit import NEW, OLD, module_of, outcome, values

directory = sys.argv[1]
save_checkpoint({k: module_of(values(OLD)).state_dict()[k] for k in ["c"]}, directory)
before, free = sorted(os.listdir(directory)), os.statvfs(directory).f_bfree
try:
    save_checkpoint(module_of(values(NEW)), directory)
    error = None
except OSError as e:
    error = [e.errno, str(e)]
after, free_after = sorted(os.listdir(directory)), os.statvfs(directory).f_bfree
c = dtorch.from_torch(torch.zeros(128, 256), dtorch.DeviceMesh("cpu", [0, 1, 2, 3]), [Replicate()])
m = dtorch.nn.Module()
m.c = dtorch.nn.Parameter(c)
load_checkpoint(m, directory)
old_loads = torch.equal(m.c.to_torch(), values(OLD)["c"])
works = (m.c * 2).sum().item() == 2 * values(OLD)["c"].sum().item()
report(error=error, before=before, after=after, freed=free_after == free, old_loads=old_loads,
       usable=works)
"""


def namespaced_tmpfs(size: str, probe_at) -> list | None:
    """The command prefix that runs a program with a tmpfs of ``size`` mounted on its first
    argument, in a mount namespace of its own (as root, or as a user through a user
    namespace), or None where neither is allowed (tried on the empty directory
    ``probe_at``)."""
    if shutil.which("unshare") is None:
        return None
    mount = f'mount -t tmpfs -o size={size} tmpfs "$1" && shift && exec "$@"'
    for flags in (["-m"], ["-Urm"]):
        prefix = ["unshare", *flags, "sh", "-c", mount, "sh"]
        probe = subprocess.run([*prefix, str(probe_at), "true"], capture_output=True,
                               timeout=30, check=False)
        if probe.returncode == 0:
            return prefix
    return None


def test_a_full_disk_raises_frees_what_it_wrote_and_keeps_the_old(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    prefix = namespaced_tmpfs("1m", mount)
    if prefix is None:
        pytest.skip("no mount namespace for a tmpfs here (needs root or user namespaces)")
    proc = subprocess.run([*prefix, str(mount), sys.executable, "-c", FULL_DISK, str(mount)],
                          capture_output=True, text=True, timeout=180, cwd=TESTS_DIR, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"no result ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    r = json.loads(lines[-1][len("RESULT "):])
    assert r["error"] is not None and r["error"][0] == 28, r  # ENOSPC
    assert f"could not write the checkpoint {mount}" in r["error"][1]
    assert r["after"] == r["before"] and r["freed"], r  # no temporaries, no space held
    assert r["old_loads"] and r["usable"]
    assert os.listdir(mount) == []  # (the tmpfs was the namespace's alone)


# -- async saves ------------------------------------------------------------------------------


def overwrite(m: dtorch.nn.Module, seed: int) -> None:
    """Every parameter written in place with another state's values (an optimizer step)."""
    for key, value in values(seed).items():
        p = getattr(m, key)
        with torch.no_grad():
            p.copy_(dtorch.from_torch(value, p.device_mesh) if isinstance(p, dtorch.Tensor)
                    else value)


def test_an_async_save_writes_the_values_of_its_call(tmp_path):
    """The program goes on at once and changes every parameter in place; the checkpoint holds
    the values the save was called with (the devices copied them first), and the commit is the
    same as a save's."""
    save_checkpoint(module_of(values(OLD)), tmp_path)
    m = module_of(values(NEW))
    future = save_checkpoint(m, tmp_path, async_=True)
    overwrite(m, OLD + 7)
    assert future.result() == str(tmp_path / "dtorch.index.json")
    assert outcome(tmp_path)[0] == "new"
    assert_only_the_index_and_its_files(tmp_path)
    assert torch.equal(m.a.to_torch(), values(OLD + 7)["a"])  # (the program's own writes)


def test_async_saves_wait_for_each_other_and_loads_for_them(tmp_path):
    first = save_checkpoint(module_of(values(OLD)), tmp_path, async_=True)
    second = save_checkpoint(module_of(values(NEW)), tmp_path, async_=True)
    assert first.done()  # the second waited for the first before it began
    assert outcome(tmp_path)[0] == "new"  # the load waited for the second
    assert second.result() == first.result()
    assert_only_the_index_and_its_files(tmp_path)


@pytest.mark.parametrize("waited", [True, False])
def test_a_failed_async_save_raises_at_result_or_at_the_next_save(tmp_path, monkeypatch,
                                                                   waited):
    save_checkpoint(module_of(values(OLD)), tmp_path)
    before = sorted(os.listdir(tmp_path))
    monkeypatch.setattr(commit, "new_save_id", lambda: "0123456789ab")
    (tmp_path / "rank00001-mesh0-0123456789ab.safetensors").mkdir()  # device 1's write fails
    future = save_checkpoint(module_of(values(NEW)), tmp_path, async_=True)
    monkeypatch.undo()
    with pytest.raises(IsADirectoryError, match=f"could not write the checkpoint {tmp_path}"):
        future.result() if waited else save_checkpoint(module_of(values(NEW)), tmp_path)
    os.rmdir(tmp_path / "rank00001-mesh0-0123456789ab.safetensors")
    assert sorted(os.listdir(tmp_path)) == before and outcome(tmp_path)[0] == "old"
    save_checkpoint(module_of(values(NEW)), tmp_path)  # the runtime and the directory go on
    assert outcome(tmp_path)[0] == "new"


def test_an_async_save_writes_on_streams_of_its_own(tmp_path):
    """The snapshot's copies and the files' writes run on the checkpoint's graph, whose streams
    are not the program's: the program's kernels do not queue behind the writes."""
    m = module_of(values(NEW))
    x = dtorch.from_torch(torch.rand(256, 256), m.a.device_mesh, [Replicate()])
    with dtorch.profiler.profile() as prof:
        future = save_checkpoint(m, tmp_path, async_=True)
        for _ in range(4):
            x = x @ x * 0.01
        future.result()
        dtorch.sync()
    events = [e for e in prof.kernels() if e["pid"] == 0]
    streams = {n: {e["tid"] for e in events if n in e["name"].split("+")}
               for n in ("write_safetensors", "matmul", "copy_", "step:chunk")}
    assert streams["write_safetensors"] and streams["matmul"]
    # the copies: copy_ of the sharded tensors, the chunk of the replicated one ("c", which
    # its devices write a share each of), with the writes, on the checkpoint's stream only
    assert streams["write_safetensors"] == streams["copy_"] == streams["step:chunk"]
    assert not streams["write_safetensors"] & streams["matmul"]
