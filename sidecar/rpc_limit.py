"""How many calls one of the sidecar's gRPC servers serves at once: :class:`RpcLimit`.

gRPC's own ``maximum_concurrent_rpcs`` refused a call beyond it with
``INTERNAL`` (gRPC core's refusal), which names nothing. Here a call beyond
the bound in flight is refused at once with RESOURCE_EXHAUSTED naming the
bound's flag, counted as ``moe_sidecar_limit_refusals_total{resource=...}``;
the server's gauge shows how many are in flight. A call is in flight from its
handler's start until the handler ends: a Session or Watch stream for as long
as it is open.

On the coordinator listeners (``--max-concurrent-rpcs``, resource
``concurrent_rpcs``, gauge ``moe_sidecar_rpcs_in_flight``) ``Health.Check``
is not counted (:data:`UNCOUNTED_METHODS`): it answers from memory at once,
and a rank waiting for its sidecar (and a probe on the listener) reads
SERVING there while every place is taken. On the health port
(``--max-health-rpcs``, resource ``health_rpcs``, gauge
``moe_sidecar_health_rpcs_in_flight``) every call is counted, probes too: its
long-lived streams hold at most half the places, the rest are the probes'.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeAlias, TypeVar, cast

import grpc
from prometheus_client import Gauge

from moe_sidecar.core.errors import ResourceExhausted
from moe_sidecar.metrics import SidecarMetrics
from moe_sidecar.status import ErrorTranslator

__all__ = ["UNCOUNTED_METHODS", "RpcLimit"]

UNCOUNTED_METHODS = frozenset({"/grpc.health.v1.Health/Check"})
"""The coordinator listeners' methods served beyond the bound (answered from
memory, never waiting)."""

# Strings: grpc's classes are generic to mypy's stubs only, not at run time.
_Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"
_Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"
_Behaviour: TypeAlias = Callable[..., Any]
RequestT = TypeVar("RequestT")
ResponseT = TypeVar("ResponseT")


class RpcLimit(grpc.aio.ServerInterceptor):
    """The ``max_rpcs`` places of calls in flight on one server, bounded by
    ``flag``: a call beyond them is counted as a refusal of ``resource``;
    ``gauge`` (this server's own) shows the calls in flight; ``uncounted``
    methods are served beyond the bound.

    Not thread-safe: use it from the server's event loop.
    """

    def __init__(
        self,
        metrics: SidecarMetrics,
        translator: ErrorTranslator,
        max_rpcs: int,
        *,
        flag: str,
        resource: str,
        gauge: Gauge,
        uncounted: frozenset[str] = frozenset(),
    ) -> None:
        self._metrics = metrics
        self._translator = translator
        self.max_rpcs = max_rpcs
        self.flag = flag
        self.resource = resource
        self._gauge = gauge
        self._uncounted = uncounted
        self.in_flight = 0

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails],
            Awaitable[grpc.RpcMethodHandler[RequestT, ResponseT] | None],
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[RequestT, ResponseT] | None:
        """The method's handler, its behaviour run in one of the places."""
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method
        if handler is None or method in self._uncounted:
            return handler
        # The same request and response types: only the behaviour is wrapped.
        return cast("grpc.RpcMethodHandler[RequestT, ResponseT]", self._bounded(handler, method))

    def _bounded(self, handler: grpc.RpcMethodHandler[Any, Any], method: str) -> _Handler:
        """``handler`` with its behaviour (whichever of the four it is) in a place."""
        codec = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_unary is not None:
            behaviour = self._call(handler.unary_unary, method)
            return grpc.unary_unary_rpc_method_handler(behaviour, **codec)
        if handler.stream_unary is not None:
            behaviour = self._call(handler.stream_unary, method)
            return grpc.stream_unary_rpc_method_handler(behaviour, **codec)
        if handler.unary_stream is not None:
            behaviour = self._stream(handler.unary_stream, method)
            return grpc.unary_stream_rpc_method_handler(behaviour, **codec)
        assert handler.stream_stream is not None
        behaviour = self._stream(handler.stream_stream, method)
        return grpc.stream_stream_rpc_method_handler(behaviour, **codec)

    def _call(self, behaviour: _Behaviour, method: str) -> _Behaviour:
        """A behaviour that answers once (or writes through ``context.write``)."""

        async def bounded(request: Any, context: _Context) -> Any:
            async with self._place(context, method):
                answer = behaviour(request, context)
                return await answer if inspect.isawaitable(answer) else answer

        return bounded

    def _stream(self, behaviour: _Behaviour, method: str) -> _Behaviour:
        """A streaming behaviour: an async generator's items are passed on;
        one that writes through ``context.write`` is awaited as a call."""
        if not inspect.isasyncgenfunction(behaviour):
            return self._call(behaviour, method)

        async def bounded(request: Any, context: _Context) -> AsyncIterator[Any]:
            async with self._place(context, method):
                responses = behaviour(request, context)
                try:
                    async for response in responses:
                        yield response
                finally:
                    # The source's own cleanup runs now (the call's end), not
                    # whenever the generator is collected.
                    await responses.aclose()

        return bounded

    @contextlib.asynccontextmanager
    async def _place(self, context: _Context, method: str) -> AsyncIterator[None]:
        """Holds a place for the block, or refuses the call when all are taken.

        Raises:
            grpc.aio.AbortError: every place is taken; the call is answered
                RESOURCE_EXHAUSTED naming the bound's flag.
        """
        if self.in_flight >= self.max_rpcs:
            self._metrics.refused(self.resource)
            await self._translator.unary(context, method, self._refusal())
        self.in_flight += 1
        self._gauge.set(self.in_flight)
        try:
            yield
        finally:
            self.in_flight -= 1
            self._gauge.set(self.in_flight)

    async def _refusal(self) -> None:
        """Raises the refusal of a call beyond the bound, for the one error mapping.

        Raises:
            ResourceExhausted: always (naming the bound's flag).
        """
        raise ResourceExhausted(
            f"{self.in_flight} calls are in flight; {self.flag} is {self.max_rpcs}: "
            f"retry once one ends, or raise {self.flag}"
        )
