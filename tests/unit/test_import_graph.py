"""The shape of the import graph: no circles, a pure core, a torch-free sidecar.

Read from the source with ``ast`` (nothing is imported), under the installed
names that pyproject's package-dir gives the directories.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parents[2]

PURE_CORE = (
    "moe_sidecar",  # the package itself: importing moe_sidecar.plan runs it first
    "moe_sidecar.plan",
    "moe_sidecar.group",
    "moe_sidecar.effects",
    "moe_sidecar.policy",
    "moe_sidecar.cluster",
    "moe_sidecar.limits",
    "moe_sidecar.sizing",
    "moe_sidecar.identity",
)
"""The decision core: frozen values in, a step out; time is an argument."""
IMPURE = ("grpc", "asyncio", "time", "torch", "flashinfer", "sqlite3", "socket", "threading")


def _modules() -> dict[str, Path]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        package_dirs = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    modules: dict[str, Path] = {}
    for name, directory in package_dirs.items():
        if name == "moe_workspace":
            continue  # generated code
        for path in (ROOT / directory).rglob("*.py"):
            parts = [p for p in path.relative_to(ROOT / directory).with_suffix("").parts]
            dotted = ".".join([name, *[p for p in parts if p != "__init__"]])
            # A directory mapped on its own (moe_sidecar.client) wins over its parent's walk.
            if dotted not in modules or str(directory) in str(path.parent):
                modules[dotted] = path
    return modules


MODULES = _modules()


def _imports(path: Path, *, top_level: bool = False) -> set[str]:
    """Module names imported in ``path``: anywhere (lazy imports too), or only
    at module level (what importing the module runs)."""
    found: set[str] = set()
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level else list(ast.walk(tree))
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _project_edges() -> dict[str, set[str]]:
    return {
        name: {m for m in _imports(path) if m in MODULES and m != name}
        for name, path in MODULES.items()
    }


def test_the_layout_maps_to_the_installed_names() -> None:
    assert "moe_sidecar.policy" in MODULES and "moe_sidecar.client.manager" in MODULES
    assert MODULES["moe_sidecar.client.manager"] == ROOT / "client" / "manager.py"
    assert not any(name.split(".")[0] in ("sidecar", "client") for name in MODULES)


def test_no_import_circles() -> None:
    edges = _project_edges()
    # A module's package __init__ importing the module back is not a circle.
    for name in edges:
        edges[name] = {m for m in edges[name] if not name.startswith(m + ".")}
    state: dict[str, int] = {}
    circles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                circles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for name in sorted(edges):
        if name not in state:
            visit(name, [name])
    assert circles == []


@pytest.mark.parametrize("module", PURE_CORE)
def test_the_core_is_pure(module: str) -> None:
    impure = {m for m in _imports(MODULES[module]) if m.split(".")[0] in IMPURE}
    assert impure == set(), f"{module} imports {impure}"
    # ... and reaches only other pure modules (and the typed errors) of the project.
    allowed = {*PURE_CORE, "moe_sidecar.errors"}
    project = {m for m in _imports(MODULES[module]) if m in MODULES}
    assert project <= allowed, f"{module} imports {project - allowed}"


def test_the_sidecar_imports_neither_torch_nor_the_client() -> None:
    for name, path in MODULES.items():
        if name.startswith("moe_sidecar.client"):
            continue
        imported = _imports(path)
        assert not {m for m in imported if m.split(".")[0] in ("torch", "flashinfer")}, name
        loaded = {m for m in _imports(path, top_level=True) if m.startswith("moe_sidecar.client")}
        assert not loaded, f"importing {name} imports {loaded}"
        # Only the command line reaches the client, inside the commands that need it.
        reached = {m for m in imported if m in MODULES and m.startswith("moe_sidecar.client")}
        if name != "moe_sidecar.cli":
            assert not reached, f"{name} imports {reached}"
