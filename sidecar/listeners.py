"""The sidecar's listeners: the coordinator's gRPC server, the health port and the metrics endpoint.

What :func:`moe_sidecar.server.start_server` binds, each start-up helper
raising :class:`StartupError` with a message naming the flag to change.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import stat
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from moe_sidecar.config import (
    SidecarConfig,
)
from moe_sidecar.health import HealthServicer
from moe_sidecar.metrics import MetricsEndpoint, SidecarMetrics, start_metrics_endpoint
from moe_sidecar.rpc_limit import UNCOUNTED_METHODS, RpcLimit
from moe_sidecar.servicer import SERVICE_NAME, CoordinatorServicer, coordinator_handler
from moe_sidecar.state import Coordinator
from moe_sidecar.status import ErrorTranslator
from moe_sidecar.wire.address import ListenAddress

__all__ = [
    "SOCKET_MODE",
    "StartupError",
    "lock_socket_path",
    "not_serving_health",
    "socket_lock_path",
    "start_coordinator_server",
    "start_health_server",
    "start_metrics",
]

_BIND_HINTS = {
    "--listen": "give another --listen address, or stop the process that holds it",
    "--health-port": "give another --health-port (0 disables the health server)",
    "--metrics-port": "give another --metrics-port (0 disables the metrics endpoint)",
}
"""What to change when the address a flag names is taken (a second sidecar on
the same machine takes every default port of the first)."""
SOCKET_MODE = 0o660
"""Owner and group (the inference container's) may connect; nobody else."""


# SO_REUSEPORT (gRPC's default on Linux) would let a second sidecar bind the
# same TCP port and silently split the ranks of a group between two state
# holders; a second sidecar must fail to start instead.
_SERVER_OPTIONS = (("grpc.so_reuseport", 0),)


def _listener_options(
    max_connections: int, idle_timeout: float, max_queued_rpcs: int
) -> tuple[tuple[str, int], ...]:
    """gRPC core's bounds of one server's listeners (each verified against a
    real server: tests/integration/test_attacks_net.py).

    - ``grpc.max_allowed_incoming_connections``: connections each listening
      port holds at once; one more is closed as it arrives.
    - ``grpc.max_connection_idle_ms``: a connection with no call in flight is
      sent GOAWAY and closed (a plaintext connection counts from its accept).
    - ``grpc.server_handshake_timeout_ms``: a TLS handshake that does not
      finish in time is closed (120 s by default).
    - ``grpc.server.max_pending_requests`` and its hard limit: calls received
      but not yet started. Beyond its defaults (1,000 soft, 3,000 hard) gRPC
      cancels new calls (CANCELLED), where the sidecar would have answered
      RESOURCE_EXHAUSTED naming the limit.
    """
    idle_ms = max(1, round(idle_timeout * 1000))
    return (
        ("grpc.max_allowed_incoming_connections", max_connections),
        ("grpc.max_connection_idle_ms", idle_ms),
        ("grpc.server_handshake_timeout_ms", idle_ms),
        ("grpc.server.max_pending_requests", max_queued_rpcs),
        ("grpc.server.max_pending_requests_hard_limit", max_queued_rpcs),
    )


class StartupError(Exception):
    """The server cannot start: an address is taken or unusable."""


def _refuse_a_file_that_is_no_socket(address: ListenAddress) -> None:
    """Refuses a ``--listen`` path that holds something other than a socket.

    Checked before the lock beside it is made, so a refused path leaves
    nothing behind.

    Raises:
        StartupError: the path exists and is not a socket (the message names ``--listen``).
    """
    assert address.unix_path is not None
    try:
        mode = address.unix_path.lstat().st_mode
    except FileNotFoundError:
        return
    except OSError as error:
        raise StartupError(
            f"--listen {address.target}: cannot use the socket path: {error.strerror}; "
            f"{_BIND_HINTS['--listen']}"
        ) from None
    if not stat.S_ISSOCK(mode):
        raise StartupError(
            f"--listen {address.target}: {str(address.unix_path)!r} exists and is not a socket; "
            "refusing to replace it; give --listen a path where no file is, or remove it"
        )


def _prepare_socket_path(address: ListenAddress) -> None:
    """Creates the socket's directory and removes a stale socket file.

    Raises:
        StartupError: the path is not a socket, or a live process serves on it.
    """
    path = address.unix_path
    assert path is not None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise StartupError(
            f"--listen {address.target}: cannot create {str(path.parent)!r}: {error.strerror}"
        ) from None
    _refuse_a_file_that_is_no_socket(address)
    if not path.exists():
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(str(path))
    except OSError as error:
        if error.errno not in (errno.ECONNREFUSED, errno.ENOENT):
            raise StartupError(
                f"--listen {address.target}: cannot probe the socket {str(path)!r}: {error}"
            ) from None
        # Nobody accepts on it: left behind by a sidecar that died.
        path.unlink(missing_ok=True)
    else:
        raise StartupError(
            f"--listen {address.target}: address already in use (another process listens on "
            f"{str(path)!r}); {_BIND_HINTS['--listen']}"
        )
    finally:
        probe.close()


def _server_credentials(config: SidecarConfig) -> grpc.ServerCredentials | None:
    """TLS for the TCP listeners, when configured (mTLS with a client CA).

    Raises:
        StartupError: a certificate, key or CA file cannot be read.
    """
    if config.tls_cert is None or config.tls_key is None:
        return None
    try:
        chain = config.tls_cert.read_bytes()
        key = config.tls_key.read_bytes()
        ca = config.tls_client_ca.read_bytes() if config.tls_client_ca is not None else None
    except OSError as error:
        raise StartupError(f"cannot read the TLS files: {error}") from None
    return grpc.ssl_server_credentials(
        [(key, chain)], root_certificates=ca, require_client_auth=ca is not None
    )


def _bind_failure(address: ListenAddress) -> tuple[str, bool] | None:
    """Why ``address`` cannot be bound (TCP) and whether another socket holds
    it, or None when it can be bound.

    Probed with a socket of our own, bound as gRPC binds (``SO_REUSEADDR``, no
    ``SO_REUSEPORT``), before gRPC is given the address: gRPC's own failure
    says only "Failed to bind" and prints a line of its C core, where the
    user needs the flag to change and the cause. A port of 0 (any free
    port) is never taken.
    """
    host = address.host[1:-1] if address.host.startswith("[") else address.host
    try:
        candidates = socket.getaddrinfo(
            host, address.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except OSError as error:
        return f"cannot resolve {host!r}: {error.strerror or error}", False
    for family, kind, proto, _, sockaddr in candidates:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(sockaddr)
            except OSError as error:
                if error.errno == errno.EADDRINUSE and address.port != 0:
                    taken = "address already in use (another process, perhaps another "
                    return taken + "moe-sidecar, listens there)", True
                if error.errno == errno.EADDRNOTAVAIL:
                    return f"{error.strerror} (not an address of this machine)", False
                if error.errno != errno.EADDRINUSE:
                    return str(error.strerror), False
    return None


@contextlib.contextmanager
def _core_log_captured() -> Iterator[list[str]]:
    """Holds what gRPC's C core writes to stderr (fd 2) while the block runs.

    gRPC logs a failed bind itself, a line of its own before ours; the
    block's caller puts that line's cause into its one error line instead.
    The list given to the block holds the text once the block ends; text of
    a block that ended without an error is written back to stderr, unchanged.
    """
    captured: list[str] = []
    with tempfile.TemporaryFile() as held:
        saved = os.dup(2)
        os.dup2(held.fileno(), 2)
        failed = False
        try:
            yield captured
        except BaseException:
            failed = True
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            text = held.read().decode(errors="replace")
            captured.append(text)
            if text and not failed:
                sys.stderr.write(text)


def _core_cause(text: str) -> str:
    """The message of gRPC's last C-core log line (after its ``file.cc:N]`` header)."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return ""
    return lines[-1].partition("] ")[2] or lines[-1]


def _bind(
    server: grpc.aio.Server,
    address: ListenAddress,
    credentials: grpc.ServerCredentials | None = None,
    *,
    flag: str = "--listen",
    value: object = None,
) -> str:
    """Binds ``address`` on ``server``; returns the client target it serves.

    Raises:
        StartupError: the address cannot be bound; the message names ``flag``
            (with ``value``, the address by default) and the cause.
    """
    given = f"{flag} {value if value is not None else address.target}"
    if address.unix_path is not None:
        _prepare_socket_path(address)
    elif (failure := _bind_failure(address)) is not None:
        where = "" if value is None else f" {address.host}:{address.port}:"
        cause, taken = failure
        hint = _BIND_HINTS[flag] if taken else f"give another {flag}"
        raise StartupError(f"{given}:{where} {cause}; {hint}")
    try:
        with _core_log_captured() as core_log:
            # Unix sockets are guarded by their file mode; TCP by TLS when configured.
            if credentials is not None and address.unix_path is None:
                port = server.add_secure_port(address.target, credentials)
            else:
                port = server.add_insecure_port(address.target)
    except RuntimeError as error:
        cause = _core_cause(core_log[0]) or str(error)
        raise StartupError(f"{given}: cannot listen on {address.target!r}: {cause}") from None
    if address.unix_path is not None:
        return address.target
    if port == 0:
        raise StartupError(
            f"{given}: cannot listen on {address.target!r} (address already in use, or not an "
            f"address of this machine); {_BIND_HINTS[flag]}"
        )
    return f"{address.host}:{port}"


def not_serving_health() -> HealthServicer:
    """Health for ``""`` and the coordinator service, NOT_SERVING until ready."""
    servicer = HealthServicer()
    for service in ("", SERVICE_NAME):
        servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    return servicer


def socket_lock_path(socket_path: Path) -> Path:
    """The lock file of a Unix socket: ``<socket>.lock`` beside it."""
    return socket_path.with_name(socket_path.name + ".lock")


def lock_socket_path(address: ListenAddress) -> int:
    """Holds ``<socket>.lock`` for the server's life, so that no second sidecar
    probes, replaces or removes this socket while this one starts or serves
    (two sidecars started at once on one path otherwise both ran, one
    unreachable). Returns the lock's file descriptor.

    Raises:
        StartupError: the path holds a file that is no socket (no lock is
            made then), another sidecar holds the lock, or the directory is
            unusable.
    """
    path = address.unix_path
    assert path is not None
    _refuse_a_file_that_is_no_socket(address)
    lock = socket_lock_path(path)
    while True:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, SOCKET_MODE)
        except OSError as error:
            raise StartupError(
                f"--listen {address.target}: cannot use the socket path: {error}"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StartupError(
                f"--listen {address.target}: address already in use (another moe-sidecar serves "
                f"or is starting on {str(path)!r}: its lock {str(lock)!r} is held); "
                f"{_BIND_HINTS['--listen']}"
            ) from None
        # A sidecar that stopped removes its lock file before releasing it:
        # a lock taken on the file it removed guards nothing, so take the
        # file the path names now.
        if _names_the_same_file(lock, fd):
            return fd
        os.close(fd)


def _names_the_same_file(path: Path, fd: int) -> bool:
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


async def start_coordinator_server(
    config: SidecarConfig,
    coordinator: Coordinator,
    health_servicer: HealthServicer,
    metrics: SidecarMetrics,
) -> tuple[grpc.aio.Server, CoordinatorServicer, tuple[str, ...]]:
    """The gRPC server of every ``--listen`` address: coordinator, health, reflection,
    at most ``--max-concurrent-rpcs`` calls in flight (:class:`RpcLimit`).

    Raises:
        StartupError: an address cannot be bound or the TLS files read.
    """
    translator = ErrorTranslator(metrics)
    server = grpc.aio.server(
        options=(
            *_SERVER_OPTIONS,
            ("grpc.max_concurrent_streams", config.max_streams_per_connection),
            # A stream's window stays what the flag says: BDP probing grew it
            # to about 4 MiB for a peer that writes and never reads.
            ("grpc.http2.bdp_probe", 0),
            ("grpc.http2.lookahead_bytes", config.stream_receive_bytes),
            *_listener_options(
                config.max_listener_connections,
                config.idle_connection_timeout,
                config.max_queued_rpcs,
            ),
        ),
        # Not gRPC's maximum_concurrent_rpcs: its refusal is INTERNAL and names
        # nothing; RpcLimit's is RESOURCE_EXHAUSTED naming the flag.
        interceptors=(
            RpcLimit(
                metrics,
                translator,
                config.max_concurrent_rpcs,
                flag="--max-concurrent-rpcs",
                resource="concurrent_rpcs",
                gauge=metrics.rpcs_in_flight,
                uncounted=UNCOUNTED_METHODS,
            ),
        ),
    )
    servicer = CoordinatorServicer(
        coordinator,
        translator,
        max_page_size=config.max_page_size,
        max_sessions=config.max_sessions,
        stream_write_timeout=config.stream_write_timeout,
    )
    server.add_generic_rpc_handlers((coordinator_handler(servicer),))
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    credentials = _server_credentials(config)
    bound = tuple(_bind(server, a, credentials) for a in config.listen_addresses)
    await server.start()
    for address in config.listen_addresses:
        if address.unix_path is not None:
            os.chmod(address.unix_path, SOCKET_MODE)
    return server, servicer, bound


class _StreamSlots:
    """The long-lived streams of the health port (Health.Watch, reflection):
    at most ``limit`` at once, so that a flood of them leaves the rest of the
    port's RPC limit to kubelet's probes (Health.Check)."""

    def __init__(self, limit: int, metrics: SidecarMetrics) -> None:
        self.limit = limit
        self.open = 0
        self._metrics = metrics

    @contextlib.asynccontextmanager
    async def slot(self, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[None]:
        if self.open >= self.limit:
            self._metrics.refused("health_streams")
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.open} streams are open on the health port; at most {self.limit} (half "
                "of --max-health-rpcs, the rest is kept for Health.Check probes)",
            )
        self.open += 1
        try:
            yield
        finally:
            self.open -= 1


class _HealthPortHealth(health_pb2_grpc.HealthServicer):  # type: ignore[misc]
    """The shared health statuses, with Watch streams counted in ``slots``."""

    def __init__(self, shared: HealthServicer, slots: _StreamSlots) -> None:
        self._shared = shared
        self._slots = slots

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> health_pb2.HealthCheckResponse:
        return await self._shared.Check(request, context)

    async def List(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        return await self._shared.List(request, context)

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        async with self._slots.slot(context):
            await self._shared.Watch(request, context)


class _HealthPortReflection(reflection.aio.ReflectionServicer):  # type: ignore[misc]
    """Reflection of the health port, its streams counted in ``slots``."""

    def __init__(self, names: tuple[str, ...], slots: _StreamSlots) -> None:
        super().__init__(names)
        self._slots = slots

    async def ServerReflectionInfo(
        self,
        request_iterator: AsyncIterator[reflection_pb2.ServerReflectionRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[reflection_pb2.ServerReflectionResponse]:
        async with self._slots.slot(context):
            async for response in super().ServerReflectionInfo(request_iterator, context):
                yield response


def _health_port_options(config: SidecarConfig) -> tuple[tuple[str, int], ...]:
    """The health port's bounds: connections, idle time, and streams per
    connection (no more than the port's RPC limit, which probes share)."""
    return (
        *_SERVER_OPTIONS,
        ("grpc.max_concurrent_streams", config.max_health_rpcs),
        *_listener_options(
            config.max_health_connections, config.idle_connection_timeout, config.max_queued_rpcs
        ),
    )


async def start_health_server(
    config: SidecarConfig, health_servicer: HealthServicer, metrics: SidecarMetrics
) -> tuple[grpc.aio.Server | None, int | None]:
    """The plain-TCP health port for kubelet probes and its bound port, or
    (None, None) with ``--health-port 0``: Health and reflection only, at
    most ``--max-health-rpcs`` calls at once, of which at most half
    long-lived streams (Health.Watch, reflection), so probes are answered
    under a flood of streams.

    Raises:
        StartupError: the port cannot be bound.
    """
    if config.health_port is None:
        return None, None
    host, port, max_rpcs = config.health_host, config.health_port, config.max_health_rpcs
    # Not gRPC's maximum_concurrent_rpcs (INTERNAL, naming nothing): RpcLimit
    # counts every call here, probes too, as gRPC's bound did.
    rpc_limit = RpcLimit(
        metrics,
        ErrorTranslator(metrics),
        max_rpcs,
        flag="--max-health-rpcs",
        resource="health_rpcs",
        gauge=metrics.health_rpcs_in_flight,
    )
    server = grpc.aio.server(options=_health_port_options(config), interceptors=(rpc_limit,))
    slots = _StreamSlots(max(1, max_rpcs // 2), metrics)
    health_pb2_grpc.add_HealthServicer_to_server(_HealthPortHealth(health_servicer, slots), server)
    # grpcurl (and anything else without the .proto) finds Health/Check
    # through reflection; only the health service is listed here.
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
        _HealthPortReflection((health.SERVICE_NAME, reflection.SERVICE_NAME), slots), server
    )
    bracketed = f"[{host}]" if ":" in host and not host.startswith("[") else host
    address = ListenAddress(target=f"{bracketed}:{port}", host=bracketed, port=port)
    bound = int(_bind(server, address, flag="--health-port", value=port).rpartition(":")[2])
    await server.start()
    return server, bound


async def start_metrics(
    config: SidecarConfig, metrics: SidecarMetrics, port: int
) -> MetricsEndpoint:
    """The Prometheus endpoint on ``--metrics-host:port``.

    Raises:
        StartupError: the port cannot be bound.
    """
    host = config.metrics_host.strip("[]")  # asyncio binds a bare IPv6 address
    try:
        return await start_metrics_endpoint(
            metrics,
            port,
            host,
            max_connections=config.max_metrics_connections,
            request_timeout=config.metrics_request_timeout,
        )
    except OSError as error:
        if error.errno == errno.EADDRINUSE:
            cause = (
                f"{config.metrics_host}:{port}: address already in use (another process, "
                "perhaps another moe-sidecar, listens there)"
            )
        else:
            cause = f"cannot serve metrics on {config.metrics_host}:{port}: {error.strerror}"
        raise StartupError(
            f"--metrics-port {port}: {cause}; {_BIND_HINTS['--metrics-port']}"
        ) from None
