"""The package's shape stays legible, checked rather than hoped for: every import (function-level
ones too) is an edge of one declared table of layers (``LAYERS``: ARCHITECTURE's layering
written as data), the table points only downward, the modules form no import cycle, no file
outgrows 600 lines, no class name means two classes, a host boots without any client module, and
the declared dependencies are enough to run the quickstart.

``python tests/test_layout.py`` prints the graph between the layers as the code has it.
"""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "dtorch"


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: pathlib.Path, top_level_only: bool) -> set:
    """The dtorch modules ``path`` imports (at load time only, or anywhere)."""
    tree = ast.parse(path.read_text())
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("dtorch")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if not base.startswith("dtorch"):
                continue
            for alias in node.names:  # ``from . import session`` names a module
                candidate = f"{base}.{alias.name}"
                found.add(candidate if candidate in MODULES else base)
    return {m for m in found if m in MODULES}


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def graph(top_level_only: bool) -> dict:
    return {m: imports(p, top_level_only) for m, p in MODULES.items()}



# -- the layers, as data ------------------------------------------------------------------------
# Each layer and the layers it may import; a module belongs to the longest key that names it or
# its package. A layer may always import its own modules. ``dtorch`` as a target is the public
# API, which the layers above the client use as a user would (at call time: the package's own
# ``__init__`` imports them).
FOUNDATION = {"dtorch.config", "dtorch.logs", "dtorch.placement", "dtorch.type", "dtorch.spec",
              "dtorch.blocks"}
WIRE = FOUNDATION | {"dtorch.protocol", "dtorch.mesh"}
LAYERS = {
    # values every role shares: no sockets, no processes, no torch state
    "dtorch.config": set(),
    "dtorch.logs": set(),
    "dtorch.placement": set(),
    "dtorch.type": set(),
    "dtorch.memory_stats": set(),
    "dtorch.spec": {"dtorch.placement"},
    # torch's side of the sharding math: cutting and joining blocks
    "dtorch.blocks": {"dtorch.placement"},
    "dtorch.redistribute": {"dtorch.placement"},
    "dtorch.global_option": {"dtorch.config"},
    "dtorch.future": {"dtorch.logs"},
    "dtorch.protocol": {"dtorch.placement", "dtorch.spec"},
    "dtorch.mesh": {"dtorch.placement", "dtorch.spec"},
    # the calling thread's context (graphs, defaults, the session as an opaque handle)
    "dtorch.current": {"dtorch.mesh"},
    # the operator registry; the symbol; torch's operators (entries whose kernels hosts run)
    "dtorch.ops.registry": {"dtorch.protocol"},
    "dtorch.tensor": {"dtorch.ops.registry", "dtorch.placement"},
    "dtorch.ops": WIRE | {"dtorch.current", "dtorch.tensor", "dtorch.ops.registry"},
    # the runtime's helpers that the subsystems' kernels use (public names)
    "dtorch.runtime.collectives": {"dtorch.blocks", "dtorch.placement", "dtorch.spec"},
    "dtorch.runtime.cpu_memory": set(),
    # the public Graph (its memory fronts are kernels of cuda/)
    "dtorch.graph": {"dtorch.cuda.memory_kernels", "dtorch.current", "dtorch.future",
                     "dtorch.global_option", "dtorch.memory_stats", "dtorch.mesh"},
    # each subsystem's host kernels, registered as any operator is
    "dtorch.buckets": WIRE | {"dtorch.ops", "dtorch.ops.registry", "dtorch.runtime.collectives"},
    "dtorch.checkpoint.kernels": WIRE | {"dtorch.ops", "dtorch.ops.registry", "dtorch.tensor"},
    "dtorch.optim.kernels": WIRE | {"dtorch.ops", "dtorch.ops.registry"},
    "dtorch.cuda.memory_kernels": WIRE | {"dtorch.ops", "dtorch.ops.registry",
                                          "dtorch.runtime.cpu_memory"},
    # the fused operators' torch code, on torch tensors (DTorch's compiled_op)
    "dtorch.compiled_op": {"dtorch.ops"},
    "dtorch.cuda.nvtx_kernels": WIRE | {"dtorch.ops", "dtorch.ops.registry", "dtorch.current",
                                        "dtorch.graph"},
    # the one list of kernel modules a host imports
    "dtorch.kernels": {"dtorch.ops", "dtorch.buckets", "dtorch.checkpoint.kernels",
                       "dtorch.optim.kernels", "dtorch.cuda.memory_kernels",
                       "dtorch.cuda.nvtx_kernels"},
    # the runtime roles: the launcher starts them; the controller; the hosts
    "dtorch.launcher": WIRE,
    "dtorch.controller": WIRE | {"dtorch.launcher", "dtorch.redistribute"},
    "dtorch.runtime": WIRE | {"dtorch.launcher", "dtorch.kernels", "dtorch.ops",
                              "dtorch.ops.registry", "dtorch.runtime.collectives",
                              "dtorch.runtime.cpu_memory"},
    # the user's side: the cluster API, the client, the layers above it
    "dtorch.cluster": WIRE | {"dtorch.current", "dtorch.launcher"},
    "dtorch.client": WIRE | {"dtorch.cluster", "dtorch.current", "dtorch.future",
                             "dtorch.launcher", "dtorch.ops", "dtorch.ops.registry",
                             "dtorch.tensor"},
    "dtorch.autograd": WIRE | {"dtorch", "dtorch.buckets", "dtorch.client", "dtorch.tensor"},
    # steps replayed from their records (the optimizers give it their changing scalars)
    "dtorch.step_replay": WIRE | {"dtorch.client", "dtorch.tensor"},
    "dtorch.distributed_spec": WIRE | {"dtorch.graph"},
    "dtorch.cuda": {"dtorch.cuda.nvtx_kernels", "dtorch.current", "dtorch.graph"},
    "dtorch.profiler": {"dtorch.cuda", "dtorch.current", "dtorch.protocol"},
    "dtorch.nn": WIRE | {"dtorch", "dtorch.autograd", "dtorch.checkpoint.kernels", "dtorch.ops",
                         "dtorch.tensor"},
    # (the client: an async save's snapshot copy is a redistribute on a graph of its own)
    "dtorch.checkpoint": WIRE | {"dtorch", "dtorch.checkpoint.kernels", "dtorch.client",
                                 "dtorch.nn", "dtorch.tensor"},
    "dtorch.optim": WIRE | {"dtorch", "dtorch.buckets", "dtorch.nn", "dtorch.optim.kernels",
                            "dtorch.step_replay", "dtorch.tensor"},
    "dtorch.amp": {"dtorch.nn", "dtorch.tensor"},
    # training that survives lost devices: snapshots through checkpoints, a new mesh, again
    "dtorch.elastic": WIRE | {"dtorch", "dtorch.checkpoint", "dtorch.optim", "dtorch.profiler",
                              "dtorch.tensor"},
    "dtorch.models": WIRE | {"dtorch", "dtorch.checkpoint", "dtorch.nn", "dtorch.tensor"},
    # checking and timing programs against torch, as a user would
    "dtorch.util": {"dtorch"},
}
PUBLIC_API = "dtorch"  # the package's __init__: it imports every layer


def layer_of(module: str) -> str:
    if module == PUBLIC_API:
        return PUBLIC_API
    parts = module.split(".")
    for n in range(len(parts), 1, -1):
        if ".".join(parts[:n]) in LAYERS:
            return ".".join(parts[:n])
    raise KeyError(f"{module} belongs to no layer of LAYERS: add it to the table")


def layer_graph() -> dict:
    """Layer -> the layers its modules import, as the code has it."""
    edges: dict = {}
    for module, deps in graph(top_level_only=False).items():
        here = layer_of(module)
        edges.setdefault(here, set()).update(layer_of(d) for d in deps if layer_of(d) != here)
    return edges


def test_every_module_belongs_to_a_layer_and_every_layer_has_modules():
    assert {m: layer_of(m) for m in MODULES}  # (raises, naming the module, when one has none)
    used = {layer_of(m) for m in MODULES}
    assert set(LAYERS) - used == set()


def test_every_import_is_an_edge_of_the_table():
    """Function-level imports included: a deferred import is a dependency all the same."""
    bad = {}
    for module, deps in graph(top_level_only=False).items():
        here = layer_of(module)
        if here == PUBLIC_API:
            continue
        wrong = sorted(d for d in deps
                       if layer_of(d) != here and layer_of(d) not in LAYERS[here])
        if wrong:
            bad[module] = wrong
    assert bad == {}


def _cycles(edges: dict) -> list:
    state, cycles = {}, []

    def visit(m, path):
        state[m] = "open"
        for d in sorted(edges.get(m, ())):
            if state.get(d) == "open":
                cycles.append(path[path.index(d):] + [d])
            elif d not in state:
                visit(d, path + [d])
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    return cycles


def test_the_table_points_only_downward():
    """The table is a DAG (leaving out the public API, which the layers above the client call
    as a user would): every layer is below the ones that may import it."""
    assert _cycles({k: v - {PUBLIC_API} for k, v in LAYERS.items()}) == []


def test_no_import_cycles():
    """Every import, function-level ones included, forms a DAG of modules. (A package importing
    its own submodules is not a cycle back into it: edges into a package's ``__init__`` from
    inside it are left out, and so is a module's import of itself under ``python -m``.)"""
    edges = {m: {d for d in deps if d != m and not m.startswith(d + ".")}
             for m, deps in graph(top_level_only=False).items()}
    assert _cycles(edges) == []


def test_no_file_over_600_lines():
    lines = {m: len(p.read_text().splitlines()) for m, p in MODULES.items()}
    assert {m: n for m, n in lines.items() if n > 600} == {}


def test_no_class_name_means_two_classes():
    where: dict = {}
    for m, p in MODULES.items():
        for node in ast.parse(p.read_text()).body:
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(m)
    assert {name: ms for name, ms in where.items() if len(ms) > 1} == {}


def test_a_host_process_loads_no_client_module():
    """What a host imports, measured: its modules under the bare package it boots with."""
    code = ("import sys, types; p = types.ModuleType('dtorch'); p.__path__ = [%r]; "
            "sys.modules['dtorch'] = p; import dtorch.runtime.host, dtorch.controller.main; "
            "print(sorted(m for m in sys.modules if m.startswith('dtorch')))" % str(PACKAGE))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    loaded = ast.literal_eval(out.strip())
    assert "dtorch.runtime.host" in loaded
    assert [m for m in loaded if layer_of(m) == 'dtorch.client'] == []


def _registered(code: str) -> list:
    code += "; from dtorch.ops.registry import REGISTRY; print(sorted(REGISTRY))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    return ast.literal_eval(out.strip().splitlines()[-1])


def test_a_host_registers_every_kernel_the_client_does():
    """The host's one list of kernel modules (``dtorch/kernels.py``) is the client's registry."""
    host = _registered("import sys, types; p = types.ModuleType('dtorch'); p.__path__ = [%r]; "
                       "sys.modules['dtorch'] = p; import dtorch.runtime.host" % str(PACKAGE))
    assert host == _registered("import dtorch")


# -- declared dependencies --------------------------------------------------------------------


def _requirement_names(dist: str) -> set:
    """``dist`` and everything it requires, transitively (extras' requirements left out)."""
    seen, todo = set(), [dist]
    while todo:
        name = re.split(r"[\s\[<>=!~;]", todo.pop(), maxsplit=1)[0].lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [r for r in requires if "extra ==" not in r]
    return seen


def _only_declared(tmp: pathlib.Path, names: set) -> pathlib.Path:
    """A directory of links to the installed top-level modules of the distributions ``names``:
    a site-packages as a fresh ``pip install .`` would have it."""
    site = tmp / "site"
    site.mkdir()
    for name in names:
        try:
            files = metadata.files(name) or []
        except metadata.PackageNotFoundError:
            continue
        for f in files:
            top = f.parts[0]
            if top.endswith((".dist-info", ".pth")) or top.startswith(("__", "..")):
                continue
            src = pathlib.Path(f.locate()).parents[len(f.parts) - 1] / top
            dst = site / top
            if src.exists() and not dst.exists():
                dst.symlink_to(src)
    return site


@pytest.mark.timeout(120)
def test_declared_dependencies_run_the_quickstart(tmp_path):
    """The quickstart runs in an interpreter that sees only the standard library, this
    repository and the distributions dtorch declares (with what they require): a missing
    entry in ``[project.dependencies]`` (numpy, once) fails here, not on a user's fresh
    machine. (The runtime's own processes start from the usual interpreter.)"""
    declared = _requirement_names("dtorch")
    assert {"torch", "pyzmq", "msgpack", "numpy"} <= declared
    site = _only_declared(tmp_path, declared)
    script = ROOT / "examples" / "quickstart.py"
    boot = (f"import sys; sys.path[:0] = [{str(site)!r}, {str(ROOT)!r}]; sys.argv = "
            f"[{str(script)!r}]; exec(compile(open(sys.argv[0]).read(), sys.argv[0], 'exec'), "
            f"{{'__name__': '__main__'}})")
    run = subprocess.run([sys.executable, "-I", "-S", "-c", boot], capture_output=True,
                         text=True, cwd=tmp_path, timeout=110)
    assert run.returncode == 0, run.stderr[-3000:]


if __name__ == "__main__":
    for layer, deps in sorted(layer_graph().items()):
        print(f"{layer.removeprefix('dtorch.')} -> "
              + " ".join(sorted(d.removeprefix("dtorch.") for d in deps)))
    print("module cycles:", _cycles({m: {d for d in ds if d != m and not m.startswith(d + ".")}
                                     for m, ds in graph(top_level_only=False).items()}))
