"""A rank's session with its sidecar: one bidirectional stream, used synchronously.

Ranks run synchronous code, so the stream is driven from the calling thread:
a message is put on the request queue (gRPC's own thread sends it) and the
answer is the next message of the response iterator. The sidecar answers a
session's messages one at a time, in the order sent, so several may be in
flight: :meth:`SessionStream.send` returns at once and
:meth:`SessionStream.receive` reads the oldest answer not yet read (a
covered round sends its proposal and goes on; its answer is read later).
The stream's life is the rank's liveness as the sidecar sees it (see the
``Session`` RPC), so the stream stays open between calls.

A receive waits at most its deadline: a watchdog thread (one per session,
waking a few times a second, costing nothing per call) cancels the stream of
a receive past its deadline, and it fails as a client-side deadline.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from typing import Final

import grpc

from moe_sidecar.client.errors import RpcStatus, SessionStatus
from moe_sidecar.wire.codec import session_leave_to_proto
from moe_workspace.v1 import coordinator_pb2 as pb
from moe_workspace.v1 import coordinator_pb2_grpc as pb_grpc

__all__ = ["CLOSE_WAIT_S", "SessionStream"]

_CLOSE: Final = None
"""Ends the request iterator: the client half-closes the stream (after its goodbye)."""
_WATCH_INTERVAL_S = 0.2
CLOSE_WAIT_S: Final = 1.0
"""Most seconds :meth:`SessionStream.close` waits for the sidecar to end the stream."""
LOCAL_DEADLINE_DETAILS = "Deadline Exceeded"
"""What gRPC writes as details when a client's deadline fires (the typed
error mapping reads it, so a session's deadline reads like a unary one's)."""


class SessionStream:
    """One open ``Session`` stream of this process.

    Args:
        stub: a stub of the sidecar's channel (owned by the caller).

    Raises:
        grpc.RpcError: (from :meth:`call`) the stream failed or was cancelled;
            after that the session is dead (:attr:`alive` is False) and a new
            one must be opened.
    """

    def __init__(self, stub: pb_grpc.WorkspaceCoordinatorStub) -> None:
        self._requests: queue.SimpleQueue[pb.SessionRequest | None] = queue.SimpleQueue()
        self._responses = stub.Session(iter(self._requests.get, _CLOSE))
        self._sent: deque[int] = deque()
        """Ids of the messages sent and not yet answered, oldest first."""
        self._deadline: float | None = None
        self._timed_out = False
        self._alive = True
        self._lock = threading.Lock()
        self._watchdog = threading.Thread(
            target=self._watch, name="moe-sidecar-session", daemon=True
        )
        self._watchdog.start()

    @property
    def alive(self) -> bool:
        """False once the stream failed, timed out or was closed."""
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

        Raises:
            SessionStatus: DEADLINE_EXCEEDED when the answer did not come in
                time; INTERNAL when nothing was sent or the answer is another
                message's; UNAVAILABLE when the sidecar ended the session.
            grpc.RpcError: the stream failed (the sidecar went away, or the
                stream was cancelled).
        """
        if not self._sent:
            raise SessionStatus(
                RpcStatus(grpc.StatusCode.INTERNAL, "session: receive() with nothing sent")
            )
        self._deadline = time.monotonic() + timeout
        try:
            response: pb.SessionResponse = next(self._responses)
        except grpc.RpcError:
            self._alive = False
            if self._timed_out:
                raise SessionStatus(
                    RpcStatus(grpc.StatusCode.DEADLINE_EXCEEDED, LOCAL_DEADLINE_DETAILS)
                ) from None
            raise
        except StopIteration:
            self._alive = False
            raise SessionStatus(
                RpcStatus(grpc.StatusCode.UNAVAILABLE, "the sidecar ended the session")
            ) from None
        finally:
            self._deadline = None
        expected = self._sent.popleft()
        if response.id != expected:
            self._alive = False
            self._responses.cancel()
            raise SessionStatus(
                RpcStatus(
                    grpc.StatusCode.INTERNAL,
                    f"session answered message {response.id} to message {expected}",
                )
            )
        return response

    def call(self, request: pb.SessionRequest, timeout: float) -> pb.SessionResponse:
        """Sends ``request`` and returns its answer, waiting at most ``timeout``
        seconds; nothing else may be unanswered.

        Raises:
            SessionStatus: DEADLINE_EXCEEDED when the answer did not come in
                time; INTERNAL when an earlier message is still unanswered.
            grpc.RpcError: the stream failed (the sidecar went away, or the
                stream was cancelled).
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

    def _watch(self) -> None:
        while self._alive:
            time.sleep(_WATCH_INTERVAL_S)
            deadline = self._deadline
            if deadline is not None and time.monotonic() > deadline:
                self._timed_out = True
                self._responses.cancel()
                return

    def close(self) -> None:
        """Says goodbye (a ``leave``), half-closes the stream and waits (at
        most :data:`CLOSE_WAIT_S`) for the sidecar to end it: the sidecar sees
        the rank leave cleanly, which its peers' watchers do not take for a
        death. Idempotent.

        A cancel sent right after the goodbye could overtake it, and the
        sidecar would see a stream that ended without one, as from a killed
        process; so the stream is cancelled only once it ended, or past the wait.
        """
        with self._lock:
            if not self._alive:
                return
            self._alive = False
        self._requests.put(session_leave_to_proto(0))
        self._requests.put(_CLOSE)
        give_up = threading.Timer(CLOSE_WAIT_S, self._responses.cancel)
        give_up.daemon = True
        give_up.start()
        try:
            for _ in self._responses:
                pass  # answers nobody reads any more (the caller dropped them)
        except grpc.RpcError:
            pass  # the stream failed or was given up on: the rank is gone either way
        finally:
            give_up.cancel()
        self._responses.cancel()
