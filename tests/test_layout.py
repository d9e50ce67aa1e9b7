"""The package layout keeps its promises (docs/architecture.md): layers import only layers below
them, no import circles, and the flat package root holds only the public API.

Imports are read from the source (every ``import`` statement, also those inside
functions), so a circle hidden behind a deferred import counts as one.
"""

import ast
from pathlib import Path

import pytest

from .conftest import ROOT

pytestmark = pytest.mark.unit

PACKAGE = Path(ROOT) / "hpcddp"

# The layers from the bottom up (docs/architecture.md): a module imports its own layer or a
# lower one. runtime.lifecycle is init(), which composes the features, so it sits above them.
LEVELS = {
    "env": 0,
    "_requirements": 0,
    "comm": 1,
    "runtime": 2,
    "observe": 3,
    "torch_backend": 3,
    "ddp": 4,
    "reproducible": 4.5,
    "collectives": 5,
    "checkpoint": 6,
    "fault": 7,
    "elastic": 7.5,
    "runtime.lifecycle": 8,
    "hpcddp": 9,
    "horovod": 9,
    "_site": 9,
    "bench": 10,
    "cli": 11,
    "testing": 12,
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in PACKAGE.rglob("*.py")}


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The hpcddp modules ``name`` imports (a package's own submodules and re-exports included)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            # "from . import timeline" imports the module hpcddp.timeline, not only the package
            found.update(f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules)
    return {module for module in found if module in modules and module != name}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """Return one import circle as a list of modules, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_circles():
    modules = _modules()
    # A package's __init__ is imported before any of its modules; its own imports of
    # them are the package's public face, not a dependency of theirs on it.
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    for name in graph:
        graph[name] = {m for m in graph[name] if not name.startswith(m + ".")}
    circle = _cycle(graph)
    assert circle is None, "import circle: " + " -> ".join(circle)


def _layer(module: str) -> str:
    parts = module.split(".")
    if module == "hpcddp.runtime.lifecycle":
        return "runtime.lifecycle"
    return parts[1] if len(parts) > 1 else "hpcddp"


def test_layers_import_only_layers_below_them():
    modules = _modules()
    upward = []
    for name, path in sorted(modules.items()):
        layer = _layer(name)
        for imported in sorted(_imports(name, path, modules)):
            other = _layer(imported)
            if other != layer and LEVELS[other] >= LEVELS[layer] and not name.startswith(imported + "."):
                upward.append(f"{name} -> {imported}")
    assert not upward, "imports that climb (see LEVELS and docs/architecture.md):\n" + "\n".join(upward)


def test_package_root_holds_only_the_public_api():
    flat = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert flat == ["__init__.py", "_requirements.py"], f"modules belong in a folder of their concern: {flat}"


def test_module_paths_from_before_the_layout_still_import():
    import importlib

    timeline = importlib.import_module("hpcddp.timeline")
    assert callable(timeline.start) and callable(timeline.stop)
    import hpcddp
    from hpcddp.collectives import allreduce, barrier

    assert (allreduce, barrier) == (hpcddp.allreduce, hpcddp.barrier)
    # comm/mpi.py became the package comm/mpi/: its one public name keeps its path.
    from hpcddp.comm.mpi import MPICommunicator
    from hpcddp.comm.mpi.communicator import MPICommunicator as defined

    assert MPICommunicator is defined
