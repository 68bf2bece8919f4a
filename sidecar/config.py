"""The sidecar's configuration: one frozen dataclass, built from flags and env.

Every ``serve`` flag ``--some-flag`` can also come from the environment as
``MOE_SIDECAR_SOME_FLAG``; a flag given on the command line wins over the
environment. An unknown ``MOE_SIDECAR_*`` key is an error naming it (a typo
must not silently run with a default), except the keys of the client library
(:data:`CLIENT_ENV_KEYS`, e.g. ``MOE_SIDECAR_TARGET``).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeAlias

from moe_sidecar.core.defaults import CLIENT_ENV_KEYS, DEFAULT_TARGET, ENV_PREFIX, parse_bool
from moe_sidecar.core.limits import (
    DEFAULT_MAX_WORKSPACE_BYTES,
    MAX_GENERATION,
    MAX_WORKSPACE_BYTES,
)
from moe_sidecar.etcd_url import EtcdTarget, EtcdUrlError, parse_etcd_url
from moe_sidecar.wire.address import (
    AddressError,
    ListenAddress,
    is_loopback,
)
from moe_sidecar.wire.address import parse_listen_address as _parse_address

__all__ = [
    "DEFAULT_HEALTH_HOST",
    "DEFAULT_LISTEN",
    "DEFAULT_METRICS_HOST",
    "DEFAULT_STATE_DIR",
    "LOG_FORMATS",
    "ConfigError",
    "SidecarConfig",
    "SqliteStore",
    "StoreTarget",
    "add_serve_arguments",
    "config_from_flags",
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
LISTENER_TIMEOUT_FIELDS = ("idle_connection_timeout", "metrics_request_timeout")
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
    """Parses ``sqlite:///ABSOLUTE/DIR`` or an etcd URL (:mod:`moe_sidecar.etcd_url`).

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


def _check_port(name: str, value: int | None) -> None:
    if value is not None and not 0 <= value <= 65535:
        raise ConfigError(f"{name}={value!r}: must be in [0, 65535] (or None to disable)")


def _check_host(name: str, value: str) -> None:
    if not value or any(c.isspace() or c == "/" for c in value):
        raise ConfigError(
            f"{name}={value!r}: must be an address to bind, e.g. 127.0.0.1 (loopback only) or "
            "0.0.0.0 (every interface)"
        )


def _check_int(name: str, value: int, low: int, high: int, why: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        suffix = f" ({why})" if why else ""
        raise ConfigError(f"{name}={value!r}: must be an integer in [{low}, {high}]{suffix}")


def _check_seconds(name: str, value: float, *, low: float, low_inclusive: bool) -> None:
    ok = math.isfinite(value) and (value >= low if low_inclusive else value > low)
    if not ok or value > MAX_SECONDS:
        bound = "[" if low_inclusive else "("
        raise ConfigError(f"{name}={value!r}: must be in {bound}{low:g}, {MAX_SECONDS:g}] seconds")


@dataclass(frozen=True)
class SidecarConfig:
    """Everything ``serve`` needs; validated on construction.

    ``health_port`` and ``metrics_port`` are None when disabled; 0 asks the
    OS for a free port (the server reports which). On the command line a
    port of 0 disables the endpoint instead and ``auto`` asks the OS, as
    documented for the flags.

    Raises:
        ConfigError: any field is malformed (the message names it and the value).
    """

    listen: tuple[str, ...] = DEFAULT_LISTEN
    health_port: int | None = 50052
    health_host: str = DEFAULT_HEALTH_HOST
    """Address the health server binds (``0.0.0.0``: every interface)."""
    metrics_port: int | None = 9464
    state_dir: Path = DEFAULT_STATE_DIR
    round_timeout: float = 60.0
    log_format: str = "auto"
    log_level: str = "INFO"
    grace_period: float = 5.0
    enable_admin: bool = False
    max_groups: int = 128
    """Groups the sidecar keeps; a proposal for one more is RESOURCE_EXHAUSTED.
    A group can hold up to about 0.7 MiB of the sidecar's memory and 0.26 MB of
    its database (full growth history, 64 ranks, an open round and a restart,
    256-character names), so 128 such groups fit the manifest's 256 Mi memory
    limit and 64 Mi state volume (tests/integration/test_attacks.py)."""
    max_watchers: int = 64
    """Watch streams open at once."""
    max_concurrent_rpcs: int = 4096
    """RPCs in flight at once on the coordinator's listeners (each waiting
    Propose and each Watch is one)."""
    max_streams_per_connection: int = 256
    """HTTP/2 streams one client connection may open at once."""
    max_health_rpcs: int = 64
    """RPCs in flight at once on the health port (kubelet probes, Health.Watch)."""
    max_metrics_connections: int = 16
    """Connections the metrics endpoint serves at once."""
    # Listener bounds: what a flood of connections can hold. An idle HTTP/2
    # connection costs the sidecar about 15 KiB; with these defaults every
    # port together holds at most a few MiB of them however many arrive.
    max_listener_connections: int = 256
    """Connections each coordinator listener (each ``--listen``) holds at once;
    one more is closed as it arrives."""
    max_health_connections: int = 64
    """Connections the health port holds at once; one more is closed as it arrives."""
    max_queued_rpcs: int = 16384
    """Calls a listener has received but not yet started that may wait at
    once. gRPC cancels (CANCELLED) calls beyond its own default of 1,000-3,000
    instead of refusing them; up to this many wait and are answered, beyond
    the RPC limits RESOURCE_EXHAUSTED."""
    idle_connection_timeout: float = 60.0
    """Seconds a gRPC connection (coordinator or health port) stays open with
    no call in flight, or in its TLS handshake, before the sidecar closes it.
    A rank's Session stream is a call in flight: it is never closed for this."""
    metrics_request_timeout: float = 5.0
    """Seconds a metrics connection may take to send its request (and to read
    the answer); when every slot is taken, the connection waiting longest for
    its request is closed to make room, so a scrape always gets one."""
    max_group_series: int = 256
    """Groups with metric series of their own; the rest are summed under group="_other"."""
    max_page_size: int = 500
    """Most groups one ListGroups page holds."""
    max_workspace_bytes: int = DEFAULT_MAX_WORKSPACE_BYTES
    """The per-rank workspace ceiling: a proposal, a commit, a decided plan or a
    cluster document whose FlashInfer workspace is above it is refused, naming it."""
    metrics_host: str = DEFAULT_METRICS_HOST
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    """With it, TCP listeners require client certificates signed by this CA (mTLS)."""
    insecure: bool = False
    """Allow plaintext TCP beyond loopback (the operator knows the network is private)."""
    store: str = ""
    """``sqlite:///DIR`` or ``etcd://...``; empty: the SQLite in ``state_dir``."""
    node_name: str = ""
    """This node's name in plan origins; empty: the hostname."""
    # --- the cluster store: what this node trusts of etcd (see _STORE_OPTIONS) ---
    store_page_bytes: int = DEFAULT_STORE_PAGE_BYTES
    """Bytes one page of a prefix read may hold (a page's key count is this
    over ``store_max_document_bytes``); pages are merged one by one."""
    store_max_document_bytes: int = DEFAULT_STORE_MAX_DOCUMENT_BYTES
    """A document in etcd longer than this is set aside unread."""
    store_max_generation_lead: int = DEFAULT_STORE_MAX_GENERATION_LEAD
    """A document whose generation is this far past the group's here is set aside."""
    store_max_epoch_lead: int = DEFAULT_STORE_MAX_EPOCH_LEAD
    """A document whose epoch is this far past the group's here is set aside."""
    store_key_file: Path | None = None
    """A key every sidecar of the cluster holds: documents carry an HMAC with
    it, and one without a valid HMAC is set aside."""
    max_merged_groups: int = DEFAULT_MAX_MERGED_GROUPS
    """Groups created here from the cluster store (no local rank yet); they do
    not count against ``max_groups``."""
    listen_addresses: tuple[ListenAddress, ...] = field(init=False, repr=False, compare=False)
    store_target: StoreTarget = field(init=False, repr=False, compare=False)
    """``store`` parsed; with etcd, the node's SQLite in ``state_dir`` stays
    the write-ahead record."""

    def __post_init__(self) -> None:
        if isinstance(self.listen, str) or not self.listen:
            raise ConfigError(f"listen={self.listen!r}: give a non-empty tuple of addresses")
        parsed = tuple(parse_listen_address(a) for a in self.listen)
        seen: set[str] = set()
        for address in parsed:
            key = str(address.unix_path) if address.is_unix else f"{address.host}:{address.port}"
            if key in seen and not (address.port == 0 and not address.is_unix):
                raise ConfigError(f"listen={address.target!r}: given twice")
            seen.add(key)
        object.__setattr__(self, "listen_addresses", parsed)
        _check_port("health_port", self.health_port)
        _check_port("metrics_port", self.metrics_port)
        if not str(self.state_dir):
            raise ConfigError("state_dir='': must name a directory")
        self._set_store()
        self._check_node_name()
        _check_seconds("round_timeout", self.round_timeout, low=0.0, low_inclusive=False)
        _check_seconds("grace_period", self.grace_period, low=0.0, low_inclusive=True)
        for name in LISTENER_TIMEOUT_FIELDS:
            _check_seconds(name, getattr(self, name), low=0.0, low_inclusive=False)
        if self.log_format not in LOG_FORMATS:
            raise ConfigError(f"log_format={self.log_format!r}: must be one of {LOG_FORMATS}")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"log_level={self.log_level!r}: must be one of {LOG_LEVELS}")
        for name in LIMIT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_LIMIT:
                raise ConfigError(f"{name}={value!r}: must be an integer in [1, {MAX_LIMIT}]")
        value = self.max_workspace_bytes
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or not 1 <= value <= MAX_WORKSPACE_BYTES
        ):
            raise ConfigError(
                f"max_workspace_bytes={value!r}: must be an integer in [1, {MAX_WORKSPACE_BYTES}]"
            )
        for name in ("health_host", "metrics_host"):
            _check_host(name, getattr(self, name))
        self._check_tls()
        self._check_store_limits()

    @property
    def tls(self) -> bool:
        """Whether TCP listeners serve TLS."""
        return self.tls_cert is not None

    def _check_tls(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError(
                f"tls_cert={self.tls_cert!r}, tls_key={self.tls_key!r}: give both or neither"
            )
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ConfigError(
                f"tls_client_ca={str(self.tls_client_ca)!r}: client certificates need "
                "--tls-cert and --tls-key too"
            )
        for name in ("tls_cert", "tls_key", "tls_client_ca"):
            path = getattr(self, name)
            if path is not None and not path.is_file():
                raise ConfigError(f"{name}={str(path)!r}: no such file")
        if self.tls or self.insecure:
            return
        for address in self.listen_addresses:
            if not address.is_unix and not is_loopback(address.host):
                raise ConfigError(
                    f"listen={address.target!r}: TCP beyond loopback needs TLS (--tls-cert and "
                    "--tls-key, optionally --tls-client-ca for client certificates), or "
                    "--insecure if this network is private and every peer on it may act as "
                    "any rank"
                )

    def _set_store(self) -> None:
        target: StoreTarget = (
            parse_store_url(self.store) if self.store else SqliteStore(self.state_dir)
        )
        if isinstance(target, SqliteStore) and target.path != self.state_dir:
            if self.state_dir != DEFAULT_STATE_DIR:
                raise ConfigError(
                    f"store={self.store!r} and state_dir={str(self.state_dir)!r} name two "
                    "directories; give one of them"
                )
            object.__setattr__(self, "state_dir", target.path)
        object.__setattr__(self, "store_target", target)

    def _check_store_limits(self) -> None:
        _check_int("store_page_bytes", self.store_page_bytes, 1 << 16, MAX_STORE_PAGE_BYTES)
        _check_int(
            "store_max_document_bytes",
            self.store_max_document_bytes,
            MIN_STORE_DOCUMENT_BYTES,
            self.store_page_bytes,
            "at most store_page_bytes",
        )
        for name in ("store_max_generation_lead", "store_max_epoch_lead"):
            _check_int(name, getattr(self, name), 1, MAX_GENERATION)
        _check_int("max_merged_groups", self.max_merged_groups, 0, MAX_LIMIT)
        key = self.store_key_file
        if key is not None and not key.is_file():
            raise ConfigError(f"store_key_file={str(key)!r}: no such file")

    def _check_node_name(self) -> None:
        name = self.node_name
        if len(name) > MAX_NODE_NAME_LENGTH or not name.isprintable() or name != name.strip():
            raise ConfigError(
                f"node_name={name[:40]!r}: at most {MAX_NODE_NAME_LENGTH} printable "
                "characters, no leading or trailing space"
            )


# --- flags and environment -------------------------------------------------------


def _port_or_disabled(text: str) -> int | None:
    # 0 already means "disabled" here, so a port the OS picks is spelled
    # "auto" (the config's 0); the "serving" log line names the port bound.
    if text.strip().lower() == "auto":
        return 0
    try:
        port = int(text)
    except ValueError:
        raise ValueError(
            "must be a port number in [0, 65535] (0 disables it; auto: a port the OS picks)"
        ) from None
    if not 0 <= port <= 65535:
        raise ValueError(f"{port} is not in [0, 65535] (0 disables it)")
    return None if port == 0 else port


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"must be a whole number in [1, {MAX_LIMIT}]") from None


def _seconds(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError("must be a number of seconds, e.g. 60 or 2.5") from None


def _bool(text: str) -> bool:
    return parse_bool(text)


def _listen(texts: list[str]) -> tuple[str, ...]:
    return tuple(t.strip() for t in texts)


@dataclass(frozen=True)
class _Option:
    flag: str
    dest: str
    convert: Callable[[Any], object]
    help: str
    metavar: str | None = None
    choices: tuple[str, ...] | None = None

    @property
    def env_key(self) -> str:
        return ENV_PREFIX + self.flag.lstrip("-").replace("-", "_").upper()


_OPTIONS: tuple[_Option, ...] = (
    _Option(
        "--listen",
        "listen",
        _listen,
        "address to serve on: unix:///path/sock or host:port; repeatable. Any --listen "
        f"replaces the default listener {DEFAULT_LISTEN[0]}: give it too to keep it "
        "(env: comma-separated)",
        "ADDR",
    ),
    _Option(
        "--health-port",
        "health_port",
        _port_or_disabled,
        "TCP port of the grpc.health.v1 server on --health-host, for kubelet probes "
        "(default 50052; 0 disables; auto: a port the OS picks, named in the serving log line)",
        "N",
    ),
    _Option(
        "--health-host",
        "health_host",
        str,
        f"address the health server binds (default {DEFAULT_HEALTH_HOST}, loopback only; "
        "0.0.0.0 for probes from the pod network)",
        "HOST",
    ),
    _Option(
        "--metrics-port",
        "metrics_port",
        _port_or_disabled,
        "TCP port of the Prometheus endpoint on --metrics-host (default 9464; 0 disables; "
        "auto: a port the OS picks, named in the serving log line)",
        "N",
    ),
    _Option(
        "--state-dir",
        "state_dir",
        Path,
        f"directory of the SQLite state, created if missing (default {DEFAULT_STATE_DIR}, "
        "which needs root or a directory made for this user; e.g. --state-dir ./state)",
        "DIR",
    ),
    _Option(
        "--round-timeout",
        "round_timeout",
        _seconds,
        "seconds a round waits for its missing local ranks (default 60)",
        "SECONDS",
    ),
    _Option(
        "--log-format",
        "log_format",
        str,
        "log line format (default auto: text on a terminal, json otherwise)",
        choices=LOG_FORMATS,
    ),
    _Option(
        "--log-level",
        "log_level",
        lambda t: str(t).upper(),
        "DEBUG, INFO, WARNING, ERROR or CRITICAL (default INFO)",
        "LEVEL",
    ),
    _Option(
        "--grace-period",
        "grace_period",
        _seconds,
        "seconds to drain in-flight calls on shutdown (default 5)",
        "SECONDS",
    ),
    _Option(
        "--store",
        "store",
        str,
        "where plans are kept: sqlite:///DIR (default: the SQLite database in --state-dir; "
        "one node) or etcd://HOST:PORT[,HOST:PORT...]/PREFIX[?cacert=..&cert=..&key=..&"
        "user=..&password-file=..&timeout=..] (etcds:// for TLS): every node merges its plans "
        "into etcd and watches the prefix; the SQLite in --state-dir stays the node's "
        "write-ahead record",
        "URL",
    ),
    _Option(
        "--node-name",
        "node_name",
        str,
        "this node's name in plan histories (default: the hostname; on Kubernetes, spec.nodeName)",
        "NAME",
    ),
    _Option(
        "--enable-admin",
        "enable_admin",
        _bool,
        "allow admin calls (ResetGroup, RemoveGroup); off by default",
    ),
    _Option(
        "--max-groups",
        "max_groups",
        _integer,
        "groups kept at most; a new one beyond is refused RESOURCE_EXHAUSTED (default 128)",
        "N",
    ),
    _Option("--max-watchers", "max_watchers", _integer, "Watch streams at once (default 64)", "N"),
    _Option(
        "--max-concurrent-rpcs",
        "max_concurrent_rpcs",
        _integer,
        "RPCs in flight at once on the coordinator listeners (default 4096)",
        "N",
    ),
    _Option(
        "--max-streams-per-connection",
        "max_streams_per_connection",
        _integer,
        "HTTP/2 streams per client connection (default 256)",
        "N",
    ),
    _Option(
        "--max-health-rpcs",
        "max_health_rpcs",
        _integer,
        "RPCs in flight at once on the health port (default 64)",
        "N",
    ),
    _Option(
        "--max-metrics-connections",
        "max_metrics_connections",
        _integer,
        "connections the metrics endpoint serves at once (default 16)",
        "N",
    ),
    _Option(
        "--max-listener-connections",
        "max_listener_connections",
        _integer,
        "connections each --listen listener holds at once; more are closed on arrival "
        "(default 256)",
        "N",
    ),
    _Option(
        "--max-health-connections",
        "max_health_connections",
        _integer,
        "connections the health port holds at once; more are closed on arrival (default 64)",
        "N",
    ),
    _Option(
        "--max-queued-rpcs",
        "max_queued_rpcs",
        _integer,
        "calls received but not yet started that may wait per server; beyond them gRPC "
        "cancels new calls (default 16384)",
        "N",
    ),
    _Option(
        "--idle-connection-timeout",
        "idle_connection_timeout",
        _seconds,
        "seconds a gRPC connection with no call in flight (or in its TLS handshake) stays "
        "open (default 60)",
        "SECONDS",
    ),
    _Option(
        "--metrics-request-timeout",
        "metrics_request_timeout",
        _seconds,
        "seconds a metrics connection may take to send its request; when all are taken the "
        "one waiting longest is closed for a new one (default 5)",
        "SECONDS",
    ),
    _Option(
        "--max-group-series",
        "max_group_series",
        _integer,
        'groups with metric series of their own; the rest sum into group="_other" (default 256)',
        "N",
    ),
    _Option(
        "--max-page-size",
        "max_page_size",
        _integer,
        "groups per ListGroups page at most (default 500)",
        "N",
    ),
    _Option(
        "--max-workspace-bytes",
        "max_workspace_bytes",
        int,
        "per-rank workspace ceiling in bytes: a proposal, commit, decided plan or cluster "
        f"document beyond it is refused (default {DEFAULT_MAX_WORKSPACE_BYTES}, 64 GiB)",
        "BYTES",
    ),
    _Option(
        "--metrics-host",
        "metrics_host",
        str,
        f"address the metrics endpoint binds (default {DEFAULT_METRICS_HOST}, loopback only; "
        "0.0.0.0 for a scraper on the pod network)",
        "HOST",
    ),
    _Option("--tls-cert", "tls_cert", Path, "PEM certificate for TCP listeners", "FILE"),
    _Option("--tls-key", "tls_key", Path, "PEM private key for TCP listeners", "FILE"),
    _Option(
        "--tls-client-ca",
        "tls_client_ca",
        Path,
        "PEM CA bundle: TCP clients must present a certificate it signed (mTLS)",
        "FILE",
    ),
    _Option(
        "--insecure",
        "insecure",
        _bool,
        "allow plaintext TCP listeners beyond loopback (off by default)",
    ),
)
_STORE_OPTIONS = (
    _Option(
        "--store-page-bytes",
        "store_page_bytes",
        int,
        "bytes one page of a read of etcd's prefix may hold; pages are merged one by one "
        f"(default {DEFAULT_STORE_PAGE_BYTES}, at most {MAX_STORE_PAGE_BYTES})",
        "BYTES",
    ),
    _Option(
        "--store-max-document-bytes",
        "store_max_document_bytes",
        int,
        "a plan document in etcd longer than this is set aside unread "
        f"(default {DEFAULT_STORE_MAX_DOCUMENT_BYTES})",
        "BYTES",
    ),
    _Option(
        "--store-max-generation-lead",
        "store_max_generation_lead",
        int,
        "a document whose generation is this far past the group's here is set aside "
        f"(default {DEFAULT_STORE_MAX_GENERATION_LEAD})",
        "N",
    ),
    _Option(
        "--store-max-epoch-lead",
        "store_max_epoch_lead",
        int,
        "a document whose epoch is this far past the group's here is set aside "
        f"(default {DEFAULT_STORE_MAX_EPOCH_LEAD})",
        "N",
    ),
    _Option(
        "--store-key-file",
        "store_key_file",
        Path,
        "file holding a key (16 bytes or more) every sidecar of the cluster holds: documents "
        "written to etcd carry an HMAC-SHA256 with it, and documents without a valid one "
        "are set aside (default: none, documents are not authenticated)",
        "FILE",
    ),
    _Option(
        "--max-merged-groups",
        "max_merged_groups",
        int,
        "groups created here from etcd before any local rank proposed for them; they do not "
        f"count against --max-groups (default {DEFAULT_MAX_MERGED_GROUPS}; 0 merges only "
        "groups this node already has)",
        "N",
    ),
)
_OPTIONS += _STORE_OPTIONS
_ENV_KEYS = frozenset(o.env_key for o in _OPTIONS)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds every ``serve`` flag to ``parser``.

    Flags default to None so that :func:`config_from_flags` can tell a flag
    that was given from one that was not (and fall back to the environment).
    """
    for option in _OPTIONS:
        env_help = f" [env {option.env_key}]"
        if option.dest == "listen":
            parser.add_argument(
                option.flag,
                dest=option.dest,
                action="append",
                metavar=option.metavar,
                help=option.help + env_help,
            )
        elif option.convert is _bool:
            parser.add_argument(
                option.flag,
                dest=option.dest,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=option.help + env_help,
            )
        else:
            parser.add_argument(
                option.flag,
                dest=option.dest,
                metavar=option.metavar,
                choices=option.choices,
                help=option.help + env_help,
            )


def _from_env(option: _Option, text: str) -> object:
    raw: object = text
    if option.dest == "listen":
        raw = text.split(",")
        if any(not t.strip() for t in text.split(",")):
            raise ConfigError(f"{option.env_key}={text!r}: empty address in the list")
        for address in raw:
            parse_listen_address(address.strip(), option.env_key)  # errors name the variable
    if option.choices is not None and text not in option.choices:
        raise ConfigError(f"{option.env_key}={text!r}: must be one of {option.choices}")
    try:
        return option.convert(raw)
    except ValueError as error:
        raise ConfigError(f"{option.env_key}={text!r}: {error}") from None


def _from_flag(option: _Option, value: object) -> object:
    if isinstance(value, bool):
        return value
    if option.dest == "listen" and isinstance(value, list):
        for text in value:
            parse_listen_address(text.strip(), option.flag)  # errors name the flag
    try:
        return option.convert(value)
    except ValueError as error:
        raise ConfigError(f"{option.flag} {value!r}: {error}") from None


def config_from_flags(args: argparse.Namespace, environ: Mapping[str, str]) -> SidecarConfig:
    """Builds the config from parsed ``serve`` flags over the environment.

    Raises:
        ConfigError: an unknown ``MOE_SIDECAR_*`` key, or a malformed value
            (the message names the flag or env key and the value).
    """
    unknown = sorted(
        k for k in environ if k.startswith(ENV_PREFIX) and k not in _ENV_KEYS | CLIENT_ENV_KEYS
    )
    if unknown:
        raise ConfigError(
            f"unknown environment variable {unknown[0]}={environ[unknown[0]]!r}; the sidecar "
            f"reads {', '.join(sorted(_ENV_KEYS))}"
            + (f" (also unknown: {', '.join(unknown[1:])})" if unknown[1:] else "")
        )
    values: dict[str, object] = {}
    sources: dict[str, str] = {}
    for option in _OPTIONS:
        given = getattr(args, option.dest, None)
        if given is not None:
            values[option.dest] = _from_flag(option, given)
            sources[option.dest] = option.flag
        elif option.env_key in environ:
            values[option.dest] = _from_env(option, environ[option.env_key])
            sources[option.dest] = option.env_key
    try:
        return SidecarConfig(**values)  # type: ignore[arg-type]
    except ConfigError as error:
        raise ConfigError(_named_by_source(str(error), sources)) from None


def _named_by_source(message: str, sources: Mapping[str, str]) -> str:
    """``message`` (which starts ``field=value: ...``, as every check above
    writes it) with the field spelled as the user gave it: the flag or the
    variable to change. A field left at its default is named by its flag."""
    field, sep, rest = message.partition("=")
    option = next((o for o in _OPTIONS if o.dest == field), None)
    if not sep or option is None:
        return message
    source = sources.get(field, option.flag)
    return f"{source}={rest}" if source.startswith(ENV_PREFIX) else f"{source} {rest}"
