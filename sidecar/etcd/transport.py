"""How the etcd client reaches etcd: endpoints, channels, the auth token, failover.

:class:`EtcdTransport` owns one lazily created gRPC channel per endpoint, the
authentication token, and the "closed" state of a client. Its
:meth:`EtcdTransport.call` is the one unary call path: start on the endpoint
that answered last, pass the call to the next endpoint when one is
unavailable, try every endpoint once and then raise :class:`EtcdUnavailable`
at once; log in again once when etcd no longer knows the token. Watches
(:mod:`moe_sidecar.etcd.watch`) use its stubs, token and failover through the
same public methods.

Channels are created inside the running event loop on first use; a
transport belongs to the loop that first used it.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple, TypeVar

import grpc
import grpc.aio

from moe_sidecar.etcd.errors import (
    EtcdClientClosed,
    EtcdTimeout,
    EtcdUnavailable,
    is_invalid_token,
    mapped_error,
)
from moe_sidecar.etcd.url import MAX_TIMEOUT, EtcdTls
from moe_workspace.etcd.v3 import rpc_pb2, rpc_pb2_grpc

__all__ = [
    "MAX_RECEIVE_BYTES",
    "EtcdTransport",
    "Stubs",
    "key_bytes",
    "prefix_range_end",
    "task_cancelling",
]

_log = logging.getLogger("moe_sidecar.etcd.client")

MAX_RECEIVE_BYTES = 64 * 1024 * 1024
"""The largest response a channel accepts (gRPC's receive limit)."""
_CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    # Reconnect soon after etcd returns: gRPC's default backoff grows to 120 s,
    # and while a channel backs off its calls fail at once.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # gRPC takes this as the time one connection attempt may take (its
    # handshake included), not as a pause: at 100 ms a loaded etcd, or a
    # loaded node, failed handshakes as "unavailable".
    ("grpc.min_reconnect_backoff_ms", 5000),
    # Notice a peer that vanished under an open watch. etcd refuses pings
    # more often than every 5 s, and pings without an open call.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
    ("grpc.enable_retries", 0),
)

_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")
Metadata = tuple[tuple[str, str], ...]


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


def key_bytes(key: str | bytes) -> bytes:
    """``key`` as bytes (a ``str`` as UTF-8).

    Raises:
        ValueError: the key is empty.
    """
    data = key.encode("utf-8") if isinstance(key, str) else bytes(key)
    if not data:
        raise ValueError("an etcd key must not be empty")
    return data


def task_cancelling() -> bool:
    """Whether the running task itself is being cancelled (Python 3.11+ can tell)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return bool(cancelling()) if cancelling is not None else False


class Stubs(NamedTuple):
    """One endpoint's stubs, on its own channel."""

    position: int
    """The endpoint's place in :attr:`EtcdTransport.endpoints`."""
    address: str
    kv: rpc_pb2_grpc.KVAsyncStub
    watch: rpc_pb2_grpc.WatchAsyncStub
    auth: rpc_pb2_grpc.AuthAsyncStub
    maintenance: rpc_pb2_grpc.MaintenanceAsyncStub


Method = Callable[[Stubs], "grpc.aio.UnaryUnaryMultiCallable[_Req, _Resp]"]
"""Which unary method of an endpoint's stubs to call, e.g. ``lambda s: s.kv.Range``."""


class _Endpoint:
    """One endpoint: its address, and its stubs once its channel exists."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.channel: grpc.aio.Channel | None = None
        self.stubs: Stubs | None = None


class EtcdTransport:
    """The channels, token and failover of one etcd client (see the module docstring)."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        tls: EtcdTls | None,
        user: str | None,
        password: str | None,
        timeout: float,
    ) -> None:
        """Creates no channel yet: that happens on first use, inside the loop.

        Raises:
            ValueError: no endpoint, a user without a password (or the
                reverse), a client certificate without its key (or the
                reverse), or a timeout out of range.
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
        self._endpoints = [_Endpoint(address) for address in endpoints]
        self._current = 0
        self._tls = tls
        self._user = user
        self._password = password
        self.timeout = timeout
        """Seconds a call may take by default, every endpoint together."""
        self._token: str | None = None
        self._auth_lock: asyncio.Lock | None = None
        self._closed = False
        self._closed_event: asyncio.Event | None = None

    @property
    def endpoints(self) -> tuple[str, ...]:
        """Every endpoint, in the order given."""
        return tuple(endpoint.address for endpoint in self._endpoints)

    @property
    def closed(self) -> bool:
        return self._closed

    async def close(self) -> None:
        """Closes every channel; calls in flight fail, open watches end. Idempotent."""
        self._closed = True
        if self._closed_event is not None:
            self._closed_event.set()
        for endpoint in self._endpoints:
            channel, endpoint.channel, endpoint.stubs = endpoint.channel, None, None
            if channel is not None:
                await channel.close()

    def closed_event(self) -> asyncio.Event:
        """Set once the transport is closed (made in the running loop on first use)."""
        if self._closed_event is None:
            self._closed_event = asyncio.Event()
            if self._closed:
                self._closed_event.set()
        return self._closed_event

    def check_open(self) -> None:
        """
        Raises:
            EtcdClientClosed: the transport is closed.
        """
        if self._closed:
            raise EtcdClientClosed(f"etcd client for {', '.join(self.endpoints)} is closed")

    def deadline(self, timeout: float | None) -> float:
        """The loop time ``timeout`` seconds from now (None: :attr:`timeout`).

        Raises:
            ValueError: ``timeout`` is not a positive number.
        """
        seconds = self.timeout if timeout is None else timeout
        if not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"timeout={timeout!r}: must be a positive number of seconds")
        return asyncio.get_running_loop().time() + seconds

    # --- endpoints ------------------------------------------------------------------

    def current(self) -> Stubs:
        """The stubs of the endpoint that answered last (its channel opened on first use).

        Raises:
            EtcdClientClosed: the transport is closed.
        """
        self.check_open()
        index = self._current
        endpoint = self._endpoints[index]
        if endpoint.stubs is None:
            channel = self._open_channel(endpoint.address)
            endpoint.channel = channel
            endpoint.stubs = Stubs(
                index,
                endpoint.address,
                rpc_pb2_grpc.KVStub(channel),
                rpc_pb2_grpc.WatchStub(channel),
                rpc_pb2_grpc.AuthStub(channel),
                rpc_pb2_grpc.MaintenanceStub(channel),
            )
        return endpoint.stubs

    def fail_over(self, failed: Stubs) -> None:
        """``failed`` did not answer: the next call goes to the next endpoint
        (unless another call has moved on already)."""
        if len(self._endpoints) > 1 and self._current == failed.position:
            self._current = (failed.position + 1) % len(self._endpoints)
            _log.info(
                "etcd endpoint unavailable, trying the next",
                extra={"endpoint": failed.address, "next": self.endpoints[self._current]},
            )

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

    # --- authentication -------------------------------------------------------------

    async def token(self, deadline: float) -> str | None:
        """The auth token, authenticating first if there is none (None: no auth).

        Raises:
            EtcdAuthError: wrong user or password, or the cluster has no auth.
            EtcdUnavailable: no endpoint answered.
        """
        if self._user is None:
            return None
        if self._auth_lock is None:
            self._auth_lock = asyncio.Lock()
        async with self._auth_lock:
            if self._token is None:
                request = rpc_pb2.AuthenticateRequest(
                    name=self._user, password=self._password or ""
                )
                _, response = await self.call(
                    "authenticate",
                    lambda s: s.auth.Authenticate,
                    request,
                    deadline=deadline,
                    authenticate=False,
                )
                self._token = response.token
                _log.debug("authenticated to etcd", extra={"etcd_user": self._user})
            return self._token

    def forget_token(self, token: str | None) -> None:
        """Drops ``token`` if it is still the current one (etcd no longer knows it)."""
        if token is not None and self._token == token:
            self._token = None

    # --- the unary call -------------------------------------------------------------

    async def call(
        self,
        what: str,
        method: Method[_Req, _Resp],
        request: _Req,
        *,
        deadline: float,
        authenticate: bool = True,
        revision: int = 0,
    ) -> tuple[str, _Resp]:
        """Calls ``method`` until ``deadline``: failing over, logging in again.

        Starts on the endpoint that answered last; an unavailable endpoint
        passes the call to the next one, until each was tried once. A token
        etcd no longer knows is replaced once. ``revision`` is named in a
        "compacted" error. Returns the endpoint that answered and its response.

        Raises:
            EtcdClientClosed: the transport is (or got) closed.
            EtcdUnavailable: every endpoint was tried and none answered.
            EtcdTimeout: the deadline passed.
            EtcdError: the mapped error of any other failure.
        """
        self.check_open()
        loop = asyncio.get_running_loop()
        reauthenticated = False
        failed: list[str] = []
        while True:
            token = await self.token(deadline) if authenticate else None
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise EtcdTimeout(f"etcd {what}: no answer within its deadline")
            stubs = self.current()
            metadata: Metadata | None = (("token", token),) if token is not None else None
            try:
                response = await method(stubs)(request, timeout=remaining, metadata=metadata)
            except asyncio.CancelledError as error:
                # A call cut off by close() ends as "locally cancelled".
                if self._closed and not task_cancelling():
                    raise EtcdClientClosed(f"etcd {what}: the client was closed") from error
                raise
            except grpc.aio.AioRpcError as error:
                if self._closed:
                    raise EtcdClientClosed(f"etcd {what}: the client was closed") from error
                if not reauthenticated and is_invalid_token(error.code(), error.details() or ""):
                    # etcd forgot the token (it expired, or etcd restarted): log in again.
                    self.forget_token(token)
                    reauthenticated = True
                    continue
                self._after_failure(error, stubs, token, what=what, revision=revision)
                failed.append(f"{stubs.address}: {error.details() or ''}")
                if len(failed) >= len(self._endpoints):
                    raise EtcdUnavailable(
                        f"etcd {what}: no endpoint answered ({'; '.join(failed)})"
                    ) from error
                self.fail_over(stubs)
                continue
            return stubs.address, response

    def _after_failure(
        self,
        error: grpc.aio.AioRpcError,
        stubs: Stubs,
        token: str | None,
        *,
        what: str,
        revision: int,
    ) -> None:
        """Returns when ``error`` says the endpoint is unavailable (try the next one).

        Raises:
            EtcdError: the mapped error of any other failure.
        """
        code, text = error.code(), error.details() or ""
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            # etcd 3.4 holds a call whose token names a raft index it has not
            # reached (an etcd re-created empty) until the deadline: log in
            # afresh next time rather than hang again.
            self.forget_token(token)
        if code != grpc.StatusCode.UNAVAILABLE:
            raise mapped_error(
                code, text, what=what, endpoint=stubs.address, revision=revision
            ) from error
