"""How a rank reaches the decision core: a sidecar over gRPC, or in-process.

Both transports take and return the decision core's own types
(:class:`moe_sidecar.core.group.Proposal`, :class:`~moe_sidecar.core.group.Decision`,
:class:`~moe_sidecar.core.group.CommitRecord`) and raise the typed errors of
:mod:`moe_sidecar.client.errors`, so the manager handles their answers
alike. It tells them apart by ``embedded`` only: embedded, it agrees across
the EP group itself and passes covered rounds without leaving proposals
unanswered (:mod:`moe_sidecar.client.covered`).
Conversions to and from the wire go through :mod:`moe_sidecar.wire.codec`.

* :class:`GrpcTransport` talks to the node's sidecar. Ranks run synchronous
  code, so it is a synchronous client: every call has a deadline, UNAVAILABLE
  is retried with exponential backoff (proposals and commits are idempotent),
  and the channel is created lazily in the process that uses it, and created
  anew if the object crossed a fork.
* :class:`EmbeddedTransport` drives :mod:`moe_sidecar.core.policy` in-process with one
  local rank per group; the manager then agrees across the EP group itself.

:func:`transport_for` picks one: ``MOE_SIDECAR_TARGET`` (or an explicit
target) means gRPC; neither means embedded.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Final, Protocol, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from moe_sidecar.client import view_rpcs
from moe_sidecar.client.embedded_transport import EmbeddedTransport
from moe_sidecar.client.errors import (
    CoordinatorError,
    CoordinatorUnavailable,
    InternalError,
    InvalidArgument,
    SessionStatus,
    SidecarNotAnswering,
    error_from_rpc,
)
from moe_sidecar.client.session import SessionStream
from moe_sidecar.core.defaults import (
    EMBEDDED,
    ENV_PROPOSE_TIMEOUT,
    ENV_STALL_BUDGET,
    ENV_TARGET,
)
from moe_sidecar.core.group import (
    CommitRecord,
    Decision,
    GroupSummary,
    Proposal,
    RankSummary,
)
from moe_sidecar.core.membership import View
from moe_sidecar.core.policy.arrivals import Arrival
from moe_sidecar.wire.address import AddressError, parse_listen_address
from moe_sidecar.wire.codec import (
    arrival_to_proto,
    commit_to_proto,
    decision_from_proto,
    proposal_to_proto,
    session_acknowledge_to_proto,
    session_commit_to_proto,
    session_propose_to_proto,
    session_resume_to_proto,
    summary_from_proto,
)
from moe_workspace.v1 import coordinator_pb2 as pb
from moe_workspace.v1 import coordinator_pb2_grpc as pb_grpc

__all__ = [
    "CHANNEL_OPTIONS",
    "DEFAULT_CALL_TIMEOUT_S",
    "DEFAULT_PROPOSE_TIMEOUT_S",
    "DEFAULT_STALL_BUDGET_S",
    "DEFAULT_UNAVAILABLE_RETRY_S",
    "EmbeddedTransport",
    "GrpcTransport",
    "Transport",
    "transport_for",
]

DEFAULT_PROPOSE_TIMEOUT_S = 120.0
"""A Propose long-polls until every local rank has proposed. The sidecar
fails a round that misses a rank after its round timeout (and names the
missing rank); this deadline only catches a sidecar that never answers, so it
must exceed the sidecar's ``--round-timeout``."""
DEFAULT_STALL_BUDGET_S = 30.0
"""How long a call that waits for no other rank (a commit, an
acknowledgement, a read) waits for a sidecar that does not answer (stalled)
or cannot be reached (starting a little after the ranks, or restarting)
before it raises :class:`~moe_sidecar.client.errors.SidecarNotAnswering` or
:class:`~moe_sidecar.client.errors.CoordinatorUnavailable`:
``MOE_SIDECAR_STALL_BUDGET`` overrides it."""
DEFAULT_CALL_TIMEOUT_S = DEFAULT_STALL_BUDGET_S
"""Deadline of calls that do not wait for other ranks (Commit): the stall budget."""
DEFAULT_UNAVAILABLE_RETRY_S = DEFAULT_STALL_BUDGET_S
"""How long UNAVAILABLE is retried before the rank gives up: the stall budget."""
_RESUME_PAUSE_S: Final = (0.05, 1.0)
"""First and longest wait before a broken session is opened again (a
stream that breaks at once again waits longer each time)."""

_log = logging.getLogger(__name__)


def stall_budget(environ: Mapping[str, str]) -> float:
    """``MOE_SIDECAR_STALL_BUDGET`` in seconds (unset or empty: the default).

    Raises:
        InvalidArgument: not a number of seconds above 0 (naming the variable).
    """
    text = environ.get(ENV_STALL_BUDGET, "").strip()
    if not text:
        return DEFAULT_STALL_BUDGET_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0 or seconds == float("inf"):
        raise InvalidArgument.of(ENV_STALL_BUDGET, text, "must be a number of seconds above 0")
    return seconds


class Transport(view_rpcs.ViewCalls, Protocol):
    """What the manager needs from the decision core (and the views' calls: ViewCalls)."""

    @property
    def rpc_count(self) -> int:
        """Calls sent to a sidecar so far (every attempt); 0 when embedded."""
        ...

    @property
    def embedded(self) -> bool:
        """True when the decision core runs in this process."""
        ...

    def propose(self, proposal: Proposal) -> Decision:
        """The decision for ``proposal``'s round; waits for the round to close.

        Raises:
            CoordinatorError: the typed error the round (or the call) failed with.
        """
        ...

    def commit(self, group: str, record: CommitRecord) -> None:
        """Records what the rank holds in ``group`` after building and the barrier.

        Raises:
            CoordinatorError: the commit was refused or could not be delivered.
        """
        ...

    @property
    def unanswered(self) -> int:
        """Proposals sent with :meth:`propose_later` whose decision
        :meth:`next_answer` has not returned yet."""
        ...

    def propose_later(self, proposal: Proposal) -> None:
        """Sends ``proposal`` without waiting for its round to close; its
        decision comes from :meth:`next_answer`, in the order sent.

        Raises:
            CoordinatorError: the proposal could not be sent.
        """
        ...

    def next_answer(self) -> Decision:
        """The decision of the oldest proposal sent with :meth:`propose_later`
        and not yet answered.

        Raises:
            CoordinatorError: the typed error that proposal was answered with
                (a refused round names the layers and ranks); it counts as
                answered.
            InternalError: nothing is unanswered.
        """
        ...

    def arrive(self, arrival: Arrival) -> grpc.Future[pb.ArriveResponse] | None:
        """Tells the sidecar the rank reached its lifetime's first round
        (``arrival.lifetime`` is the token) without waiting: the call's future,
        which ends when the rank's first proposal arrives or the sidecar's
        round timeout passes; None when there is no sidecar to tell."""
        ...

    def gone_ranks(self, group: str) -> list[RankSummary]:
        """The ranks of ``group``'s current lifetime known to be gone (empty when
        the transport cannot know, as in embedded mode).

        Raises:
            CoordinatorError: the decider could not be asked.
        """
        ...

    def close(self) -> None:
        """Releases what the transport holds; it may be used again afterwards."""
        ...


# --- proto <-> domain ------------------------------------------------------


def _decision_from_proto(p: Proposal, response: pb.ProposeResponse, target: str) -> Decision:
    try:
        decision = decision_from_proto(response, p.requirement.layer)
    except ValueError as error:
        raise InternalError(
            f"Propose to sidecar {target}: {error} for round {p.round} of group {p.group!r}"
        ) from error
    if decision.round != p.round:
        raise InternalError(
            f"Propose to sidecar {target}: asked round {p.round} of group {p.group!r} but the "
            f"answer is for round {decision.round}"
        )
    return decision


# --- gRPC ------------------------------------------------------------------

_Reply = TypeVar("_Reply")


CHANNEL_OPTIONS = (
    # Reconnect within a second of the sidecar coming back: gRPC's default
    # backoff grows to two minutes and would eat the retry window.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


class GrpcTransport:
    """A synchronous gRPC client of one sidecar.

    Proposals and commits travel on one ``Session`` stream per process
    (:class:`~moe_sidecar.client.session.SessionStream`): the sidecar knows at
    once when this rank is gone. With ``session=False`` (or against a
    sidecar without sessions) they are unary ``Propose``/``Commit`` calls.

    UNAVAILABLE (the sidecar starting, restarting or draining) is retried for
    ``unavailable_retry`` seconds: between attempts the transport waits for
    the channel to be ready again (reconnecting within a second of the
    sidecar's return), never longer than what is left of the window. A call
    with no answer in its deadline (a stalled sidecar) raises
    :class:`~moe_sidecar.client.errors.SidecarNotAnswering` and leaves the
    session open: a slow sidecar ends no rank.

    The session comes back by itself: once a proposal or commit has said who
    the rank is, a stream that breaks (the sidecar restarted) is opened
    again at once from the stream's own reader thread, waiting for the
    sidecar to be back, and its first message resumes the rank's lifetime,
    so a rank idle between batches is watched again as soon as the sidecar
    is back, without waiting for its next call.

    Safe to create before a fork or to pickle into a spawned process: no gRPC
    object exists until the first call, and a call from another process than
    the one that opened the channel opens a new one (a gRPC channel must not
    be used across a fork).

    Args:
        target: the sidecar's address, ``unix:///path`` or ``host:port``.
        propose_timeout: deadline of each Propose attempt, in seconds; must
            exceed the sidecar's round timeout. Default: env
            ``MOE_SIDECAR_PROPOSE_TIMEOUT``, else :data:`DEFAULT_PROPOSE_TIMEOUT_S`.
        call_timeout: deadline of every other call. Default: env
            ``MOE_SIDECAR_STALL_BUDGET``, else :data:`DEFAULT_STALL_BUDGET_S`.
        unavailable_retry: seconds during which UNAVAILABLE is retried
            (default: as ``call_timeout``).
        session: use a session stream (default) or unary calls.

    Raises:
        ValueError: a timeout is not positive.
        InvalidArgument: ``MOE_SIDECAR_STALL_BUDGET`` is malformed (naming it).
    """

    def __init__(
        self,
        target: str,
        *,
        propose_timeout: float | None = None,
        call_timeout: float | None = None,
        unavailable_retry: float | None = None,
        session: bool = True,
    ) -> None:
        if propose_timeout is None:
            env = os.environ.get(ENV_PROPOSE_TIMEOUT, "")
            propose_timeout = float(env) if env else DEFAULT_PROPOSE_TIMEOUT_S
        if call_timeout is None or unavailable_retry is None:
            budget = stall_budget(os.environ)
            call_timeout = budget if call_timeout is None else call_timeout
            unavailable_retry = budget if unavailable_retry is None else unavailable_retry
        if propose_timeout <= 0 or call_timeout <= 0 or unavailable_retry < 0:
            raise ValueError(
                f"timeouts must be positive: propose_timeout={propose_timeout}, "
                f"call_timeout={call_timeout}, unavailable_retry={unavailable_retry}"
            )
        self.target = target
        self.propose_timeout = propose_timeout
        self.call_timeout = call_timeout
        self.unavailable_retry = unavailable_retry
        self.session = session
        self._rpc_count = 0
        self._message_id = 0
        self._pid: int | None = None
        self._channel: grpc.Channel | None = None
        self._stub: pb_grpc.WorkspaceCoordinatorStub | None = None
        self._stream: SessionStream | None = None
        self._lock = threading.Lock()
        self._stream_lock = threading.Lock()
        """Held while the session stream is replaced (the caller's thread and
        a reader thread that saw the stream break may both open one)."""
        self._identity: tuple[str, int, str] | None = None
        """(group, ep_rank, lifetime token) the session speaks for, once a
        proposal or commit said so: what a new stream resumes."""
        self._resume_pause = _RESUME_PAUSE_S[0]
        self._closed = threading.Event()
        self._unanswered: deque[Proposal] = deque()
        self._sent_on: SessionStream | None = None
        """The stream the unanswered proposals were sent on (a new stream
        sends them again: proposals are idempotent)."""
        self._answers: deque[Decision | CoordinatorError] = deque()
        """Unary mode: the answers of proposals already exchanged, in order."""

    @property
    def rpc_count(self) -> int:
        return self._rpc_count

    @property
    def unanswered(self) -> int:
        return len(self._unanswered)

    @property
    def embedded(self) -> bool:
        return False

    def __getstate__(self) -> dict[str, Any]:
        # A channel cannot be pickled; the receiving process opens its own.
        state = dict(self.__dict__)
        state.update(
            _pid=None,
            _channel=None,
            _stub=None,
            _stream=None,
            _lock=None,
            _stream_lock=None,
            _identity=None,
            _closed=None,
            _sent_on=None,
            _unanswered=deque(),
            _answers=deque(),
        )
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._stream_lock = threading.Lock()
        self._closed = threading.Event()

    def _stub_here(self) -> pb_grpc.WorkspaceCoordinatorStub:
        with self._lock:
            pid = os.getpid()
            if self._stub is None or self._pid != pid:
                # After a fork the inherited channel belongs to the parent:
                # drop it without closing (closing would touch the parent's
                # gRPC state) and open one owned by this process.
                self._channel = grpc.insecure_channel(self.target, options=CHANNEL_OPTIONS)
                self._stub = pb_grpc.WorkspaceCoordinatorStub(self._channel)
                self._stream = None
                self._pid = pid
            return self._stub

    def _stream_here(self) -> SessionStream:
        stub = self._stub_here()
        with self._stream_lock:
            stream = self._stream
            if stream is None or not stream.alive:
                stream = self._stream = self._open_stream(stub)
            return stream

    def _open_stream(self, stub: pb_grpc.WorkspaceCoordinatorStub) -> SessionStream:
        """A new session stream, resuming the rank's lifetime first when known."""
        identity = self._identity
        # Id 0, as a goodbye's: the greeting's answer is the stream's own, and
        # this may run in a reader thread beside the caller's numbering.
        greeting = session_resume_to_proto(0, *identity) if identity is not None else None
        return SessionStream(stub, greeting=greeting, on_break=self._stream_broke)

    def _speaks_for(self, group: str, ep_rank: int, lifetime: str) -> None:
        """Records whom the session speaks for (what a new stream resumes)."""
        self._identity = (group, ep_rank, lifetime)

    def _stream_broke(self, broken: SessionStream) -> None:
        """A session stream ended without a goodbye (in its reader thread):
        unless the transport is closed, or the rank never said who it is,
        wait for the sidecar to be back and open the next stream then, so
        the sidecar sees the rank's session again without the rank's next
        call. A stream the caller's thread opened meanwhile is kept."""
        if broken.greeted:
            self._resume_pause = _RESUME_PAUSE_S[0]  # it was live: start from the shortest wait
        pause, self._resume_pause = (
            self._resume_pause,
            min(self._resume_pause * 2, _RESUME_PAUSE_S[1]),
        )
        while not self._closed.wait(pause):
            with self._lock:
                channel = self._channel if self._pid == os.getpid() else None
                stub = self._stub
            if channel is None or stub is None or self._identity is None:
                return
            if not _answers_health(channel, _RESUME_PAUSE_S[1]):
                pause = 0.0  # the check itself waited: ask again at once
                continue
            with self._stream_lock:
                if self._closed.is_set() or self._stream is not broken:
                    return  # closed, or the caller's thread opened one already
                try:
                    self._stream = self._open_stream(stub)
                except (RuntimeError, ValueError) as error:  # the channel closed meanwhile
                    _log.debug("moe-sidecar: session not reopened: %s", error)
            return

    def _wait_ready(self, deadline: float) -> None:
        """Waits until the sidecar answers again, or ``deadline``: one health
        check that waits for the channel to (re)connect, whatever it answers.

        Not ``grpc.channel_ready_future``: its connectivity-polling thread
        outlives the wait, and closing the transport right after a retry made
        it raise "Channel closed!" in that thread (a traceback in the rank's
        output at cleanup).
        """
        remaining = deadline - time.monotonic()
        if remaining <= 0 or self._channel is None:
            return
        with contextlib.suppress(grpc.RpcError):
            health_pb2_grpc.HealthStub(self._channel).Check(
                health_pb2.HealthCheckRequest(), timeout=remaining, wait_for_ready=True
            )

    def _call(self, method: str, timeout: float, send: Callable[[float], _Reply]) -> _Reply:
        deadline = time.monotonic() + self.unavailable_retry
        attempts = 0
        while True:
            attempts += 1
            self._rpc_count += 1
            try:
                return send(timeout)
            except (grpc.RpcError, SessionStatus) as failure:
                error = error_from_rpc(failure, method=method, target=self.target, timeout=timeout)
                if self.session and _unimplemented(failure):
                    self.session = False  # a sidecar older than sessions: unary calls
                    continue
                retriable = isinstance(error, CoordinatorUnavailable) and not isinstance(
                    error, SidecarNotAnswering
                )
                if not retriable or time.monotonic() >= deadline:
                    if retriable and attempts > 1:
                        error = CoordinatorUnavailable(
                            f"{error.message} (gave up after {attempts} attempts over "
                            f"{self.unavailable_retry:g}s)"
                        )
                    raise error from failure
            # Jitter keeps the ranks of a node from retrying in lockstep.
            time.sleep(min(random.uniform(0.01, 0.05), max(deadline - time.monotonic(), 0.0)))
            self._wait_ready(deadline)

    def _session_call(self, request: pb.SessionRequest, timeout: float) -> pb.SessionResponse:
        response = self._stream_here().call(request, timeout)
        if response.WhichOneof("result") == "error":
            raise SessionStatus.named(response.error.code, response.error.message)
        return response

    def _next_id(self) -> int:
        self._message_id += 1
        return self._message_id

    def propose(self, proposal: Proposal) -> Decision:
        """See :meth:`Transport.propose`.

        Raises:
            CoordinatorError: the sidecar's typed error; CoordinatorUnavailable
                once UNAVAILABLE has been retried for ``unavailable_retry``
                seconds; RoundTimedOut when the call's own deadline fires.
        """

        self._speaks_for(proposal.group, proposal.ep_rank, proposal.lifetime)

        def send(timeout: float) -> pb.ProposeResponse:
            if self.session:
                request = session_propose_to_proto(self._next_id(), proposal)
                return self._session_call(request, timeout).decision
            return self._stub_here().Propose(proposal_to_proto(proposal), timeout=timeout)

        response = self._call("Propose", self.propose_timeout, send)
        return _decision_from_proto(proposal, response, self.target)

    def commit(self, group: str, record: CommitRecord) -> None:
        """See :meth:`Transport.commit`.

        Raises:
            CoordinatorError: the sidecar's typed error, or CoordinatorUnavailable.
        """

        self._speaks_for(group, record.ep_rank, record.lifetime)

        def send(timeout: float) -> object:
            if self.session:
                request = session_commit_to_proto(self._next_id(), group, record)
                return self._session_call(request, timeout)
            return self._stub_here().Commit(commit_to_proto(group, record), timeout=timeout)

        self._call("Commit", self.call_timeout, send)

    def _stream_with_unanswered(self) -> SessionStream:
        """The open stream, on which every unanswered proposal has been sent
        (sent again on a stream opened since)."""
        stream = self._stream_here()
        if stream is not self._sent_on:
            for proposal in self._unanswered:
                self._rpc_count += 1 if self._sent_on is not None else 0  # sent again
                stream.send(session_propose_to_proto(self._next_id(), proposal))
            self._sent_on = stream
        return stream

    def _drop_in_flight(self, stream: SessionStream) -> None:
        """Reads and drops the answers still in flight on ``stream`` (they
        were sent after a proposal that must be sent again, so they are
        refused as out of sequence, or the stream is gone)."""
        while stream.alive and stream.unanswered:
            with contextlib.suppress(grpc.RpcError, SessionStatus):
                stream.receive(self.call_timeout)

    def propose_later(self, proposal: Proposal) -> None:
        """See :meth:`Transport.propose_later`."""
        if not self.session:
            # Unary calls cannot be left in flight: exchange now, hand the
            # answer out in order.
            answer: Decision | CoordinatorError
            try:
                answer = self.propose(proposal)
            except CoordinatorError as error:
                answer = error
            self._answers.append(answer)
            self._unanswered.append(proposal)
            return
        self._speaks_for(proposal.group, proposal.ep_rank, proposal.lifetime)
        stream = self._stream_with_unanswered()
        self._unanswered.append(proposal)
        self._rpc_count += 1
        stream.send(session_propose_to_proto(self._next_id(), proposal))

    def next_answer(self) -> Decision:
        """See :meth:`Transport.next_answer`.

        A stream that broke meanwhile (the sidecar restarting) is opened
        again and every unanswered proposal sent again, within the
        UNAVAILABLE retry window.

        Raises:
            CoordinatorError: the typed error the oldest proposal was answered with.
            InternalError: nothing is unanswered.
        """
        if not self._unanswered:
            raise InternalError("next_answer() with nothing unanswered")
        proposal = self._unanswered[0]
        if self._answers:
            self._unanswered.popleft()
            answer = self._answers.popleft()
            if isinstance(answer, CoordinatorError):
                raise answer
            return answer

        deadline = time.monotonic() + self.unavailable_retry
        attempts = 0
        while True:
            attempts += 1
            if attempts > 1:
                self._rpc_count += 1
            stream = self._stream_with_unanswered()
            try:
                response = stream.receive(self.propose_timeout)
                if response.WhichOneof("result") == "error":
                    raise SessionStatus.named(response.error.code, response.error.message)
                break
            except (grpc.RpcError, SessionStatus) as failure:
                error = error_from_rpc(
                    failure, method="Propose", target=self.target, timeout=self.propose_timeout
                )
                retriable = isinstance(error, CoordinatorUnavailable) and not isinstance(
                    error, SidecarNotAnswering
                )
                if not retriable or time.monotonic() >= deadline:
                    if retriable:
                        # Giving up: what is still in flight is answered by nothing useful.
                        self._drop_in_flight(stream)
                        self._unanswered.clear()
                        self._sent_on = None
                    elif stream.alive:
                        self._unanswered.popleft()  # answered: with an error
                    else:
                        self._unanswered.clear()  # the session is over
                        self._sent_on = None
                    raise error from failure
                # Undecided (the sidecar draining, restarting, or unable to
                # persist): every proposal from this one on is sent again, in
                # order, once the answers still in flight are out of the way.
                self._drop_in_flight(stream)
                self._sent_on = None
            # Jitter keeps the ranks of a node from retrying in lockstep.
            time.sleep(min(random.uniform(0.01, 0.05), max(deadline - time.monotonic(), 0.0)))
            self._wait_ready(deadline)
        self._unanswered.popleft()
        return _decision_from_proto(proposal, response.decision, self.target)

    def arrive(self, arrival: Arrival) -> grpc.Future[pb.ArriveResponse]:
        """See :meth:`Transport.arrive` (it waits for the channel to be ready,
        within the propose deadline)."""
        self._rpc_count += 1
        call: grpc.Future[pb.ArriveResponse] = self._stub_here().Arrive.future(
            arrival_to_proto(arrival), timeout=self.propose_timeout, wait_for_ready=True
        )
        return call

    def _summary(self, group: str) -> GroupSummary:
        stub = self._stub_here()
        request = pb.GetGroupRequest(group=group)
        reply = self._call(
            "GetGroup", self.call_timeout, lambda timeout: stub.GetGroup(request, timeout=timeout)
        )
        return summary_from_proto(reply)

    def gone_ranks(self, group: str) -> list[RankSummary]:
        """The ranks of ``group``'s current lifetime the sidecar knows are gone.

        Raises:
            CoordinatorError: the sidecar could not be asked.
        """
        return [r for r in self._summary(group).ranks if r.current and r.left]

    def latest_view(self, group: str) -> View | None:
        """See :meth:`Transport.latest_view` (GetGroup's view)."""
        return self._summary(group).view

    def acknowledge_view(self, group: str, view: int, rounds: int) -> View:
        """See :meth:`Transport.acknowledge_view` (on the Session stream only)."""

        def send(timeout: float) -> pb.View:
            view_rpcs.check_session(self.session, self.target, group, view)
            request = session_acknowledge_to_proto(self._next_id(), view, rounds)
            return self._session_call(request, timeout).acknowledged

        return view_rpcs.decoded(self._call("AcknowledgeView", self.call_timeout, send), group)

    def await_view(self, group: str, view: int, timeout: float) -> View:
        """See :meth:`Transport.await_view` (a Watch stream of the group)."""
        self._rpc_count += 1
        return view_rpcs.await_view(self._stub_here(), self.target, group, view, timeout)

    def close(self) -> None:
        """Ends the session (the sidecar sees this rank leave) and closes the
        channel once the sidecar ended the stream (at once, or, while it is
        stalled, when it wakes and reads the goodbye)."""
        self._closed.set()
        with self._lock, self._stream_lock:
            mine = self._pid == os.getpid()
            channel = self._channel if mine else None
            if self._stream is not None and mine:
                self._stream.close(then=channel.close if channel is not None else None)
            elif channel is not None:
                channel.close()
            self._stream = None
            self._channel = None
            self._stub = None
            self._pid = None
            self._sent_on = None
            self._unanswered.clear()
            self._answers.clear()
            self._identity = None
        self._closed = threading.Event()  # usable again: a later call opens anew


def _answers_health(channel: grpc.Channel, wait: float) -> bool:
    """Whether the server behind ``channel`` answers a health check (whatever
    it answers) within ``wait`` seconds, waiting for the channel to connect."""
    try:
        health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=wait, wait_for_ready=True
        )
    except grpc.RpcError as error:
        code = error.code() if isinstance(error, grpc.Call) else None
        return code not in (
            grpc.StatusCode.DEADLINE_EXCEEDED,
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.CANCELLED,
            None,
        )
    except ValueError:  # the channel was closed meanwhile
        return False
    return True


def _unimplemented(failure: grpc.RpcError | SessionStatus) -> bool:
    code = (
        failure.status.code
        if isinstance(failure, SessionStatus)
        else getattr(failure, "code", lambda: None)()
    )
    return bool(code is grpc.StatusCode.UNIMPLEMENTED)


def transport_for(
    target: str | None,
    *,
    propose_timeout: float | None = None,
    unavailable_retry: float = DEFAULT_UNAVAILABLE_RETRY_S,
) -> Transport:
    """The transport for ``target``.

    ``None`` reads ``MOE_SIDECAR_TARGET``; unset, empty, or :data:`EMBEDDED`
    gives the embedded transport, anything else a gRPC client of that address.

    Raises:
        InvalidArgument: the address is not ``unix:///abs``, ``unix:rel`` or
            ``host:port`` (naming where it came from).
    """
    source = "target"
    if target is None:
        source, target = ENV_TARGET, os.environ.get(ENV_TARGET, "")
    target = target.strip()
    if not target or target == EMBEDDED:
        return EmbeddedTransport()
    try:
        parse_listen_address(target, source)
    except AddressError as error:
        raise InvalidArgument(str(error), field=source, value=target) from None
    return GrpcTransport(
        target, propose_timeout=propose_timeout, unavailable_retry=unavailable_retry
    )
