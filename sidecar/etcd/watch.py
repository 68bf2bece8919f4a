"""A watch on an etcd prefix that reconnects by itself and loses nothing.

:class:`EtcdWatch` (made by :meth:`moe_sidecar.etcd.client.EtcdClient.watch_prefix`)
is an async iterator of :class:`WatchEvent`. Whenever its stream breaks it
opens a new one (on the next endpoint, after a :class:`~moe_sidecar.etcd.backoff.Backoff`
pause) from one past the last revision it delivered, so a restart of etcd
loses nothing and repeats nothing. When it cannot catch up (etcd compacted
the history it needs, or etcd's revision went backwards: re-created empty or
restored from a backup) it raises :class:`~moe_sidecar.etcd.errors.EtcdStale`
and the caller re-reads.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from types import TracebackType

import grpc
import grpc.aio

from moe_sidecar.etcd.backoff import Backoff
from moe_sidecar.etcd.errors import (
    RETRYABLE_STREAM_CODES,
    EtcdClientClosed,
    EtcdClusterReset,
    EtcdCompacted,
    EtcdEventTooLarge,
    EtcdUnavailable,
    is_invalid_token,
    is_too_large,
    mapped_error,
    status_from_reason,
)
from moe_sidecar.etcd.transport import (
    EtcdTransport,
    Metadata,
    Stubs,
    prefix_range_end,
    task_cancelling,
)
from moe_workspace.etcd.v3 import kv_pb2, rpc_pb2

__all__ = ["WATCH_BACKOFF_MAX", "WATCH_BACKOFF_MIN", "EtcdWatch", "EventType", "WatchEvent"]

_log = logging.getLogger("moe_sidecar.etcd.client")

WATCH_BACKOFF_MIN = 0.05
"""Seconds before the first reconnect of a broken watch."""
WATCH_BACKOFF_MAX = 2.0
"""The longest pause between reconnects."""
# A watch on a member that lost its leader is ended by etcd (so the client
# moves to another member) instead of going silent.
_REQUIRE_LEADER = ("hasleader", "true")


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


class EtcdWatch:
    """The events under one prefix: an async iterator and async context manager.

    The stream opens on the first ``__anext__``; iteration ends when the
    client is closed.
    """

    def __init__(self, transport: EtcdTransport, prefix: bytes, start_revision: int) -> None:
        self._transport = transport
        self._prefix = prefix
        self._range_end = prefix_range_end(prefix)
        self._next_revision = start_revision
        self._backoff = Backoff(WATCH_BACKOFF_MIN, WATCH_BACKOFF_MAX)
        self._resumed = False
        """etcd has accepted this watch before (a later create may reveal a reset)."""
        self._reauthenticated = False
        """The token was just dropped for one etcd forgot: retry at once, once."""
        self._outage: str | None = None
        """Why the stream is down (None: it is up, or never broke)."""
        self._events = self._run()

    @property
    def prefix(self) -> bytes:
        return self._prefix

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

    # --- the reconnect loop ---------------------------------------------------------

    async def _run(self) -> AsyncGenerator[WatchEvent, None]:
        transport = self._transport
        while not transport.closed:
            closed = transport.closed_event()
            try:
                stubs = transport.current()
                token = await transport.token(transport.deadline(None))
            except EtcdClientClosed:
                return
            except EtcdUnavailable as error:
                self._note_outage(str(error))
                await self._backoff.pause(closed)
                continue
            call = stubs.watch.Watch(
                _watch_requests(self._create_request(), closed), metadata=_metadata(token)
            )
            try:
                async for event in self._stream(call, stubs, token):
                    yield event
            except asyncio.CancelledError:
                # close() cuts the stream off as "locally cancelled": the watch ends.
                if transport.closed and not task_cancelling():
                    return
                raise
            except grpc.aio.AioRpcError as error:
                if transport.closed:
                    return
                if self._stream_failed(error, stubs, token):
                    continue  # logged in again: watch again at once
            finally:
                call.cancel()
            if not (self._reauthenticated and self._outage is None):
                await self._backoff.pause(closed)

    def _create_request(self) -> rpc_pb2.WatchRequest:
        return rpc_pb2.WatchRequest(
            create_request=rpc_pb2.WatchCreateRequest(
                key=self._prefix,
                range_end=self._range_end,
                start_revision=self._next_revision,
                progress_notify=True,
                # etcd splits a response larger than its request limit (a catch-up
                # batch of many large values) instead of sending one that could
                # pass this client's receive limit.
                fragment=True,
            )
        )

    async def _stream(
        self,
        call: grpc.aio.StreamStreamCall[rpc_pb2.WatchRequest, rpc_pb2.WatchResponse],
        stubs: Stubs,
        token: str | None,
    ) -> AsyncIterator[WatchEvent]:
        """The events of one stream, until it ends, is cancelled or breaks.

        Raises:
            grpc.aio.AioRpcError: the stream broke.
            EtcdStale: etcd cannot bring this watch up to date.
            EtcdError: etcd refused the watch.
        """
        created = False
        while True:
            response = await self._read(call, stubs.address, token, created=created)
            if response is None:
                return
            if response.canceled:
                self._cancelled(response, stubs.address, token)
                return
            if response.created:
                self._created(response.header.revision, stubs.address)
                created = True
                continue
            events = response.events
            for i, event in enumerate(events):
                self._next_revision = _resume_revision(events, i, more=response.fragment)
                yield _watch_event(event)
            if not events and response.header.revision >= self._next_revision:
                # A progress notice: nothing up to this revision is left to see.
                self._next_revision = response.header.revision + 1

    async def _read(
        self,
        call: grpc.aio.StreamStreamCall[rpc_pb2.WatchRequest, rpc_pb2.WatchResponse],
        address: str,
        token: str | None,
        *,
        created: bool,
    ) -> rpc_pb2.WatchResponse | None:
        """The stream's next response; None when it ended (or never took the watch)."""
        if created:
            response = await call.read()
        else:
            try:
                response = await asyncio.wait_for(call.read(), self._transport.timeout)
            except TimeoutError:
                # etcd took the stream but not the watch: etcd 3.4 holds one whose
                # token names a raft index it has not reached (an etcd re-created
                # empty). Log in afresh and watch again.
                self._transport.forget_token(token)
                self._note_outage(f"{address}: no answer to the watch request")
                return None
        if not isinstance(response, rpc_pb2.WatchResponse):  # grpc.aio.EOF
            self._note_outage(f"{address}: the stream ended")
            return None
        return response

    # --- what etcd said -------------------------------------------------------------

    def _created(self, revision: int, address: str) -> None:
        """etcd took the watch at store revision ``revision``.

        Raises:
            EtcdClusterReset: etcd is behind what this watch has already seen.
        """
        if self._next_revision == 0:
            self._next_revision = revision + 1
        elif self._resumed and revision + 1 < self._next_revision:
            raise EtcdClusterReset(
                f"etcd watch of {self._shown} on {address}: etcd is at revision {revision}, "
                f"behind the {self._next_revision - 1} already seen: it was re-created or "
                "restored from a backup; re-read the prefix and watch from the revision of "
                "that read + 1",
                revision=revision,
                expected_revision=self._next_revision,
            )
        self._resumed = True
        if self._outage is not None:
            _log.info(
                "etcd watch resumed", extra={"endpoint": address, "revision": self._next_revision}
            )
            self._outage = None
        self._backoff.reset()
        self._reauthenticated = False

    def _cancelled(self, response: rpc_pb2.WatchResponse, address: str, token: str | None) -> None:
        """etcd cancelled the watch: returns to watch again (after logging in
        again if the token was the reason, else after a pause).

        Raises:
            EtcdCompacted: the start revision is compacted.
            EtcdAuthError: etcd refused the watch's credentials or permissions.
            EtcdError: etcd cancelled the watch for another reason.
        """
        if response.compact_revision > 0:
            raise EtcdCompacted(
                f"etcd watch of {self._shown} on {address}: revision {self._next_revision} is "
                f"compacted (the oldest kept is {response.compact_revision}); re-read the "
                "prefix and watch from the revision of that read + 1",
                compact_revision=response.compact_revision,
                requested_revision=self._next_revision,
            )
        if not response.cancel_reason:
            self._note_outage(f"{address}: cancelled")
            return
        code, text = status_from_reason(response.cancel_reason)
        if is_invalid_token(code, text) and not self._reauthenticated:
            self._transport.forget_token(token)
            self._reauthenticated = True
            return
        raise mapped_error(code, text, what=f"watch of {self._shown}", endpoint=address)

    def _stream_failed(self, error: grpc.aio.AioRpcError, stubs: Stubs, token: str | None) -> bool:
        """The stream broke: True to log in again and watch again at once, False
        to watch again (on the next endpoint) after a pause.

        Raises:
            EtcdEventTooLarge: an event is larger than the client receives.
            EtcdError: the mapped error of a failure that retrying cannot cure.
        """
        code, text = error.code(), error.details() or ""
        if is_invalid_token(code, text) and not self._reauthenticated:
            self._transport.forget_token(token)
            self._reauthenticated = True
            return True
        if is_too_large(code, text):
            raise EtcdEventTooLarge(
                f"etcd watch of {self._shown} on {stubs.address}: an event after revision "
                f"{self._next_revision - 1} is larger than this client receives ({text}); "
                "re-read the prefix and watch from the revision of that read + 1"
            ) from error
        if code not in RETRYABLE_STREAM_CODES:
            raise mapped_error(code, text, what="watch", endpoint=stubs.address) from error
        self._note_outage(f"{stubs.address}: {text or code.name}")
        self._transport.fail_over(stubs)
        return False

    @property
    def _shown(self) -> str:
        return repr(self._prefix.decode("utf-8", "replace"))

    def _note_outage(self, reason: str) -> None:
        if self._outage is None:
            _log.warning(
                "etcd watch interrupted; reconnecting",
                extra={
                    "prefix": self._prefix.decode("utf-8", "replace"),
                    "revision": self._next_revision,
                    "reason": reason,
                },
            )
        self._outage = reason


def _metadata(token: str | None) -> Metadata:
    return (_REQUIRE_LEADER,) + ((("token", token),) if token else ())


def _resume_revision(events: Sequence[kv_pb2.Event], index: int, *, more: bool) -> int:
    """Where to resume once ``events[index]`` is delivered (``more``: a fragment
    follows, which may hold more events of the last revision).

    A transaction's events share one revision: resume after it only once
    all of them are out.
    """
    revision = events[index].kv.mod_revision
    if index + 1 == len(events):
        return revision if more else revision + 1
    last = events[index + 1].kv.mod_revision != revision
    return revision + 1 if last else revision


async def _watch_requests(
    create: rpc_pb2.WatchRequest, closed: asyncio.Event
) -> AsyncIterator[rpc_pb2.WatchRequest]:
    """The request side of a watch stream: one create, then silence until closed."""
    yield create
    await closed.wait()


def _watch_event(event: kv_pb2.Event) -> WatchEvent:
    kind = EventType.DELETE if event.type == kv_pb2.Event.DELETE else EventType.PUT
    value = event.kv.value if kind is EventType.PUT else b""
    return WatchEvent(kind, event.kv.key, value, event.kv.mod_revision)
