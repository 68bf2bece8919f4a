"""A small asyncio client for etcd v3: what a plan store on etcd needs, no more.

It speaks etcd's own gRPC API through stubs generated from etcd's protos
(``moe_workspace.etcd.v3``, made by ``scripts/generate_proto.py``):

- reads: :meth:`EtcdClient.get` (value and ``mod_revision``),
  :meth:`EtcdClient.read_prefix` (every key under a prefix, read at one
  revision, page by page, as the pages come) and :meth:`EtcdClient.get_prefix`
  (the same, gathered);
- writes: :meth:`EtcdClient.put_if`, a compare-and-swap on the key's
  ``mod_revision`` (``0`` means "the key must not exist") that answers the
  current value when it loses;
- :meth:`EtcdClient.watch_prefix`: the events under a prefix from a revision
  on (:mod:`moe_sidecar.etcd.watch`), reconnecting by itself.

The pieces: :mod:`moe_sidecar.etcd.transport` (endpoints, channels, the
token, failover: the one unary call path), :mod:`moe_sidecar.etcd.errors`
(the typed errors), :mod:`moe_sidecar.etcd.watch` (the watch) and
:mod:`moe_sidecar.etcd.url` (the URL); this module re-exports what a user
of the client needs.

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

Endpoints, prefix, TLS and auth come from one URL (:func:`parse_etcd_url`)::

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

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import NamedTuple, Self

import grpc

from moe_sidecar.etcd.errors import (
    EtcdAuthError,
    EtcdClientClosed,
    EtcdClusterReset,
    EtcdCompacted,
    EtcdError,
    EtcdEventTooLarge,
    EtcdPermissionDenied,
    EtcdRequestError,
    EtcdStale,
    EtcdTimeout,
    EtcdUnavailable,
)
from moe_sidecar.etcd.transport import EtcdTransport, key_bytes, prefix_range_end
from moe_sidecar.etcd.url import (
    DEFAULT_PORT,
    DEFAULT_PREFIX,
    DEFAULT_TIMEOUT,
    EtcdTarget,
    EtcdTls,
    EtcdUrlError,
    parse_etcd_url,
)
from moe_sidecar.etcd.watch import EtcdWatch, EventType, WatchEvent
from moe_workspace.etcd.v3 import rpc_pb2

__all__ = [
    "DEFAULT_PAGE_SIZE",
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
    "EtcdEventTooLarge",
    "EtcdPermissionDenied",
    "EtcdRequestError",
    "EtcdStale",
    "EtcdTarget",
    "EtcdTimeout",
    "EtcdTls",
    "EtcdUnavailable",
    "EtcdUrlError",
    "EtcdWatch",
    "EventType",
    "KeyValue",
    "PrefixPage",
    "PrefixRead",
    "Versioned",
    "WatchEvent",
    "parse_etcd_url",
    "prefix_range_end",
]

DEFAULT_PAGE_SIZE = 1000
"""Keys per ``Range`` page of :meth:`EtcdClient.get_prefix`."""


class Versioned(NamedTuple):
    """A key's value and the revision that last modified it."""

    value: bytes
    mod_revision: int


class KeyValue(NamedTuple):
    """One key of a prefix read."""

    key: bytes
    value: bytes
    mod_revision: int


class PrefixPage(NamedTuple):
    """One page of :meth:`EtcdClient.read_prefix`."""

    items: list[KeyValue]
    """In key order."""
    revision: int
    """The store's revision every page of the read is read at."""
    too_large: list[KeyValue]
    """Keys whose value alone is larger than one response may carry, with an
    empty value (left out) and their ``mod_revision``."""


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
        self.transport = EtcdTransport(
            endpoints, tls=tls, user=user, password=password, timeout=timeout
        )
        """Channels, token and failover; its :meth:`EtcdTransport.call` reaches
        any unary method of etcd's API this client does not wrap."""
        if page_size < 1:
            raise ValueError(f"page_size={page_size!r}: must be at least 1")
        self._page_size = page_size

    @classmethod
    def from_target(cls, target: EtcdTarget, *, password: str | None = None) -> Self:
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
        return self.transport.endpoints

    @property
    def closed(self) -> bool:
        return self.transport.closed

    async def __aenter__(self) -> Self:
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
        await self.transport.close()

    # ------------------------------------------------------------------ reads

    async def get(self, key: str | bytes, *, timeout: float | None = None) -> Versioned | None:  # noqa: ASYNC109 (a gRPC deadline)
        """The key's value and ``mod_revision``; None when it does not exist.

        Raises:
            EtcdUnavailable: no endpoint answered (EtcdTimeout: not in time).
            EtcdAuthError: authentication failed or the key is not readable.
            EtcdError: etcd refused the read (EtcdClientClosed: closed client).
        """
        request = rpc_pb2.RangeRequest(key=key_bytes(key))
        deadline = self.transport.deadline(timeout)
        _, response = await self.transport.call(
            "get", lambda s: s.kv.Range, request, deadline=deadline
        )
        if not response.kvs:
            return None
        kv = response.kvs[0]
        return Versioned(kv.value, kv.mod_revision)

    async def revision_of(self, key: str | bytes, *, timeout: float | None = None) -> int:  # noqa: ASYNC109 (a gRPC deadline)
        """The key's ``mod_revision`` (0: no such key), its value left unread:
        for a value too large to receive.

        Raises:
            EtcdError: as :meth:`get` does.
        """
        request = rpc_pb2.RangeRequest(key=key_bytes(key), keys_only=True)
        deadline = self.transport.deadline(timeout)
        _, response = await self.transport.call(
            "revision_of", lambda s: s.kv.Range, request, deadline=deadline
        )
        return response.kvs[0].mod_revision if response.kvs else 0

    async def get_prefix(self, prefix: str | bytes, *, timeout: float | None = None) -> PrefixRead:  # noqa: ASYNC109 (a gRPC deadline)
        """Every key under ``prefix`` (in key order) and the revision read at.

        The pages of :meth:`read_prefix` (``page_size`` keys each), gathered.
        A value that alone exceeds what one response may carry is left out.

        Raises:
            EtcdUnavailable: no endpoint answered (EtcdTimeout: not in time).
            EtcdCompacted: the snapshot's revision was compacted between two
                pages; read again.
            EtcdAuthError: authentication failed or the prefix is not readable.
            EtcdError: etcd refused the read (EtcdClientClosed: closed client).
        """
        items: list[KeyValue] = []
        revision = 0
        async for page in self.read_prefix(prefix, keys=self._page_size, timeout=timeout):
            items.extend(page.items)
            revision = page.revision
        return PrefixRead(items, revision)

    async def read_prefix(
        self,
        prefix: str | bytes,
        *,
        keys: int,
        timeout: float | None = None,  # noqa: ASYNC109 (a gRPC deadline)
    ) -> AsyncIterator[PrefixPage]:
        """The keys under ``prefix`` in pages of at most ``keys`` keys, in key order.

        Every page is read at the first page's revision, so together they are
        one consistent snapshot; ``timeout`` bounds each page. A page too
        large for one response (etcd's values are not bounded here) is asked
        for again with half as many keys (the pages after it double back up
        to ``keys``); a single value too large is left
        out and its key listed in :attr:`PrefixPage.too_large`, so no
        prefix, whatever it holds, stops a read for good.

        Raises:
            ValueError: ``keys`` is below 1.
            EtcdUnavailable: no endpoint answered (EtcdTimeout: not in time).
            EtcdCompacted: the snapshot's revision was compacted between two
                pages; read again.
            EtcdAuthError: authentication failed or the prefix is not readable.
            EtcdError: etcd refused the read (EtcdClientClosed: closed client).
        """
        if keys < 1:
            raise ValueError(f"keys={keys!r}: must be at least 1")
        start = key_bytes(prefix)
        end = prefix_range_end(start)
        revision = 0
        limit = keys
        while True:
            request = rpc_pb2.RangeRequest(key=start, range_end=end, limit=limit, revision=revision)
            try:
                response = await self._range(request, timeout)
            except EtcdRequestError as error:
                if error.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                if limit > 1:
                    limit //= 2
                    continue
                request.keys_only = True
                response = await self._range(request, timeout)
                revision = revision or response.header.revision
                if not response.kvs:
                    return
                kv = response.kvs[0]
                yield PrefixPage([], revision, [KeyValue(kv.key, b"", kv.mod_revision)])
                start = kv.key + b"\0"
                continue
            revision = revision or response.header.revision
            limit = min(keys, limit * 2)  # back towards ``keys`` past the large values
            items = [KeyValue(kv.key, kv.value, kv.mod_revision) for kv in response.kvs]
            yield PrefixPage(items, revision, [])
            if not response.more or not response.kvs:
                return
            start = response.kvs[-1].key + b"\0"

    async def read_prefix_by_key(
        self,
        prefix: str | bytes,
        *,
        keys: int,
        timeout: float | None = None,  # noqa: ASYNC109 (a gRPC deadline)
    ) -> AsyncIterator[PrefixPage]:
        """The keys under ``prefix``, each value read alone, in key order.

        The keys are listed first (``keys_only``, pages of at most ``keys``
        keys), then each key's value is asked for on its own, all at the
        first listing's revision (one consistent snapshot). So what the
        client holds at once is one value, whatever the prefix holds: etcd
        3.4 tells no value's size before sending it (``KeyValue`` carries
        none), and a page of values is as large as its largest values. Every
        listing yields a page without items (it carries the revision), then
        one page per key; a value too large for one response is left out
        and its key listed in :attr:`PrefixPage.too_large`.

        Raises:
            ValueError: ``keys`` is below 1.
            EtcdUnavailable: no endpoint answered (EtcdTimeout: not in time).
            EtcdCompacted: the snapshot's revision was compacted during the
                read; read again.
            EtcdAuthError: authentication failed or the prefix is not readable.
            EtcdError: etcd refused the read (EtcdClientClosed: closed client).
        """
        if keys < 1:
            raise ValueError(f"keys={keys!r}: must be at least 1")
        start = key_bytes(prefix)
        end = prefix_range_end(start)
        revision = 0
        while True:
            listing = await self._range(
                rpc_pb2.RangeRequest(
                    key=start, range_end=end, limit=keys, revision=revision, keys_only=True
                ),
                timeout,
            )
            revision = revision or listing.header.revision
            yield PrefixPage([], revision, [])
            for kv in listing.kvs:
                listed = KeyValue(kv.key, b"", kv.mod_revision)
                yield await self._value_page(listed, revision, timeout)
            if not listing.more or not listing.kvs:
                return
            start = listing.kvs[-1].key + b"\0"

    async def _value_page(
        self,
        listed: KeyValue,
        revision: int,
        timeout: float | None,  # noqa: ASYNC109 (a gRPC deadline)
    ) -> PrefixPage:
        """The page of one listed key's value at ``revision``.

        Raises:
            EtcdError: as :meth:`read_prefix_by_key`.
        """
        request = rpc_pb2.RangeRequest(key=listed.key, revision=revision)
        try:
            response = await self._range(request, timeout)
        except EtcdRequestError as error:
            if error.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            return PrefixPage([], revision, [listed])
        items = [KeyValue(kv.key, kv.value, kv.mod_revision) for kv in response.kvs]
        return PrefixPage(items, revision, [])

    async def _range(
        self, request: rpc_pb2.RangeRequest, seconds: float | None
    ) -> rpc_pb2.RangeResponse:
        _, response = await self.transport.call(
            "get_prefix",
            lambda s: s.kv.Range,
            request,
            deadline=self.transport.deadline(seconds),
            revision=request.revision,
        )
        return response

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
        data = key_bytes(key)
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
        deadline = self.transport.deadline(timeout)
        _, response = await self.transport.call(
            "put_if", lambda s: s.kv.Txn, request, deadline=deadline
        )
        if response.succeeded:
            return CasResult(True, Versioned(value, response.header.revision))
        kvs = response.responses[0].response_range.kvs if response.responses else []
        current = Versioned(kvs[0].value, kvs[0].mod_revision) if kvs else None
        return CasResult(False, current)

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
                (EtcdCompacted), etcd's revision went backwards across a
                reconnect (EtcdClusterReset: re-created or restored), or an
                event is too large to receive (EtcdEventTooLarge); re-read
                and watch again.
            EtcdAuthError: (from iteration) authentication failed or the
                prefix is not readable.
            EtcdError: (from iteration) etcd cancelled the watch otherwise.
        """
        if start_revision < 0:
            raise ValueError(f"start_revision={start_revision!r}: must be >= 0")
        return EtcdWatch(self.transport, key_bytes(prefix), start_revision)
