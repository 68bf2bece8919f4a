"""The sidecar's configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from moe_sidecar.config.values import (
    DEFAULT_HEALTH_HOST,
    DEFAULT_LISTEN,
    DEFAULT_MAX_MERGED_GROUPS,
    DEFAULT_MAX_SESSIONS,
    DEFAULT_METRICS_HOST,
    DEFAULT_STATE_DIR,
    DEFAULT_STORE_MAX_DOCUMENT_BYTES,
    DEFAULT_STORE_MAX_EPOCH_LEAD,
    DEFAULT_STORE_MAX_GENERATION_LEAD,
    DEFAULT_STORE_PAGE_BYTES,
    DEFAULT_STREAM_RECEIVE_BYTES,
    DEFAULT_STREAM_WRITE_TIMEOUT,
    LIMIT_FIELDS,
    LISTENER_TIMEOUT_FIELDS,
    LOG_FORMATS,
    LOG_LEVELS,
    MAX_LIMIT,
    MAX_NODE_NAME_LENGTH,
    MAX_STORE_PAGE_BYTES,
    MAX_STREAM_RECEIVE_BYTES,
    MIN_STORE_DOCUMENT_BYTES,
    MIN_STREAM_RECEIVE_BYTES,
    ConfigError,
    SqliteStore,
    StoreTarget,
    check_host,
    check_int,
    check_port,
    check_seconds,
    parse_listen_address,
    parse_store_url,
)
from moe_sidecar.core.limits import (
    DEFAULT_MAX_WORKSPACE_BYTES,
    MAX_GENERATION,
    MAX_WORKSPACE_BYTES,
)
from moe_sidecar.wire.address import ListenAddress, is_loopback

__all__ = ["SidecarConfig"]


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
    reconnect_window: float = 30.0
    """Seconds a started sidecar waits for the ranks it read back to speak
    again before it declares them lost (0: it waits for nobody)."""
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
    # --- the cluster store: what this node trusts of etcd (flags: config_flags) ---
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
    # --- the streams' bounds (flags: --max-sessions, --stream-receive-bytes,
    # --stream-write-timeout) ---
    stream_receive_bytes: int = DEFAULT_STREAM_RECEIVE_BYTES
    """Bytes a coordinator stream's peer may send before the sidecar reads them."""
    max_sessions: int = DEFAULT_MAX_SESSIONS
    """Session streams open at once; one more is RESOURCE_EXHAUSTED."""
    stream_write_timeout: float = DEFAULT_STREAM_WRITE_TIMEOUT
    """Seconds a Watch stream's message may wait for its peer to read it; then
    (or at once when its queue overflowed meanwhile) the stream is cut off."""
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
        check_port("health_port", self.health_port)
        check_port("metrics_port", self.metrics_port)
        if not str(self.state_dir):
            raise ConfigError("state_dir='': must name a directory")
        self._set_store()
        self._check_node_name()
        check_seconds("round_timeout", self.round_timeout, low=0.0, low_inclusive=False)
        check_seconds("grace_period", self.grace_period, low=0.0, low_inclusive=True)
        check_seconds("reconnect_window", self.reconnect_window, low=0.0, low_inclusive=True)
        for name in LISTENER_TIMEOUT_FIELDS:
            check_seconds(name, getattr(self, name), low=0.0, low_inclusive=False)
        if self.log_format not in LOG_FORMATS:
            raise ConfigError(f"log_format={self.log_format!r}: must be one of {LOG_FORMATS}")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"log_level={self.log_level!r}: must be one of {LOG_LEVELS}")
        for name in LIMIT_FIELDS:
            check_int(name, getattr(self, name), 1, MAX_LIMIT)
        check_int("max_workspace_bytes", self.max_workspace_bytes, 1, MAX_WORKSPACE_BYTES)
        for name in ("health_host", "metrics_host"):
            check_host(name, getattr(self, name))
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
        check_int("store_page_bytes", self.store_page_bytes, 1 << 16, MAX_STORE_PAGE_BYTES)
        check_int(
            "store_max_document_bytes",
            self.store_max_document_bytes,
            MIN_STORE_DOCUMENT_BYTES,
            self.store_page_bytes,
            "at most store_page_bytes",
        )
        for name in ("store_max_generation_lead", "store_max_epoch_lead"):
            check_int(name, getattr(self, name), 1, MAX_GENERATION)
        check_int("max_merged_groups", self.max_merged_groups, 0, MAX_LIMIT)
        check_int("max_sessions", self.max_sessions, 1, MAX_LIMIT)
        check_int(
            "stream_receive_bytes",
            self.stream_receive_bytes,
            MIN_STREAM_RECEIVE_BYTES,
            MAX_STREAM_RECEIVE_BYTES,
        )
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
