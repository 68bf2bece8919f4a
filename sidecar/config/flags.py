"""The ``serve`` flags and their environment variables, read into a :class:`SidecarConfig`.

Every ``serve`` flag ``--some-flag`` can also come from the environment as
``MOE_SIDECAR_SOME_FLAG``; a flag given on the command line wins over the
environment. An unknown ``MOE_SIDECAR_*`` key is an error naming it (a typo
must not silently run with a default), except the keys of the client library
(:data:`CLIENT_ENV_KEYS`, e.g. ``MOE_SIDECAR_TARGET``) and of its engines'
rooms (:data:`ENGINE_ENV_KEYS`).
"""

from __future__ import annotations

import argparse
import difflib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from moe_sidecar.config.model import SidecarConfig
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
    LOG_FORMATS,
    MAX_LIMIT,
    MAX_STORE_PAGE_BYTES,
    MAX_STREAM_RECEIVE_BYTES,
    ConfigError,
    parse_listen_address,
)
from moe_sidecar.core.defaults import CLIENT_ENV_KEYS, ENV_PREFIX, parse_bool
from moe_sidecar.core.limits import DEFAULT_MAX_WORKSPACE_BYTES

__all__ = ["ENGINE_ENV_KEYS", "add_serve_arguments", "check_environment", "config_from_flags"]

ENGINE_ENV_KEYS: Final = frozenset({"MOE_SIDECAR_VLLM", "MOE_SIDECAR_SGLANG"})
"""The keys with the project's prefix that the client's engine rooms read
(``moe_sidecar.client.engines``: vLLM's plugin switch), which the sidecar
leaves to them. The daemon imports no client module, so the names are
spelled here; ``tests/unit/test_engine_env_keys.py`` checks them against
each room's ``settings.ENV_KEYS``."""


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


def _path(text: str) -> Path:
    # Path("") is Path("."): an empty value would silently mean the working directory.
    if not str(text).strip():
        raise ValueError("must name a path; empty would mean the working directory")
    return Path(text)


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
        _path,
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
        "--reconnect-window",
        "reconnect_window",
        _seconds,
        "seconds a started sidecar waits for the ranks it read back to reconnect before "
        "it declares them lost (default 30; 0: never)",
        "SECONDS",
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
        "RPCs in flight at once on the coordinator listeners; one more is refused "
        "RESOURCE_EXHAUSTED naming the flag (default 4096)",
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
    _Option("--tls-cert", "tls_cert", _path, "PEM certificate for TCP listeners", "FILE"),
    _Option("--tls-key", "tls_key", _path, "PEM private key for TCP listeners", "FILE"),
    _Option(
        "--tls-client-ca",
        "tls_client_ca",
        _path,
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
        "bytes one page of a read of etcd's prefix may hold: its keys are listed this over "
        "--store-max-document-bytes at a time, each document then read alone "
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
        _path,
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
_STREAM_OPTIONS = (
    _Option(
        "--max-sessions",
        "max_sessions",
        _integer,
        f"Session streams open at once; one more is RESOURCE_EXHAUSTED (default "
        f"{DEFAULT_MAX_SESSIONS})",
        "N",
    ),
    _Option(
        "--stream-receive-bytes",
        "stream_receive_bytes",
        _integer,
        "bytes a coordinator stream's peer may send before the sidecar reads them (the HTTP/2 "
        "window of each stream, not grown by gRPC's BDP probing), so a peer that writes and "
        f"never reads holds at most about twice this (default {DEFAULT_STREAM_RECEIVE_BYTES}, at most "
        f"{MAX_STREAM_RECEIVE_BYTES})",
        "BYTES",
    ),
    _Option(
        "--stream-write-timeout",
        "stream_write_timeout",
        _seconds,
        "seconds a Watch stream's message may wait for its peer to read it; then, or at once "
        "when the stream overflowed its queue meanwhile, its connection is shut down (default "
        f"{DEFAULT_STREAM_WRITE_TIMEOUT:g})",
        "SECONDS",
    ),
)
_OPTIONS += _STREAM_OPTIONS
_ENV_KEYS = frozenset(o.env_key for o in _OPTIONS)
_HELP_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("listeners", ("--listen",)),
    (
        "health and metrics",
        ("--health-port", "--health-host", "--metrics-port", "--metrics-host"),
    ),
    (
        "state and store",
        ("--state-dir", "--store", "--node-name", *(o.flag for o in _STORE_OPTIONS)),
    ),
    ("TLS", ("--tls-cert", "--tls-key", "--tls-client-ca", "--insecure")),
    (
        "rounds, admin and shutdown",
        ("--round-timeout", "--reconnect-window", "--enable-admin", "--grace-period"),
    ),
    ("logs", ("--log-format", "--log-level")),
    (
        "limits (each bounds a resource; moe_sidecar_limit exports them)",
        (
            *(o.flag for o in _OPTIONS if o.flag.startswith("--max-") and o not in _STORE_OPTIONS),
            "--idle-connection-timeout",
            "--metrics-request-timeout",
            "--stream-receive-bytes",
            "--stream-write-timeout",
        ),
    ),
)
"""``serve --help``'s sections, each flag in one (a test checks none is left out)."""


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds every ``serve`` flag to ``parser``.

    Flags default to None so that :func:`config_from_flags` can tell a flag
    that was given from one that was not (and fall back to the environment).
    They are listed in sections (listeners, health and metrics, state and
    store, TLS, ...).

    Raises:
        AssertionError: a flag of the option table is in no section.
    """
    by_flag = {o.flag: o for o in _OPTIONS}
    for title, flags in _HELP_GROUPS:
        group = parser.add_argument_group(title)
        for flag in flags:
            _add_option(group, by_flag.pop(flag))
    if by_flag:  # a new option must be given a section
        raise AssertionError(f"serve flags in no help section: {sorted(by_flag)}")


def _add_option(parser: argparse._ActionsContainer, option: _Option) -> None:
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


def check_environment(environ: Mapping[str, str]) -> None:
    """Refuses a ``MOE_SIDECAR_*`` key that neither the sidecar nor the client reads.

    A typo must not run silently with a default, in ``serve`` or any other
    command; the message names the first unknown key and the closest known one.

    Raises:
        ConfigError: an unknown key (the message names it and its value).
    """
    known = _ENV_KEYS | CLIENT_ENV_KEYS | ENGINE_ENV_KEYS
    unknown = sorted(k for k in environ if k.startswith(ENV_PREFIX) and k not in known)
    if not unknown:
        return
    key = unknown[0]
    # Compared without the prefix, which every key shares and would make any two close.
    suffixes = sorted(k.removeprefix(ENV_PREFIX) for k in known)
    close = difflib.get_close_matches(key.removeprefix(ENV_PREFIX), suffixes, n=1, cutoff=0.7)
    hint = (
        f"did you mean {ENV_PREFIX}{close[0]}?"
        if close
        else f"each serve flag --some-flag is {ENV_PREFIX}SOME_FLAG (moe-sidecar serve --help)"
    )
    also = f" (also unknown: {', '.join(unknown[1:])})" if unknown[1:] else ""
    raise ConfigError(f"unknown environment variable {key}={environ[key]!r}; {hint}{also}")


def config_from_flags(args: argparse.Namespace, environ: Mapping[str, str]) -> SidecarConfig:
    """Builds the config from parsed ``serve`` flags over the environment.

    Raises:
        ConfigError: an unknown ``MOE_SIDECAR_*`` key, or a malformed value
            (the message names the flag or env key and the value).
    """
    check_environment(environ)
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
    """``message`` (which starts ``field=value: ...`` or ``field: ...``, as every
    check above writes it) with the field spelled as the user gave it: the flag
    or the variable to change. A field left at its default is named by its flag."""
    match = re.match(r"([a-z_]+)(=|: )", message)
    option = next((o for o in _OPTIONS if match and o.dest == match.group(1)), None)
    if match is None or option is None:
        return message
    source = sources.get(option.dest, option.flag)
    sep, rest = match.group(2), message[match.end() :]
    if sep == ": ":
        return f"{source}: {rest}"
    return f"{source}={rest}" if source.startswith(ENV_PREFIX) else f"{source} {rest}"
