"""Prometheus metrics of one sidecar, in a registry of its own, and their endpoint.

A registry per :class:`SidecarMetrics` (not prometheus_client's global one)
lets several servers run in one process, as the tests do, without their
series colliding, and keeps the endpoint to the project's own series.

Everything is bounded: at most ``max_group_series`` groups get series of
their own (later ones are summed under ``group="_other"``, and a removed
group's series go with it), and the endpoint (:class:`MetricsEndpoint`, an
asyncio server on the sidecar's loop) holds at most ``max_connections``
connections at once, each with a deadline, closing the one idle longest
when another arrives: idle connections cost no threads, cannot pile up,
and cannot keep a scrape out.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import platform
from collections.abc import Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = [
    "OTHER_GROUPS",
    "ROUND_LATENCY_BUCKETS",
    "GroupSeries",
    "MetricsEndpoint",
    "SidecarMetrics",
    "installed_version",
    "start_metrics_endpoint",
]

ROUND_LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)
"""Rounds normally close in well under a millisecond; a slow rank makes it seconds."""
OTHER_GROUPS = "_other"
"""The ``group`` label of every group beyond ``max_group_series``."""
REQUEST_TIMEOUT_S = 5.0
"""A metrics connection must send its request within this long (the default
of ``--metrics-request-timeout``)."""
MAX_REQUEST_BYTES = 8192

_log = logging.getLogger("moe_sidecar.metrics")


@dataclass
class GroupSeries:
    """The labelled children of one group, looked up once (``labels()`` costs
    microseconds on every proposal otherwise)."""

    name: str
    rounds: Counter
    """The unlabelled family; children per action are cached below."""
    rebuilds: Counter
    workspace_bytes: Gauge | None
    """None for the summed ``_other`` series: a size is not a sum."""
    waiting_ranks: Gauge | None
    rounds_by_action: dict[str, Counter] = field(default_factory=dict)

    def round_closed(self, action: str) -> None:
        """Counts one closed round with outcome ``action``."""
        child = self.rounds_by_action.get(action)
        if child is None:
            child = self.rounds.labels(group=self.name, action=action)
            self.rounds_by_action[action] = child
        child.inc()

    def set_sizes(self, workspace_bytes: int, waiting_ranks: int) -> None:
        """The group's current plan size and waiting ranks (not for ``_other``)."""
        if self.workspace_bytes is not None and self.waiting_ranks is not None:
            self.workspace_bytes.set(workspace_bytes)
            self.waiting_ranks.set(waiting_ranks)

    def set_waiting(self, waiting_ranks: int) -> None:
        """The group's waiting ranks alone (not for ``_other``)."""
        if self.waiting_ranks is not None:
            self.waiting_ranks.set(waiting_ranks)


def installed_version() -> str:
    """The installed moe-sidecar's version (``unknown`` when run from a checkout
    without ``pip install``)."""
    try:
        return importlib.metadata.version("moe-sidecar")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class SidecarMetrics:
    """Every series the sidecar exports; the state holder and the servers update it.

    Args:
        max_group_series: groups with series of their own.
        limits: each bounded resource's limit, exported as ``moe_sidecar_limit``.
    """

    def __init__(
        self, max_group_series: int = 256, limits: Mapping[str, float] | None = None
    ) -> None:
        self.registry = CollectorRegistry()
        self._max_group_series = max_group_series
        self.rounds = self._counter(
            "moe_sidecar_rounds",
            "Closed rounds by group and outcome (build, reuse, rebuild, refused, timed_out, "
            "aborted).",
            ("group", "action"),
        )
        self.rebuilds = self._counter(
            "moe_sidecar_rebuilds",
            "Rounds that told the ranks to rebuild their workspace.",
            ("group",),
        )
        self.workspace_bytes = self._gauge(
            "moe_sidecar_workspace_bytes",
            "Per-rank workspace bytes of the group's stored plan (0: none stored).",
            ("group",),
        )
        self.round_latency = Histogram(
            "moe_sidecar_round_latency_seconds",
            "Time from a round's first proposal to its close.",
            buckets=ROUND_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.errors = self._counter(
            "moe_sidecar_errors", "RPCs answered with an error, by gRPC status code.", ("code",)
        )
        self.undecodable = self._counter(
            "moe_sidecar_undecodable_requests",
            "Requests whose bytes are not the method's message (answered INVALID_ARGUMENT).",
            ("method",),
        )
        self.waiting_ranks = self._gauge(
            "moe_sidecar_waiting_ranks",
            "Local ranks that wait for the rest: in the group's open round, or arrived at "
            "their lifetime's first round and sharing the group's proof.",
            ("group",),
        )
        self.groups = self._gauge("moe_sidecar_groups", "Groups this sidecar knows.")
        self.build_info = self._gauge(
            "moe_sidecar_build_info",
            "Always 1; its labels say which release of moe-sidecar runs, on which Python.",
            ("version", "python"),
        )
        self.build_info.labels(version=installed_version(), python=platform.python_version()).set(1)
        self.views = self._counter(
            "moe_sidecar_views",
            "Membership views decided, by the state they were decided in (proposed, "
            "committed, failed).",
            ("state",),
        )
        self.ranks_lost = self._counter(
            "moe_sidecar_ranks_lost",
            "Ranks whose session broke without a goodbye (a death their peers are told of).",
        )
        self._define_limit_series(limits or {})
        self._groups: dict[str, GroupSeries] = {}
        self._other: GroupSeries | None = None

    def _define_limit_series(self, limits: Mapping[str, float]) -> None:
        """The bounded resources' series: each limit, and what was refused for it."""
        self.limit = self._gauge(
            "moe_sidecar_limit",
            "The configured limit of each bounded resource (the --max-* flags).",
            ("resource",),
        )
        self.refusals = self._counter(
            "moe_sidecar_limit_refusals",
            "Requests refused because a bounded resource was full, by resource.",
            ("resource",),
        )
        self.proof_refusals = self._counter(
            "moe_sidecar_proof_refusals",
            "Proposals and commits refused (PERMISSION_DENIED) because their group proof did "
            "not match the group's ranks' (or a rank holding the group's proof took its slot "
            "back).",
        )
        self.sessions = self._gauge(
            "moe_sidecar_sessions", "Session streams open now (at most --max-sessions)."
        )
        self.watchers = self._gauge(
            "moe_sidecar_watchers", "Watch streams subscribed now (at most --max-watchers)."
        )
        self.rpcs_in_flight = self._gauge(
            "moe_sidecar_rpcs_in_flight",
            "Calls in flight on the coordinator listeners now (at most --max-concurrent-rpcs; "
            "Health.Check not counted).",
        )
        self.health_rpcs_in_flight = self._gauge(
            "moe_sidecar_health_rpcs_in_flight",
            "Calls in flight on the health port now (at most --max-health-rpcs; "
            "Health.Check counted).",
        )
        self.stream_cutoffs = self._counter(
            "moe_sidecar_stream_cutoffs",
            "Streams the sidecar cut off because their peer did not read: by method, reason "
            "(overflow: its queue overflowed while a write waited; write_timeout: a write "
            "waited --stream-write-timeout) and connection (shut: its TCP connection was shut "
            "down; not_found: it could not be, e.g. a Unix-socket peer).",
            ("method", "reason", "connection"),
        )
        for resource, value in limits.items():
            self.limit.labels(resource=resource).set(value)

    def _counter(self, name: str, documentation: str, labels: tuple[str, ...] = ()) -> Counter:
        """A counter ``name`` in this sidecar's registry."""
        return Counter(name, documentation, list(labels), registry=self.registry)

    def _gauge(self, name: str, documentation: str, labels: tuple[str, ...] = ()) -> Gauge:
        """A gauge ``name`` in this sidecar's registry."""
        return Gauge(name, documentation, list(labels), registry=self.registry)

    def group(self, name: str) -> GroupSeries:
        """The series of group ``name`` (the summed ``_other`` series beyond the limit)."""
        series = self._groups.get(name)
        if series is not None:
            return series
        if len(self._groups) >= self._max_group_series:
            if self._other is None:
                self._other = GroupSeries(
                    name=OTHER_GROUPS,
                    rounds=self.rounds,
                    rebuilds=self.rebuilds.labels(group=OTHER_GROUPS),
                    workspace_bytes=None,
                    waiting_ranks=None,
                )
            return self._other
        series = self._groups[name] = GroupSeries(
            name=name,
            rounds=self.rounds,
            rebuilds=self.rebuilds.labels(group=name),
            workspace_bytes=self.workspace_bytes.labels(group=name),
            waiting_ranks=self.waiting_ranks.labels(group=name),
        )
        return series

    def forget(self, name: str) -> None:
        """Drops a removed group's series. Idempotent."""
        series = self._groups.pop(name, None)
        if series is None:
            return
        for family in (self.rebuilds, self.workspace_bytes, self.waiting_ranks):
            with contextlib.suppress(KeyError):
                family.remove(name)
        for action in series.rounds_by_action:
            with contextlib.suppress(KeyError):
                self.rounds.remove(name, action)

    def refused(self, resource: str) -> None:
        """Counts one request refused because ``resource`` was full."""
        self.refusals.labels(resource=resource).inc()


@dataclass
class _MetricsConnection:
    """One connection of the endpoint: its task and whether its request came."""

    task: asyncio.Task[None]
    answering: bool = False
    """True once its request was read: it is being answered, not idle."""


@dataclass
class MetricsEndpoint:
    """The HTTP endpoint exposing a registry; ``port`` is the bound port."""

    port: int
    _server: asyncio.Server
    _connections: dict[asyncio.Task[None], _MetricsConnection]

    async def stop(self) -> None:
        """Stops serving, ends open connections and frees the port. Idempotent."""
        self._server.close()
        tasks = list(self._connections)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._server.wait_closed()


async def _serve_one(
    metrics: SidecarMetrics,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    connection: _MetricsConnection,
    seconds: float,
) -> None:
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), seconds)
    except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
        return
    connection.answering = True
    method, _, rest = head.partition(b" ")
    path = rest.partition(b" ")[0].partition(b"?")[0]
    if method not in (b"GET", b"HEAD"):
        status, body, kind = b"405 Method Not Allowed", b"only GET\n", b"text/plain"
    elif path not in (b"/", b"/metrics"):
        status, body, kind = b"404 Not Found", b"see /metrics\n", b"text/plain"
    else:
        status, body, kind = (
            b"200 OK",
            generate_latest(metrics.registry),
            CONTENT_TYPE_LATEST.encode(),
        )
    writer.write(
        b"HTTP/1.1 "
        + status
        + b"\r\nContent-Type: "
        + kind
        + b"\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\nConnection: close\r\n\r\n"
        + (body if method != b"HEAD" else b"")
    )
    with contextlib.suppress(ConnectionError, asyncio.TimeoutError):
        await asyncio.wait_for(writer.drain(), seconds)


def _make_room(connections: dict[asyncio.Task[None], _MetricsConnection]) -> bool:
    """Closes the connection that has waited longest for its request (the
    dict keeps arrival order). Returns False when every one is being answered."""
    for connection in connections.values():
        if not connection.answering:
            connection.task.cancel()
            del connections[connection.task]
            return True
    return False


async def start_metrics_endpoint(
    metrics: SidecarMetrics,
    port: int,
    host: str = "0.0.0.0",
    *,
    max_connections: int = 16,
    request_timeout: float = REQUEST_TIMEOUT_S,
) -> MetricsEndpoint:
    """Serves ``metrics`` over HTTP on ``host:port`` (port 0: any free port).

    At most ``max_connections`` connections are held at once. When one more
    arrives, the held connection that has waited longest for its request is
    closed to make room (a scraper sends its request at once, so idle
    sockets cannot keep scrapes out); only when every held one is being
    answered is the new one closed instead. Either is counted as a refusal
    of ``metrics_connections``. A connection has ``request_timeout`` seconds
    to send its request and as long to read the answer.

    Raises:
        OSError: the port cannot be bound.
    """
    connections: dict[asyncio.Task[None], _MetricsConnection] = {}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if len(connections) >= max_connections:
            metrics.refused("metrics_connections")
            if not _make_room(connections):
                writer.close()
                return
        connection = connections[task] = _MetricsConnection(task)
        try:
            await _serve_one(metrics, reader, writer, connection, request_timeout)
        finally:
            connections.pop(task, None)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    server = await asyncio.start_server(handle, host, port, limit=MAX_REQUEST_BYTES)
    bound = int(server.sockets[0].getsockname()[1])
    return MetricsEndpoint(port=bound, _server=server, _connections=connections)
