"""The one codec between the wire contract (``moe_workspace.v1``) and the domain.

Both ends of the gRPC connection use it: the sidecar's servicer, the client's
transport, ``moe-sidecar groups`` and ``simulate``. It imports the generated
code and the domain types only (no server state, no metrics, no torch), so a
rank process can use it without pulling in the daemon.

Decoding a request checks presence (a missing message is INVALID_ARGUMENT
naming it), not ranges: the decision core checks every range on its own
input. Decoding a response the client received checks what it acts on.
"""

from __future__ import annotations

import base64
import math
from typing import TypeVar

from google.protobuf.message import DecodeError, Message
from google.protobuf.timestamp_pb2 import Timestamp

from moe_sidecar import flashinfer
from moe_sidecar.core import limits
from moe_sidecar.core.capacity_fields import CAPACITY_FIELDS
from moe_sidecar.core.effects import EventKind, GroupEvent
from moe_sidecar.core.errors import InvalidArgument, UndecodableRequest
from moe_sidecar.core.group import (
    CommitRecord,
    Decision,
    GroupSummary,
    Growth,
    Proposal,
    RankSummary,
    Requirement,
)
from moe_sidecar.core.identity import lifetime_id, owner_id, proof_id
from moe_sidecar.core.membership import Acknowledgement, View, ViewState
from moe_sidecar.core.plan import Action, Capacities, Plan
from moe_sidecar.core.policy.arrivals import Arrival
from moe_workspace.v1 import coordinator_pb2 as pb

__all__ = [
    "action_from_proto",
    "action_to_proto",
    "arrival_from_proto",
    "arrival_to_proto",
    "capacities_from_proto",
    "capacities_to_proto",
    "commit_from_proto",
    "commit_to_proto",
    "decision_from_proto",
    "decision_to_proto",
    "decode_request",
    "event_from_proto",
    "event_to_proto",
    "page_token_from_proto",
    "page_token_to_proto",
    "plan_from_proto",
    "plan_to_proto",
    "proposal_from_proto",
    "proposal_to_proto",
    "session_acknowledge_to_proto",
    "session_acknowledged_to_proto",
    "session_commit_to_proto",
    "session_committed_to_proto",
    "session_decision_to_proto",
    "session_decision_wire",
    "session_error_to_proto",
    "session_leave_to_proto",
    "session_left_to_proto",
    "session_propose_to_proto",
    "summary_from_proto",
    "summary_to_proto",
    "view_from_proto",
    "view_to_proto",
]

_ACTION_TO_PROTO = {
    Action.BUILD: pb.ACTION_BUILD,
    Action.REUSE: pb.ACTION_REUSE,
    Action.REBUILD: pb.ACTION_REBUILD,
}
_ACTION_FROM_PROTO = {wire: action for action, wire in _ACTION_TO_PROTO.items()}

_EVENT_TO_PROTO = {
    EventKind.ROUND_DECIDED: pb.EVENT_KIND_ROUND_DECIDED,
    EventKind.ROUND_REFUSED: pb.EVENT_KIND_ROUND_REFUSED,
    EventKind.RANK_TIMEOUT: pb.EVENT_KIND_RANK_TIMEOUT,
    EventKind.COMMIT: pb.EVENT_KIND_COMMIT,
    EventKind.RESET: pb.EVENT_KIND_RESET,
    EventKind.LIFETIME_STARTED: pb.EVENT_KIND_LIFETIME_STARTED,
    EventKind.ROUND_ABORTED: pb.EVENT_KIND_ROUND_ABORTED,
    EventKind.GROUP_REMOVED: pb.EVENT_KIND_GROUP_REMOVED,
    EventKind.RANK_LEFT: pb.EVENT_KIND_RANK_LEFT,
    EventKind.PLAN_MERGED: pb.EVENT_KIND_PLAN_MERGED,
    EventKind.PROOF_REFUSED: pb.EVENT_KIND_PROOF_REFUSED,
    EventKind.VIEW_CHANGED: pb.EVENT_KIND_VIEW_CHANGED,
}
_VIEW_STATE_TO_PROTO = {
    ViewState.PROPOSED: pb.VIEW_STATE_PROPOSED,
    ViewState.COMMITTED: pb.VIEW_STATE_COMMITTED,
    ViewState.FAILED: pb.VIEW_STATE_FAILED,
}
_VIEW_STATE_FROM_PROTO = {wire: state for state, wire in _VIEW_STATE_TO_PROTO.items()}
_EVENT_FROM_PROTO = {wire: kind for kind, wire in _EVENT_TO_PROTO.items()}


def _timestamp(seconds: float) -> Timestamp:
    stamp = Timestamp()
    stamp.FromNanoseconds(round(seconds * 1e9))
    return stamp


def _seconds(stamp: Timestamp) -> float:
    return stamp.seconds + stamp.nanos / 1e9


# --- actions, capacities, plans ------------------------------------------------------


def action_to_proto(action: Action | None) -> pb.Action.ValueType:
    """The wire action (``ACTION_UNSPECIFIED`` for None)."""
    return pb.ACTION_UNSPECIFIED if action is None else _ACTION_TO_PROTO[action]


def action_from_proto(action: pb.Action.ValueType) -> Action | None:
    """The domain action, or None for ``ACTION_UNSPECIFIED`` or an unknown value."""
    return _ACTION_FROM_PROTO.get(action)


def capacities_to_proto(c: Capacities) -> pb.Capacities:
    """The wire form of capacities: every field of the capacity table."""
    return pb.Capacities(**{field.name: getattr(c, field.name) for field in CAPACITY_FIELDS})


def capacities_from_proto(c: pb.Capacities) -> Capacities:
    """The domain form of wire capacities (ranges unchecked): every field of
    the capacity table (proto3 reads a field an older peer did not send as 0)."""
    return Capacities(**{field.name: getattr(c, field.name) for field in CAPACITY_FIELDS})


def plan_to_proto(plan: Plan, ep_size: int | None, release: str = "") -> pb.Plan:
    """The wire form of a plan; ``workspace_bytes`` derived at ``ep_size``
    (None: 0) in FlashInfer ``release``'s arithmetic (empty: the default
    release's; a commit carries no bytes)."""
    return pb.Plan(
        capacities=capacities_to_proto(plan.capacities),
        epoch=plan.epoch,
        generation=plan.generation,
        workspace_bytes=(
            flashinfer.workspace_size(release, plan.capacities, ep_size) if ep_size else 0
        ),
    )


def plan_from_proto(plan: pb.Plan, field: str = "plan") -> Plan:
    """The domain form of a wire plan (its derived ``workspace_bytes`` is ignored).

    Raises:
        InvalidArgument: the plan has no capacities (naming ``field``).
    """
    if not plan.HasField("capacities"):
        raise InvalidArgument.of(f"{field}.capacities", None, "is missing")
    return Plan(
        capacities=capacities_from_proto(plan.capacities),
        epoch=plan.epoch,
        generation=plan.generation,
    )


# --- requests ------------------------------------------------------------------------

_Message = TypeVar("_Message", bound=Message)


def decode_request(message_class: type[_Message], data: bytes) -> _Message:
    """Parses a request's raw bytes as ``message_class``.

    Raises:
        UndecodableRequest: the bytes are not that message (INVALID_ARGUMENT).
    """
    try:
        return message_class.FromString(data)
    except (DecodeError, RecursionError, ValueError) as error:
        name = message_class.DESCRIPTOR.full_name
        raise UndecodableRequest(
            f"request: {len(data)} bytes that are not a {name}: {error}",
            field="request",
            value=len(data),
        ) from None


_PAGE_TOKEN_PREFIX = "g1."


def page_token_to_proto(after: str | None) -> str:
    """The opaque token of the page that starts after group ``after`` ("" for none)."""
    if after is None:
        return ""
    return _PAGE_TOKEN_PREFIX + base64.urlsafe_b64encode(after.encode()).decode().rstrip("=")


def page_token_from_proto(
    request: pb.ListGroupsRequest, default_size: int, max_size: int
) -> tuple[int, str | None, float]:
    """Page size (0: ``default_size``; above ``max_size``: ``max_size``), the
    group name the page starts after, and the idle filter of a ``ListGroupsRequest``.

    Raises:
        InvalidArgument: a negative page size or idle time, or a token this
            sidecar did not make.
    """
    if request.page_size < 0:
        raise InvalidArgument.of("page_size", request.page_size, "must be >= 0")
    idle = request.idle_for_seconds
    if not math.isfinite(idle) or idle < 0:
        raise InvalidArgument.of("idle_for_seconds", idle, "must be a finite number >= 0")
    size = min(request.page_size or default_size, max_size)
    token = request.page_token
    if not token:
        return size, None, idle
    try:
        if not token.startswith(_PAGE_TOKEN_PREFIX):
            raise ValueError("unknown prefix")
        encoded = token[len(_PAGE_TOKEN_PREFIX) :]
        after = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode()
        limits.check_name("page_token", after, allow_empty=False)
    except (ValueError, InvalidArgument):
        raise InvalidArgument.of(
            "page_token", token[:40], "is not a next_page_token of this sidecar"
        ) from None
    return size, after, idle


def proposal_to_proto(p: Proposal) -> pb.ProposeRequest:
    """The ``ProposeRequest`` a rank sends for ``p``."""
    return pb.ProposeRequest(
        group=p.group,
        ep_size=p.ep_size,
        ep_rank=p.ep_rank,
        local_ranks=p.local_ranks,
        lifetime=p.lifetime,
        round=p.round,
        requirement=pb.Requirement(
            capacities=capacities_to_proto(p.requirement.capacities),
            layer=p.requirement.layer,
        ),
        group_proof=p.proof,
        flashinfer_release=p.release,
        owner_digest=p.owner,
    )


def proposal_from_proto(request: pb.ProposeRequest) -> Proposal:
    """The domain proposal of a ``ProposeRequest``; its lifetime and group
    proof tokens become their ids (:func:`moe_sidecar.core.identity.lifetime_id`,
    :func:`~moe_sidecar.core.identity.proof_id`): the sidecar never keeps a token.

    Raises:
        InvalidArgument: the requirement or its capacities are missing, the
            lifetime or proof token is not a usable secret, ``owner_digest``
            is not a SHA-256's hex digits (the owner digest becomes its id,
            :func:`~moe_sidecar.core.identity.owner_id`), or
            ``flashinfer_release`` names no release of the table (empty is
            the default release: a client older than the field).
    """
    if not request.HasField("requirement"):
        raise InvalidArgument.of("requirement", None, "is missing; every proposal states its need")
    r = request.requirement
    if not r.HasField("capacities"):
        raise InvalidArgument.of(
            "requirement.capacities", None, "is missing; every proposal states its need"
        )
    return Proposal(
        group=request.group,
        ep_size=request.ep_size,
        ep_rank=request.ep_rank,
        local_ranks=request.local_ranks,
        lifetime=lifetime_id(request.lifetime),
        round=request.round,
        requirement=Requirement(capacities=capacities_from_proto(r.capacities), layer=r.layer),
        proof=proof_id(request.group_proof),
        release=flashinfer.check_release_name("flashinfer_release", request.flashinfer_release),
        owner=owner_id(request.owner_digest),
    )


def commit_to_proto(group: str, record: CommitRecord) -> pb.CommitRequest:
    """The ``CommitRequest`` a rank sends for ``record``."""
    return pb.CommitRequest(
        group=group,
        ep_rank=record.ep_rank,
        lifetime=record.lifetime,
        round=record.round,
        plan=plan_to_proto(record.plan, None),
        build_seconds=record.build_seconds,
        group_proof=record.proof,
    )


def commit_from_proto(request: pb.CommitRequest) -> tuple[str, CommitRecord]:
    """The group name and domain record of a ``CommitRequest`` (the lifetime
    and group proof tokens become their ids).

    Raises:
        InvalidArgument: the plan (or its capacities) is missing, or the
            lifetime or proof token is not a usable secret.
    """
    if not request.HasField("plan"):
        raise InvalidArgument.of("plan", None, "is missing; commit the plan the rank holds")
    return request.group, CommitRecord(
        ep_rank=request.ep_rank,
        lifetime=lifetime_id(request.lifetime),
        round=request.round,
        plan=plan_from_proto(request.plan),
        build_seconds=request.build_seconds,
        proof=proof_id(request.group_proof),
    )


# --- responses -----------------------------------------------------------------------


def decision_to_proto(decision: Decision, ep_size: int, release: str) -> pb.ProposeResponse:
    """The response every rank of a decided round gets (its plan's bytes in
    the ranks' FlashInfer ``release``)."""
    return pb.ProposeResponse(
        round=decision.round,
        action=_ACTION_TO_PROTO[decision.action],
        plan=plan_to_proto(decision.plan, ep_size, release),
        grew=decision.grew,
    )


def decision_from_proto(response: pb.ProposeResponse, layer: str) -> Decision:
    """The decision a ``ProposeResponse`` carries for a round of ``layer``.

    Raises:
        ValueError: the response has no action, no plan or no capacities.
    """
    action = action_from_proto(response.action)
    if action is None or not response.HasField("plan"):
        raise ValueError(
            f"malformed ProposeResponse (action={response.action}, "
            f"plan present={response.HasField('plan')})"
        )
    try:
        plan = plan_from_proto(response.plan)
    except InvalidArgument as error:
        raise ValueError(f"malformed ProposeResponse: {error.message}") from None
    return Decision(round=response.round, action=action, plan=plan, grew=response.grew, layer=layer)


def _growth_to_proto(g: Growth, ep_size: int, release: str) -> pb.Growth:
    return pb.Growth(
        plan=plan_to_proto(g.plan, ep_size, release),
        layer=g.layer,
        ep_rank=g.ep_rank,
        round=g.round,
        time=_timestamp(g.at),
        node=g.node,
    )


def view_to_proto(view: View) -> pb.View:
    """The wire form of a membership view."""
    message = pb.View(
        number=view.number,
        members=list(view.members),
        generation=view.generation,
        state=_VIEW_STATE_TO_PROTO[view.state],
        cause=view.cause,
        acknowledged=[a.ep_rank for a in view.acks],
    )
    if view.deadline is not None:
        message.deadline.CopyFrom(_timestamp(view.deadline))
    return message


def view_from_proto(message: pb.View) -> View | None:
    """The membership view a sidecar sent (None: a state this code does not know).
    Acknowledgements come back without their round counts (the wire does not carry them)."""
    state = _VIEW_STATE_FROM_PROTO.get(message.state)
    if state is None:
        return None
    return View(
        number=message.number,
        members=tuple(message.members),
        generation=message.generation,
        state=state,
        cause=message.cause,
        deadline=_seconds(message.deadline) if message.HasField("deadline") else None,
        acks=tuple(Acknowledgement(r, 0) for r in message.acknowledged),
    )


def summary_to_proto(s: GroupSummary) -> pb.Group:
    """The wire view of a group: plan, lifetimes, rounds, ranks and growth history."""
    group = pb.Group(
        name=s.name,
        ep_size=s.ep_size,
        local_ranks=s.local_ranks,
        epoch=s.epoch,
        lifetimes=s.lifetimes,
        last_closed_round=s.last_closed_round,
        open_round=s.open_round,
        waiting_ranks=s.waiting_ranks,
        restarting_ranks=s.restarting_ranks,
        last_activity=_timestamp(s.last_activity),
        ranks=[
            pb.RankState(
                ep_rank=r.ep_rank,
                lifetime=r.lifetime,
                last_round=r.last_round,
                last_layer=r.last_layer,
                committed_generation=r.committed_generation,
                last_build_seconds=r.build_seconds,
                last_seen=_timestamp(r.last_seen),
                current=r.current,
                left=r.left,
            )
            for r in s.ranks
        ],
        history=[_growth_to_proto(g, s.ep_size, s.release) for g in s.history],
        refused_proposals=s.refused_proposals,
        flashinfer_release=flashinfer.release_named(s.release).name,
        arrived_ranks=s.arrived_ranks,
    )
    if s.plan is not None:
        group.plan.CopyFrom(plan_to_proto(s.plan, s.ep_size, s.release))
    if s.view is not None:
        group.view.CopyFrom(view_to_proto(s.view))
    return group


def summary_from_proto(group: pb.Group) -> GroupSummary:
    """The domain view of a wire group (what ``moe-sidecar groups`` prints).

    Raises:
        InvalidArgument: a plan in it has no capacities.
    """
    return GroupSummary(
        name=group.name,
        ep_size=group.ep_size,
        local_ranks=group.local_ranks,
        epoch=group.epoch,
        plan=plan_from_proto(group.plan) if group.HasField("plan") else None,
        lifetimes=group.lifetimes,
        last_closed_round=group.last_closed_round,
        open_round=group.open_round,
        waiting_ranks=group.waiting_ranks,
        restarting_ranks=group.restarting_ranks,
        last_activity=_seconds(group.last_activity),
        ranks=tuple(
            RankSummary(
                ep_rank=r.ep_rank,
                lifetime=r.lifetime,
                last_round=r.last_round,
                last_layer=r.last_layer,
                committed_generation=r.committed_generation,
                build_seconds=r.last_build_seconds,
                last_seen=_seconds(r.last_seen),
                current=r.current,
                left=r.left,
            )
            for r in group.ranks
        ),
        history=tuple(
            Growth(
                plan=plan_from_proto(h.plan, "history.plan"),
                layer=h.layer,
                ep_rank=h.ep_rank,
                round=h.round,
                at=_seconds(h.time),
                node=h.node,
            )
            for h in group.history
        ),
        refused_proposals=group.refused_proposals,
        release=group.flashinfer_release,
        view=view_from_proto(group.view) if group.HasField("view") else None,
        arrived_ranks=tuple(group.arrived_ranks),
    )


def arrival_to_proto(a: Arrival) -> pb.ArriveRequest:
    """The ``ArriveRequest`` a rank sends for ``a`` (``a.lifetime`` is its token)."""
    return pb.ArriveRequest(
        group=a.group,
        ep_size=a.ep_size,
        ep_rank=a.ep_rank,
        local_ranks=a.local_ranks,
        lifetime=a.lifetime,
    )


def arrival_from_proto(request: pb.ArriveRequest) -> Arrival:
    """The domain arrival of an ``ArriveRequest``; its lifetime token becomes
    its id (:func:`moe_sidecar.core.identity.lifetime_id`).

    Raises:
        InvalidArgument: the lifetime token is not a usable secret.
    """
    return Arrival(
        group=request.group,
        ep_size=request.ep_size,
        ep_rank=request.ep_rank,
        local_ranks=request.local_ranks,
        lifetime=lifetime_id(request.lifetime),
    )


def event_to_proto(event: GroupEvent, sizing: tuple[int, str] | None) -> pb.GroupEvent:
    """The wire form of a group event (plan bytes derived by ``sizing``: the
    group's EP size and FlashInfer release; None: an unknown group, 0 bytes)."""
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
        node=event.node,
        lost=event.lost,
        survivors=list(event.survivors),
    )
    if event.plan is not None:
        ep_size, release = sizing if sizing is not None else (None, "")
        message.plan.CopyFrom(plan_to_proto(event.plan, ep_size, release))
    if event.view is not None:
        message.view.CopyFrom(view_to_proto(event.view))
    return message


def event_from_proto(message: pb.GroupEvent) -> GroupEvent | None:
    """The group event a Watch stream delivered (a watcher's side), or None for
    a kind this code does not know (a newer sidecar's).

    Raises:
        InvalidArgument: the event's plan is out of range.
    """
    kind = _EVENT_FROM_PROTO.get(message.kind)
    if kind is None:
        return None
    return GroupEvent(
        group=message.group,
        kind=kind,
        at=_seconds(message.time),
        round=message.round,
        action=action_from_proto(message.action),
        plan=plan_from_proto(message.plan) if message.HasField("plan") else None,
        ep_rank=message.ep_rank,
        layer=message.layer,
        message=message.message,
        missing_ranks=tuple(message.missing_ranks),
        node=message.node,
        lost=message.lost,
        survivors=tuple(message.survivors),
        view=view_from_proto(message.view) if message.HasField("view") else None,
    )


# --- sessions ------------------------------------------------------------------------


def session_propose_to_proto(message_id: int, p: Proposal) -> pb.SessionRequest:
    """A session message carrying a proposal."""
    return pb.SessionRequest(id=message_id, propose=proposal_to_proto(p))


def session_commit_to_proto(message_id: int, group: str, record: CommitRecord) -> pb.SessionRequest:
    """A session message carrying a commit."""
    return pb.SessionRequest(id=message_id, commit=commit_to_proto(group, record))


def session_decision_to_proto(message_id: int, decision: pb.ProposeResponse) -> pb.SessionResponse:
    """The answer to a session's proposal: its decision (see :func:`decision_to_proto`)."""
    return pb.SessionResponse(id=message_id, decision=decision)


def _varint(value: int) -> bytes:
    """``value`` (>= 0) as a protobuf base-128 varint."""
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _tag(message: type[Message], field: str, wire_type: int) -> bytes:
    return _varint(message.DESCRIPTOR.fields_by_name[field].number << 3 | wire_type)


_SESSION_ID_TAG = _tag(pb.SessionResponse, "id", 0)
_SESSION_DECISION_TAG = _tag(pb.SessionResponse, "decision", 2)


def session_decision_wire(message_id: int, decision: bytes) -> bytes:
    """The serialized answer to a session's proposal, from its decision's
    serialized ``ProposeResponse``: the same bytes as serializing
    :func:`session_decision_to_proto`, without copying or encoding the
    decision again (every rank of a round gets the same one)."""
    head = _SESSION_ID_TAG + _varint(message_id) if message_id else b""
    return head + _SESSION_DECISION_TAG + _varint(len(decision)) + decision


def session_committed_to_proto(message_id: int) -> pb.SessionResponse:
    """The answer to a session's commit."""
    return pb.SessionResponse(id=message_id, committed=pb.CommitResponse())


def session_leave_to_proto(message_id: int) -> pb.SessionRequest:
    """A rank's clean goodbye on its session (its cleanup)."""
    return pb.SessionRequest(id=message_id, leave=pb.LeaveRequest())


def session_left_to_proto(message_id: int) -> pb.SessionResponse:
    """The answer to a session's goodbye (the stream ends next)."""
    return pb.SessionResponse(id=message_id, left=pb.LeaveResponse())


def session_acknowledge_to_proto(message_id: int, view: int, rounds: int) -> pb.SessionRequest:
    """A member's acknowledgement of view ``view`` at ``rounds`` all-to-all rounds."""
    return pb.SessionRequest(
        id=message_id, acknowledge=pb.AcknowledgeView(view=view, rounds=rounds)
    )


def session_acknowledged_to_proto(message_id: int, view: View | None) -> pb.SessionResponse:
    """The answer to an acknowledgement: the view as it stands."""
    response = pb.SessionResponse(id=message_id)
    response.acknowledged.CopyFrom(view_to_proto(view) if view is not None else pb.View())
    return response


def session_error_to_proto(message_id: int, code: str, message: str) -> pb.SessionResponse:
    """A session message's error: the status code's name and the message."""
    return pb.SessionResponse(id=message_id, error=pb.SessionError(code=code, message=message))
