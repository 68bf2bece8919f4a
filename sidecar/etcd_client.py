"""A small asyncio client for etcd v3: what a plan store on etcd needs, no more.

It speaks etcd's own gRPC API through stubs generated from etcd's protos
(``moe_workspace.etcd.v3``, made by ``scripts/generate_proto.py``):

- reads: :meth:`EtcdClient.get` (value and ``mod_revision``) and
  :meth:`EtcdClient.get_prefix` (every key under a prefix, read at one
  revision, page by page);
- writes: :meth:`EtcdClient.put_if`, a compare-and-swap on the key's
  ``mod_revision`` (``0`` means "the key must not exist") that answers the
  current value when it loses, :meth:`EtcdClient.put` and
  :meth:`EtcdClient.delete`;
- :meth:`EtcdClient.watch_prefix`: the events under a prefix from a revision
  on, as an async iterator that reconnects by itself and resumes after the
  last revision it delivered, so a restart of etcd loses nothing; when it
  cannot catch up (etcd compacted the history it needs, or etcd's revision
  went backwards: re-created empty or restored from a backup) it raises
  :class:`EtcdStale` and the caller re-reads.

Several endpoints may be given: a call goes to the endpoint that last
answered and moves on to the next one when an endpoint is unavailable; it
tries every endpoint once and raises :class:`EtcdUnavailable` at once when
none answers (it does not wait out its deadline). Every call has a deadline
(``timeout``, default :data:`DEFAULT_TIMEOUT`), past which it raises
:class:`EtcdTimeout`. A call moves to the next endpoint only when one is
unavailable (a hung endpoint takes the whole deadline). An unavailable
endpoint may or may not have applied a write; every write here is safe to
repeat (a repeated ``put_if`` loses and reports the value it wrote itself).

With a user name the client authenticates (``Authenticate``), sends the
token in the ``token`` metadata key and, when etcd no longer knows the token
(it expired, or etcd restarted: etcd's default "simple" tokens live in
memory), authenticates again and retries once. TLS takes a CA bundle and an
optional client certificate and key.

Channels are created lazily, inside the running event loop, on first use; a
client belongs to the loop that first used it.

Endpoints, prefix, TLS and auth come from one URL (:func:`parse_etcd_url`,
in :mod:`moe_sidecar.etcd_url` and re-exported here)::

    etcd://HOST[:PORT][,HOST[:PORT]...][/PREFIX][?OPTION=VALUE&...]
    etcds://...      the same over TLS

``PORT`` defaults to 2379, ``PREFIX`` to ``/moe-sidecar`` (a ``/`` is added
at its end). Options, named after ``etcdctl``'s flags: ``cacert``, ``cert``,
``key`` (file paths; TLS only; ``cert`` and ``key`` go together), ``user``,
``password-file`` (the password is never written in the URL), ``server-name``
(the name to verify in the server's certificate; TLS only) and ``timeout``
(seconds per call).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import math
import re
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import NamedTuple, TypeVar

import grpc
import grpc.aio

from moe_sidecar.etcd_url import (
    DEFAULT_PORT,
    DEFAULT_PREFIX,
    DEFAULT_TIMEOUT,
    MAX_TIMEOUT,
    EtcdTarget,
    EtcdTls,
    EtcdUrlError,
    parse_etcd_url,
)
from moe_workspace.etcd.v3 import kv_pb2, rpc_pb2, rpc_pb2_grpc

__all__ = [
    "DEFAULT_PORT",
    "DEFAULT_PREFIX",
    "DEFAULT_TIMEOUT",
    "CasResult",
    "EtcdAuthError",
    "EtcdClient",
    "EtcdClientClosed",
    "EtcdClusterReset",
    "EtcdCompacted",
    "EtcdError",
    "EtcdPermissionDenied",
    "EtcdRequestError",
    "EtcdStale",
    "EtcdStatus",
    "EtcdTarget",
    "EtcdTimeout",
    "EtcdTls",
    "EtcdUnavailable",
    "EtcdUrlError",
    "EtcdWatch",
    "EventType",
    "KeyValue",
    "PrefixRead",
    "Versioned",
    "WatchEvent",
    "parse_etcd_url",
    "prefix_range_end",
]

_log = logging.getLogger("moe_sidecar.etcd_client")

DEFAULT_PAGE_SIZE = 1000
"""Keys per ``Range`` page of :meth:`EtcdClient.get_prefix`."""

_WATCH_BACKOFF_MIN = 0.05
_WATCH_BACKOFF_MAX = 2.0
_CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    # Reconnect soon after etcd returns: gRPC's default backoff grows to 120 s,
    # and while a channel backs off its calls fail at once.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # Notice a peer that vanished under an open watch. etcd refuses pings
    # more often than every 5 s, and pings without an open call.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.enable_retries", 0),
)
# A watch on a member that lost its leader is ended by etcd (so the client
# moves to another member) instead of going silent.
_REQUIRE_LEADER = ("hasleader", "true")

# --------------------------------------------------------------------------- errors


class EtcdError(Exception):
    """Base of every error this module raises about etcd.

    ``message`` is the whole text; it names the call, the endpoint and what
    etcd said.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class EtcdUnavailable(EtcdError):
    """No endpoint answered: etcd is down, unreachable or has no leader.

    Retry later; nothing is known about whether a write took effect.
    """


class EtcdTimeout(EtcdUnavailable):
    """The call's deadline passed before etcd answered (outcome unknown)."""


class EtcdAuthError(EtcdError):
    """Authentication failed: a wrong user or password, credentials that a
    cluster without auth refuses, or none where the cluster requires them."""


class EtcdPermissionDenied(EtcdAuthError):
    """The authenticated user may not read or write the key."""


class EtcdStale(EtcdError):
    """Watching can no longer bring the caller's view up to date.

    The caller must re-read the current state (:meth:`EtcdClient.get_prefix`)
    and watch again from the revision that read returns, plus one.
    """


class EtcdCompacted(EtcdStale):
    """etcd has compacted the revision asked for: its history is gone."""

    def __init__(self, message: str, *, compact_revision: int, requested_revision: int) -> None:
        super().__init__(message)
        self.compact_revision = compact_revision
        """The oldest revision etcd still has."""
        self.requested_revision = requested_revision


class EtcdClusterReset(EtcdStale):
    """etcd's revision went backwards under a watch: the cluster was re-created
    empty or restored from an older backup, so its revisions mean other writes."""

    def __init__(self, message: str, *, revision: int, expected_revision: int) -> None:
        super().__init__(message)
        self.revision = revision
        """The store's revision now."""
        self.expected_revision = expected_revision
        """The revision the watch was to resume from."""


class EtcdRequestError(EtcdError):
    """etcd refused the request for another reason (kept in ``code``)."""

    def __init__(self, message: str, *, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


class EtcdClientClosed(EtcdError):
    """The client was used after :meth:`EtcdClient.close`."""


# --------------------------------------------------------------------------- values


class Versioned(NamedTuple):
    """A key's value and the revision that last modified it."""

    value: bytes
    mod_revision: int


class KeyValue(NamedTuple):
    """One key of a prefix read."""

    key: bytes
    value: bytes
    mod_revision: int


class PrefixRead(NamedTuple):
    """Every key under a prefix, read at one revision of the store."""

    items: list[KeyValue]
    """In key order."""
    revision: int
    """The store's revision the read saw; watch from ``revision + 1`` to miss nothing."""


@dataclass(frozen=True)
class CasResult:
    """What :meth:`EtcdClient.put_if` did."""

    succeeded: bool
    current: Versioned | None
    """The key as the transaction left it: the value written and its new
    revision on success; on failure what the key holds (None: no such key)."""


class EventType(enum.Enum):
    PUT = "PUT"
    DELETE = "DELETE"


@dataclass(frozen=True)
class WatchEvent:
    """One change under a watched prefix."""

    type: EventType
    key: bytes
    value: bytes
    """Empty for a DELETE."""
    mod_revision: int
    """The revision of the change (for a DELETE, the revision of the deletion)."""


@dataclass(frozen=True)
class EtcdStatus:
    """What one member says about itself (``Maintenance.Status``)."""

    endpoint: str
    version: str
    leader: int
    member_id: int
    revision: int
    db_size: int


def prefix_range_end(prefix: bytes) -> bytes:
    """The end of the key range holding every key that starts with ``prefix``.

    The prefix with its last byte that is not 0xff incremented (and what
    follows dropped); ``b"\\0"`` (every key) when there is no such byte.
    """
    end = bytearray(prefix)
    while end and end[-1] == 0xFF:
        end.pop()
    if not end:
        return b"\0"
    end[-1] += 1
    return bytes(end)


def _key_bytes(key: str | bytes) -> bytes:
    data = key.encode("utf-8") if isinstance(key, str) else bytes(key)
    if not data:
        raise ValueError("an etcd key must not be empty")
    return data


# --------------------------------------------------------------------------- gRPC errors

_INVALID_TOKEN = "invalid auth token"
_AUTH_FAILED_TEXTS = (
    "authentication failed",
    "user name is empty",
    "authentication is not enabled",
    "user name not found",
)
_RETRYABLE_STREAM_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)


def _is_invalid_token(code: grpc.StatusCode | None, text: str) -> bool:
    return code == grpc.StatusCode.UNAUTHENTICATED and _INVALID_TOKEN in text


_REASON = re.compile(r"code = (\w+) desc = (.*)", re.DOTALL)


def _status_from_reason(reason: str) -> tuple[grpc.StatusCode | None, str]:
    """The status code and text inside a watch's ``cancel_reason``.

    etcd writes a refused watch's reason as ``rpc error: code = PermissionDenied
    desc = etcdserver: permission denied``.
    """
    match = _REASON.search(reason)
    if match is None:
        return None, reason
    name = re.sub(r"(?<!^)(?=[A-Z])", "_", match.group(1)).upper()
    return getattr(grpc.StatusCode, name, None), match.group(2)


def _mapped_error(
    code: grpc.StatusCode | None, text: str, *, what: str, endpoint: str, revision: int = 0
) -> EtcdError:
    """The typed error for etcd's status ``code`` with message ``text``."""
    name = code.name if code is not None else "UNKNOWN"
    message = f"etcd {what} on {endpoint}: {text or name} ({name})"
    if code == grpc.StatusCode.UNAVAILABLE:
        return EtcdUnavailable(message)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return EtcdTimeout(message)
    if code == grpc.StatusCode.PERMISSION_DENIED or "permission denied" in text:
        return EtcdPermissionDenied(message)
    if code == grpc.StatusCode.UNAUTHENTICATED or any(t in text for t in _AUTH_FAILED_TEXTS):
        return EtcdAuthError(message)
    if code == grpc.StatusCode.OUT_OF_RANGE and "compacted" in text:
        return EtcdCompacted(
            f"{message}; re-read the keys and watch from the revision of that read",
            compact_revision=0,
            requested_revision=revision,
        )
    return EtcdRequestError(message, code=code)


# --------------------------------------------------------------------------- the client

_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")
_Metadata = tuple[tuple[str, str], ...]


class _Stubs(NamedTuple):
    """One endpoint's stubs, on its own channel."""

    address: str
    kv: rpc_pb2_grpc.KVAsyncStub
    watch: rpc_pb2_grpc.WatchAsyncStub
    auth: rpc_pb2_grpc.AuthAsyncStub
    maintenance: rpc_pb2_grpc.MaintenanceAsyncStub


class _Endpoint:
    """One endpoint: its address, and its channel once created."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.channel: grpc.aio.Channel | None = None
        self.stubs: _Stubs | None = None


class EtcdClient:
    """An asyncio etcd v3 client over one or more endpoints of one cluster.

    Use it as an async context manager, or call :meth:`close`. Keys are
    bytes (a ``str`` key is encoded as UTF-8) and must not be empty (else
    ValueError); values are bytes.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        tls: EtcdTls | None = None,
        user: str | None = None,
        password: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        page_size: int = DEFAULT_PAGE_SIZE,
    ) -> None:
        """Creates no channel yet: that happens on first use, inside the loop.

        Raises:
            ValueError: no endpoint, a user without a password (or the
                reverse), a client certificate without its key (or the
                reverse), or a timeout or page size out of range.
        """
        if isinstance(endpoints, str):
            raise ValueError(f"endpoints={endpoints!r}: give a sequence of 'host:port' strings")
        if not endpoints:
            raise ValueError("endpoints: at least one 'host:port' is needed")
        if (user is None) != (password is None):
            raise ValueError("user and password go together")
        if tls is not None and (tls.cert is None) != (tls.key is None):
            raise ValueError("tls: a client certificate and its key go together")
        if not (math.isfinite(timeout) and 0 < timeout <= MAX_TIMEOUT):
            raise ValueError(f"timeout={timeout!r}: must be in (0, {MAX_TIMEOUT:g}] seconds")
        if page_size < 1:
            raise ValueError(f"page_size={page_size!r}: must be at least 1")
        self._endpoints = [_Endpoint(address) for address in endpoints]
        self._current = 0
        self._tls = tls
        self._user = user
        self._password = password
        self._timeout = timeout
        self._page_size = page_size
        self._token: str | None = None
        self._auth_lock: asyncio.Lock | None = None
        self._closed = False
        self._closed_event: asyncio.Event | None = None

    @classmethod
    def from_target(cls, target: EtcdTarget, *, password: str | None = None) -> EtcdClient:
        """A client for a parsed URL; ``password`` overrides ``password-file``.

        Raises:
            EtcdUrlError: a file the URL names cannot be read, or the URL
                names a user but no password was given or found.
        """
        if target.user is not None and password is None:
            password = target.password()
            if password is None:
                raise EtcdUrlError(
                    f"etcd user {target.user!r} needs a password: add password-file=PATH"
                )
        return cls(
            target.endpoints,
            tls=target.tls_config(),
            user=target.user,
            password=password if target.user is not None else None,
            timeout=target.timeout,
        )

    @property
    def endpoints(self) -> tuple[str, ...]:
        """Every endpoint, in the order given."""
        return tuple(endpoint.address for endpoint in self._endpoints)

    @property
    def closed(self) -> bool:
        return self._closed

    async def __aenter__(self) -> EtcdClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Closes every channel; calls in flight fail, open watches end. Idempotent."""
        self._closed = True
        if self._closed_event is not None:
            self._closed_event.set()
        for endpoint in self._endpoints:
            channel, endpoint.channel, endpoint.stubs = endpoint.channel, None, None
            if channel is not None:
                await channel.close()

    # ------------------------------------------------------------------ reads

    async def get(self, key: str | bytes, *, timeout: float | None = None) -> Versioned | None:  # noqa: ASYNC109 (a gRPC deadline)
        """The key's value and ``mod_revision``; None when it does not exist.

        Raises:
            EtcdUnavailable: no endpoint answered (EtcdTimeout: not in time).
            EtcdAuthError: authentication failed or the key is not readable.
            EtcdError: etcd refused the read (EtcdClientClosed: closed client).
        """
        request = rpc_pb2.RangeRequest(key=_key_bytes(key))
        response = await self._unary("get", _range, request, deadline=self._deadline(timeout))
        if not response.kvs:
            return None
        kv = response.kvs[0]
        return Versioned(kv.value, kv.mod_revision)

    async def get_prefix(self, prefix: str | bytes, *, timeout: float | None = None) -> PrefixRead:  # noqa: ASYNC109 (a gRPC deadline)
        """Every key under ``prefix`` (in key order) and the revision read at.

        Large prefixes are read in pages, every page at the first page's
        revision, so the result is one consistent snapshot; ``timeout``
        bounds the whole read.

        Raises:
            EtcdUnavailable: no endpoint answered (EtcdTimeout: not in time).
            EtcdCompacted: the snapshot's revision was compacted between two
                pages; read again.
            EtcdAuthError: authentication failed or the prefix is not readable.
            EtcdError: etcd refused the read (EtcdClientClosed: closed client).
        """
        start = _key_bytes(prefix)
        end = prefix_range_end(start)
        deadline = self._deadline(timeout)
        items: list[KeyValue] = []
        revision = 0
        while True:
            request = rpc_pb2.RangeRequest(
                key=start, range_end=end, limit=self._page_size, revision=revision
            )
            response = await self._unary(
                "get_prefix", _range, request, deadline=deadline, revision=revision
            )
            if revision == 0:
                revision = response.header.revision
            items.extend(KeyValue(kv.key, kv.value, kv.mod_revision) for kv in response.kvs)
            if not response.more or not response.kvs:
                return PrefixRead(items, revision)
            start = response.kvs[-1].key + b"\0"

    async def status(self, *, timeout: float | None = None) -> EtcdStatus:  # noqa: ASYNC109 (a gRPC deadline)
        """What the endpoint that answers says about itself (needs no login).

        Raises:
            EtcdUnavailable: no endpoint answered (EtcdTimeout: not in time).
            EtcdError: etcd refused (EtcdClientClosed: closed client).
        """
        address, response = await self._unary_at(
            "status",
            _status,
            rpc_pb2.StatusRequest(),
            deadline=self._deadline(timeout),
            authenticate=False,
        )
        return EtcdStatus(
            endpoint=address,
            version=response.version,
            leader=response.leader,
            member_id=response.header.member_id,
            revision=response.header.revision,
            db_size=response.dbSize,
        )

    # ------------------------------------------------------------------ writes

    async def put_if(
        self,
        key: str | bytes,
        value: bytes,
        expected_mod_revision: int,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (a gRPC deadline)
    ) -> CasResult:
        """Writes ``value`` only if the key's ``mod_revision`` is the one expected.

        ``expected_mod_revision=0`` means the key must not exist. One etcd
        transaction: compare, then put on success or read on failure, so a
        loser learns the winner's value and revision in the same round trip.

        Raises:
            ValueError: a negative ``expected_mod_revision``.
            EtcdUnavailable: no endpoint answered (EtcdTimeout: not in time);
                whether the write happened is unknown.
            EtcdAuthError: authentication failed or the key is not writable.
            EtcdError: etcd refused the transaction (EtcdClientClosed: closed client).
        """
        if expected_mod_revision < 0:
            raise ValueError(f"expected_mod_revision={expected_mod_revision!r}: must be >= 0")
        data = _key_bytes(key)
        request = rpc_pb2.TxnRequest(
            compare=[
                rpc_pb2.Compare(
                    result=rpc_pb2.Compare.EQUAL,
                    target=rpc_pb2.Compare.MOD,
                    key=data,
                    mod_revision=expected_mod_revision,
                )
            ],
            success=[rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(key=data, value=value))],
            failure=[rpc_pb2.RequestOp(request_range=rpc_pb2.RangeRequest(key=data))],
        )
        response = await self._unary("put_if", _txn, request, deadline=self._deadline(timeout))
        if response.succeeded:
            return CasResult(True, Versioned(value, response.header.revision))
        kvs = response.responses[0].response_range.kvs if response.responses else []
        current = Versioned(kvs[0].value, kvs[0].mod_revision) if kvs else None
        return CasResult(False, current)

    async def put(self, key: str | bytes, value: bytes, *, timeout: float | None = None) -> int:  # noqa: ASYNC109 (a gRPC deadline)
        """Writes ``value`` unconditionally; returns the key's new ``mod_revision``.

        Raises:
            EtcdUnavailable: no endpoint answered (EtcdTimeout: not in time).
            EtcdAuthError: authentication failed or the key is not writable.
            EtcdError: etcd refused the write (EtcdClientClosed: closed client).
        """
        request = rpc_pb2.PutRequest(key=_key_bytes(key), value=value)
        response = await self._unary("put", _put, request, deadline=self._deadline(timeout))
        return response.header.revision

    async def delete(self, key: str | bytes, *, timeout: float | None = None) -> bool:  # noqa: ASYNC109 (a gRPC deadline)
        """Deletes the key; True if it existed.

        Raises:
            EtcdUnavailable: no endpoint answered (EtcdTimeout: not in time).
            EtcdAuthError: authentication failed or the key is not writable.
            EtcdError: etcd refused the delete (EtcdClientClosed: closed client).
        """
        request = rpc_pb2.DeleteRangeRequest(key=_key_bytes(key))
        response = await self._unary(
            "delete", _delete_range, request, deadline=self._deadline(timeout)
        )
        return response.deleted > 0

    async def compact(self, revision: int, *, timeout: float | None = None) -> None:  # noqa: ASYNC109 (a gRPC deadline)
        """Discards the history before ``revision`` (returns once it is applied).

        Raises:
            EtcdCompacted: ``revision`` is already compacted.
            EtcdUnavailable: no endpoint answered (EtcdTimeout: not in time).
            EtcdAuthError: authentication failed or the user may not compact.
            EtcdError: etcd refused, e.g. a future revision (EtcdClientClosed:
                closed client).
        """
        request = rpc_pb2.CompactionRequest(revision=revision, physical=True)
        await self._unary(
            "compact", _compact, request, deadline=self._deadline(timeout), revision=revision
        )

    # ------------------------------------------------------------------ watch

    def watch_prefix(self, prefix: str | bytes, start_revision: int = 0) -> EtcdWatch:
        """The changes under ``prefix`` from ``start_revision`` on (inclusive).

        ``start_revision=0`` means "from now". To see every change after a
        :meth:`get_prefix`, pass its ``revision + 1``. The watch reconnects
        (to the next endpoint, with a backoff of up to 2 s) whenever its
        stream breaks, and resumes after the last revision it delivered:
        events are neither lost nor repeated. Iteration ends when the client
        is closed. Use it as::

            async with client.watch_prefix(prefix, revision + 1) as watch:
                async for event in watch:
                    ...

        so that the stream is closed when the block is left.

        Raises:
            ValueError: a negative ``start_revision`` (at once).
            EtcdStale: (from iteration) watching cannot catch up: the
                revision to start or resume from has been compacted
                (EtcdCompacted), or etcd's revision went backwards across a
                reconnect (EtcdClusterReset: re-created or restored); re-read
                and watch again.
            EtcdAuthError: (from iteration) authentication failed or the
                prefix is not readable.
            EtcdError: (from iteration) etcd cancelled the watch otherwise.
        """
        if start_revision < 0:
            raise ValueError(f"start_revision={start_revision!r}: must be >= 0")
        return EtcdWatch(self, _key_bytes(prefix), start_revision)

    # ------------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self._closed:
            raise EtcdClientClosed(f"etcd client for {', '.join(self.endpoints)} is closed")

    def _deadline(self, timeout: float | None) -> float:
        seconds = self._timeout if timeout is None else timeout
        if not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"timeout={timeout!r}: must be a positive number of seconds")
        return asyncio.get_running_loop().time() + seconds

    def _loop_objects(self) -> tuple[asyncio.Lock, asyncio.Event]:
        """The lock and event of the running loop, made on first use."""
        if self._auth_lock is None or self._closed_event is None:
            self._auth_lock = asyncio.Lock()
            self._closed_event = asyncio.Event()
            if self._closed:
                self._closed_event.set()
        return self._auth_lock, self._closed_event

    def _stubs(self, index: int) -> _Stubs:
        self._check_open()
        endpoint = self._endpoints[index]
        if endpoint.stubs is None:
            channel = self._open_channel(endpoint.address)
            endpoint.channel = channel
            endpoint.stubs = _Stubs(
                endpoint.address,
                rpc_pb2_grpc.KVStub(channel),
                rpc_pb2_grpc.WatchStub(channel),
                rpc_pb2_grpc.AuthStub(channel),
                rpc_pb2_grpc.MaintenanceStub(channel),
            )
        return endpoint.stubs

    def _open_channel(self, address: str) -> grpc.aio.Channel:
        options: list[tuple[str, int | str]] = list(_CHANNEL_OPTIONS)
        if self._tls is None:
            return grpc.aio.insecure_channel(address, options=options)
        credentials = grpc.ssl_channel_credentials(
            root_certificates=self._tls.ca,
            private_key=self._tls.key,
            certificate_chain=self._tls.cert,
        )
        if self._tls.server_name:
            options.append(("grpc.ssl_target_name_override", self._tls.server_name))
        return grpc.aio.secure_channel(address, credentials, options=options)

    async def _token_for(self, deadline: float) -> str | None:
        """The auth token, authenticating first if there is none (None: no auth).

        Raises:
            EtcdAuthError: wrong user or password, or the cluster has no auth.
            EtcdUnavailable: no endpoint answered.
        """
        if self._user is None:
            return None
        lock, _ = self._loop_objects()
        async with lock:
            if self._token is None:
                request = rpc_pb2.AuthenticateRequest(
                    name=self._user, password=self._password or ""
                )
                response = await self._unary(
                    "authenticate", _authenticate, request, deadline=deadline, authenticate=False
                )
                self._token = response.token
                _log.debug("authenticated to etcd", extra={"etcd_user": self._user})
            return self._token

    def _forget_token(self, token: str | None) -> None:
        """Drops ``token`` if it is still the current one (etcd no longer knows it)."""
        if token is not None and self._token == token:
            self._token = None

    async def _unary(
        self,
        what: str,
        method: Callable[[_Stubs], grpc.aio.UnaryUnaryMultiCallable[_Req, _Resp]],
        request: _Req,
        *,
        deadline: float,
        authenticate: bool = True,
        revision: int = 0,
    ) -> _Resp:
        """See :meth:`_unary_at`; returns only the response."""
        _, response = await self._unary_at(
            what, method, request, deadline=deadline, authenticate=authenticate, revision=revision
        )
        return response

    async def _unary_at(
        self,
        what: str,
        method: Callable[[_Stubs], grpc.aio.UnaryUnaryMultiCallable[_Req, _Resp]],
        request: _Req,
        *,
        deadline: float,
        authenticate: bool = True,
        revision: int = 0,
    ) -> tuple[str, _Resp]:
        """Calls ``method`` until ``deadline``: failing over, logging in again.

        Starts on the endpoint that answered last; an unavailable endpoint
        passes the call to the next one, until each was tried once. A token
        etcd no longer knows is replaced once. Returns the endpoint that
        answered and its response.

        Raises:
            EtcdClientClosed: the client is (or got) closed.
            EtcdUnavailable: every endpoint was tried and none answered.
            EtcdTimeout: the deadline passed.
            EtcdError: the mapped error of any other failure.
        """
        self._check_open()
        loop = asyncio.get_running_loop()
        reauthenticated = False
        failed: list[str] = []
        while True:
            token = await self._token_for(deadline) if authenticate else None
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise EtcdTimeout(f"etcd {what}: no answer within its deadline")
            index = self._current
            stubs = self._stubs(index)
            metadata: _Metadata | None = (("token", token),) if token is not None else None
            try:
                response = await method(stubs)(request, timeout=remaining, metadata=metadata)
            except asyncio.CancelledError as error:
                # A call cut off by close() ends as "locally cancelled".
                if self._closed and not _task_cancelling():
                    raise EtcdClientClosed(f"etcd {what}: the client was closed") from error
                raise
            except grpc.aio.AioRpcError as error:
                if self._closed:
                    raise EtcdClientClosed(f"etcd {what}: the client was closed") from error
                code, text = error.code(), error.details() or ""
                if _is_invalid_token(code, text) and not reauthenticated:
                    # etcd forgot the token (it expired, or etcd restarted): log in again.
                    self._forget_token(token)
                    reauthenticated = True
                    continue
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    # etcd 3.4 holds a call whose token names a raft index it has not
                    # reached (an etcd re-created empty) until the deadline: log in
                    # afresh next time rather than hang again.
                    self._forget_token(token)
                if code != grpc.StatusCode.UNAVAILABLE:
                    raise _mapped_error(
                        code, text, what=what, endpoint=stubs.address, revision=revision
                    ) from error
                failed.append(f"{stubs.address}: {text}")
                if len(failed) >= len(self._endpoints):
                    raise EtcdUnavailable(
                        f"etcd {what}: no endpoint answered ({'; '.join(failed)})"
                    ) from error
                self._current = (index + 1) % len(self._endpoints)
                _log.info(
                    "etcd endpoint unavailable, trying the next",
                    extra={"endpoint": stubs.address, "next": self.endpoints[self._current]},
                )
                continue
            return stubs.address, response


def _range(
    s: _Stubs,
) -> grpc.aio.UnaryUnaryMultiCallable[rpc_pb2.RangeRequest, rpc_pb2.RangeResponse]:
    return s.kv.Range


def _put(s: _Stubs) -> grpc.aio.UnaryUnaryMultiCallable[rpc_pb2.PutRequest, rpc_pb2.PutResponse]:
    return s.kv.Put


def _txn(s: _Stubs) -> grpc.aio.UnaryUnaryMultiCallable[rpc_pb2.TxnRequest, rpc_pb2.TxnResponse]:
    return s.kv.Txn


def _delete_range(
    s: _Stubs,
) -> grpc.aio.UnaryUnaryMultiCallable[rpc_pb2.DeleteRangeRequest, rpc_pb2.DeleteRangeResponse]:
    return s.kv.DeleteRange


def _compact(
    s: _Stubs,
) -> grpc.aio.UnaryUnaryMultiCallable[rpc_pb2.CompactionRequest, rpc_pb2.CompactionResponse]:
    return s.kv.Compact


def _status(
    s: _Stubs,
) -> grpc.aio.UnaryUnaryMultiCallable[rpc_pb2.StatusRequest, rpc_pb2.StatusResponse]:
    return s.maintenance.Status


def _authenticate(
    s: _Stubs,
) -> grpc.aio.UnaryUnaryMultiCallable[rpc_pb2.AuthenticateRequest, rpc_pb2.AuthenticateResponse]:
    return s.auth.Authenticate


# --------------------------------------------------------------------------- watch


class EtcdWatch:
    """The events under one prefix: an async iterator and async context manager.

    Made by :meth:`EtcdClient.watch_prefix`; the stream opens on the first
    ``__anext__``.
    """

    def __init__(self, client: EtcdClient, prefix: bytes, start_revision: int) -> None:
        self._client = client
        self._prefix = prefix
        self._range_end = prefix_range_end(prefix)
        self._next_revision = start_revision
        self._events = self._run()

    @property
    def prefix(self) -> bytes:
        return self._prefix

    @property
    def _shown(self) -> str:
        return repr(self._prefix.decode("utf-8", "replace"))

    @property
    def next_revision(self) -> int:
        """The revision to resume from: one past the last event delivered.

        0 while a watch "from now" waits for etcd's first answer. After an
        event that is not the last of its revision (one transaction changed
        several keys) it is that revision itself, so a new watch from it
        repeats the transaction's events rather than losing some.
        """
        return self._next_revision

    def __aiter__(self) -> EtcdWatch:
        return self

    async def __anext__(self) -> WatchEvent:
        return await self._events.__anext__()

    async def aclose(self) -> None:
        """Closes the stream; iteration ends. Idempotent."""
        await self._events.aclose()

    async def __aenter__(self) -> EtcdWatch:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def _run(self) -> AsyncGenerator[WatchEvent, None]:
        client = self._client
        backoff = _WATCH_BACKOFF_MIN
        reauthenticated = False
        resumed = False  # etcd has accepted this watch before
        outage: str | None = None
        while not client.closed:
            _, closed = client._loop_objects()
            index = client._current
            try:
                stubs = client._stubs(index)
                token = await client._token_for(client._deadline(None))
            except EtcdClientClosed:
                return
            except EtcdUnavailable as error:
                outage = self._note_outage(outage, str(error))
                await _pause(closed, backoff)
                backoff = min(backoff * 2, _WATCH_BACKOFF_MAX)
                continue
            metadata: _Metadata = (_REQUIRE_LEADER,) + ((("token", token),) if token else ())
            create = rpc_pb2.WatchRequest(
                create_request=rpc_pb2.WatchCreateRequest(
                    key=self._prefix,
                    range_end=self._range_end,
                    start_revision=self._next_revision,
                    progress_notify=True,
                )
            )
            call = stubs.watch.Watch(_watch_requests(create, closed), metadata=metadata)
            created = False
            try:
                while True:
                    if created:
                        response = await call.read()
                    else:
                        try:
                            response = await asyncio.wait_for(call.read(), client._timeout)
                        except TimeoutError:
                            # etcd took the stream but not the watch: etcd 3.4 holds one
                            # whose token names a raft index it has not reached (an etcd
                            # re-created empty). Log in afresh and watch again.
                            client._forget_token(token)
                            reason = f"{stubs.address}: no answer to the watch request"
                            outage = self._note_outage(outage, reason)
                            break
                    if not isinstance(response, rpc_pb2.WatchResponse):  # grpc.aio.EOF
                        outage = self._note_outage(outage, f"{stubs.address}: the stream ended")
                        break
                    if response.canceled:
                        if self._refused(response, stubs.address, token, reauthenticated):
                            reauthenticated = True  # log in again, then watch again
                        else:
                            outage = self._note_outage(outage, f"{stubs.address}: cancelled")
                        break
                    if response.created:
                        now = response.header.revision
                        if self._next_revision == 0:
                            self._next_revision = now + 1
                        elif resumed and now + 1 < self._next_revision:
                            raise EtcdClusterReset(
                                f"etcd watch of {self._shown} on {stubs.address}: etcd is at "
                                f"revision {now}, behind the {self._next_revision - 1} already "
                                "seen: it was re-created or restored from a backup; re-read the "
                                "prefix and watch from the revision of that read + 1",
                                revision=now,
                                expected_revision=self._next_revision,
                            )
                        resumed = True
                        if outage is not None:
                            _log.info(
                                "etcd watch resumed",
                                extra={"endpoint": stubs.address, "revision": self._next_revision},
                            )
                            outage = None
                        backoff = _WATCH_BACKOFF_MIN
                        reauthenticated = False
                        created = True
                        continue
                    if response.events:
                        events = response.events
                        for i, event in enumerate(events):
                            revision = event.kv.mod_revision
                            # A transaction's events share one revision: resume after
                            # it only once all of them are out.
                            done = i + 1 == len(events) or events[i + 1].kv.mod_revision != revision
                            self._next_revision = revision + 1 if done else revision
                            yield _watch_event(event)
                    elif response.header.revision >= self._next_revision:
                        # A progress notice: nothing up to this revision is left to see.
                        self._next_revision = response.header.revision + 1
            except asyncio.CancelledError:
                # close() cuts the stream off as "locally cancelled": the watch ends.
                if client.closed and not _task_cancelling():
                    return
                raise
            except grpc.aio.AioRpcError as error:
                if client.closed:
                    return
                code, text = error.code(), error.details() or ""
                if _is_invalid_token(code, text) and not reauthenticated:
                    client._forget_token(token)
                    reauthenticated = True
                    continue
                if code not in _RETRYABLE_STREAM_CODES:
                    raise _mapped_error(code, text, what="watch", endpoint=stubs.address) from error
                outage = self._note_outage(outage, f"{stubs.address}: {text or code.name}")
                if len(client._endpoints) > 1 and client._current == index:
                    client._current = (index + 1) % len(client._endpoints)
            finally:
                call.cancel()
            if reauthenticated and outage is None:
                continue
            await _pause(closed, backoff)
            backoff = min(backoff * 2, _WATCH_BACKOFF_MAX)

    def _note_outage(self, outage: str | None, reason: str) -> str:
        if outage is None:
            _log.warning(
                "etcd watch interrupted; reconnecting",
                extra={
                    "prefix": self._prefix.decode("utf-8", "replace"),
                    "revision": self._next_revision,
                    "reason": reason,
                },
            )
        return reason

    def _refused(
        self,
        response: rpc_pb2.WatchResponse,
        address: str,
        token: str | None,
        reauthenticated: bool,
    ) -> bool:
        """Handles a watch etcd cancelled: True to log in again and watch again,
        False to watch again after a pause (etcd gave no reason).

        Raises:
            EtcdCompacted: the start revision is compacted.
            EtcdAuthError: etcd refused the watch's credentials or permissions.
            EtcdError: etcd cancelled the watch for another reason.
        """
        shown = self._shown
        if response.compact_revision > 0:
            raise EtcdCompacted(
                f"etcd watch of {shown} on {address}: revision {self._next_revision} is "
                f"compacted (the oldest kept is {response.compact_revision}); re-read the "
                "prefix and watch from the revision of that read + 1",
                compact_revision=response.compact_revision,
                requested_revision=self._next_revision,
            )
        if not response.cancel_reason:
            return False
        code, text = _status_from_reason(response.cancel_reason)
        if _is_invalid_token(code, text) and not reauthenticated:
            self._client._forget_token(token)
            return True
        raise _mapped_error(code, text, what=f"watch of {shown}", endpoint=address)


async def _watch_requests(
    create: rpc_pb2.WatchRequest, closed: asyncio.Event
) -> AsyncIterator[rpc_pb2.WatchRequest]:
    """The request side of a watch stream: one create, then silence until closed."""
    yield create
    await closed.wait()


def _task_cancelling() -> bool:
    """Whether the running task itself is being cancelled (Python 3.11+ can tell)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return bool(cancelling()) if cancelling is not None else False


async def _pause(closed: asyncio.Event, seconds: float) -> None:
    """Waits ``seconds``, or less if the client closes meanwhile."""
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(closed.wait(), seconds)


def _watch_event(event: kv_pb2.Event) -> WatchEvent:
    kind = EventType.DELETE if event.type == kv_pb2.Event.DELETE else EventType.PUT
    value = event.kv.value if kind is EventType.PUT else b""
    return WatchEvent(kind, event.kv.key, value, event.kv.mod_revision)
