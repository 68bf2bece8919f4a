"""Health transitions and server reflection, seen by plain gRPC clients."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import subprocess
import time
from pathlib import Path

import grpc
import psutil  # type: ignore[import-untyped]
import pytest
from google.protobuf import descriptor_pool, message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from moe_sidecar.server import running_server
from moe_sidecar.store.sqlite import DATABASE_FILE
from moe_workspace.v1 import coordinator_pb2 as pb
from tests.integration.helpers import (
    NVFP4,
    coordinator_stub,
    make_config,
    propose_request,
    start_sidecar_process,
    stop_process,
    wait_for_serving_record,
    workspace_bytes,
)

pytestmark = pytest.mark.timeout(30)

SERVICE = "moe_workspace.v1.WorkspaceCoordinator"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def _check(target: str, service: str = "") -> int:
    async with grpc.aio.insecure_channel(target) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
        return int(reply.status)


async def test_health_is_serving_on_the_health_port_and_every_listener(tmp_path: Path) -> None:
    async with running_server(make_config(tmp_path)) as server:
        health_target = f"127.0.0.1:{server.addresses.health_port}"
        for target in (health_target, *server.addresses.listen):
            assert await _check(target) == SERVING
            assert await _check(target, SERVICE) == SERVING


async def test_health_turns_not_serving_while_draining(tmp_path: Path) -> None:
    async with running_server(make_config(tmp_path, grace_period=1.5)) as server:
        health_target = f"127.0.0.1:{server.addresses.health_port}"
        async with (
            grpc.aio.insecure_channel(health_target) as health_channel,
            grpc.aio.insecure_channel(server.addresses.listen[0]) as main_channel,
        ):
            watch = health_pb2_grpc.HealthStub(health_channel).Watch(
                health_pb2.HealthCheckRequest(service=SERVICE)
            )
            assert (await watch.read()).status == SERVING
            # A stream open on the main listener keeps the drain going for the
            # whole grace period, long enough to look at the health port.
            hold = health_pb2_grpc.HealthStub(main_channel).Watch(
                health_pb2.HealthCheckRequest(service="")
            )
            assert (await hold.read()).status == SERVING
            stopping = asyncio.create_task(server.stop())
            assert (await watch.read()).status == NOT_SERVING
            assert (await hold.read()).status == NOT_SERVING
            assert await _check(health_target) == NOT_SERVING
            assert await _check(health_target, SERVICE) == NOT_SERVING
            assert not stopping.done()
            await asyncio.wait_for(stopping, timeout=10)
            hold.cancel()
            watch.cancel()


def _listening_tcp_ports(process: subprocess.Popen[bytes]) -> list[int]:
    """The TCP ports ``process`` listens on (what a probe could connect to)."""
    connections = psutil.Process(process.pid).net_connections(kind="tcp")
    return [c.laddr.port for c in connections if c.status == psutil.CONN_LISTEN]


def _until_file_open(process: subprocess.Popen[bytes], name: str, timeout: float = 30) -> None:
    """Returns once ``process`` holds a file called ``name`` open."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the sidecar exited with {process.returncode}"
        with contextlib.suppress(FileNotFoundError):  # a descriptor closed while listing
            fds = os.listdir(f"/proc/{process.pid}/fd")
            if any(os.readlink(f"/proc/{process.pid}/fd/{fd}").endswith(name) for fd in fds):
                return
        time.sleep(0.01)  # the poll interval of a wait with a deadline
    raise AssertionError(f"the sidecar never opened {name}")


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs Linux's /proc")
async def test_health_port_stays_closed_until_the_stored_state_is_loaded(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    async with (
        running_server(config) as server,
        coordinator_stub(server.addresses.listen[0]) as stub,
    ):
        await stub.Propose(
            propose_request(0, group="stored/ep1", ep_size=1, local_ranks=1), timeout=5
        )
    # Another program holds the database with an exclusive lock (a rollback
    # journal keeps readers out too): the next start cannot read its state
    # until that program lets go.
    database = sqlite3.connect(config.state_dir / DATABASE_FILE, isolation_level=None)
    database.execute("PRAGMA journal_mode=DELETE")
    database.execute("BEGIN EXCLUSIVE")
    target = f"unix://{tmp_path}/later.sock"
    log = tmp_path / "sidecar.log"
    process = start_sidecar_process(
        log,
        "--listen",
        target,
        "--state-dir",
        str(config.state_dir),
        "--health-port",
        "auto",
        "--metrics-port",
        "0",
    )
    try:
        try:
            # SQLite waits up to 5 s for the lock, so the state is still loading here.
            await asyncio.to_thread(_until_file_open, process, DATABASE_FILE)
            # Asked for any port, it has no port to name yet; no TCP port at all
            # is open, so neither is the health port.
            assert _listening_tcp_ports(process) == []
            assert not await asyncio.to_thread((tmp_path / "later.sock").exists)
            assert process.poll() is None
        finally:
            database.execute("ROLLBACK")
            database.close()
        serving = await asyncio.to_thread(wait_for_serving_record, process, log)
        health_port = serving["health_port"]
        assert health_port in await asyncio.to_thread(_listening_tcp_ports, process)
        assert await _check(f"127.0.0.1:{health_port}", SERVICE) == SERVING
        # SERVING came with the stored state loaded.
        async with coordinator_stub(target) as stub:
            group = await stub.GetGroup(pb.GetGroupRequest(group="stored/ep1"), timeout=5)
        assert group.plan.generation == 1
    finally:
        await asyncio.to_thread(stop_process, process)


def _reflect(target: str) -> tuple[list[str], list[str], str]:
    """Lists services and calls two methods using reflection-only descriptors."""
    with grpc.insecure_channel(target) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = list(database.get_services())
        pool = descriptor_pool.DescriptorPool(database)
        service = pool.FindServiceByName(SERVICE)
        methods = sorted(service.methods_by_name)

        def call(name: str, **fields: object) -> object:
            method = service.methods_by_name[name]
            request_class = message_factory.GetMessageClass(method.input_type)
            response_class = message_factory.GetMessageClass(method.output_type)
            # Classes from the reflection pool, not the generated module.
            assert request_class is not getattr(pb, method.input_type.name, None)
            rpc = channel.unary_unary(
                f"/{SERVICE}/{name}",
                request_serializer=request_class.SerializeToString,
                response_deserializer=response_class.FromString,
            )
            return rpc(request_class(**fields), timeout=5)

        listed = call("ListGroups")
        names = [g.name for g in listed.groups]  # type: ignore[attr-defined]
        group = call("GetGroup", group=names[0])
        return services, methods, f"{group.name}:{group.plan.workspace_bytes}"  # type: ignore[attr-defined]


@pytest.mark.parametrize("listener", [0, 1], ids=["unix", "tcp"])
async def test_reflection_lists_every_service_and_serves_calls(
    tmp_path: Path, listener: int
) -> None:
    async with running_server(make_config(tmp_path)) as server:
        target = server.addresses.listen[listener]
        async with coordinator_stub(target) as stub:
            await stub.Propose(
                propose_request(0, group="solo/ep1", ep_size=1, local_ranks=1), timeout=5
            )
        services, methods, described = await asyncio.to_thread(_reflect, target)
    assert set(services) == {
        SERVICE,
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    }
    assert methods == [
        "Arrive",
        "Commit",
        "ExcludeRanks",
        "GetGroup",
        "ListGroups",
        "Propose",
        "RemoveGroup",
        "ResetGroup",
        "Session",
        "Watch",
    ]
    assert described == f"solo/ep1:{workspace_bytes(NVFP4.capacities, 1)}"
