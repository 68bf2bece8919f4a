"""The generated wire code must match what scripts/generate_proto.py makes now."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(60)


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    generated = load_script("generate_proto").generate(tmp_path)
    names = {str(p) for p in generated}
    assert "moe_workspace/v1/coordinator_pb2_grpc.py" in names
    assert "moe_workspace/etcd/v3/rpc_pb2_grpc.py" in names
    stale = [
        str(rel)
        for rel in generated
        if not (ROOT / "proto" / rel).exists()
        or (ROOT / "proto" / rel).read_bytes() != (tmp_path / rel).read_bytes()
    ]
    assert not stale, f"stale generated code, run: python scripts/generate_proto.py ({stale})"


def _generated_for(*protos: str) -> set[str]:
    suffixes = (".proto", "_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")
    return {"__init__.py"} | {f"{proto}{suffix}" for proto in protos for suffix in suffixes}


@pytest.mark.parametrize(
    ("package", "expected"),
    [
        ("moe_workspace/v1", _generated_for("coordinator")),
        ("moe_workspace/etcd/v3", _generated_for("auth", "kv", "rpc")),
        ("moe_workspace/etcd", {"__init__.py"}),
        ("moe_workspace", {"__init__.py"}),
    ],
)
def test_no_unexpected_files_beside_the_generated_code(package: str, expected: set[str]) -> None:
    directory = ROOT / "proto" / package
    names = {p.name for p in directory.iterdir() if p.is_file()}
    assert names == expected


def test_etcd_stubs_keep_etcds_method_paths() -> None:
    """etcd routes by the full method name; ours must be etcd's, byte for byte."""
    from moe_workspace.etcd.v3 import rpc_pb2

    services = rpc_pb2.DESCRIPTOR.services_by_name
    paths = {
        f"/{service.full_name}/{method.name}"
        for service in services.values()
        for method in service.methods
    }
    assert {
        "/etcdserverpb.KV/Range",
        "/etcdserverpb.KV/Put",
        "/etcdserverpb.KV/DeleteRange",
        "/etcdserverpb.KV/Txn",
        "/etcdserverpb.KV/Compact",
        "/etcdserverpb.Watch/Watch",
        "/etcdserverpb.Maintenance/Status",
        "/etcdserverpb.Auth/Authenticate",
    } <= paths
    kv = rpc_pb2.RangeResponse.DESCRIPTOR.fields_by_name["kvs"].message_type
    assert kv is not None
    assert kv.full_name == "mvccpb.KeyValue"
