"""``grpc.health.v1.Health``: Check, List and Watch, with no lock held while writing.

grpc's own asyncio servicer holds a service's condition while it writes a
Watch update, so one watcher that never reads (a zero flow-control window)
blocks every later status change, and with it the sidecar's shutdown. Here
a status change only records the new status and wakes each watcher; every
watcher writes on its own, so a stuck one stalls nobody else, and shutdown
cancels it with the server.
"""

from __future__ import annotations

import asyncio
from typing import Any, TypeAlias

import grpc
from grpc_health.v1 import health_pb2

__all__ = ["HealthServicer"]

_Status: TypeAlias = int
"""A ``HealthCheckResponse.ServingStatus`` value (a proto enum is an int)."""
_SERVICE_UNKNOWN: int = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class HealthServicer:
    """Health of the sidecar's services; statuses change without awaiting anyone."""

    def __init__(self) -> None:
        self._status: dict[str, _Status] = {}
        self._changed: dict[str, set[asyncio.Event]] = {}
        self._shutting_down = False

    def set(self, service: str, status: _Status) -> None:
        """Sets ``service``'s status and wakes its watchers (ignored once
        shutting down, so nothing turns SERVING again)."""
        if self._shutting_down:
            return
        self._update(service, status)

    def enter_graceful_shutdown(self) -> None:
        """Every service NOT_SERVING, for good. Idempotent."""
        if self._shutting_down:
            return
        self._shutting_down = True
        for service in list(self._status):
            self._update(service, health_pb2.HealthCheckResponse.NOT_SERVING)

    def _update(self, service: str, status: _Status) -> None:
        self._status[service] = status
        for changed in self._changed.get(service, ()):
            changed.set()

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> health_pb2.HealthCheckResponse:
        status = self._status.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def List(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        """Every service's status (``grpc.health.v1.Health/List``)."""
        return health_pb2.HealthListResponse(
            statuses={
                service: health_pb2.HealthCheckResponse(status=status)
                for service, status in self._status.items()
            }
        )

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        changed = asyncio.Event()
        watchers = self._changed.setdefault(request.service, set())
        watchers.add(changed)
        last: _Status | None = None
        try:
            while True:
                status = self._status.get(request.service, _SERVICE_UNKNOWN)
                if status != last:
                    # Only this watcher waits here if its peer does not read.
                    await context.write(health_pb2.HealthCheckResponse(status=status))
                    last = status
                changed.clear()
                if self._status.get(request.service, _SERVICE_UNKNOWN) == last:
                    await changed.wait()
        finally:
            watchers.discard(changed)
            if not watchers:
                self._changed.pop(request.service, None)
