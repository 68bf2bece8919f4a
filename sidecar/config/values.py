"""The configuration's values: its error, defaults, bounds and the parsers of addresses and stores.

The pieces that :class:`moe_sidecar.config.SidecarConfig` validates with and
that the flags of :mod:`moe_sidecar.config.flags` name in their help.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TypeAlias

from moe_sidecar.core.defaults import DEFAULT_TARGET
from moe_sidecar.etcd.url import EtcdTarget, EtcdUrlError, parse_etcd_url
from moe_sidecar.wire.address import AddressError, ListenAddress
from moe_sidecar.wire.address import parse_listen_address as _parse_address

__all__ = [
    "DEFAULT_HEALTH_HOST",
    "DEFAULT_LISTEN",
    "DEFAULT_MAX_MERGED_GROUPS",
    "DEFAULT_MAX_SESSIONS",
    "DEFAULT_METRICS_HOST",
    "DEFAULT_STATE_DIR",
    "DEFAULT_STORE_MAX_DOCUMENT_BYTES",
    "DEFAULT_STORE_MAX_EPOCH_LEAD",
    "DEFAULT_STORE_MAX_GENERATION_LEAD",
    "DEFAULT_STORE_PAGE_BYTES",
    "DEFAULT_STREAM_RECEIVE_BYTES",
    "DEFAULT_STREAM_WRITE_TIMEOUT",
    "LIMIT_FIELDS",
    "LISTENER_TIMEOUT_FIELDS",
    "LOG_FORMATS",
    "LOG_LEVELS",
    "MAX_LIMIT",
    "MAX_NODE_NAME_LENGTH",
    "MAX_SECONDS",
    "MAX_STORE_PAGE_BYTES",
    "MAX_STREAM_RECEIVE_BYTES",
    "MIN_STORE_DOCUMENT_BYTES",
    "MIN_STREAM_RECEIVE_BYTES",
    "ConfigError",
    "SqliteStore",
    "StoreTarget",
    "check_host",
    "check_int",
    "check_port",
    "check_seconds",
    "parse_listen_address",
    "parse_store_url",
]

DEFAULT_LISTEN = (DEFAULT_TARGET,)
LOG_FORMATS = ("auto", "json", "text")
"""``auto``: text on a terminal, JSON otherwise (a container's log, a file, a pipe)."""
DEFAULT_HEALTH_HOST = "127.0.0.1"
"""Loopback: the health server is reachable from other machines only when
configured (``--health-host 0.0.0.0``, which the Kubernetes example sets so
that the kubelet's probes reach it)."""
DEFAULT_METRICS_HOST = "127.0.0.1"
"""Loopback, as the health server: Prometheus on the pod network needs
``--metrics-host 0.0.0.0``."""
MAX_LIMIT = 1 << 20
LIMIT_FIELDS = (
    "max_groups",
    "max_watchers",
    "max_concurrent_rpcs",
    "max_streams_per_connection",
    "max_health_rpcs",
    "max_metrics_connections",
    "max_group_series",
    "max_page_size",
    *("max_listener_connections", "max_health_connections", "max_queued_rpcs"),
)
"""Every bounded resource's limit (all flags; the metrics export them too)."""
LISTENER_TIMEOUT_FIELDS = (
    "idle_connection_timeout",
    "metrics_request_timeout",
    "stream_write_timeout",
)
"""The listeners' timeouts in seconds (flags; the metrics export them too)."""
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
MAX_SECONDS = 86400.0
DEFAULT_STATE_DIR = Path("/var/lib/moe-sidecar")
MAX_NODE_NAME_LENGTH = 253
"""A DNS name's length: Kubernetes node names are DNS subdomains."""
# --- the cluster store's limits (the fields and flags below) ---
DEFAULT_STORE_PAGE_BYTES = 32 << 20
MAX_STORE_PAGE_BYTES = 48 << 20
"""Below the etcd client's 64 MiB receive limit, with room for a page's framing."""
DEFAULT_STORE_MAX_DOCUMENT_BYTES = 1 << 20
"""A document with the full history (256 growths, 256-character names) is
about 190 KB; etcd's own default request limit is 1.5 MiB."""
MIN_STORE_DOCUMENT_BYTES = 1 << 12
DEFAULT_STORE_MAX_GENERATION_LEAD = 1_000_000
"""A generation counts growths; no group grows a million times."""
DEFAULT_STORE_MAX_EPOCH_LEAD = 100_000
"""An epoch counts admin resets."""
DEFAULT_MAX_MERGED_GROUPS = 128
# --- the streams' bounds (the fields and flags below) ---
DEFAULT_STREAM_RECEIVE_BYTES = 64 << 10
"""Bytes a coordinator stream's peer may send before the sidecar reads them:
the HTTP/2 window each stream is given, kept there (gRPC's BDP probing, which
grew it to about 4 MiB for a peer that writes and never reads, is off)."""
MIN_STREAM_RECEIVE_BYTES = 1 << 12
MAX_STREAM_RECEIVE_BYTES = 16 << 20
DEFAULT_STREAM_WRITE_TIMEOUT = 10.0
"""Seconds a Watch stream's message may wait for its peer to take it before
the stream is cut off (its connection shut down): a peer that never reads
would otherwise hold the call, and its place, for as long as it stays."""
DEFAULT_MAX_SESSIONS = 2048
"""Session streams open at once: 32 groups of 64 ranks, below
``max_concurrent_rpcs`` (4096) so a flood meets this bound, named, first."""


class ConfigError(ValueError):
    """A configuration value is malformed; the message names where it came from."""


def parse_listen_address(value: str, field: str = "listen") -> ListenAddress:
    """:func:`moe_sidecar.wire.address.parse_listen_address`, its error as a :class:`ConfigError`.

    Raises:
        ConfigError: the address is malformed (the message names ``field``).
    """
    try:
        return _parse_address(value, field)
    except AddressError as error:
        raise ConfigError(str(error)) from error


@dataclass(frozen=True)
class SqliteStore:
    """Plans in the node's own SQLite database only (``sqlite:///DIR``)."""

    path: Path
    """The state directory holding the database."""


StoreTarget: TypeAlias = SqliteStore | EtcdTarget
"""A parsed ``--store``: the node's SQLite alone, or etcd beside it."""


def parse_store_url(value: str) -> StoreTarget:
    """Parses ``sqlite:///ABSOLUTE/DIR`` or an etcd URL (:mod:`moe_sidecar.etcd.url`).

    Raises:
        ConfigError: the URL is malformed (the message quotes it).
    """
    if value.startswith("sqlite:"):
        raw = value[len("sqlite://") :] if value.startswith("sqlite://") else ""
        if not raw.startswith("/") or raw.startswith("//"):
            raise ConfigError(
                f"store={value!r}: expected sqlite:///ABSOLUTE/DIR (three slashes, then the "
                "state directory)"
            )
        return SqliteStore(Path(raw))
    if value.startswith(("etcd://", "etcds://")):
        try:
            return parse_etcd_url(value)
        except EtcdUrlError as error:
            raise ConfigError(f"store: {error}") from None
    raise ConfigError(
        f"store={value!r}: expected sqlite:///DIR (one node) or "
        "etcd://HOST:PORT[,HOST:PORT...]/PREFIX (etcds:// for TLS)"
    )


def check_port(name: str, value: int | None) -> None:
    if value is not None and not 0 <= value <= 65535:
        raise ConfigError(f"{name}={value!r}: must be in [0, 65535] (or None to disable)")


def check_host(name: str, value: str) -> None:
    if not value or any(c.isspace() or c == "/" for c in value):
        raise ConfigError(
            f"{name}={value!r}: must be an address to bind, e.g. 127.0.0.1 (loopback only) or "
            "0.0.0.0 (every interface)"
        )


def check_int(name: str, value: int, low: int, high: int, why: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        suffix = f" ({why})" if why else ""
        raise ConfigError(f"{name}={value!r}: must be an integer in [{low}, {high}]{suffix}")


def check_seconds(name: str, value: float, *, low: float, low_inclusive: bool) -> None:
    ok = math.isfinite(value) and (value >= low if low_inclusive else value > low)
    if not ok or value > MAX_SECONDS:
        bound = "[" if low_inclusive else "("
        raise ConfigError(f"{name}={value!r}: must be in {bound}{low:g}, {MAX_SECONDS:g}] seconds")
