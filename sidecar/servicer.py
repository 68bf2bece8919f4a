"""The gRPC servicer: converts between the wire and the domain, nothing else.

Every conversion goes through :mod:`moe_sidecar.wire.codec` (shared with the
client). Each method decodes its request, calls the
:class:`~moe_sidecar.state.Coordinator`, and encodes the result;
:class:`~moe_sidecar.status.ErrorTranslator` turns errors into status codes.

The methods receive the request's raw bytes (:func:`coordinator_handler`
registers them without a deserializer) and decode them with the codec, so
bytes that are not the method's message are INVALID_ARGUMENT, counted and
logged, instead of grpc's own UNKNOWN before any code of ours runs.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, TypeAlias, TypeVar

import grpc
from google.protobuf import message_factory
from google.protobuf.message import Message

from moe_sidecar.config.values import DEFAULT_MAX_SESSIONS, DEFAULT_STREAM_WRITE_TIMEOUT
from moe_sidecar.core.errors import InvalidArgument, ResourceExhausted, quote_name
from moe_sidecar.core.group import Decision, GroupState, summarize
from moe_sidecar.core.identity import lifetime_id
from moe_sidecar.metrics import SidecarMetrics
from moe_sidecar.session_places import SessionPlaces
from moe_sidecar.state import Coordinator
from moe_sidecar.status import ErrorTranslator
from moe_sidecar.watch_cutoff import WatchCutoffs
from moe_sidecar.wire.codec import (
    arrival_from_proto,
    commit_from_proto,
    decision_to_proto,
    decode_request,
    event_to_proto,
    page_token_from_proto,
    page_token_to_proto,
    proposal_from_proto,
    session_acknowledged_to_proto,
    session_committed_to_proto,
    session_decision_wire,
    session_error_to_proto,
    session_left_to_proto,
    session_resumed_to_proto,
    summary_to_proto,
)
from moe_workspace.v1 import coordinator_pb2 as pb

__all__ = [
    "DEFAULT_PAGE_SIZE",
    "MAX_PAGE_BYTES",
    "MAX_PENDING_RESPONSE_BYTES",
    "SERVICE_NAME",
    "SHUTDOWN_DETAILS",
    "CoordinatorServicer",
    "coordinator_handler",
]

SERVICE = pb.DESCRIPTOR.services_by_name["WorkspaceCoordinator"]
SERVICE_NAME: str = SERVICE.full_name
DEFAULT_PAGE_SIZE = 100
"""Groups per ListGroups page when the request names no size."""
MAX_PAGE_BYTES = 1 << 20
"""A ListGroups page ends early (with a next_page_token) once it holds this
many bytes: a group with a full growth history and 64 ranks encodes to about
100 KB, so a page of --max-page-size such groups would pass gRPC's 4 MiB
receive limit of every client. A page always holds at least one group."""

MAX_PENDING_RESPONSE_BYTES = 16 << 20
"""Bytes of ListGroups, GetGroup and ResetGroup answers that may wait for
their readers at once. A client that asks and never reads (a closed HTTP/2
window) leaves its answer in the sidecar's memory, about three times its
size, until it goes: 50 such ListGroups calls of 1 MiB pages took 162 MiB.
Beyond this, such calls are RESOURCE_EXHAUSTED until readers catch up."""

_Context = grpc.aio.ServicerContext[Any, Any]
_Response = TypeVar("_Response", bound=Message)
_Identity: TypeAlias = tuple[str, int, str]
"""(group, ep_rank, lifetime id): whom a session message speaks for."""

_BROKEN = "its session stream closed (the process exited, was killed, or lost its connection)"
"""Why a rank whose session broke is gone: a death, as its peers' watchers read it."""
_CLOSED_CLEANLY = "it closed its session cleanly (cleanup)"
"""Why a rank that half-closed its session is gone: not a death."""

SHUTDOWN_DETAILS = (
    "the sidecar is shutting down; open a new session once it is back (rounds are kept)"
)


class _OpenSessions:
    """The Session streams being served, so that a shutdown ends them at once
    instead of leaving each to the end of the grace period.

    A stream waiting for its rank's next message is woken by cancelling its
    task right at that wait (nothing else of it runs then); one busy with an
    answer ends once the answer is sent.
    """

    def __init__(self) -> None:
        self._reading: set[asyncio.Task[Any]] = set()
        self._ending = False

    async def next_message(self, messages: AsyncIterator[bytes], context: _Context) -> bytes | None:
        """The stream's next message, None at its end.

        Raises:
            grpc.aio.AbortError: the sidecar is shutting down (the stream is
                ended with UNAVAILABLE).
        """
        if not self._ending:
            task = asyncio.current_task()
            assert task is not None
            self._reading.add(task)
            try:
                return await anext(messages)
            except StopAsyncIteration:
                return None
            except asyncio.CancelledError:
                if not self._ending:
                    raise
                task.uncancel()  # our own wake-up, not the call's cancellation
            finally:
                self._reading.discard(task)
        await context.abort(grpc.StatusCode.UNAVAILABLE, SHUTDOWN_DETAILS)
        raise AssertionError("unreachable: context.abort returned")  # pragma: no cover

    def end_all(self) -> None:
        """Ends every stream: those waiting for a message now. Idempotent."""
        self._ending = True
        for task in self._reading:
            task.cancel()


class _PendingResponses:
    """The bytes of answers not yet delivered, released as each call ends."""

    def __init__(self, limit: int, metrics: SidecarMetrics) -> None:
        self.limit = limit
        self.held = 0
        self._metrics = metrics

    def check(self, size: int = 0) -> None:
        """Refuses an answer when others wait already and it would pass the limit
        (with ``size`` 0: when the limit is reached, before making the answer).

        Raises:
            ResourceExhausted: naming the bytes waiting and the limit.
        """
        if self.held and self.held + max(size, 1) > self.limit:
            self._metrics.refused("response_bytes")
            raise ResourceExhausted(
                f"{self.held} bytes of answers wait for clients that do not read them; at "
                f"most {self.limit} may: retry once they are read"
            )

    def admit(self, context: _Context, response: _Response, *, refuse: bool = True) -> _Response:
        """Counts ``response`` until its call ends.

        Raises:
            ResourceExhausted: (unless ``refuse`` is False, for an answer to a
                call that already changed state) answers of others wait
                already, and this one would take them past the limit.
        """
        size = response.ByteSize()
        if refuse:
            self.check(size)
        self.held += size
        # (grpc-stubs type the callback as a class of their own; any callable does.)
        release: Any = functools.partial(self._release, size)
        context.add_done_callback(release)
        return response

    def _release(self, size: int, _context: object) -> None:
        self.held -= size


class CoordinatorServicer:
    """``moe_workspace.v1.WorkspaceCoordinator`` over a :class:`Coordinator`.

    Args:
        coordinator: the state holder.
        errors: the error -> status mapping.
        max_page_size: most groups one ListGroups page holds.
        max_sessions: Session streams open at once (``--max-sessions``).
        stream_write_timeout: seconds a Watch stream's write may be pending
            before the stream is cut off (``--stream-write-timeout``).
    """

    def __init__(
        self,
        coordinator: Coordinator,
        errors: ErrorTranslator,
        *,
        max_page_size: int = 500,
        max_pending_response_bytes: int = MAX_PENDING_RESPONSE_BYTES,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        stream_write_timeout: float = DEFAULT_STREAM_WRITE_TIMEOUT,
    ) -> None:
        self._coordinator = coordinator
        self._errors = errors
        self._max_page_size = max_page_size
        self._pending = _PendingResponses(max_pending_response_bytes, coordinator.metrics)
        self._encoded: tuple[Decision, int, str, bytes] | None = None
        self._sessions = _OpenSessions()
        self._places = SessionPlaces(coordinator.metrics, max_sessions)
        self._cutoffs = WatchCutoffs(coordinator.metrics, stream_write_timeout)

    def _decision_bytes(self, decision: Decision, ep_size: int, release: str) -> bytes:
        """The serialized wire form of ``decision``, encoded once per round:
        every rank of a round is answered with the same Decision object, and
        these bytes go out as they are (the handlers' serializers pass bytes
        through)."""
        encoded = self._encoded
        if encoded is None or encoded[0] is not decision or encoded[1:3] != (ep_size, release):
            wire = decision_to_proto(decision, ep_size, release).SerializeToString()
            encoded = self._encoded = (decision, ep_size, release, wire)
        return encoded[3]

    async def Propose(self, data: bytes, context: _Context) -> bytes:
        return await self._errors.unary(context, "Propose", self._propose(data))

    async def _propose(self, data: bytes) -> bytes:
        request = decode_request(pb.ProposeRequest, data)
        proposal = proposal_from_proto(request)
        decision = await self._coordinator.propose(proposal)
        return self._decision_bytes(decision, proposal.ep_size, proposal.release)

    async def Session(
        self, requests: AsyncIterator[bytes], context: _Context
    ) -> AsyncIterator[pb.SessionResponse | bytes]:
        """One rank's session: each message answered in turn; the stream's end
        is the rank's departure: a death (``lost``) unless it said goodbye
        (a ``leave``, answered ``left``, after which the stream ends).

        The first message answered without an error binds the session to its
        (group, rank, lifetime), as a resume does (a stream the client opens
        after the sidecar restarted, before the rank's next call); a refused
        one binds nothing, so a stranger's
        bad first message cannot claim a session (nor depart a rank). While the
        sidecar shuts down (:meth:`end_sessions`) the stream ends UNAVAILABLE;
        beyond ``--max-sessions`` open streams a new one is RESOURCE_EXHAUSTED
        (:class:`~moe_sidecar.session_places.SessionPlaces`).
        """
        refused = await self._errors.answer(context, "Session", self._open_session())
        if refused is not None:
            await context.abort(*refused)
        try:
            async for response in self._session(requests, context):
                yield response
        finally:
            self._places.close_session()

    async def _open_session(self) -> None:
        """Takes one of the ``--max-sessions`` places.

        Raises:
            ResourceExhausted: every place is taken.
        """
        self._places.open_session()

    async def _session(
        self, requests: AsyncIterator[bytes], context: _Context
    ) -> AsyncIterator[pb.SessionResponse | bytes]:
        """Serves one Session stream's messages until its end."""
        binding: _Identity | None = None
        in_flight: _Identity | None = None
        """The identity of an unbound session's first message while it is
        answered: a rank that dies waiting in its first round still departs."""
        closed_cleanly = False
        """The rank said goodbye (its cleanup): it left, it did not die."""
        messages = aiter(requests)
        try:
            while True:
                data = await self._sessions.next_message(messages, context)
                if data is None:
                    return
                request = await self._errors.answer(context, "Session", _decode_session(data))
                if isinstance(request, tuple):
                    yield session_error_to_proto(0, request[0].name, request[1])
                    continue
                if request.WhichOneof("message") == "leave":
                    closed_cleanly = True
                    yield session_left_to_proto(request.id)
                    return
                if request.WhichOneof("message") == "acknowledge":
                    yield await self._acknowledgement(request, binding, context)
                    continue
                if request.WhichOneof("message") == "resume":
                    resumption, resumed = await self._resumption(request, binding, context)
                    binding = resumed or binding
                    yield resumption
                    continue
                identity = _identity(request)
                if binding is not None and identity != binding:
                    yield session_error_to_proto(
                        request.id,
                        grpc.StatusCode.INVALID_ARGUMENT.name,
                        f"session: one session carries one rank's lifetime; this one is rank "
                        f"{binding[1]} of group {quote_name(binding[0])}, the message speaks "
                        f"for rank {identity[1]} of group {quote_name(identity[0])}",
                    )
                    continue
                if binding is None:
                    in_flight = identity
                response = await self._session_answer(request, context)
                # A decision comes serialized (bytes): never an error.
                if binding is None and (
                    isinstance(response, bytes) or not response.HasField("error")
                ):
                    binding = identity
                    self._coordinator.session_bound(*identity)
                in_flight = None
                yield response
        finally:
            departing = binding or in_flight
            if departing is not None:
                self._coordinator.depart(
                    *departing,
                    why=_CLOSED_CLEANLY if closed_cleanly else _BROKEN,
                    lost=not closed_cleanly,
                )

    async def _acknowledgement(
        self, request: pb.SessionRequest, binding: _Identity | None, context: _Context
    ) -> pb.SessionResponse:
        """The answer to a member's acknowledgement of a view, on its bound session."""
        if binding is None:
            return session_error_to_proto(
                request.id,
                grpc.StatusCode.FAILED_PRECONDITION.name,
                "session: an acknowledgement before the session's first proposal speaks for nobody",
            )
        ack = request.acknowledge
        state = await self._errors.answer(
            context, "Session", self._acknowledge(binding, ack.view, ack.rounds)
        )
        if isinstance(state, tuple):
            return session_error_to_proto(request.id, state[0].name, state[1])
        return session_acknowledged_to_proto(request.id, state.current_view())

    async def _resumption(
        self, request: pb.SessionRequest, binding: _Identity | None, context: _Context
    ) -> tuple[pb.SessionResponse, _Identity | None]:
        """The answer to a resume (a rank's session back on a new stream) and
        the identity it binds the stream to (None: it binds nothing)."""
        resume = request.resume
        identity = (resume.group, resume.ep_rank, lifetime_id(resume.lifetime))
        if binding is not None and binding != identity:
            return session_error_to_proto(
                request.id,
                grpc.StatusCode.INVALID_ARGUMENT.name,
                f"session: one session carries one rank's lifetime; this one is rank "
                f"{binding[1]} of group {quote_name(binding[0])}",
            ), None
        refused = await self._errors.answer(context, "Session", self._reconnect(identity))
        if isinstance(refused, tuple):
            return session_error_to_proto(request.id, refused[0].name, refused[1]), None
        return session_resumed_to_proto(request.id), identity

    async def _reconnect(self, identity: _Identity) -> None:
        self._coordinator.reconnect(*identity)

    async def _acknowledge(self, binding: _Identity, view: int, rounds: int) -> GroupState:
        return self._coordinator.acknowledge_view(*binding, view, rounds)

    def end_sessions(self) -> None:
        """Ends every open Session stream with UNAVAILABLE (the sidecar is
        shutting down): at once where it waits for its rank's next message,
        after its answer where one is being made. Idempotent."""
        self._sessions.end_all()

    async def _session_answer(
        self, request: pb.SessionRequest, context: _Context
    ) -> pb.SessionResponse | bytes:
        """The answer to one session message (an error answer, not an error
        status, when the coordinator refuses it)."""
        if request.WhichOneof("message") == "propose":
            answer = await self._errors.answer(context, "Session", self._propose_message(request))
            if isinstance(answer, tuple):
                return session_error_to_proto(request.id, answer[0].name, answer[1])
            return answer
        committed = await self._errors.answer(context, "Session", self._commit(request.commit))
        if isinstance(committed, tuple):
            return session_error_to_proto(request.id, committed[0].name, committed[1])
        return session_committed_to_proto(request.id)

    async def _propose_message(self, request: pb.SessionRequest) -> bytes:
        proposal = proposal_from_proto(request.propose)
        decision = await self._coordinator.propose(proposal)
        return session_decision_wire(
            request.id, self._decision_bytes(decision, proposal.ep_size, proposal.release)
        )

    async def Arrive(self, data: bytes, context: _Context) -> pb.ArriveResponse:
        return await self._errors.unary(context, "Arrive", self._arrive(data))

    async def _arrive(self, data: bytes) -> pb.ArriveResponse:
        request = decode_request(pb.ArriveRequest, data)
        await self._coordinator.arrive(arrival_from_proto(request))
        return pb.ArriveResponse()

    async def Commit(self, data: bytes, context: _Context) -> pb.CommitResponse:
        return await self._errors.unary(context, "Commit", self._commit_bytes(data))

    async def _commit_bytes(self, data: bytes) -> pb.CommitResponse:
        return await self._commit(decode_request(pb.CommitRequest, data))

    async def _commit(self, request: pb.CommitRequest) -> pb.CommitResponse:
        self._coordinator.commit(*commit_from_proto(request))
        return pb.CommitResponse()

    async def Watch(self, data: bytes, context: _Context) -> AsyncIterator[pb.GroupEvent]:
        async for event in self._errors.stream(context, "Watch", self._watch(data, context)):
            yield event

    async def _watch(self, data: bytes, context: _Context) -> AsyncGenerator[pb.GroupEvent, None]:
        request = decode_request(pb.WatchRequest, data)
        subscription = self._coordinator.watch(request.group)
        # A peer that never reads leaves this handler stuck in a write that
        # gRPC cannot end: the guard cuts its connection (moe_sidecar.watch_cutoff).
        guard = self._cutoffs.guard(subscription, context.peer(), self._coordinator.unwatch)
        try:
            # The stream's headers say the subscription exists: a rank's
            # peer-loss watcher waits for them, so no event after it can be missed.
            await context.send_initial_metadata(())
            async for event in subscription:
                yield event_to_proto(event, self._coordinator.sizing_of(event.group))
        finally:
            guard.close()
            self._coordinator.unwatch(subscription)

    async def ListGroups(self, data: bytes, context: _Context) -> pb.ListGroupsResponse:
        return await self._errors.unary(context, "ListGroups", self._list_groups(data, context))

    async def _list_groups(self, data: bytes, context: _Context) -> pb.ListGroupsResponse:
        request = decode_request(pb.ListGroupsRequest, data)
        self._pending.check()
        size, after, idle_for = page_token_from_proto(
            request, DEFAULT_PAGE_SIZE, self._max_page_size
        )
        groups, last = self._coordinator.groups_page(after, size, idle_for)
        page: list[pb.Group] = []
        page_bytes = 0
        for state in groups:
            group = summary_to_proto(self._coordinator.summary(state))
            page_bytes += group.ByteSize()
            if page and page_bytes > MAX_PAGE_BYTES:
                last = page[-1].name
                break
            page.append(group)
        response = pb.ListGroupsResponse(groups=page, next_page_token=page_token_to_proto(last))
        return self._pending.admit(context, response)

    async def GetGroup(self, data: bytes, context: _Context) -> pb.Group:
        return await self._errors.unary(context, "GetGroup", self._get_group(data, context))

    async def _get_group(self, data: bytes, context: _Context) -> pb.Group:
        request = decode_request(pb.GetGroupRequest, data)
        self._pending.check()
        group = summary_to_proto(
            self._coordinator.summary(self._coordinator.shown_group(request.group))
        )
        return self._pending.admit(context, group)

    async def ResetGroup(self, data: bytes, context: _Context) -> pb.Group:
        return await self._errors.unary(context, "ResetGroup", self._reset_group(data, context))

    async def _reset_group(self, data: bytes, context: _Context) -> pb.Group:
        request = decode_request(pb.ResetGroupRequest, data)
        self._pending.check()  # before the reset: a refusal changes nothing
        group = summary_to_proto(self._coordinator.summary(self._coordinator.reset(request.group)))
        return self._pending.admit(context, group, refuse=False)

    async def ExcludeRanks(self, data: bytes, context: _Context) -> pb.Group:
        return await self._errors.unary(context, "ExcludeRanks", self._exclude(data, context))

    async def _exclude(self, data: bytes, context: _Context) -> pb.Group:
        request = decode_request(pb.ExcludeRanksRequest, data)
        self._pending.check()  # before the exclusion: a refusal changes nothing
        ranks = tuple(request.ranks)
        state = self._coordinator.exclude(request.group, ranks, request.reason)
        return self._pending.admit(context, summary_to_proto(summarize(state)), refuse=False)

    async def RemoveGroup(self, data: bytes, context: _Context) -> pb.RemoveGroupResponse:
        return await self._errors.unary(context, "RemoveGroup", self._remove_group(data))

    async def _remove_group(self, data: bytes) -> pb.RemoveGroupResponse:
        self._coordinator.remove(decode_request(pb.RemoveGroupRequest, data).group)
        return pb.RemoveGroupResponse()


async def _decode_session(data: bytes) -> pb.SessionRequest:
    """A session message with a proposal or a commit whose lifetime is a usable token.

    Raises:
        InvalidArgument: undecodable bytes, no message, or a bad lifetime token.
    """
    request = decode_request(pb.SessionRequest, data)
    method = request.WhichOneof("message")
    if method is None:
        raise InvalidArgument.of(
            "message",
            None,
            "a session message holds a propose, a commit, a leave, an acknowledge or a resume",
        )
    if method in ("leave", "acknowledge"):
        return request
    if method == "resume":
        lifetime_id(request.resume.lifetime)  # a usable token, as for a proposal
        return request
    inner = request.propose if method == "propose" else request.commit
    lifetime_id(inner.lifetime)  # the token must be usable before it binds a session
    return request


def _identity(request: pb.SessionRequest) -> _Identity:
    """(group, ep_rank, lifetime id) a session message speaks for."""
    inner = request.propose if request.WhichOneof("message") == "propose" else request.commit
    return inner.group, inner.ep_rank, lifetime_id(inner.lifetime)


def _serializer(message: type[Message]) -> Callable[[Message | bytes], bytes]:
    """``message``'s serializer, passing bytes already serialized (a round's
    decision, encoded once for all its ranks) through as they are."""
    to_bytes = message.SerializeToString

    def serialize(response: Message | bytes) -> bytes:
        return response if isinstance(response, bytes) else to_bytes(response)

    return serialize


def coordinator_handler(servicer: CoordinatorServicer) -> grpc.GenericRpcHandler:
    """The service's method handlers, made from its descriptor: every method of
    the ``.proto`` is served, each taking its request's raw bytes.

    Raises:
        AttributeError: the servicer lacks a method the ``.proto`` defines.
    """
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
    for method in SERVICE.methods:
        behaviour: Callable[..., Any] = getattr(servicer, method.name)
        serialize = _serializer(message_factory.GetMessageClass(method.output_type))
        if method.client_streaming and method.server_streaming:
            make = grpc.stream_stream_rpc_method_handler
        elif method.client_streaming:
            make = grpc.stream_unary_rpc_method_handler
        elif method.server_streaming:
            make = grpc.unary_stream_rpc_method_handler
        else:
            make = grpc.unary_unary_rpc_method_handler
        # No request_deserializer: the method gets bytes and decodes them itself.
        handlers[method.name] = make(behaviour, response_serializer=serialize)
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)
