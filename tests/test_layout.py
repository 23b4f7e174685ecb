"""The package's shape stays legible: no import cycles, each role imports only what it may, and
the declared dependencies are enough to run the quickstart.

Roles: the client (``dtorch/__init__.py``, ``client/``) may import anything; the controller,
the hosts and the launcher (``controller/``, ``runtime/``, ``launcher/local.py`` and
``launcher/auth.py``) never import the client; ``tensor.py`` (the symbol) and ``ops/`` (registry entries, whose kernels the hosts run)
import no client module when they load: a front imports client state only when it is called.
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


def test_no_import_cycles():
    """Load-time imports form a DAG (a package imports its own submodules, which is not a
    cycle back into it: edges into a package's ``__init__`` from inside it are left out)."""
    edges = {m: {d for d in deps if not m.startswith(d + ".")}
             for m, deps in graph(top_level_only=True).items()}
    state, cycles = {}, []

    def visit(m, path):
        state[m] = "open"
        for d in sorted(edges[m]):
            if state.get(d) == "open":
                cycles.append(path[path.index(d):] + [d] if d in path else [m, d])
            elif d not in state:
                visit(d, path + [d])
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    assert cycles == []


RUNTIME_ROLES = ("dtorch.controller", "dtorch.runtime", "dtorch.launcher")
CLIENT = ("dtorch.client",)


def _is(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_runtime_roles_never_import_the_client():
    bad = {m: sorted(d for d in deps if _is(d, CLIENT) or d == "dtorch")
           for m, deps in graph(top_level_only=False).items() if _is(m, RUNTIME_ROLES)}
    assert {m: d for m, d in bad.items() if d} == {}


def test_the_launcher_never_imports_the_users_cluster_api():
    bad = {m: sorted(d for d in deps if _is(d, ("dtorch.cluster",)))
           for m, deps in graph(top_level_only=False).items() if _is(m, ("dtorch.launcher",))}
    assert {m: d for m, d in bad.items() if d} == {}


def test_symbol_registry_and_context_never_import_the_client():
    bad = {m: sorted(d for d in deps if _is(d, CLIENT) or d == "dtorch")
           for m, deps in graph(top_level_only=False).items()
           if m in ("dtorch.tensor", "dtorch.current") or _is(m, ("dtorch.ops",))}
    assert {m: d for m, d in bad.items() if d} == {}


def test_the_context_imports_no_layer_above_it():
    assert imports(MODULES["dtorch.current"], False) <= {"dtorch.mesh"}


def test_tensor_is_the_symbol_only():
    assert not any(_is(d, CLIENT) for d in imports(MODULES["dtorch.tensor"], False))


def test_a_host_process_loads_no_client_module():
    """What a host imports, measured: its modules under the bare package it boots with."""
    code = ("import sys, types; p = types.ModuleType('dtorch'); p.__path__ = [%r]; "
            "sys.modules['dtorch'] = p; import dtorch.runtime.host, dtorch.controller.main; "
            "print(sorted(m for m in sys.modules if m.startswith('dtorch')))" % str(PACKAGE))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    loaded = ast.literal_eval(out.strip())
    assert "dtorch.runtime.host" in loaded
    assert [m for m in loaded if _is(m, CLIENT)] == []


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


ROLES = {"client": ("dtorch.client",), "controller": ("dtorch.controller",),
         "runtime": ("dtorch.runtime",)}


def test_no_role_imports_another_roles_modules():
    """The client, the controller and the hosts meet only in shared modules (protocol, specs,
    placements, the registry, the launcher), never in each other's."""
    found = {}
    for module, deps in graph(top_level_only=False).items():
        for role, prefixes in ROLES.items():
            if _is(module, prefixes):
                others = [d for d in deps for r, p in ROLES.items() if r != role and _is(d, p)]
                if others:
                    found[module] = sorted(others)
    assert found == {}
