"""A rank's session with its sidecar: one bidirectional stream, used synchronously.

Ranks run synchronous code: a message is put on the request queue (gRPC's
own thread sends it) and a reader thread, one per stream, puts every answer
on a queue the caller reads. The sidecar answers a session's messages one at
a time, in the order sent, so several may be in flight:
:meth:`SessionStream.send` returns at once and :meth:`SessionStream.receive`
reads the oldest answer not yet read (a covered round sends its proposal and
goes on; its answer is read later). The stream's life is the rank's liveness
as the sidecar sees it (see the ``Session`` RPC), so the stream stays open
between calls, and nothing but a goodbye ends it on purpose:

* a receive past its deadline leaves the stream open (a stalled sidecar
  answers later; the late answer is dropped): a stream the client cancels
  reads as a death to the sidecar, and a slow sidecar must end no rank;
* :meth:`SessionStream.close` says goodbye and never cancels a stream the
  sidecar has not ended yet (while it is stalled, say): the sidecar reads the
  goodbye when it wakes;
* a stream that breaks (the sidecar restarted) calls ``on_break`` from the
  reader thread, so the transport can open the next one at once, without
  waiting for the rank's next call; that stream's first message is a
  ``greeting`` (a resume carrying the rank's lifetime), answered to the
  stream itself.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from typing import Final

import grpc

from moe_sidecar.client.errors import RpcStatus, SessionStatus
from moe_sidecar.wire.codec import session_leave_to_proto
from moe_workspace.v1 import coordinator_pb2 as pb
from moe_workspace.v1 import coordinator_pb2_grpc as pb_grpc

__all__ = ["CLOSE_WAIT_S", "SessionStream"]

_log = logging.getLogger(__name__)

_CLOSE: Final = None
"""Ends the request iterator: the client half-closes the stream (after its goodbye)."""
CLOSE_WAIT_S: Final = 1.0
"""Most seconds :meth:`SessionStream.close` waits for the sidecar to end the stream."""
LOCAL_DEADLINE_DETAILS = "Deadline Exceeded"
"""What gRPC writes as details when a client's deadline fires (the typed
error mapping reads it, so a session's deadline reads like a unary one's)."""


class _Ended:
    """The reader's last item: the stream ended, with ``error`` (None: the sidecar ended it)."""

    def __init__(self, error: grpc.RpcError | None) -> None:
        self.error = error


class SessionStream:
    """One open ``Session`` stream of this process.

    Args:
        stub: a stub of the sidecar's channel (owned by the caller).
        greeting: the stream's first message (a resume), answered to the
            stream itself: its answer never reaches :meth:`receive`.
        on_break: called (from the reader thread) with this stream when it
            ends without :meth:`close`: the sidecar went away or ended it.

    Raises:
        grpc.RpcError: (from :meth:`receive`) the stream failed; after that
            the session is dead (:attr:`alive` is False) and a new one must
            be opened.
    """

    def __init__(
        self,
        stub: pb_grpc.WorkspaceCoordinatorStub,
        *,
        greeting: pb.SessionRequest | None = None,
        on_break: Callable[[SessionStream], None] | None = None,
    ) -> None:
        self._requests: queue.SimpleQueue[pb.SessionRequest | None] = queue.SimpleQueue()
        self._answers: queue.SimpleQueue[pb.SessionResponse | _Ended] = queue.SimpleQueue()
        self._greeting_id = greeting.id if greeting is not None else None
        self.greeted: bool | None = None
        """Whether the sidecar accepted the greeting (None: not answered yet, or none)."""
        if greeting is not None:
            self._requests.put(greeting)
        self._responses = stub.Session(iter(self._requests.get, _CLOSE))
        self._sent: deque[int] = deque()
        """Ids of the messages sent and not yet answered, oldest first."""
        self._abandoned: set[int] = set()
        """Ids whose receive passed its deadline: their late answers are dropped."""
        self._alive = True
        self._closing = False
        self._on_break = on_break
        self._then: Callable[[], None] | None = None
        """Runs once the stream ended after :meth:`close` (the channel's close)."""
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="moe-sidecar-session", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        """False once the stream failed or was closed."""
        return self._alive

    @property
    def unanswered(self) -> int:
        """Messages sent whose answer has not been read yet."""
        return len(self._sent)

    def send(self, request: pb.SessionRequest) -> None:
        """Sends ``request`` without waiting for its answer (read it with :meth:`receive`)."""
        self._sent.append(request.id)
        self._requests.put(request)

    def receive(self, timeout: float) -> pb.SessionResponse:
        """The answer to the oldest message sent and not yet answered,
        waiting at most ``timeout`` seconds for it.

        Past ``timeout`` the message counts as answered (its late answer is
        dropped) and the stream stays open.

        Raises:
            SessionStatus: DEADLINE_EXCEEDED when the answer did not come in
                time; INTERNAL when nothing was sent or the answer is another
                message's; UNAVAILABLE when the sidecar ended the session.
            grpc.RpcError: the stream failed (the sidecar went away).
        """
        if not self._sent:
            raise SessionStatus(
                RpcStatus(grpc.StatusCode.INTERNAL, "session: receive() with nothing sent")
            )
        expected = self._sent[0]
        while True:
            try:
                item = self._answers.get(timeout=max(timeout, 0.0))
            except queue.Empty:
                self._sent.popleft()
                self._abandoned.add(expected)
                raise SessionStatus(
                    RpcStatus(grpc.StatusCode.DEADLINE_EXCEEDED, LOCAL_DEADLINE_DETAILS)
                ) from None
            if isinstance(item, _Ended):
                self._answers.put(item)  # every later receive sees the end too
                if item.error is not None:
                    raise item.error
                raise SessionStatus(
                    RpcStatus(grpc.StatusCode.UNAVAILABLE, "the sidecar ended the session")
                )
            if item.id in self._abandoned:
                self._abandoned.discard(item.id)
                continue
            break
        self._sent.popleft()
        if item.id != expected:
            self._alive = False
            self._responses.cancel()
            raise SessionStatus(
                RpcStatus(
                    grpc.StatusCode.INTERNAL,
                    f"session answered message {item.id} to message {expected}",
                )
            )
        return item

    def call(self, request: pb.SessionRequest, timeout: float) -> pb.SessionResponse:
        """Sends ``request`` and returns its answer, waiting at most ``timeout``
        seconds; nothing else may be unanswered.

        Raises:
            SessionStatus: DEADLINE_EXCEEDED when the answer did not come in
                time; INTERNAL when an earlier message is still unanswered.
            grpc.RpcError: the stream failed (the sidecar went away).
        """
        if self._sent:
            raise SessionStatus(
                RpcStatus(
                    grpc.StatusCode.INTERNAL,
                    f"session: call() while {len(self._sent)} message(s) are unanswered",
                )
            )
        self.send(request)
        return self.receive(timeout)

    def _read(self) -> None:
        """The reader thread: every answer onto the queue, then the stream's end."""
        error: grpc.RpcError | None = None
        try:
            for response in self._responses:
                if self._greeting_id is not None and response.id == self._greeting_id:
                    self._greeted(response)
                else:
                    self._answers.put(response)
        except grpc.RpcError as failure:
            error = failure
        self._alive = False
        self._answers.put(_Ended(error))
        with self._lock:
            closing, then = self._closing, self._then
        if then is not None:
            then()
        if not closing and self._on_break is not None:
            self._on_break(self)

    def _greeted(self, response: pb.SessionResponse) -> None:
        self._greeting_id = None
        self.greeted = response.WhichOneof("result") == "resumed"
        if not self.greeted:
            # A sidecar that does not know the lifetime (or one older than
            # resumes): the stream binds at the rank's next proposal.
            _log.info("moe-sidecar: session not resumed: %s", response.error.message)

    def close(self, then: Callable[[], None] | None = None) -> None:
        """Says goodbye (a ``leave``), half-closes the stream and waits (at
        most :data:`CLOSE_WAIT_S`) for the sidecar to end it: the sidecar sees
        the rank leave cleanly, which its peers' watchers do not take for a
        death. ``then`` runs once the stream ended: at once, or later from the
        reader thread. Idempotent.

        A stream the sidecar has not ended within the wait (it is stalled) is
        left open, never cancelled: a cancel can overtake the goodbye, and
        the sidecar would see a stream that ended without one, as from a
        killed process.
        """
        with self._lock:
            if self._closing:
                return
            self._closing = True
            open_now = self._alive
            if open_now:
                self._then = then
        if not open_now:
            if then is not None:
                then()
            return
        self._requests.put(session_leave_to_proto(0))
        self._requests.put(_CLOSE)
        self._reader.join(CLOSE_WAIT_S)
