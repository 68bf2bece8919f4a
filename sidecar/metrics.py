"""Prometheus metrics of one sidecar, in a registry of its own.

A registry per :class:`SidecarMetrics` (not prometheus_client's global one)
lets several servers run in one process, as the tests do, without their
series colliding.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

__all__ = [
    "ROUND_LATENCY_BUCKETS",
    "GroupSeries",
    "MetricsEndpoint",
    "SidecarMetrics",
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


@dataclass
class GroupSeries:
    """The labelled children of one group, looked up once (``labels()`` costs
    microseconds on every proposal otherwise)."""

    name: str
    rounds: Counter
    """The unlabelled family; children per action are cached below."""
    rebuilds: Counter
    workspace_bytes: Gauge
    waiting_ranks: Gauge
    rounds_by_action: dict[str, Counter] = field(default_factory=dict)

    def round_closed(self, action: str) -> None:
        """Counts one closed round with outcome ``action``."""
        child = self.rounds_by_action.get(action)
        if child is None:
            child = self.rounds.labels(group=self.name, action=action)
            self.rounds_by_action[action] = child
        child.inc()


class SidecarMetrics:
    """Every series the sidecar exports; the state holder and the error mapper update it."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.rounds = Counter(
            "moe_sidecar_rounds",
            "Closed rounds by group and outcome (build, reuse, rebuild, refused, timed_out).",
            ["group", "action"],
            registry=self.registry,
        )
        self.rebuilds = Counter(
            "moe_sidecar_rebuilds",
            "Rounds that told the ranks to rebuild their workspace.",
            ["group"],
            registry=self.registry,
        )
        self.workspace_bytes = Gauge(
            "moe_sidecar_workspace_bytes",
            "Per-rank workspace bytes of the group's stored plan (0: none stored).",
            ["group"],
            registry=self.registry,
        )
        self.round_latency = Histogram(
            "moe_sidecar_round_latency_seconds",
            "Time from a round's first proposal to its close.",
            buckets=ROUND_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.errors = Counter(
            "moe_sidecar_errors",
            "RPCs answered with an error, by gRPC status code.",
            ["code"],
            registry=self.registry,
        )
        self.waiting_ranks = Gauge(
            "moe_sidecar_waiting_ranks",
            "Local ranks that proposed the group's open round and wait for the rest.",
            ["group"],
            registry=self.registry,
        )
        self.groups = Gauge(
            "moe_sidecar_groups",
            "Groups this sidecar knows.",
            registry=self.registry,
        )
        self._groups: dict[str, GroupSeries] = {}

    def group(self, name: str) -> GroupSeries:
        """The series of group ``name``."""
        series = self._groups.get(name)
        if series is None:
            series = self._groups[name] = GroupSeries(
                name=name,
                rounds=self.rounds,
                rebuilds=self.rebuilds.labels(group=name),
                workspace_bytes=self.workspace_bytes.labels(group=name),
                waiting_ranks=self.waiting_ranks.labels(group=name),
            )
        return series


@dataclass
class MetricsEndpoint:
    """The HTTP server exposing a registry; ``port`` is the bound port."""

    port: int
    _server: WSGIServer
    _thread: threading.Thread

    def stop(self) -> None:
        """Stops serving and frees the port. Idempotent."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(timeout=5.0)
        self._server.server_close()


def start_metrics_endpoint(
    metrics: SidecarMetrics, port: int, host: str = "0.0.0.0"
) -> MetricsEndpoint:
    """Serves ``metrics`` over HTTP on ``host:port`` (port 0: any free port).

    Raises:
        OSError: the port cannot be bound.
    """
    server, thread = start_http_server(port, addr=host, registry=metrics.registry)
    return MetricsEndpoint(port=int(server.server_address[1]), _server=server, _thread=thread)
