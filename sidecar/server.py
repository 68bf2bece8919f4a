"""The sidecar's servers: gRPC (coordinator, health, reflection), health port, metrics.

:func:`serve` runs until its ``shutdown_trigger`` completes, then drains.
:func:`running_server` is the same server as an async context manager that
reports what it bound, for tests and benchmarks that run it in-process::

    async with running_server(SidecarConfig(listen=("unix:///tmp/s.sock",), ...)) as server:
        server.addresses.listen   # ("unix:///tmp/s.sock",)

Only the command line installs signal handlers; here shutdown is an argument.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2

from moe_sidecar.config import SidecarConfig
from moe_sidecar.config.values import (
    DEFAULT_STATE_DIR,
    LIMIT_FIELDS,
    LISTENER_TIMEOUT_FIELDS,
    SqliteStore,
)
from moe_sidecar.etcd.client import EtcdClient
from moe_sidecar.etcd.replica import EtcdReplica, replica_settings
from moe_sidecar.health import HealthServicer
from moe_sidecar.listeners import (
    SOCKET_MODE,
    StartupError,
    lock_socket_path,
    not_serving_health,
    socket_lock_path,
    start_coordinator_server,
    start_health_server,
    start_metrics,
)
from moe_sidecar.metrics import MetricsEndpoint, SidecarMetrics
from moe_sidecar.servicer import SERVICE_NAME, CoordinatorServicer
from moe_sidecar.state import Clock, Coordinator
from moe_sidecar.store.replica import Replica, StoreMetrics
from moe_sidecar.store.sqlite import StateStore

__all__ = [
    "SOCKET_MODE",
    "BoundAddresses",
    "RunningServer",
    "StartupError",
    "running_server",
    "serve",
    "start_server",
]

_log = logging.getLogger("moe_sidecar.server")


def _exported_limits(config: SidecarConfig) -> dict[str, float]:
    """Every limit of ``config`` by resource name, for ``moe_sidecar_limit``."""
    limits: dict[str, float] = {
        name.removeprefix("max_"): getattr(config, name) for name in LIMIT_FIELDS
    }
    for name in LISTENER_TIMEOUT_FIELDS:
        limits[name.removesuffix("_timeout") + "_seconds"] = getattr(config, name)
    limits["workspace_bytes"] = config.max_workspace_bytes
    # Checked apart from LIMIT_FIELDS (0 is allowed: merge no group a local rank did not use).
    limits["merged_groups"] = config.max_merged_groups
    limits["sessions"] = config.max_sessions
    limits["stream_receive_bytes"] = config.stream_receive_bytes
    return limits


@dataclass(frozen=True)
class BoundAddresses:
    """What a started server listens on."""

    listen: tuple[str, ...]
    """Client targets, one per ``--listen``: ``unix:///path`` or ``host:port``
    with the port the OS chose for a port of 0."""
    health_port: int | None
    metrics_port: int | None


@dataclass
class RunningServer:
    """A started sidecar; :meth:`stop` drains it."""

    config: SidecarConfig
    addresses: BoundAddresses
    coordinator: Coordinator
    metrics: SidecarMetrics
    _server: grpc.aio.Server
    _servicer: CoordinatorServicer
    _health: HealthServicer
    _health_server: grpc.aio.Server | None
    _metrics_endpoint: MetricsEndpoint | None
    _socket_locks: list[int] = field(default_factory=list)
    _stopped: asyncio.Event = field(default_factory=asyncio.Event)
    _stopping: bool = False
    _replica: Replica | None = None

    async def stop(self) -> None:
        """Drains and stops: waiting Proposes woken with UNAVAILABLE and Watch
        streams ended, NOT_SERVING, in-flight calls given the grace period,
        then everything closed. Idempotent.

        Nothing here waits on a peer: a client that never reads (a zero
        flow-control window) is cancelled with the server at the end of the
        grace period, so the stop takes at most about that long.
        """
        if self._stopping:
            await self._stopped.wait()
            return
        self._stopping = True
        started = time.monotonic()
        try:
            # The ranks first: they are told to retry before anything else happens.
            self.coordinator.drain()
            # Session streams wait on their ranks' next message, not on the
            # coordinator: ended here, they leave nothing for the grace period.
            self._servicer.end_sessions()
            self._health.enter_graceful_shutdown()
            _log.info("draining", extra={"grace_period": self.config.grace_period})
            await self._server.stop(self.config.grace_period)
        finally:
            if self._replica is not None:
                # What the cluster store has not got yet is pushed now if it
                # can be (the pod may come back on another node), else it
                # stays in the outbox for this node's next start. Within what
                # is left of the grace period: a stop takes about that long at most.
                left = self.config.grace_period - (time.monotonic() - started)
                await self._replica.close(max(0.0, left))
            self.coordinator.close()
            if self._health_server is not None:
                await self._health_server.stop(0)
            if self._metrics_endpoint is not None:
                await self._metrics_endpoint.stop()
            for address in self.config.listen_addresses:
                if address.unix_path is not None:
                    with contextlib.suppress(OSError):
                        address.unix_path.unlink()
                    # Removed while still held (lock_socket_path takes only
                    # the file the path names), so a clean stop leaves nothing.
                    with contextlib.suppress(OSError):
                        socket_lock_path(address.unix_path).unlink()
            # Released only after the socket and lock files are gone.
            for fd in self._socket_locks:
                os.close(fd)
            self._socket_locks.clear()
            self._stopped.set()
            _log.info("stopped", extra={"seconds": round(time.monotonic() - started, 3)})


def _prepare_state_dir(path: Path) -> None:
    """Creates the state directory, or says which flag to change and why not.

    Raises:
        StartupError: the path is not a directory, cannot be created, or this
            user cannot write it.
    """
    given = f"--state-dir {str(path)!r}"
    why = " (the default needs root)" if path == DEFAULT_STATE_DIR else ""
    instead = "give a directory this user may write (created if missing), e.g. --state-dir ./state"
    try:
        if path.exists() and not path.is_dir():
            raise StartupError(f"{given}: is a file, not a directory; {instead}")
        path.mkdir(mode=0o750, parents=True, exist_ok=True)
    except PermissionError:
        raise StartupError(f"{given}: permission denied creating it{why}; {instead}") from None
    except OSError as error:
        raise StartupError(f"{given}: cannot create it: {error.strerror}; {instead}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise StartupError(f"{given}: not writable by uid {os.getuid()}{why}; {instead}")


def node_name(config: SidecarConfig) -> str:
    """This node's name: ``--node-name``, else the hostname."""
    return config.node_name or socket.gethostname()


def _open_replica(config: SidecarConfig, metrics: SidecarMetrics) -> Replica | None:
    """The cluster store beside the node's SQLite (None: SQLite alone).

    Raises:
        StartupError: a file the etcd URL or --store-key-file names cannot be read.
    """
    target = config.store_target
    if isinstance(target, SqliteStore):
        return None
    try:
        client = EtcdClient.from_target(target)
    except ValueError as error:  # EtcdUrlError: a TLS or password file
        raise StartupError(f"--store: {error}") from None
    try:
        settings = replica_settings(config)
    except ValueError as error:  # the --store-key-file
        raise StartupError(str(error)) from None
    return EtcdReplica(client, target.prefix, StoreMetrics(metrics.registry), settings)


async def start_server(config: SidecarConfig, *, clock: Clock = time.time) -> RunningServer:
    """Loads the state, binds every address, and starts serving.

    Health answers NOT_SERVING until the state is loaded and every port is
    bound, then SERVING. A start that fails undoes what it did (servers
    stopped, socket locks released, the store closed) before raising.

    Raises:
        StoreError: the state directory is unusable (locked, corrupt, unknown schema).
        StartupError: an address cannot be bound.
    """
    _prepare_state_dir(config.state_dir)
    metrics = SidecarMetrics(config.max_group_series, limits=_exported_limits(config))
    replica = _open_replica(config, metrics)
    async with contextlib.AsyncExitStack() as rollback:
        store = StateStore(config.state_dir)
        rollback.callback(store.close)
        coordinator = _new_coordinator(config, store, metrics, replica, clock)
        coordinator.start()
        socket_locks = _lock_socket_paths(config, rollback)
        if replica is not None:
            # Merges what etcd holds before the first round (bounded by the
            # URL's timeout; an unreachable etcd is logged, not fatal).
            rollback.push_async_callback(replica.close, 0.0)
            await replica.start(coordinator)
        health_servicer = not_serving_health()
        server, servicer, bound = await start_coordinator_server(
            config, coordinator, health_servicer, metrics
        )
        rollback.push_async_callback(server.stop, None)
        health_server, health_port = await start_health_server(config, health_servicer, metrics)
        if health_server is not None:
            rollback.push_async_callback(health_server.stop, None)
        endpoint: MetricsEndpoint | None = None
        if config.metrics_port is not None:
            endpoint = await start_metrics(config, metrics, config.metrics_port)
            rollback.push_async_callback(endpoint.stop)
        for service in ("", SERVICE_NAME):
            health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
        rollback.pop_all()  # started: RunningServer.stop undoes it from here on
    addresses = BoundAddresses(
        listen=bound,
        health_port=health_port,
        metrics_port=endpoint.port if endpoint is not None else None,
    )
    _log.info(
        "serving",
        extra={
            "listen": list(addresses.listen),
            "health_port": addresses.health_port,
            "metrics_port": addresses.metrics_port,
            "state_dir": str(config.state_dir.absolute()),
            "store": "sqlite" if replica is None else "etcd",
            "node": coordinator.node,
            "groups": len(coordinator.groups()),
        },
    )
    return RunningServer(
        config=config,
        addresses=addresses,
        coordinator=coordinator,
        metrics=metrics,
        _server=server,
        _servicer=servicer,
        _health=health_servicer,
        _health_server=health_server,
        _metrics_endpoint=endpoint,
        _socket_locks=socket_locks,
        _replica=replica,
    )


def _lock_socket_paths(config: SidecarConfig, rollback: contextlib.AsyncExitStack) -> list[int]:
    """Holds the lock of every Unix socket ``--listen`` names, each released on rollback.

    Raises:
        StartupError: another sidecar holds a lock, or a directory is unusable.
    """
    locks: list[int] = []
    for address in config.listen_addresses:
        if address.unix_path is not None:
            locks.append(lock_socket_path(address))
            rollback.callback(os.close, locks[-1])
    return locks


def _new_coordinator(
    config: SidecarConfig,
    store: StateStore,
    metrics: SidecarMetrics,
    replica: Replica | None,
    clock: Clock,
) -> Coordinator:
    """The state holder with the limits of ``config`` (not started)."""
    return Coordinator(
        store,
        round_timeout=config.round_timeout,
        reconnect_window=config.reconnect_window,
        admin_enabled=config.enable_admin,
        metrics=metrics,
        clock=clock,
        max_groups=config.max_groups,
        max_merged_groups=config.max_merged_groups,
        max_watchers=config.max_watchers,
        replica=replica,
        node=node_name(config),
        max_workspace_bytes=config.max_workspace_bytes,
    )


@contextlib.asynccontextmanager
async def running_server(
    config: SidecarConfig, *, clock: Clock = time.time
) -> AsyncIterator[RunningServer]:
    """A started server, stopped (drained) when the block exits.

    Raises:
        StoreError: the state directory is unusable.
        StartupError: an address cannot be bound.
    """
    server = await start_server(config, clock=clock)
    try:
        yield server
    finally:
        await server.stop()


async def serve(config: SidecarConfig, *, shutdown_trigger: Awaitable[object]) -> None:
    """Serves until ``shutdown_trigger`` completes, then drains and returns.

    Raises:
        StoreError: the state directory is unusable.
        StartupError: an address cannot be bound.
    """
    try:
        async with running_server(config):
            await shutdown_trigger
    finally:
        if inspect.iscoroutine(shutdown_trigger):
            # Not awaited when startup failed; close it so it is not reported.
            shutdown_trigger.close()
