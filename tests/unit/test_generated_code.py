"""The generated wire code must match what scripts/generate_proto.py makes now."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(60)


def _load_generator():
    spec = importlib.util.spec_from_file_location(
        "generate_proto", ROOT / "scripts" / "generate_proto.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    generated = _load_generator().generate(tmp_path)
    assert any(p.name == "coordinator_pb2_grpc.py" for p in generated)
    stale = [
        str(rel)
        for rel in generated
        if not (ROOT / "proto" / rel).exists()
        or (ROOT / "proto" / rel).read_bytes() != (tmp_path / rel).read_bytes()
    ]
    assert not stale, f"stale generated code, run: python scripts/generate_proto.py ({stale})"


def test_no_unexpected_files_beside_the_generated_code() -> None:
    package = ROOT / "proto" / "moe_workspace" / "v1"
    names = {p.name for p in package.iterdir() if p.is_file()}
    assert names == {
        "__init__.py",
        "coordinator.proto",
        "coordinator_pb2.py",
        "coordinator_pb2.pyi",
        "coordinator_pb2_grpc.py",
        "coordinator_pb2_grpc.pyi",
    }
