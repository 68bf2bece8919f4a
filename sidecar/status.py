"""The one place where coordinator errors become gRPC status codes.

:class:`ErrorTranslator` wraps every servicer method: a
:class:`~moe_sidecar.core.errors.CoordinatorError` aborts the call with the code of
its :class:`~moe_sidecar.core.errors.ErrorCode` and its message; any other exception
is a bug, logged with its traceback and answered INTERNAL, so no request can
take the server down. Cancellation is never swallowed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

import grpc

from moe_sidecar.core.errors import CoordinatorError, ErrorCode, UndecodableRequest
from moe_sidecar.metrics import SidecarMetrics

__all__ = ["GRPC_STATUS_FOR", "ErrorTranslator", "OncePerPeer", "grpc_status_for"]

T = TypeVar("T")

GRPC_STATUS_FOR: Mapping[ErrorCode, grpc.StatusCode] = {
    ErrorCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorCode.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorCode.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorCode.ABORTED: grpc.StatusCode.ABORTED,
    ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    ErrorCode.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorCode.INTERNAL: grpc.StatusCode.INTERNAL,
}

_log = logging.getLogger("moe_sidecar.status")


def grpc_status_for(code: ErrorCode) -> grpc.StatusCode:
    """The gRPC status code that carries ``code``."""
    return GRPC_STATUS_FOR[code]


class OncePerPeer:
    """Says whether to log about a peer: at most once per ``interval`` seconds
    per peer, remembering at most ``max_peers`` peers (the oldest forgotten)."""

    def __init__(
        self,
        interval: float = 60.0,
        max_peers: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._interval = interval
        self._max_peers = max_peers
        self._clock = clock
        self._last: OrderedDict[str, float] = OrderedDict()

    def __call__(self, peer: str) -> bool:
        now = self._clock()
        last = self._last.get(peer)
        if last is not None and now - last < self._interval:
            return False
        self._last[peer] = now
        self._last.move_to_end(peer)
        while len(self._last) > self._max_peers:
            self._last.popitem(last=False)
        return True


class ErrorTranslator:
    """Runs servicer work and turns its errors into gRPC aborts.

    ``metrics`` counts every error answered, by status code; undecodable
    requests are counted by method too and logged at most once per peer per
    minute (a flood of garbage must not flood the log).
    """

    def __init__(self, metrics: SidecarMetrics, log_peer: OncePerPeer | None = None) -> None:
        self._metrics = metrics
        self._log_peer = log_peer if log_peer is not None else OncePerPeer()

    def _undecodable(
        self, error: UndecodableRequest, method: str, context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        self._metrics.undecodable.labels(method=method).inc()
        peer = context.peer() or "unknown"
        if self._log_peer(peer):
            _log.warning(
                "undecodable request",
                extra={"method": method, "peer": peer, "detail": error.message},
            )

    def _status_of(
        self, error: Exception, method: str, context: grpc.aio.ServicerContext[Any, Any]
    ) -> tuple[grpc.StatusCode, str]:
        if isinstance(error, UndecodableRequest):
            self._undecodable(error, method, context)
        if isinstance(error, CoordinatorError):
            return grpc_status_for(error.code), error.message
        _log.error(
            "unexpected error in %s",
            method,
            exc_info=(type(error), error, error.__traceback__),
            extra={"method": method},
        )
        return (
            grpc.StatusCode.INTERNAL,
            f"internal error in {method}: {type(error).__name__}: {error}",
        )

    async def _abort(
        self, context: grpc.aio.ServicerContext[Any, Any], code: grpc.StatusCode, message: str
    ) -> None:
        self._metrics.errors.labels(code.name).inc()
        await context.abort(code, message)

    async def answer(
        self, context: grpc.aio.ServicerContext[Any, Any], method: str, work: Awaitable[T]
    ) -> T | tuple[grpc.StatusCode, str]:
        """Awaits ``work``; its error becomes the (counted) status and message
        instead of ending the call: one message of a session fails, the
        session goes on.

        Raises:
            asyncio.CancelledError: the call was cancelled (passed through).
        """
        try:
            return await work
        except asyncio.CancelledError:
            raise
        except Exception as error:
            code, message = self._status_of(error, method, context)
        self._metrics.errors.labels(code.name).inc()
        return code, message

    async def unary(
        self, context: grpc.aio.ServicerContext[Any, Any], method: str, work: Awaitable[T]
    ) -> T:
        """Awaits ``work``; its error aborts the call with the mapped status.

        Raises:
            asyncio.CancelledError: the call was cancelled (passed through).
            grpc.aio.AbortError: (from ``context.abort``) the call was answered
                with an error status; grpc.aio handles it.
        """
        try:
            return await work
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as error:
            code, message = self._status_of(error, method, context)
        await self._abort(context, code, message)
        raise AssertionError("unreachable: context.abort returned")  # pragma: no cover

    async def stream(
        self,
        context: grpc.aio.ServicerContext[Any, Any],
        method: str,
        items: AsyncGenerator[T, None],
    ) -> AsyncIterator[T]:
        """Yields from ``items``; an error ends the stream with the mapped status.

        Raises:
            asyncio.CancelledError: the call was cancelled (passed through).
            grpc.aio.AbortError: the stream was ended with an error status.
        """
        try:
            async for item in items:
                yield item
            return
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as error:
            code, message = self._status_of(error, method, context)
        finally:
            # Runs the source's own cleanup now, not whenever it is collected.
            await items.aclose()
        await self._abort(context, code, message)
