"""``moe-sidecar doctor``: whether a sidecar can do its job, every check one line.

The checks, in order: the configuration the sidecar reads (flags over the
same ``MOE_SIDECAR_*`` environment as ``serve``), whether the target answers
the coordinator's calls, whether it is serving (gRPC health), whether the
state directory is writable, and whether the store is up (the node's
SQLite; etcd too with ``--store etcd://``). Run where the sidecar runs
(``kubectl exec``, a container's probe), it finds the socket, the state and
the store from that environment, with no flags.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from moe_sidecar.config import ConfigError, SidecarConfig, SqliteStore
from moe_sidecar.core.defaults import DEFAULT_TARGET
from moe_sidecar.etcd.client import EtcdClient
from moe_sidecar.etcd.errors import EtcdError
from moe_sidecar.etcd.url import EtcdTarget, EtcdUrlError
from moe_sidecar.servicer import SERVICE_NAME
from moe_sidecar.store.sqlite import DATABASE_FILE, SCHEMA_VERSION
from moe_workspace.v1 import coordinator_pb2 as pb
from moe_workspace.v1 import coordinator_pb2_grpc as pb_grpc

__all__ = [
    "Check",
    "checks_as_json",
    "diagnose",
    "format_checks",
    "not_a_coordinator",
]


@dataclass(frozen=True)
class Check:
    """One check's outcome: its name, whether it holds, and what was found."""

    name: str
    ok: bool
    detail: str


def not_a_coordinator(channel: grpc.Channel, target: str, details: str) -> str:
    """What to say of a target that answers gRPC but serves no coordinator:
    the sidecar's health port when it answers health checks (the health
    port serves those and reflection only), else another gRPC server."""
    try:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2.0)
    except grpc.RpcError:
        what = "a gRPC server that is not a moe-sidecar coordinator"
    else:
        what = "the sidecar's health port (--health-port), which serves only health checks"
    return (
        f"{target}: UNIMPLEMENTED ({details}): this is {what}; give --target an address the "
        f"sidecar's --listen serves (default {DEFAULT_TARGET})"
    )


def _rpc_failure(error: grpc.RpcError, channel: grpc.Channel, target: str) -> str:
    code = error.code() if isinstance(error, grpc.Call) else None
    details = error.details() if isinstance(error, grpc.Call) else str(error)
    if code is grpc.StatusCode.UNIMPLEMENTED:
        return not_a_coordinator(channel, target, details or "")
    return f"{target}: {code.name if code else 'error'}: {details}"


def _answers(channel: grpc.Channel, target: str, timeout: float) -> Check:
    started = time.monotonic()
    try:
        reply = pb_grpc.WorkspaceCoordinatorStub(channel).ListGroups(
            pb.ListGroupsRequest(page_size=1), timeout=timeout
        )
    except grpc.RpcError as error:
        return Check("answers", False, _rpc_failure(error, channel, target))
    more = " or more" if reply.next_page_token else ""
    return Check(
        "answers",
        True,
        f"{target} answered ListGroups in {(time.monotonic() - started) * 1e3:.1f} ms "
        f"({len(reply.groups)}{more} group(s) on its first page)",
    )


def _serving(channel: grpc.Channel, target: str, timeout: float) -> Check:
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=timeout
        )
    except grpc.RpcError as error:
        return Check("serving", False, _rpc_failure(error, channel, target))
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    ok = reply.status == health_pb2.HealthCheckResponse.SERVING
    why = "" if ok else " (starting, or draining for a shutdown)"
    return Check("serving", ok, f"gRPC health of {SERVICE_NAME}: {status}{why}")


def _state_dir(path: Path) -> Check:
    where = path.absolute()
    if not path.is_dir():
        return Check("state dir", False, f"{where}: no such directory (serve creates it)")
    try:
        # A file written and removed, not os.access: a read-only mount or a
        # full disk answers access() with yes.
        with tempfile.NamedTemporaryFile(dir=path, prefix=".doctor-"):
            pass
    except OSError as error:
        return Check("state dir", False, f"{where}: not writable by uid {os.getuid()}: {error}")
    return Check("state dir", True, f"{where}: writable by uid {os.getuid()}")


def _sqlite(state_dir: Path) -> Check:
    database = (state_dir / DATABASE_FILE).absolute()
    if not database.is_file():
        return Check("store", False, f"SQLite {database}: no database yet (serve creates it)")
    try:
        with contextlib.closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True)) as db:
            version = db.execute("PRAGMA user_version").fetchone()[0]
            groups = db.execute("SELECT count(*) FROM groups").fetchone()[0]
    except sqlite3.Error as error:
        return Check("store", False, f"SQLite {database}: cannot read it: {error}")
    if version != SCHEMA_VERSION:
        return Check(
            "store",
            False,
            f"SQLite {database}: schema {version}, this sidecar reads {SCHEMA_VERSION}",
        )
    return Check("store", True, f"SQLite {database}: readable, {groups} group(s)")


async def _etcd_answers(target: EtcdTarget, seconds: float) -> None:
    async with EtcdClient.from_target(target) as client:
        await client.revision_of(target.prefix, timeout=seconds)


def _etcd(target: EtcdTarget, timeout: float) -> Check:
    where = f"etcd {','.join(target.endpoints)} (prefix {target.prefix})"
    try:
        asyncio.run(_etcd_answers(target, timeout))
    except (EtcdError, EtcdUrlError) as error:
        return Check("cluster store", False, f"{where}: {error}")
    return Check("cluster store", True, f"{where}: answered")


def diagnose(
    channel: grpc.Channel, target: str, config: SidecarConfig | ConfigError, timeout: float
) -> list[Check]:
    """Every check against the sidecar at ``target`` (over ``channel``) and the
    state and store ``config`` names; a refused configuration fails the
    checks that need it."""
    checks = [_answers(channel, target, timeout), _serving(channel, target, timeout)]
    if isinstance(config, ConfigError):
        refused = "not checked: the configuration is refused (above)"
        return [
            Check("config", False, str(config)),
            *checks,
            Check("state dir", False, refused),
            Check("store", False, refused),
        ]
    store = config.store_target
    described = "sqlite" if isinstance(store, SqliteStore) else config.store.split("?")[0]
    checks.insert(0, Check("config", True, f"state dir {config.state_dir}, store {described}"))
    checks += [_state_dir(config.state_dir), _sqlite(config.state_dir)]
    if isinstance(store, EtcdTarget):
        checks.append(_etcd(store, timeout))
    return checks


def format_checks(checks: list[Check]) -> str:
    """One line per check: ``ok`` or ``FAIL``, its name, what was found."""
    return "".join(f"{'ok' if c.ok else 'FAIL':<4}  {c.name}: {c.detail}\n" for c in checks)


def checks_as_json(target: str, checks: list[Check]) -> dict[str, Any]:
    """The ``--json`` object: whether all hold, the target, and each check."""
    return {
        "ok": all(c.ok for c in checks),
        "target": target,
        "checks": [asdict(c) for c in checks],
    }
