"""The bound of calls in flight on the coordinator listeners
(``--max-concurrent-rpcs``) and on the health port (``--max-health-rpcs``),
against a real sidecar (servers on real sockets): a call beyond it is
RESOURCE_EXHAUSTED naming the flag, counted, while the other servers still
answer; once the held calls end, calls are served again.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from moe_sidecar.server import RunningServer, running_server
from moe_workspace.v1 import coordinator_pb2 as pb
from tests.integration.helpers import coordinator_stub, details, make_config, propose_request

pytestmark = pytest.mark.timeout(60)

LIMIT = 3
REFUSAL = f"{LIMIT} calls are in flight; --max-concurrent-rpcs is {LIMIT}"


def _in_flight(server: RunningServer, gauge: str = "moe_sidecar_rpcs_in_flight") -> float:
    return server.metrics.registry.get_sample_value(gauge) or 0.0


def _refused(server: RunningServer, resource: str = "concurrent_rpcs") -> float:
    value = server.metrics.registry.get_sample_value(
        "moe_sidecar_limit_refusals_total", {"resource": resource}
    )
    return value or 0.0


async def _until(condition: Any, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)  # the poll interval of a wait with a deadline


class _Session:
    """One rank's Session stream that proposes round 1 of an 8-rank group and waits."""

    def __init__(self, stub: Any) -> None:
        self._requests: asyncio.Queue[pb.SessionRequest | None] = asyncio.Queue()
        self.call = stub.Session(self._messages())
        request = propose_request(0, group="held/ep8", ep_size=8, local_ranks=8)
        self._requests.put_nowait(pb.SessionRequest(id=1, propose=request))

    async def _messages(self) -> AsyncIterator[pb.SessionRequest]:
        while (message := await self._requests.get()) is not None:
            yield message


def _own_connection(target: str) -> grpc.aio.Channel:
    """A channel on a connection of its own (not shared with other channels to
    ``target``), as a probe's: the health port allows ``--max-health-rpcs``
    streams per connection."""
    return grpc.aio.insecure_channel(target, options=(("grpc.use_local_subchannel_pool", 1),))


async def _health_status(target: str) -> int:
    async with _own_connection(target) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10
        )
    return int(reply.status)


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        return str(answer.read().decode())


async def _assert_refused(call: Any, server: RunningServer, refusals: float) -> None:
    """``call`` fails RESOURCE_EXHAUSTED naming the flag, counted once."""
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await call
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert REFUSAL in details(refused.value)
    assert "raise --max-concurrent-rpcs" in details(refused.value)
    assert _refused(server) == refusals and _in_flight(server) == LIMIT


async def test_a_call_beyond_max_concurrent_rpcs_is_refused_naming_the_flag(
    tmp_path: Path,
) -> None:
    """With ``--max-concurrent-rpcs 3``, two Watch streams and a Session
    stream are held open; a unary call and a fourth stream are each refused
    at once, naming the flag, counted; health (on the listener and the
    health port) and the metrics endpoint answer meanwhile; once the held
    streams end, a call is served again."""
    config = make_config(tmp_path, max_concurrent_rpcs=LIMIT)
    async with running_server(config) as server:
        target = server.addresses.listen[0]
        async with coordinator_stub(target) as stub:
            watches = [stub.Watch(pb.WatchRequest(group="")) for _ in range(LIMIT - 1)]
            session = _Session(stub)
            await _until(lambda: _in_flight(server) == LIMIT)

            await _assert_refused(stub.ListGroups(pb.ListGroupsRequest(), timeout=10), server, 1)
            await _assert_refused(stub.Watch(pb.WatchRequest(group="")).read(), server, 2)

            serving = health_pb2.HealthCheckResponse.SERVING
            assert await _health_status(target) == serving
            assert server.addresses.health_port is not None
            assert await _health_status(f"127.0.0.1:{server.addresses.health_port}") == serving
            assert server.addresses.metrics_port is not None
            scraped = await asyncio.to_thread(_scrape, server.addresses.metrics_port)
            assert 'moe_sidecar_limit_refusals_total{resource="concurrent_rpcs"} 2.0' in scraped
            assert f"moe_sidecar_rpcs_in_flight {float(LIMIT)}" in scraped

            for call in (*watches, session.call):
                call.cancel()
            await _until(lambda: _in_flight(server) == 0)
            listed = await stub.ListGroups(pb.ListGroupsRequest(), timeout=10)
            assert [g.name for g in listed.groups] == ["held/ep8"]
            assert _refused(server) == 2


async def test_a_call_beyond_max_health_rpcs_is_refused_naming_the_flag(tmp_path: Path) -> None:
    """With ``--max-health-rpcs 1`` one Watch stream of the health port holds
    its only place (its streams hold at most half the places, and at least
    one: only with a bound of 1 can streams fill them all); a Check there is
    refused at once, naming the flag (not gRPC's own ``INTERNAL``), counted;
    the coordinator listener answers meanwhile; once the Watch ends, a Check
    is served again."""
    async with running_server(make_config(tmp_path, max_health_rpcs=1)) as server:
        assert server.addresses.health_port is not None
        health_target = f"127.0.0.1:{server.addresses.health_port}"
        serving = health_pb2.HealthCheckResponse.SERVING
        async with _own_connection(health_target) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
            assert (await watch.read()).status == serving
            assert _in_flight(server, "moe_sidecar_health_rpcs_in_flight") == 1

            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await _health_status(health_target)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "1 calls are in flight; --max-health-rpcs is 1" in details(refused.value)
            assert "raise --max-health-rpcs" in details(refused.value)
            assert _refused(server, "health_rpcs") == 1
            assert _refused(server) == 0 and _in_flight(server) == 0
            assert await _health_status(server.addresses.listen[0]) == serving

            watch.cancel()
            await _until(lambda: _in_flight(server, "moe_sidecar_health_rpcs_in_flight") == 0)
            assert await _health_status(health_target) == serving
            assert _refused(server, "health_rpcs") == 1
