"""Shared helpers of the server tests: configs, requests and channels."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from moe_sidecar.config import SidecarConfig
from moe_sidecar.flashinfer.v0_7_2_post1 import capacities_workspace_bytes
from moe_sidecar.wire.codec import capacities_from_proto
from moe_workspace.v1 import coordinator_pb2 as pb
from moe_workspace.v1 import coordinator_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]

GROUP = "deepseek-v3:fp4/tp1-ep8/pp0"

EP_SIZE = 8


def token(name: str) -> str:
    """A lifetime token for ``name`` (ranks send a secret of at least 16 characters)."""
    return name if len(name) >= 16 else f"{name}:lifetime-token"


def capacities(
    tokens: int = 256,
    dispatch: int = 100,
    combine: int = 200,
    top_k: int = 2,
    num_experts: int = 16,
) -> pb.Capacities:
    """Wire capacities of a small layer (defaults: the NVFP4-like one)."""
    return pb.Capacities(
        max_tokens=tokens,
        dispatch_bytes_per_token=dispatch,
        combine_bytes_per_token=combine,
        top_k=top_k,
        num_experts=num_experts,
    )


def workspace_bytes(c: pb.Capacities, ep_size: int = EP_SIZE) -> int:
    """The workspace the sidecar derives for ``c`` (FlashInfer's formula)."""
    return capacities_workspace_bytes(capacities_from_proto(c), ep_size)


NVFP4 = pb.Requirement(capacities=capacities(), layer="l0")
BF16 = pb.Requirement(capacities=capacities(dispatch=400), layer="mtp")
NVFP4_BYTES = workspace_bytes(NVFP4.capacities)
BF16_BYTES = workspace_bytes(BF16.capacities)


def make_config(tmp_path: Path, **overrides: Any) -> SidecarConfig:
    """A server on a Unix socket in ``tmp_path`` and an ephemeral TCP port."""
    values: dict[str, Any] = {
        "listen": (f"unix://{tmp_path}/sidecar.sock", "127.0.0.1:0"),
        "health_port": 0,
        "metrics_port": 0,
        "state_dir": tmp_path / "state",
        "round_timeout": 10.0,
        "grace_period": 2.0,
    }
    values.update(overrides)
    return SidecarConfig(**values)


def owner_digest(group: str) -> str:
    """The owner digest the test's ranks of ``group`` send (of a fixed key)."""
    return hashlib.sha256(b"the test ranks' owner key" + group.encode()).hexdigest()


def propose_request(
    rank: int,
    rnd: int = 1,
    requirement: pb.Requirement | None = NVFP4,
    *,
    group: str = GROUP,
    ep_size: int = 8,
    local_ranks: int = 8,
    lifetime: str | None = None,
) -> pb.ProposeRequest:
    request = pb.ProposeRequest(
        group=group,
        ep_size=ep_size,
        ep_rank=rank,
        local_ranks=local_ranks,
        lifetime=token(lifetime if lifetime is not None else f"life-{rank}"),
        round=rnd,
        # As the group's real ranks do: every lifetime carries the group's
        # owner digest, so a restart inherits the stored plan.
        owner_digest=owner_digest(group),
    )
    if requirement is not None:
        request.requirement.CopyFrom(requirement)
    return request


@contextlib.asynccontextmanager
async def coordinator_stub(target: str) -> AsyncIterator[Any]:
    """An asyncio stub of the coordinator on ``target``."""
    async with grpc.aio.insecure_channel(target) as channel:
        yield pb_grpc.WorkspaceCoordinatorStub(channel)


async def rpc_error(call: Any) -> grpc.aio.AioRpcError:
    """Awaits ``call`` and returns the error it must fail with."""
    try:
        await call
    except grpc.aio.AioRpcError as error:
        return error
    raise AssertionError("the call succeeded but was expected to fail")


def details(error: grpc.aio.AioRpcError) -> str:
    """The status message of ``error`` (never None)."""
    return error.details() or ""


async def run_round(
    stub: Any,
    rnd: int,
    requirement: pb.Requirement,
    *,
    group: str,
    local_ranks: int,
    ep_size: int | None = None,
    lifetime: str = "life",
) -> list[pb.ProposeResponse]:
    """Every local rank proposes round ``rnd`` at once; returns their answers."""
    return list(
        await asyncio.gather(
            *(
                stub.Propose(
                    propose_request(
                        rank,
                        rnd,
                        requirement,
                        group=group,
                        ep_size=ep_size or local_ranks,
                        local_ranks=local_ranks,
                        lifetime=token(f"{lifetime}-{rank}"),
                    ),
                    timeout=10,
                )
                for rank in range(local_ranks)
            )
        )
    )


async def grow_and_commit(stub: Any, group: str, build_seconds: float) -> list[pb.ProposeResponse]:
    """Two ranks: round 1 builds at NVFP4, round 2 rebuilds at BF16, rank 0 commits.

    Returns the answers of round 2.
    """
    await run_round(stub, 1, NVFP4, group=group, local_ranks=2)
    second = await run_round(stub, 2, BF16, group=group, local_ranks=2)
    await stub.Commit(
        pb.CommitRequest(
            group=group,
            ep_rank=0,
            lifetime=token("life-0"),
            round=2,
            plan=second[0].plan,
            build_seconds=build_seconds,
        ),
        timeout=5,
    )
    return second


# --- the sidecar as its own process (``python -m moe_sidecar``) -----------------------


def start_sidecar_process(log: Path, *flags: str) -> subprocess.Popen[bytes]:
    """``python -m moe_sidecar FLAGS``, its stderr (the log) appended to ``log``.

    The test's own ``MOE_SIDECAR_*`` variables are not passed on, so only
    ``flags`` configure it.
    """
    with log.open("ab") as stderr:
        return subprocess.Popen(
            [sys.executable, "-m", "moe_sidecar", *flags],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            env={k: v for k, v in os.environ.items() if not k.startswith("MOE_SIDECAR_")},
        )


def wait_until_serving(
    target: str, process: subprocess.Popen[bytes], log: Path, timeout: float = 30.0
) -> None:
    """Returns once ``target`` answers health SERVING; fails if ``process`` exits first."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise AssertionError(
                    f"the sidecar exited with {process.returncode}:\n{log.read_text()}"
                )
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.05)  # the poll interval of a wait with a deadline
    raise AssertionError(f"{target} not SERVING after {timeout}s:\n{log.read_text()}")


def wait_for_serving_record(
    process: subprocess.Popen[bytes], log: Path, timeout: float = 30.0
) -> dict[str, Any]:
    """The sidecar's ``serving`` log record (JSON log format), once it is written.

    The sidecar writes it after every address is bound and health is SERVING;
    it names what was bound (``listen``, ``health_port``, ``metrics_port``),
    so a test can ask for port 0 and learn the port instead of picking a
    "free" one that another process may take before the sidecar binds it.
    Fails if ``process`` exits first or ``timeout`` seconds pass.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        # Whether it had exited before the log is read: then the log is complete.
        exited = process.poll() is not None
        # Only whole lines: the last one may still be being written.
        for line in log.read_text().split("\n")[:-1]:
            if line.startswith("{"):
                record: dict[str, Any] = json.loads(line)
                if record.get("message") == "serving":
                    return record
        if exited:
            raise AssertionError(
                f"the sidecar exited with {process.returncode}:\n{log.read_text()}"
            )
        time.sleep(0.05)  # the poll interval of a wait with a deadline
    raise AssertionError(f"no serving record after {timeout}s:\n{log.read_text()}")


def stop_process(process: subprocess.Popen[bytes]) -> None:
    """Kills ``process`` if it still runs and reaps it (a test's ``finally``)."""
    if process.poll() is None:
        process.kill()
    process.wait(timeout=10)


def log_records(log: Path) -> list[dict[str, Any]]:
    """The JSON log lines of a sidecar started with the default ``--log-format json``."""
    return [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
