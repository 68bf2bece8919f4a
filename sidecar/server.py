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
import errno
import inspect
import logging
import os
import socket
import stat
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from moe_sidecar.config import ListenAddress, SidecarConfig, SqliteStore
from moe_sidecar.etcd_client import EtcdClient
from moe_sidecar.etcd_replica import EtcdReplica
from moe_sidecar.metrics import MetricsEndpoint, SidecarMetrics, start_metrics_endpoint
from moe_sidecar.replica import Replica, StoreMetrics
from moe_sidecar.servicer import SERVICE_NAME, CoordinatorServicer
from moe_sidecar.state import Clock, Coordinator
from moe_sidecar.status import ErrorTranslator
from moe_sidecar.store import StateStore
from moe_workspace.v1 import coordinator_pb2_grpc as pb_grpc

__all__ = [
    "HEALTH_HOST",
    "SOCKET_MODE",
    "BoundAddresses",
    "RunningServer",
    "StartupError",
    "running_server",
    "serve",
    "start_server",
]

HEALTH_HOST = "0.0.0.0"
"""The health and metrics ports listen on every interface so kubelet and
Prometheus reach them; the coordinator itself listens only where told."""
SOCKET_MODE = 0o660
"""Owner and group (the inference container's) may connect; nobody else."""

_log = logging.getLogger("moe_sidecar.server")

# SO_REUSEPORT (gRPC's default on Linux) would let a second sidecar bind the
# same TCP port and silently split the ranks of a group between two state
# holders; a second sidecar must fail to start instead.
_SERVER_OPTIONS = (("grpc.so_reuseport", 0),)


class StartupError(Exception):
    """The server cannot start: an address is taken or unusable."""


@dataclass(frozen=True)
class BoundAddresses:
    """What a started server listens on."""

    listen: tuple[str, ...]
    """Client targets, one per ``--listen``: ``unix:///path`` or ``host:port``
    with the port the OS chose for a port of 0."""
    health_port: int | None
    metrics_port: int | None


def _prepare_socket_path(path: Path) -> None:
    """Creates the socket's directory and removes a stale socket file.

    Raises:
        StartupError: the path is not a socket, or a live process serves on it.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    except OSError as error:
        raise StartupError(f"cannot use socket path {str(path)!r}: {error}") from None
    if not stat.S_ISSOCK(mode):
        raise StartupError(f"{str(path)!r} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(str(path))
    except OSError as error:
        if error.errno not in (errno.ECONNREFUSED, errno.ENOENT):
            raise StartupError(f"cannot probe socket {str(path)!r}: {error}") from None
        # Nobody accepts on it: left behind by a sidecar that died.
        path.unlink(missing_ok=True)
    else:
        raise StartupError(f"another process already serves on {str(path)!r}")
    finally:
        probe.close()


def _bind(server: grpc.aio.Server, address: ListenAddress) -> str:
    if address.unix_path is not None:
        _prepare_socket_path(address.unix_path)
    try:
        port = server.add_insecure_port(address.target)
    except RuntimeError as error:
        raise StartupError(f"cannot listen on {address.target!r}: {error}") from None
    if address.unix_path is not None:
        return address.target
    if port == 0:
        raise StartupError(f"cannot listen on {address.target!r}: the port is taken")
    return f"{address.host}:{port}"


@dataclass
class RunningServer:
    """A started sidecar; :meth:`stop` drains it."""

    config: SidecarConfig
    addresses: BoundAddresses
    coordinator: Coordinator
    metrics: SidecarMetrics
    _server: grpc.aio.Server
    _health: health.aio.HealthServicer
    _health_server: grpc.aio.Server | None
    _metrics_endpoint: MetricsEndpoint | None
    _stopped: asyncio.Event = field(default_factory=asyncio.Event)
    _stopping: bool = False
    _replica: Replica | None = None

    async def stop(self) -> None:
        """Drains and stops: NOT_SERVING, waiting Proposes woken with UNAVAILABLE,
        in-flight calls given the grace period, then everything closed. Idempotent.
        """
        if self._stopping:
            await self._stopped.wait()
            return
        self._stopping = True
        started = time.monotonic()
        try:
            await self._health.enter_graceful_shutdown()
            self.coordinator.drain()
            _log.info("draining", extra={"grace_period": self.config.grace_period})
            await self._server.stop(self.config.grace_period)
        finally:
            if self._replica is not None:
                # What the cluster store has not got yet is pushed now if it
                # can be (the pod may come back on another node), else it
                # stays in the outbox for this node's next start.
                await self._replica.close(self.config.grace_period)
            self.coordinator.close()
            if self._health_server is not None:
                await self._health_server.stop(None)
            if self._metrics_endpoint is not None:
                self._metrics_endpoint.stop()
            for address in self.config.listen_addresses:
                if address.unix_path is not None:
                    with contextlib.suppress(OSError):
                        address.unix_path.unlink()
            self._stopped.set()
            _log.info("stopped", extra={"seconds": round(time.monotonic() - started, 3)})


async def _health_servicer() -> health.aio.HealthServicer:
    """Health for ``""`` and the coordinator service, NOT_SERVING until ready."""
    servicer = health.aio.HealthServicer()
    for service in ("", SERVICE_NAME):
        await servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    return servicer


async def _start_coordinator_server(
    config: SidecarConfig,
    coordinator: Coordinator,
    health_servicer: health.aio.HealthServicer,
    metrics: SidecarMetrics,
) -> tuple[grpc.aio.Server, tuple[str, ...]]:
    """The gRPC server of every ``--listen`` address: coordinator, health, reflection.

    Raises:
        StartupError: an address cannot be bound.
    """
    server = grpc.aio.server(options=_SERVER_OPTIONS)
    pb_grpc.add_WorkspaceCoordinatorServicer_to_server(
        CoordinatorServicer(coordinator, ErrorTranslator(metrics)), server
    )
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    bound = tuple(_bind(server, a) for a in config.listen_addresses)
    await server.start()
    for address in config.listen_addresses:
        if address.unix_path is not None:
            os.chmod(address.unix_path, SOCKET_MODE)
    return server, bound


async def _start_health_server(
    port: int, health_servicer: health.aio.HealthServicer
) -> tuple[grpc.aio.Server, int]:
    """The plain-TCP health port for kubelet probes: Health and reflection only.

    Raises:
        StartupError: the port cannot be bound.
    """
    server = grpc.aio.server(options=_SERVER_OPTIONS)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    # grpcurl (and anything else without the .proto) finds Health/Check
    # through reflection; only the health service is listed here.
    reflection.enable_server_reflection((health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = ListenAddress(target=f"{HEALTH_HOST}:{port}", host=HEALTH_HOST, port=port)
    bound = int(_bind(server, address).rpartition(":")[2])
    await server.start()
    return server, bound


def node_name(config: SidecarConfig) -> str:
    """This node's name: ``--node-name``, else the hostname."""
    return config.node_name or socket.gethostname()


def _open_replica(config: SidecarConfig, metrics: SidecarMetrics) -> Replica | None:
    """The cluster store beside the node's SQLite (None: SQLite alone).

    Raises:
        StartupError: a file the etcd URL names cannot be read.
    """
    target = config.store_target
    if isinstance(target, SqliteStore):
        return None
    try:
        client = EtcdClient.from_target(target)
    except ValueError as error:  # EtcdUrlError: a TLS or password file
        raise StartupError(f"--store: {error}") from None
    return EtcdReplica(client, target.prefix, StoreMetrics(metrics.registry))


def _start_metrics(metrics: SidecarMetrics, port: int) -> MetricsEndpoint:
    """The Prometheus endpoint on ``port``.

    Raises:
        StartupError: the port cannot be bound.
    """
    try:
        return start_metrics_endpoint(metrics, port, HEALTH_HOST)
    except OSError as error:
        raise StartupError(f"cannot serve metrics on {HEALTH_HOST}:{port}: {error}") from None


async def start_server(config: SidecarConfig, *, clock: Clock = time.time) -> RunningServer:
    """Loads the state, binds every address, and starts serving.

    Health answers NOT_SERVING until the state is loaded and every port is
    bound, then SERVING.

    Raises:
        StoreError: the state directory is unusable (locked, corrupt, unknown schema).
        StartupError: an address cannot be bound.
    """
    metrics = SidecarMetrics()
    replica = _open_replica(config, metrics)
    store = StateStore(config.state_dir)
    started: list[grpc.aio.Server] = []
    endpoint: MetricsEndpoint | None = None
    replica_started = False
    try:
        coordinator = Coordinator(
            store,
            round_timeout=config.round_timeout,
            admin_enabled=config.enable_admin,
            metrics=metrics,
            clock=clock,
            replica=replica,
            node=node_name(config),
        )
        coordinator.start()
        if replica is not None:
            # Merges what etcd holds before the first round (bounded by the
            # URL's timeout; an unreachable etcd is logged, not fatal).
            replica_started = True
            await replica.start(coordinator)
        health_servicer = await _health_servicer()
        server, bound = await _start_coordinator_server(
            config, coordinator, health_servicer, metrics
        )
        started.append(server)
        health_server: grpc.aio.Server | None = None
        health_port: int | None = None
        if config.health_port is not None:
            health_server, health_port = await _start_health_server(
                config.health_port, health_servicer
            )
            started.append(health_server)
        if config.metrics_port is not None:
            endpoint = _start_metrics(metrics, config.metrics_port)
        for service in ("", SERVICE_NAME):
            await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    except BaseException:
        for running in started:
            await running.stop(None)
        if endpoint is not None:
            endpoint.stop()
        if replica is not None and replica_started:
            await replica.close(0.0)
        store.close()
        raise
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
            "state_dir": str(config.state_dir),
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
        _health=health_servicer,
        _health_server=health_server,
        _metrics_endpoint=endpoint,
        _replica=replica,
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
