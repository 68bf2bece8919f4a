"""Health transitions and server reflection, seen by plain gRPC clients."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pool, message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from moe_sidecar.server import running_server
from moe_workspace.v1 import coordinator_pb2 as pb
from tests.integration.helpers import (
    NVFP4,
    coordinator_stub,
    make_config,
    propose_request,
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
    assert methods == ["Commit", "GetGroup", "ListGroups", "Propose", "ResetGroup", "Watch"]
    assert described == f"solo/ep1:{workspace_bytes(NVFP4.capacities, 1)}"
