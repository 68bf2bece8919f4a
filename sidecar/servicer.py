"""The gRPC servicer: converts between the wire and the domain, nothing else.

Requests and plans convert through :mod:`moe_sidecar.wire` (shared with the
client); the group and event views, which only the sidecar sends, are here.

Each method turns its request into domain values, calls the
:class:`~moe_sidecar.state.Coordinator`, and turns the result into a response;
:class:`~moe_sidecar.status.ErrorTranslator` turns errors into status codes.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import grpc
from google.protobuf.timestamp_pb2 import Timestamp
from moe_sidecar.errors import InvalidArgument
from moe_sidecar.policy import CommitRecord, GroupState
from moe_sidecar.state import Coordinator, EventKind, GroupEvent
from moe_sidecar.status import ErrorTranslator
from moe_sidecar.wire import (
    action_to_proto,
    decision_to_proto,
    plan_from_proto,
    plan_to_proto,
    proposal_from_proto,
)
from moe_workspace.v1 import coordinator_pb2 as pb
from moe_workspace.v1 import coordinator_pb2_grpc as pb_grpc

__all__ = [
    "SERVICE_NAME",
    "CoordinatorServicer",
    "event_to_proto",
    "group_to_proto",
]

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["WorkspaceCoordinator"].full_name

_Context = grpc.aio.ServicerContext[Any, Any]

_EVENT_TO_PROTO = {
    EventKind.ROUND_DECIDED: pb.EVENT_KIND_ROUND_DECIDED,
    EventKind.ROUND_REFUSED: pb.EVENT_KIND_ROUND_REFUSED,
    EventKind.RANK_TIMEOUT: pb.EVENT_KIND_RANK_TIMEOUT,
    EventKind.COMMIT: pb.EVENT_KIND_COMMIT,
    EventKind.RESET: pb.EVENT_KIND_RESET,
    EventKind.LIFETIME_STARTED: pb.EVENT_KIND_LIFETIME_STARTED,
    EventKind.ROUND_ABORTED: pb.EVENT_KIND_ROUND_ABORTED,
}


def _timestamp(seconds: float) -> Timestamp:
    stamp = Timestamp()
    stamp.FromNanoseconds(round(seconds * 1e9))
    return stamp


def group_to_proto(state: GroupState) -> pb.Group:
    """The wire view of a group: plan, lifetimes, rounds, ranks and growth history."""
    group = pb.Group(
        name=state.name,
        ep_size=state.ep_size,
        local_ranks=state.local_ranks,
        lifetimes=state.lifetime_index,
        last_closed_round=state.last_closed_round,
        open_round=state.open_round.number if state.open_round is not None else 0,
        waiting_ranks=len(state.open_round.proposals) if state.open_round is not None else 0,
        ranks=[
            pb.RankState(
                ep_rank=r.ep_rank,
                lifetime=r.lifetime,
                last_round=r.last_round,
                last_layer=r.last_layer,
                committed_generation=r.committed_generation,
                last_build_seconds=r.build_seconds,
                last_seen=_timestamp(r.last_seen),
                current=r.lifetime_index == state.lifetime_index,
            )
            for r in state.ranks
        ],
        history=[
            pb.Growth(
                generation=g.generation,
                workspace_bytes=g.workspace_bytes,
                max_num_tokens=g.max_num_tokens,
                layer=g.layer,
                ep_rank=g.ep_rank,
                round=g.round,
                time=_timestamp(g.at),
            )
            for g in state.history
        ],
    )
    if state.plan is not None:
        group.plan.CopyFrom(plan_to_proto(state.plan))
    return group


def event_to_proto(event: GroupEvent) -> pb.GroupEvent:
    """The wire form of a group event."""
    message = pb.GroupEvent(
        group=event.group,
        kind=_EVENT_TO_PROTO[event.kind],
        time=_timestamp(event.at),
        round=event.round,
        action=action_to_proto(event.action),
        ep_rank=event.ep_rank,
        layer=event.layer,
        message=event.message,
        missing_ranks=list(event.missing_ranks),
    )
    if event.plan is not None:
        message.plan.CopyFrom(plan_to_proto(event.plan))
    return message


class CoordinatorServicer(pb_grpc.WorkspaceCoordinatorServicer):
    """``moe_workspace.v1.WorkspaceCoordinator`` over a :class:`Coordinator`."""

    def __init__(self, coordinator: Coordinator, errors: ErrorTranslator) -> None:
        self._coordinator = coordinator
        self._errors = errors

    async def Propose(self, request: pb.ProposeRequest, context: _Context) -> pb.ProposeResponse:
        return await self._errors.unary(context, "Propose", self._propose(request))

    async def _propose(self, request: pb.ProposeRequest) -> pb.ProposeResponse:
        decision = await self._coordinator.propose(proposal_from_proto(request))
        return decision_to_proto(decision)

    async def Commit(self, request: pb.CommitRequest, context: _Context) -> pb.CommitResponse:
        return await self._errors.unary(context, "Commit", self._commit(request))

    async def _commit(self, request: pb.CommitRequest) -> pb.CommitResponse:
        if not request.HasField("plan"):
            raise InvalidArgument.of("plan", None, "is missing; commit the plan the rank holds")
        self._coordinator.commit(
            request.group,
            CommitRecord(
                ep_rank=request.ep_rank,
                lifetime=request.lifetime,
                round=request.round,
                plan=plan_from_proto(request.plan),
                build_seconds=request.build_seconds,
            ),
        )
        return pb.CommitResponse()

    async def Watch(
        self, request: pb.WatchRequest, context: _Context
    ) -> AsyncIterator[pb.GroupEvent]:
        async for event in self._errors.stream(context, "Watch", self._watch(request)):
            yield event

    async def _watch(self, request: pb.WatchRequest) -> AsyncGenerator[pb.GroupEvent, None]:
        subscription = self._coordinator.watch(request.group)
        try:
            async for event in subscription:
                yield event_to_proto(event)
        finally:
            self._coordinator.unwatch(subscription)

    async def ListGroups(
        self, request: pb.ListGroupsRequest, context: _Context
    ) -> pb.ListGroupsResponse:
        return await self._errors.unary(context, "ListGroups", self._list_groups())

    async def _list_groups(self) -> pb.ListGroupsResponse:
        return pb.ListGroupsResponse(groups=[group_to_proto(g) for g in self._coordinator.groups()])

    async def GetGroup(self, request: pb.GetGroupRequest, context: _Context) -> pb.Group:
        return await self._errors.unary(context, "GetGroup", self._get_group(request))

    async def _get_group(self, request: pb.GetGroupRequest) -> pb.Group:
        return group_to_proto(self._coordinator.group(request.group))

    async def ResetGroup(self, request: pb.ResetGroupRequest, context: _Context) -> pb.Group:
        return await self._errors.unary(context, "ResetGroup", self._reset_group(request))

    async def _reset_group(self, request: pb.ResetGroupRequest) -> pb.Group:
        return group_to_proto(self._coordinator.reset(request.group))
