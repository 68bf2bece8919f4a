"""A rank's session with its sidecar: one bidirectional stream, used synchronously.

Ranks run synchronous code, so the stream is driven from the calling thread:
a message is put on the request queue (gRPC's own thread sends it) and the
answer is the next message of the response iterator. One message is in
flight at a time. The stream's life is the rank's liveness as the sidecar
sees it (see the ``Session`` RPC), so the stream stays open between calls.

A call waits at most its deadline: a watchdog thread (one per session,
waking a few times a second, costing nothing per call) cancels the stream of
a call past its deadline, and the call fails as a client-side deadline.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Final

import grpc

from moe_sidecar.client.errors import RpcStatus, SessionStatus
from moe_workspace.v1 import coordinator_pb2 as pb
from moe_workspace.v1 import coordinator_pb2_grpc as pb_grpc

__all__ = ["SessionStream"]

_CLOSE: Final = None
"""Ends the request iterator: the client half-closes the stream."""
_WATCH_INTERVAL_S = 0.2
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

    def call(self, request: pb.SessionRequest, timeout: float) -> pb.SessionResponse:
        """Sends ``request`` and returns its answer, waiting at most ``timeout`` seconds.

        Raises:
            SessionStatus: DEADLINE_EXCEEDED when the answer did not come in time.
            grpc.RpcError: the stream failed (the sidecar went away, or the
                stream was cancelled).
        """
        self._deadline = time.monotonic() + timeout
        self._requests.put(request)
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
        if response.id != request.id:
            self._alive = False
            self._responses.cancel()
            raise SessionStatus(
                RpcStatus(
                    grpc.StatusCode.INTERNAL,
                    f"session answered message {response.id} to message {request.id}",
                )
            )
        return response

    def _watch(self) -> None:
        while self._alive:
            time.sleep(_WATCH_INTERVAL_S)
            deadline = self._deadline
            if deadline is not None and time.monotonic() > deadline:
                self._timed_out = True
                self._responses.cancel()
                return

    def close(self) -> None:
        """Half-closes the stream: the sidecar sees the rank leave. Idempotent."""
        with self._lock:
            if not self._alive:
                return
            self._alive = False
        self._requests.put(_CLOSE)
        self._responses.cancel()
