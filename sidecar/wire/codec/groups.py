"""What a sidecar shows of its groups: membership views, group summaries
(``ListGroups``, ``moe-sidecar groups``) and the events of a Watch stream.

Decoding what the client received checks what it acts on; a view state or
event kind this code does not know (a newer sidecar's) decodes as None.
"""

from __future__ import annotations

from google.protobuf.timestamp_pb2 import Timestamp

from moe_sidecar import flashinfer
from moe_sidecar.core.effects import EventKind, GroupEvent
from moe_sidecar.core.group import GroupSummary, Growth, RankSummary
from moe_sidecar.core.membership import Acknowledgement, View, ViewState
from moe_sidecar.wire.codec.plans import (
    action_from_proto,
    action_to_proto,
    plan_from_proto,
    plan_to_proto,
)
from moe_workspace.v1 import coordinator_pb2 as pb

__all__ = [
    "event_from_proto",
    "event_to_proto",
    "summary_from_proto",
    "summary_to_proto",
    "view_from_proto",
    "view_to_proto",
]

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
        joined=list(view.joined),
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
        joined=tuple(message.joined),
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
        awaited_ranks=s.awaited_ranks,
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
        awaited_ranks=tuple(group.awaited_ranks),
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
