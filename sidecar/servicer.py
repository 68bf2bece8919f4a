"""The gRPC servicer: converts between the wire and the domain, nothing else.

Every conversion goes through :mod:`moe_sidecar.wire_codec` (shared with the
client). Each method decodes its request, calls the
:class:`~moe_sidecar.state.Coordinator`, and encodes the result;
:class:`~moe_sidecar.status.ErrorTranslator` turns errors into status codes.

The methods receive the request's raw bytes (:func:`coordinator_handler`
registers them without a deserializer) and decode them with the codec, so
bytes that are not the method's message are INVALID_ARGUMENT, counted and
logged, instead of grpc's own UNKNOWN before any code of ours runs.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf import message_factory

from moe_sidecar.group import summarize
from moe_sidecar.state import Coordinator
from moe_sidecar.status import ErrorTranslator
from moe_sidecar.wire_codec import (
    commit_from_proto,
    decision_to_proto,
    decode_request,
    event_to_proto,
    page_token_from_proto,
    page_token_to_proto,
    proposal_from_proto,
    summary_to_proto,
)
from moe_workspace.v1 import coordinator_pb2 as pb

__all__ = [
    "DEFAULT_PAGE_SIZE",
    "MAX_PAGE_BYTES",
    "SERVICE_NAME",
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

_Context = grpc.aio.ServicerContext[Any, Any]


class CoordinatorServicer:
    """``moe_workspace.v1.WorkspaceCoordinator`` over a :class:`Coordinator`.

    Args:
        coordinator: the state holder.
        errors: the error -> status mapping.
        max_page_size: most groups one ListGroups page holds.
    """

    def __init__(
        self, coordinator: Coordinator, errors: ErrorTranslator, *, max_page_size: int = 500
    ) -> None:
        self._coordinator = coordinator
        self._errors = errors
        self._max_page_size = max_page_size

    async def Propose(self, data: bytes, context: _Context) -> pb.ProposeResponse:
        return await self._errors.unary(context, "Propose", self._propose(data))

    async def _propose(self, data: bytes) -> pb.ProposeResponse:
        request = decode_request(pb.ProposeRequest, data)
        decision = await self._coordinator.propose(proposal_from_proto(request))
        return decision_to_proto(decision, request.ep_size)

    async def Commit(self, data: bytes, context: _Context) -> pb.CommitResponse:
        return await self._errors.unary(context, "Commit", self._commit(data))

    async def _commit(self, data: bytes) -> pb.CommitResponse:
        self._coordinator.commit(*commit_from_proto(decode_request(pb.CommitRequest, data)))
        return pb.CommitResponse()

    async def Watch(self, data: bytes, context: _Context) -> AsyncIterator[pb.GroupEvent]:
        async for event in self._errors.stream(context, "Watch", self._watch(data)):
            yield event

    async def _watch(self, data: bytes) -> AsyncGenerator[pb.GroupEvent, None]:
        request = decode_request(pb.WatchRequest, data)
        subscription = self._coordinator.watch(request.group)
        try:
            async for event in subscription:
                yield event_to_proto(event, self._coordinator.ep_size_of(event.group))
        finally:
            self._coordinator.unwatch(subscription)

    async def ListGroups(self, data: bytes, context: _Context) -> pb.ListGroupsResponse:
        return await self._errors.unary(context, "ListGroups", self._list_groups(data))

    async def _list_groups(self, data: bytes) -> pb.ListGroupsResponse:
        request = decode_request(pb.ListGroupsRequest, data)
        size, after, idle_for = page_token_from_proto(
            request, DEFAULT_PAGE_SIZE, self._max_page_size
        )
        groups, last = self._coordinator.groups_page(after, size, idle_for)
        page: list[pb.Group] = []
        page_bytes = 0
        for state in groups:
            group = summary_to_proto(summarize(state))
            page_bytes += group.ByteSize()
            if page and page_bytes > MAX_PAGE_BYTES:
                last = page[-1].name
                break
            page.append(group)
        return pb.ListGroupsResponse(groups=page, next_page_token=page_token_to_proto(last))

    async def GetGroup(self, data: bytes, context: _Context) -> pb.Group:
        return await self._errors.unary(context, "GetGroup", self._get_group(data))

    async def _get_group(self, data: bytes) -> pb.Group:
        request = decode_request(pb.GetGroupRequest, data)
        return summary_to_proto(summarize(self._coordinator.group(request.group)))

    async def ResetGroup(self, data: bytes, context: _Context) -> pb.Group:
        return await self._errors.unary(context, "ResetGroup", self._reset_group(data))

    async def _reset_group(self, data: bytes) -> pb.Group:
        request = decode_request(pb.ResetGroupRequest, data)
        return summary_to_proto(summarize(self._coordinator.reset(request.group)))

    async def RemoveGroup(self, data: bytes, context: _Context) -> pb.RemoveGroupResponse:
        return await self._errors.unary(context, "RemoveGroup", self._remove_group(data))

    async def _remove_group(self, data: bytes) -> pb.RemoveGroupResponse:
        self._coordinator.remove(decode_request(pb.RemoveGroupRequest, data).group)
        return pb.RemoveGroupResponse()


def coordinator_handler(servicer: CoordinatorServicer) -> grpc.GenericRpcHandler:
    """The service's method handlers, made from its descriptor: every method of
    the ``.proto`` is served, each taking its request's raw bytes.

    Raises:
        AttributeError: the servicer lacks a method the ``.proto`` defines.
    """
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
    for method in SERVICE.methods:
        behaviour: Callable[..., Any] = getattr(servicer, method.name)
        serialize = message_factory.GetMessageClass(method.output_type).SerializeToString
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
