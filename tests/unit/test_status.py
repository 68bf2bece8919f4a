"""The one mapping of error codes to gRPC codes, and the translator on a real server."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import grpc
import pytest

from moe_sidecar.core.errors import ErrorCode, GroupNotFound, RoundTimedOut
from moe_sidecar.metrics import SidecarMetrics
from moe_sidecar.status import GRPC_STATUS_FOR, ErrorTranslator, grpc_status_for

pytestmark = pytest.mark.timeout(20)


def test_every_error_code_has_the_grpc_code_of_its_name() -> None:
    assert set(GRPC_STATUS_FOR) == set(ErrorCode)
    for code in ErrorCode:
        assert grpc_status_for(code).name == code.name


class Probe:
    """Handlers of a tiny test service, each failing its own way."""

    def __init__(self, translator: ErrorTranslator) -> None:
        self.translator = translator
        self.cancelled = asyncio.Event()

    async def typed(self, request: bytes, context: Any) -> bytes:
        async def work() -> bytes:
            raise GroupNotFound.named("g")

        return await self.translator.unary(context, "Typed", work())

    async def bug(self, request: bytes, context: Any) -> bytes:
        async def work() -> bytes:
            raise ZeroDivisionError("boom")

        return await self.translator.unary(context, "Bug", work())

    async def hang(self, request: bytes, context: Any) -> bytes:
        async def work() -> bytes:
            try:
                await asyncio.sleep(60)  # the thing under test: a call that never ends by itself
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
            return b""

        return await self.translator.unary(context, "Hang", work())

    async def stream(self, request: bytes, context: Any) -> AsyncIterator[bytes]:
        async def items() -> AsyncGenerator[bytes, None]:
            yield b"one"
            raise RoundTimedOut("round 3 timed out")

        async for item in self.translator.stream(context, "Stream", items()):
            yield item


def _identity(b: bytes) -> bytes:
    return b


@pytest.fixture
async def probe_target() -> AsyncIterator[tuple[str, Probe, SidecarMetrics]]:
    metrics = SidecarMetrics()
    probe = Probe(ErrorTranslator(metrics))
    handlers = {
        "Typed": grpc.unary_unary_rpc_method_handler(probe.typed, _identity, _identity),
        "Bug": grpc.unary_unary_rpc_method_handler(probe.bug, _identity, _identity),
        "Hang": grpc.unary_unary_rpc_method_handler(probe.hang, _identity, _identity),
        "Stream": grpc.unary_stream_rpc_method_handler(probe.stream, _identity, _identity),
    }
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Probe", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}", probe, metrics
    finally:
        await server.stop(None)


def _count(metrics: SidecarMetrics, code: str) -> float:
    value = metrics.registry.get_sample_value("moe_sidecar_errors_total", {"code": code})
    return value or 0.0


async def test_translation_on_a_real_server(
    probe_target: tuple[str, Probe, SidecarMetrics], caplog: pytest.LogCaptureFixture
) -> None:
    target, probe, metrics = probe_target
    async with grpc.aio.insecure_channel(target) as channel:

        def unary(name: str) -> Any:
            return channel.unary_unary(f"/test.Probe/{name}", _identity, _identity)

        with pytest.raises(grpc.aio.AioRpcError) as info:
            await unary("Typed")(b"", timeout=5)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert info.value.details() == "group='g': no such group on this sidecar"

        with (
            caplog.at_level(logging.ERROR, logger="moe_sidecar.status"),
            pytest.raises(grpc.aio.AioRpcError) as info,
        ):
            await unary("Bug")(b"", timeout=5)
        assert info.value.code() == grpc.StatusCode.INTERNAL
        assert "ZeroDivisionError: boom" in (info.value.details() or "")
        assert any(r.exc_info for r in caplog.records), "the traceback is logged"

        call = channel.unary_stream("/test.Probe/Stream", _identity, _identity)(b"", timeout=5)
        assert await call.read() == b"one"
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call.read()
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

        # A cancelled call cancels the work and is not counted as an error.
        hanging = unary("Hang")(b"", timeout=0.3)
        with pytest.raises(grpc.aio.AioRpcError):
            await hanging
        await asyncio.wait_for(probe.cancelled.wait(), 5)

        # The server still serves after all of that.
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await unary("Typed")(b"", timeout=5)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND

    assert _count(metrics, "NOT_FOUND") == 2
    assert _count(metrics, "INTERNAL") == 1
    assert _count(metrics, "DEADLINE_EXCEEDED") == 1
    assert _count(metrics, "CANCELLED") == 0
