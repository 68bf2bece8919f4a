"""etcd URLs: endpoints, key prefix, TLS and auth in one string. Pure: no I/O
until a :class:`EtcdTarget` is asked for the files it names.

The syntax (what ``--store etcd://...`` takes)::

    etcd://HOST[:PORT][,HOST[:PORT]...][/PREFIX][?OPTION=VALUE&...]
    etcds://...      the same over TLS

``PORT`` defaults to 2379, ``PREFIX`` to ``/moe-sidecar`` (a ``/`` is added
at its end). Options, named after ``etcdctl``'s flags: ``cacert``, ``cert``,
``key`` (file paths; TLS only; ``cert`` and ``key`` go together), ``user``,
``password-file`` (the password is never written in the URL), ``server-name``
(the name to verify in the server's certificate; TLS only) and ``timeout``
(seconds per call).

Apart from :mod:`moe_sidecar.etcd.client` (which re-exports its names) so
that the configuration can check a URL without importing gRPC.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl, unquote

__all__ = [
    "DEFAULT_PORT",
    "DEFAULT_PREFIX",
    "DEFAULT_TIMEOUT",
    "MAX_TIMEOUT",
    "URL_OPTIONS",
    "EtcdTarget",
    "EtcdTls",
    "EtcdUrlError",
    "parse_etcd_url",
]

DEFAULT_PORT = 2379
"""etcd's client port, used when an endpoint names none."""
DEFAULT_PREFIX = "/moe-sidecar/"
"""The key prefix when the URL has no path."""
DEFAULT_TIMEOUT = 5.0
"""Seconds a call may take, all endpoints together (etcdctl's ``--command-timeout``)."""
MAX_TIMEOUT = 3600.0
URL_OPTIONS = ("cacert", "cert", "key", "user", "password-file", "server-name", "timeout")


class EtcdUrlError(ValueError):
    """An etcd URL (or a file it names) is malformed; the message names the value.

    The configuration reports it as a :class:`moe_sidecar.config.ConfigError`.
    """


@dataclass(frozen=True)
class EtcdTls:
    """TLS material, as PEM bytes; no CA means the system's trusted roots."""

    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = None
    server_name: str | None = None
    """The name to verify in the server's certificate instead of the host dialed."""


@dataclass(frozen=True)
class EtcdTarget:
    """One parsed etcd URL (see :func:`parse_etcd_url`)."""

    endpoints: tuple[str, ...]
    """``host:port`` each (``[v6addr]:port`` for IPv6), in the order given."""
    prefix: str
    """Every key lives under it; starts and ends with ``/``."""
    tls: bool = False
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    server_name: str | None = None
    user: str | None = None
    password_file: Path | None = None
    timeout: float = DEFAULT_TIMEOUT

    def tls_config(self) -> EtcdTls | None:
        """Reads the TLS files the URL names; None for plaintext.

        Raises:
            EtcdUrlError: a file cannot be read.
        """
        if not self.tls:
            return None
        return EtcdTls(
            ca=_read_option_file("cacert", self.ca_file),
            cert=_read_option_file("cert", self.cert_file),
            key=_read_option_file("key", self.key_file),
            server_name=self.server_name,
        )

    def password(self) -> str | None:
        """The password from ``password-file`` (its trailing newline dropped).

        Raises:
            EtcdUrlError: the file cannot be read or is not UTF-8.
        """
        raw = _read_option_file("password-file", self.password_file)
        if raw is None:
            return None
        try:
            return raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError as error:
            raise EtcdUrlError(f"password-file={self.password_file}: not UTF-8 text") from error


def _read_option_file(option: str, path: Path | None) -> bytes | None:
    if path is None:
        return None
    try:
        return path.read_bytes()
    except OSError as error:
        raise EtcdUrlError(f"{option}={path}: cannot read it: {error.strerror}") from error


def parse_etcd_url(value: str) -> EtcdTarget:
    """Parses ``etcd://host[:port][,host[:port]...][/prefix][?options]``.

    ``etcds://`` is the same over TLS. See the module docstring for the
    options. Pure: files the URL names are read later
    (:meth:`EtcdTarget.tls_config`, :meth:`EtcdTarget.password`).

    Raises:
        EtcdUrlError: the URL is malformed; the message quotes it and names
            the part at fault.
    """

    def fail(reason: str) -> EtcdUrlError:
        return EtcdUrlError(f"etcd URL {value!r}: {reason}")

    tls, netloc, path, query = _split_url(value, fail)
    endpoints = _parse_endpoints(netloc, fail)
    prefix = _parse_prefix(path, fail)
    options = _parse_options(query, fail)
    _check_options(options, tls, fail)

    def path_of(name: str) -> Path | None:
        return Path(options[name]) if name in options else None

    return EtcdTarget(
        endpoints=endpoints,
        prefix=prefix,
        tls=tls,
        ca_file=path_of("cacert"),
        cert_file=path_of("cert"),
        key_file=path_of("key"),
        server_name=options.get("server-name"),
        user=options.get("user"),
        password_file=path_of("password-file"),
        timeout=_parse_timeout(options, fail),
    )


_Fail = Callable[[str], EtcdUrlError]


def _split_url(value: str, fail: _Fail) -> tuple[bool, str, str, str]:
    """``(tls, endpoints, path, query)`` of the URL, split by hand: urllib's
    URL parsing refuses several bracketed IPv6 hosts."""
    scheme, sep, rest = value.partition("://")
    if not sep:
        raise fail(
            "the scheme is missing: etcd://HOST:PORT[,HOST:PORT...]/PREFIX (etcds:// for TLS)"
        )
    if scheme not in ("etcd", "etcds"):
        raise fail(f"the scheme must be etcd:// or etcds:// (TLS), not {scheme}://")
    rest, fragment, _ = rest.partition("#")
    if fragment:
        raise fail("a '#' fragment has no meaning here")
    rest, _, query = rest.partition("?")
    netloc, slash, raw_path = rest.partition("/")
    if "@" in netloc:
        raise fail(
            "credentials do not go before the host; use ?user=NAME&password-file=PATH "
            "(the password is never written in the URL)"
        )
    return scheme == "etcds", netloc, slash + raw_path, query


def _parse_endpoints(netloc: str, fail: _Fail) -> tuple[str, ...]:
    endpoints = tuple(_parse_endpoint(item, fail) for item in netloc.split(","))
    duplicates = sorted({e for e in endpoints if endpoints.count(e) > 1})
    if duplicates:
        raise fail(f"endpoint {duplicates[0]} is given twice")
    return endpoints


def _parse_prefix(raw_path: str, fail: _Fail) -> str:
    path = unquote(raw_path)
    if any(ord(c) < 0x20 or c == "\x7f" for c in path):
        raise fail("the prefix holds a control character")
    return DEFAULT_PREFIX if path in ("", "/") else path.rstrip("/") + "/"


def _parse_options(query: str, fail: _Fail) -> dict[str, str]:
    """The ``?name=value&...`` options, each known, given once and not empty."""
    options: dict[str, str] = {}
    if not query:
        return options
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=True)
    except ValueError as error:
        raise fail(f"the options {query!r} are malformed ({error})") from error
    for name, item in pairs:
        if name not in URL_OPTIONS:
            raise fail(f"unknown option {name!r}; known: {', '.join(URL_OPTIONS)}")
        if name in options:
            raise fail(f"option {name!r} is given twice")
        if not item:
            raise fail(f"option {name!r} has an empty value")
        options[name] = item
    return options


def _check_options(options: dict[str, str], tls: bool, fail: _Fail) -> None:
    """The options that only go with TLS, or only together."""
    if not tls:
        tls_only = [name for name in ("cacert", "cert", "key", "server-name") if name in options]
        if tls_only:
            raise fail(f"option {tls_only[0]!r} needs TLS: use etcds://")
    if ("cert" in options) != ("key" in options):
        raise fail("options 'cert' and 'key' (the client certificate and its key) go together")
    user = options.get("user")
    if user is not None and ":" in user:
        raise fail(
            "user must be a bare name; give the password with password-file=PATH, never in the URL"
        )
    if "password-file" in options and user is None:
        raise fail("option 'password-file' needs 'user'")


def _parse_timeout(options: dict[str, str], fail: _Fail) -> float:
    if "timeout" not in options:
        return DEFAULT_TIMEOUT
    text = options["timeout"]
    try:
        timeout = float(text)
    except ValueError as error:
        raise fail(f"timeout={text!r} is not a number of seconds") from error
    if not (math.isfinite(timeout) and 0 < timeout <= MAX_TIMEOUT):
        raise fail(f"timeout={text!r} must be in (0, {MAX_TIMEOUT:g}] seconds")
    return timeout


def _parse_endpoint(item: str, fail: _Fail) -> str:
    if not item:
        raise fail("an endpoint is empty (two commas, or none at all)")
    if item.startswith("["):
        host, bracket, rest = item[1:].partition("]")
        if not bracket or not host:
            raise fail(f"endpoint {item!r}: an IPv6 address needs [ADDRESS]:PORT")
        if rest and not rest.startswith(":"):
            raise fail(f"endpoint {item!r}: expected ':PORT' after ']'")
        port_text = rest[1:] if rest else ""
        shown_host = f"[{host}]"
    else:
        if item.count(":") > 1:
            raise fail(f"endpoint {item!r}: write an IPv6 address as [ADDRESS]:PORT")
        host, _, port_text = item.partition(":")
        if not host:
            raise fail(f"endpoint {item!r}: the host is empty")
        shown_host = host
        if ":" in item and not port_text:
            raise fail(f"endpoint {item!r}: the port after ':' is empty")
    if any(c.isspace() or c in "/?#" for c in host):
        raise fail(f"endpoint {item!r}: the host {host!r} is not a host name or address")
    port = DEFAULT_PORT
    if port_text:
        if not port_text.isdigit():
            raise fail(f"endpoint {item!r}: the port {port_text!r} is not a number")
        port = int(port_text)
        if not 1 <= port <= 65535:
            raise fail(f"endpoint {item!r}: the port {port} is outside 1..65535")
    return f"{shown_host}:{port}"
