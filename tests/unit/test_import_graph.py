"""The shape of the import graph: no circles, a pure core, a torch-free sidecar.

Read from the source with ``ast`` (nothing is imported), under the installed
names that pyproject's package-dir gives the directories.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.scripts import load_script

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parents[2]

IMPURE = ("grpc", "asyncio", "time", "torch", "flashinfer", "sqlite3", "socket", "threading")


GRAPH = load_script("import_floors")
MODULES: dict[str, Path] = GRAPH.modules(ROOT)

PURE_CORE = (
    "moe_sidecar",  # the package itself: importing moe_sidecar.core.plan runs it first
    *sorted(name for name in MODULES if name.startswith("moe_sidecar.core")),
)
"""The decision core: frozen values in, a step out; time is an argument."""


def _imports(path: Path, *, top_level: bool = False) -> set[str]:
    found: set[str] = GRAPH.imports(path, top_level=top_level)
    return found


def _project_edges() -> dict[str, set[str]]:
    return {
        name: {m for m in _imports(path) if m in MODULES and m != name}
        for name, path in MODULES.items()
    }


def test_the_layout_maps_to_the_installed_names() -> None:
    assert "moe_sidecar.core.policy" in MODULES and "moe_sidecar.client.manager" in MODULES
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
    allowed = {*PURE_CORE, "moe_sidecar.core.errors"}
    project = {m for m in _imports(MODULES[module]) if m in MODULES}
    assert project <= allowed, f"{module} imports {project - allowed}"


def test_the_sidecar_imports_neither_torch_nor_the_client() -> None:
    for name, path in MODULES.items():
        if name.startswith("moe_sidecar.client"):
            continue
        imported = _imports(path)
        assert not {m for m in imported if m.split(".")[0] in ("torch", "flashinfer")}, name
        # Not even lazily: the client's tools add their commands through entry points.
        reached = {m for m in imported if m.startswith("moe_sidecar.client")}
        assert not reached, f"{name} imports {reached}"


def test_the_client_reaches_only_the_core_the_wire_the_releases_and_itself() -> None:
    shared = (
        "moe_sidecar.core",
        "moe_sidecar.wire",
        "moe_sidecar.flashinfer",
        "moe_sidecar.client",
    )
    for name, path in MODULES.items():
        if not name.startswith("moe_sidecar.client"):
            continue
        project = {m for m in _imports(path) if m in MODULES and m != "moe_sidecar"}
        daemon = {m for m in project if not m.startswith(shared)}
        assert not daemon, f"{name} imports the daemon's {daemon}"


def test_the_wire_reaches_only_the_core_and_the_releases() -> None:
    # The releases' table gives the workspace bytes a plan shows on the wire.
    inside = ("moe_sidecar.core", "moe_sidecar.flashinfer", "moe_sidecar.wire")
    for name, path in MODULES.items():
        if not name.startswith("moe_sidecar.wire"):
            continue
        project = {m for m in _imports(path) if m in MODULES and m != "moe_sidecar"}
        outside = {m for m in project if not m.startswith(inside)}
        assert not outside, f"{name} imports {outside}"


CODEC = "moe_sidecar.wire.codec"


def test_the_codec_is_imported_from_its_package_face_only() -> None:
    # One codec for the wire: its modules are split by job, not by caller.
    outside = {
        path: {m for m in _imports(path) if m.startswith(CODEC + ".") and m in MODULES}
        for path in (
            *(p for n, p in MODULES.items() if not n.startswith(CODEC)),
            *(p for d in ("tests", "bench", "scripts") for p in (ROOT / d).rglob("*.py")),
        )
    }
    reaching = {str(path.relative_to(ROOT)): sorted(m) for path, m in outside.items() if m}
    assert reaching == {}, f"import from {CODEC} itself: {reaching}"


STATE_PARTS = (
    "moe_sidecar.step_executor",
    "moe_sidecar.group_reads",
    "moe_sidecar.admin_calls",
    "moe_sidecar.stored_groups",
)
"""Jobs moved out of the state holder: it holds them, never the reverse."""


@pytest.mark.parametrize("module", ["moe_sidecar.state", *STATE_PARTS])
def test_the_state_holder_and_its_parts_reach_neither_grpc_nor_the_wire(module: str) -> None:
    # Servicers convert at the boundary; the state holder speaks the domain.
    imported = _imports(MODULES[module])
    outside = {
        m
        for m in imported
        if m.split(".")[0] == "grpc"
        or m.startswith(("moe_sidecar.wire", "moe_sidecar.servicer", "moe_workspace"))
    }
    assert not outside, f"{module} imports {outside}"
    if module in STATE_PARTS:
        assert "moe_sidecar.state" not in imported, f"{module} imports the state holder"


RELEASE_ROOM = sorted(name for name in MODULES if name.startswith("moe_sidecar.flashinfer"))
"""Each FlashInfer release's module and their table."""


@pytest.mark.parametrize("module", RELEASE_ROOM)
def test_the_release_room_imports_only_the_core_and_the_standard_library(module: str) -> None:
    imported = _imports(MODULES[module])
    project = {m for m in imported if m in MODULES and m != "moe_sidecar"}
    outside = {
        m for m in project if not m.startswith(("moe_sidecar.core", "moe_sidecar.flashinfer"))
    }
    assert not outside, f"{module} imports {outside}"
    others = {
        m.split(".")[0] for m in imported if m.split(".")[0] not in ("moe_sidecar", "__future__")
    }
    assert others <= sys.stdlib_module_names, f"{module} imports {others - sys.stdlib_module_names}"


def test_the_core_reaches_no_release() -> None:
    # The core takes the size function; it holds no release's arithmetic.
    for module in PURE_CORE[1:]:
        reached = {m for m in _imports(MODULES[module]) if m.startswith("moe_sidecar.flashinfer")}
        assert not reached, f"{module} imports {reached}"


ENGINES = "moe_sidecar.client.engines"

PACKAGE_FACES = frozenset({"moe_sidecar.client"})
"""Package faces whose public names an engine's room holds: they name the
room's module for type checkers only and load it on first use (lazy_names)."""

ENGINE_TOOLS = frozenset({"moe_sidecar.client.size.command"})
"""Tools that answer for an engine by name (``size --engine``): they load the
room's pure sizing when the command runs, never at import."""

BORROWED_FROM_VLLM_SIZING = frozenset(
    {
        ("moe_sidecar.client.dispatch_layouts", "describe_activation"),
        ("moe_sidecar.client.backends.reference_moe_ep", "dispatch_format_name"),
    }
)
"""Two readers of vLLM's call forms that engine-neutral modules still take
from vLLM's sizing (``moe_sidecar.client.engines.vllm.sizing``): a
``QuantFormat``'s name, refused with vLLM's keyword hints, and the 0.33
description of a row size. Each pair is checked to be still needed, so the
list only shrinks."""


def _engine_imports(path: Path) -> set[tuple[str, str | None]]:
    """``(module, name)`` of each import of an engine's room in ``path``
    (``name`` None: ``import module``)."""
    found: set[tuple[str, str | None]] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update((a.name, None) for a in node.names if a.name.startswith(ENGINES))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.startswith(ENGINES):
                found.update((node.module, a.name) for a in node.names)
            elif node.module == "moe_sidecar.client":
                found.update(
                    (f"{node.module}.engines", None) for a in node.names if a.name == "engines"
                )
    return found


def test_engines_import_the_manager_never_the_reverse() -> None:
    borrowed: set[tuple[str, str | None]] = set()
    for name, path in MODULES.items():
        if name.startswith(ENGINES) or name in PACKAGE_FACES | ENGINE_TOOLS:
            continue
        for module, imported in _engine_imports(path):
            if module == f"{ENGINES}.vllm.sizing" and (name, imported) in BORROWED_FROM_VLLM_SIZING:
                borrowed.add((name, imported))
                continue
            pytest.fail(f"{name} imports {module}.{imported or ''}: only engines' rooms may")
    assert borrowed == BORROWED_FROM_VLLM_SIZING, "drop the pairs no module needs any more"
    rooms = {n.split(".")[3] for n in MODULES if n.startswith(ENGINES + ".")}
    assert rooms, "no engine's room"
    for room in sorted(rooms):
        reached = set().union(
            *(_imports(p) for n, p in MODULES.items() if n.startswith(f"{ENGINES}.{room}"))
        )
        assert "moe_sidecar.client.manager" in reached, f"{room}'s room is not on the manager"


def test_the_round_decisions_hold_no_workspace_and_reach_no_manager() -> None:
    # They read the plan held through a function and build through the
    # manager's: importing what holds or builds would put them above it.
    reached = _imports(MODULES["moe_sidecar.client.round_decisions"])
    holding = {
        "moe_sidecar.client.manager",
        "moe_sidecar.client.held_workspace",
        "moe_sidecar.client.backends",
        "moe_sidecar.client.first_round",
    }
    assert not reached & holding, f"round_decisions imports {reached & holding}"


def test_the_face_loads_an_engine_room_only_lazily() -> None:
    # What importing the package face runs names no room's module.
    at_import = _imports(MODULES["moe_sidecar.client"], top_level=True)
    assert not {m for m in at_import if m.startswith(ENGINES)}


def test_nothing_under_the_core_names_vllm() -> None:
    # The core serves every engine: vLLM's facts live in its room.
    naming = [
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "sidecar" / "core").rglob("*.py"))
        if "vllm" in path.read_text().lower()
    ]
    assert naming == []


@pytest.mark.parametrize(
    "module",
    [
        "moe_sidecar.client",
        "moe_sidecar.client.sizing",
        "moe_sidecar.client.engines",
        "moe_sidecar.client.engines.vllm",
        "moe_sidecar.client.engines.vllm.sizing",
        "moe_sidecar.client.engines.vllm.naming",
        "moe_sidecar.client.engines.vllm.settings",
        "moe_sidecar.client.layer_need",
        "moe_sidecar.client.engine_rules",
        "moe_sidecar.client.naming",
        "moe_sidecar.client.errors",
        "moe_sidecar.client.prewarm.command",
        "moe_sidecar.client.simulate.command",
        "moe_sidecar.client.size.command",
        "moe_sidecar.client.size",
        "moe_sidecar.flashinfer",
        # The table of each release's all-to-all JIT module, which the
        # backends' cache report reads too.
        "moe_sidecar.client.prewarm.install",
        "moe_sidecar.cli",
    ],
)
def test_pure_parts_of_the_client_import_without_torch(module: str) -> None:
    # A real interpreter: what importing the module runs, package faces included.
    code = f"import sys, {module}; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0, module
