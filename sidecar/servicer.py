"""The gRPC servicer: converts between the wire and the domain, nothing else.

Every conversion goes through :mod:`moe_sidecar.wire_codec` (shared with the
client). Each method turns its request into domain values, calls the
:class:`~moe_sidecar.state.Coordinator`, and turns the result into a
response; :class:`~moe_sidecar.status.ErrorTranslator` turns errors into
status codes.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import grpc

from moe_sidecar.group import summarize
from moe_sidecar.state import Coordinator
from moe_sidecar.status import ErrorTranslator
from moe_sidecar.wire_codec import (
    commit_from_proto,
    decision_to_proto,
    event_to_proto,
    proposal_from_proto,
    summary_to_proto,
)
from moe_workspace.v1 import coordinator_pb2 as pb
from moe_workspace.v1 import coordinator_pb2_grpc as pb_grpc

__all__ = ["SERVICE_NAME", "CoordinatorServicer"]

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["WorkspaceCoordinator"].full_name

_Context = grpc.aio.ServicerContext[Any, Any]


class CoordinatorServicer(pb_grpc.WorkspaceCoordinatorServicer):
    """``moe_workspace.v1.WorkspaceCoordinator`` over a :class:`Coordinator`."""

    def __init__(self, coordinator: Coordinator, errors: ErrorTranslator) -> None:
        self._coordinator = coordinator
        self._errors = errors

    async def Propose(self, request: pb.ProposeRequest, context: _Context) -> pb.ProposeResponse:
        return await self._errors.unary(context, "Propose", self._propose(request))

    async def _propose(self, request: pb.ProposeRequest) -> pb.ProposeResponse:
        decision = await self._coordinator.propose(proposal_from_proto(request))
        return decision_to_proto(decision, request.ep_size)

    async def Commit(self, request: pb.CommitRequest, context: _Context) -> pb.CommitResponse:
        return await self._errors.unary(context, "Commit", self._commit(request))

    async def _commit(self, request: pb.CommitRequest) -> pb.CommitResponse:
        self._coordinator.commit(*commit_from_proto(request))
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
                yield event_to_proto(event, self._coordinator.ep_size_of(event.group))
        finally:
            self._coordinator.unwatch(subscription)

    async def ListGroups(
        self, request: pb.ListGroupsRequest, context: _Context
    ) -> pb.ListGroupsResponse:
        return await self._errors.unary(context, "ListGroups", self._list_groups())

    async def _list_groups(self) -> pb.ListGroupsResponse:
        return pb.ListGroupsResponse(
            groups=[summary_to_proto(summarize(g)) for g in self._coordinator.groups()]
        )

    async def GetGroup(self, request: pb.GetGroupRequest, context: _Context) -> pb.Group:
        return await self._errors.unary(context, "GetGroup", self._get_group(request))

    async def _get_group(self, request: pb.GetGroupRequest) -> pb.Group:
        return summary_to_proto(summarize(self._coordinator.group(request.group)))

    async def ResetGroup(self, request: pb.ResetGroupRequest, context: _Context) -> pb.Group:
        return await self._errors.unary(context, "ResetGroup", self._reset_group(request))

    async def _reset_group(self, request: pb.ResetGroupRequest) -> pb.Group:
        return summary_to_proto(summarize(self._coordinator.reset(request.group)))
