"""The membership views' calls of a transport: what a rank asks the sidecar
about its group's views, and the gRPC side of those calls.

:class:`ViewCalls` is the part of :class:`~moe_sidecar.client.transport.Transport`
that :mod:`moe_sidecar.client.membership_view` uses: read the latest view,
acknowledge one (on the rank's Session stream: the session says who the rank
is), and wait until a proposed view is decided. The functions here are
:class:`~moe_sidecar.client.transport.GrpcTransport`'s side of them; the
embedded transport refuses every one (the views are the sidecar's).
"""

from __future__ import annotations

from typing import Protocol

import grpc

from moe_sidecar.client.errors import (
    CoordinatorError,
    InternalError,
    PreconditionFailed,
    RoundTimedOut,
    error_from_rpc,
)
from moe_sidecar.core.effects import EventKind
from moe_sidecar.core.errors import quote_name
from moe_sidecar.core.membership import View, ViewState
from moe_sidecar.wire.codec import event_from_proto, summary_from_proto, view_from_proto
from moe_workspace.v1 import coordinator_pb2 as pb
from moe_workspace.v1 import coordinator_pb2_grpc as pb_grpc

__all__ = ["ViewCalls", "await_view", "check_session", "decoded", "settles"]


class ViewCalls(Protocol):
    """What a rank asks the sidecar about its group's membership views."""

    def latest_view(self, group: str) -> View | None:
        """``group``'s latest membership view (None: nothing built).

        Raises:
            CoordinatorError: not asked (PreconditionFailed: embedded mode).
        """
        ...

    def acknowledge_view(self, group: str, view: int, rounds: int) -> View:
        """Acknowledges ``view`` at ``rounds`` all-to-all rounds; the view as it stands.

        Raises:
            CoordinatorError: refused (ViewFailed: it failed), not sent, or embedded.
        """
        ...

    def await_view(self, group: str, view: int, timeout: float) -> View:
        """``view`` (or a later view) once no longer PROPOSED, within ``timeout`` s.

        Raises:
            CoordinatorError: RoundTimedOut past ``timeout``; not asked, or embedded.
        """
        ...


def settles(current: View | None, view: int) -> bool:
    """Whether ``current`` decides what became of view ``view``: it is that
    view, no longer PROPOSED, or a later one."""
    return current is not None and (
        current.number > view
        or (current.number == view and current.state is not ViewState.PROPOSED)
    )


def check_session(session: bool, target: str, group: str, view: int) -> None:
    """An acknowledgement travels on the rank's Session stream only.

    Raises:
        PreconditionFailed: the transport makes unary calls (``session=False``,
            or a sidecar older than sessions).
    """
    if not session:
        raise PreconditionFailed(
            f"AcknowledgeView to sidecar {target}: view {view} of group {quote_name(group)} is "
            "acknowledged on the rank's Session stream, and this transport makes unary calls"
        )


def decoded(message: pb.View, group: str) -> View:
    """The view an acknowledgement was answered with.

    Raises:
        InternalError: the answer holds no view this code knows.
    """
    view = view_from_proto(message)
    if view is None or view.number == 0:
        raise InternalError(
            f"AcknowledgeView of group {quote_name(group)}: the sidecar answered with no view "
            f"this client knows (state {message.state})"
        )
    return view


def await_view(
    stub: pb_grpc.WorkspaceCoordinatorStub, target: str, group: str, view: int, timeout: float
) -> View:
    """View ``view`` of ``group`` once decided (or a later one), read from a
    Watch stream of the group subscribed before the group's state is read
    (so no decision between the two is missed).

    Raises:
        RoundTimedOut: nothing decided it within ``timeout`` seconds.
        CoordinatorError: the Watch or GetGroup call failed.
    """
    call = stub.Watch(pb.WatchRequest(group=group), timeout=timeout)
    try:
        call.initial_metadata()  # subscribed: every later VIEW_CHANGED comes on the stream
        request = pb.GetGroupRequest(group=group)
        current = summary_from_proto(stub.GetGroup(request, timeout=timeout)).view
        if current is not None and settles(current, view):
            return current
        for message in call:
            event = event_from_proto(message)
            if event is None or event.kind is not EventKind.VIEW_CHANGED:
                continue
            if event.view is not None and settles(event.view, view):
                return event.view
        raise InternalError(f"Watch of group {quote_name(group)} on {target} ended")
    except grpc.RpcError as failure:
        raise _watch_error(failure, target, group, view, timeout) from failure
    finally:
        call.cancel()


def _watch_error(
    failure: grpc.RpcError, target: str, group: str, view: int, timeout: float
) -> CoordinatorError:
    if isinstance(failure, grpc.Call) and failure.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
        return RoundTimedOut(
            f"view {view} of group {quote_name(group)}: not decided within {timeout:g}s of "
            f"waiting on sidecar {target} (a member has not acknowledged it yet)"
        )
    return error_from_rpc(failure, method="Watch", target=target, timeout=timeout)
