"""Counts the project's import arrows and floors, read from the source with ``ast``.

A module's floor is one more than the highest floor among the project modules
it imports (lazy imports inside functions too); a module importing none is
on floor 0. Module names are the installed ones, from pyproject's
``package-dir`` (generated code excluded). Prints the number of modules,
arrows and floors, the client manager's floor, the arrows from the client to
the daemon and back (both must be 0: the client reaches only the core, the
wire and itself), and the longest chain.

    python scripts/import_floors.py [REPOSITORY]   # default: this checkout

``tests/unit/test_import_graph.py`` reads the graph with this script's
:func:`modules` and :func:`imports`.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from functools import cache
from pathlib import Path

SHARED = ("moe_sidecar.core", "moe_sidecar.wire", "moe_sidecar.flashinfer", "moe_sidecar.client")


def modules(root: Path) -> dict[str, Path]:
    """Installed module name -> source file (generated code excluded)."""
    table = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    found: dict[str, Path] = {}
    for name, directory in table["package-dir"].items():
        if name == "moe_workspace":
            continue
        for path in (root / directory).rglob("*.py"):
            parts = [p for p in path.relative_to(root / directory).with_suffix("").parts]
            dotted = ".".join([name, *(p for p in parts if p != "__init__")])
            # A directory mapped on its own (moe_sidecar.client) wins over its parent's walk.
            if dotted not in found or str(directory) in str(path.parent):
                found[dotted] = path
    return found


def imports(path: Path, *, top_level: bool = False) -> set[str]:
    """Module names imported in ``path``: anywhere (lazy imports too), or only
    at module level (what importing the module runs)."""
    found: set[str] = set()
    tree = ast.parse(path.read_text())
    for node in tree.body if top_level else ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def arrows(found: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports (a package face's own children excluded)."""
    return {
        name: {
            m for m in imports(path) if m in found and m != name and not name.startswith(m + ".")
        }
        for name, path in found.items()
    }


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent.parent
    edges = arrows(modules(root))

    @cache
    def floor(name: str) -> int:
        return 1 + max((floor(m) for m in edges[name]), default=-1)

    floors = {name: floor(name) for name in edges}
    client_to_daemon = sum(
        1
        for name, targets in edges.items()
        if name.startswith("moe_sidecar.client")
        for m in targets
        if not m.startswith(SHARED) and m != "moe_sidecar"
    )
    daemon_to_client = sum(
        1
        for name, targets in edges.items()
        if not name.startswith("moe_sidecar.client")
        for m in targets
        if m.startswith("moe_sidecar.client")
    )
    chain = [max(floors, key=floors.__getitem__)]
    while edges[chain[-1]]:
        chain.append(max(edges[chain[-1]], key=floors.__getitem__))
    print(
        f"modules {len(edges)}, arrows {sum(map(len, edges.values()))}, floors {max(floors.values()) + 1}"
    )
    print(f"moe_sidecar.client.manager on floor {floors.get('moe_sidecar.client.manager')}")
    print(f"arrows client -> daemon {client_to_daemon}, daemon -> client {daemon_to_client}")
    print("longest chain: " + " -> ".join(chain))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
