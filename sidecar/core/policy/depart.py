"""A rank's session ended: the rank is gone, and a round waiting for it fails;
or its session came back on a new stream (:func:`reconnect`). Pure."""

from __future__ import annotations

from dataclasses import replace

from moe_sidecar.core.effects import Deadline, EventKind, Persist, Publish, Step
from moe_sidecar.core.errors import ErrorCode, PreconditionFailed, quote_name
from moe_sidecar.core.group import GroupState, OpenRound, RankRecord, Refusal
from moe_sidecar.core.identity import short_id
from moe_sidecar.core.policy.events import gone_text, group_event
from moe_sidecar.core.policy.rounds import round_closed
from moe_sidecar.core.policy.views import DEFAULT_ACK_TIMEOUT_S, member_left

__all__ = ["depart", "reconnect"]


def _leave_restart(state: GroupState, pending: OpenRound, ep_rank: int) -> Step:
    """A rank waiting in a restart leaves it: its next lifetime may take its place."""
    rest = replace(pending, proposals=(), need=None)
    for q in pending.proposals:
        if q.ep_rank != ep_rank:
            rest = rest.with_proposal(q)
    state = replace(state, pending=rest if rest.proposals else None)
    return Step(state, effects=(Deadline(state.next_deadline()),))


def depart(
    state: GroupState,
    ep_rank: int,
    lifetime: str,
    why: str,
    now: float,
    *,
    lost: bool = True,
    ack_timeout: float = DEFAULT_ACK_TIMEOUT_S,
) -> Step | None:
    """A rank's session ended: the rank (of lifetime ``lifetime``) is gone.

    ``lost``: the session broke (the process died, was killed, or lost its
    connection); False when the rank closed it cleanly (its cleanup). Both
    leave the same state; the RANK_LEFT event says which, and names the
    running lifetime's ranks still present, so that their watchers end (or
    stop) them on a death and leave them alone on a clean close. Either way
    the rank leaves the membership view: the next view, without it, is
    proposed (due within ``ack_timeout``; see :mod:`.views`).

    A rank of the running lifetime is marked gone and the group's open
    round, if any, fails at once for everyone in it (ABORTED, naming the rank,
    its last layer and ``why``); later rounds fail the same way until it
    comes back (proposes again with the same lifetime) or the group restarts.
    A rank waiting in a restart leaves it, so its next lifetime may take its
    place. None when the lifetime is not (or no longer) the group's.
    """
    pending = state.pending
    waiting = pending.proposal_of(ep_rank) if pending is not None else None
    if pending is not None and waiting is not None and waiting.lifetime == lifetime:
        return _leave_restart(state, pending, ep_rank)
    record = state.rank(ep_rank)
    if (
        record is None
        or record.lifetime != lifetime
        or record.lifetime_index != state.lifetime_index
        or record.left
    ):
        return None
    rnd = state.open_round
    if (
        state.proof is None
        and rnd is not None
        and rnd.proposal_of(ep_rank) is not None
        and not rnd.single_proof()
    ):
        return _withdraw(state, rnd, ep_rank)
    return _mark_gone(state, record, why, now, lost, ack_timeout)


def reconnect(state: GroupState, ep_rank: int, lifetime: str) -> None:
    """Checks that a new stream may speak for rank ``ep_rank`` of lifetime
    ``lifetime`` (its id) without a proposal: the rank's session came back
    (the sidecar restarted, the old stream broke). It changes nothing: the
    stream's end is then the rank's departure, as for a stream bound by a
    proposal.

    Raises:
        PreconditionFailed: the rank has no record of the group's running
            lifetime with that lifetime id, or it is gone (naming why), so
            the stream binds nothing.
    """
    record = state.rank(ep_rank)
    where = f"rank {ep_rank} of group {quote_name(state.name)}"
    if (
        record is None
        or record.lifetime != lifetime
        or record.lifetime_index != state.lifetime_index
    ):
        raise PreconditionFailed(
            f"session: {where} has no running lifetime {short_id(lifetime)}: the stream "
            "binds at the rank's next proposal"
        )
    if record.left:
        raise PreconditionFailed(f"session: {where} is gone ({record.left}): nothing to resume")


def _withdraw(state: GroupState, rnd: OpenRound, ep_rank: int) -> Step:
    """A rank of a round that holds two proofs is not known to be one of the
    group's ranks: its going withdraws its proposal and its place, and the
    round goes on (a stranger leaving must not fail it)."""
    state = replace(
        state,
        open_round=rnd.without(ep_rank),
        ranks=tuple(r for r in state.ranks if r.ep_rank != ep_rank),
    )
    return Step(state, effects=(Persist(), Deadline(state.next_deadline())))


def _mark_gone(
    state: GroupState, record: RankRecord, why: str, now: float, lost: bool, ack_timeout: float
) -> Step:
    """A rank of the running lifetime is gone: marked so, out of the
    membership view, and the open round (if any) abandoned for everyone in it."""
    state, view_events = member_left(
        state, record.ep_rank, gone_text(replace(record, left=why)), now, ack_timeout
    )
    record = replace(record, left=why, last_seen=now)
    state = state.with_rank(record)
    gone = group_event(
        state,
        EventKind.RANK_LEFT,
        now,
        round=record.last_round,
        ep_rank=record.ep_rank,
        layer=record.last_layer,
        message=gone_text(record),
    )
    survivors = tuple(short_id(r.lifetime) for r in state.current_ranks() if not r.left)
    left = Publish(replace(gone, lost=lost, survivors=survivors))
    rnd = state.open_round
    if rnd is None:
        return Step(state, effects=(Persist(), left, *view_events))
    message = f"round {rnd.number} of group {quote_name(state.name)} abandoned: {gone_text(record)}"
    refusal = Refusal(round=rnd.number, code=ErrorCode.ABORTED, message=message)
    closed = state.closed_by(refusal)
    event = group_event(
        state,
        EventKind.ROUND_ABORTED,
        now,
        closes=rnd,
        ep_rank=record.ep_rank,
        layer=record.last_layer,
        message=message,
    )
    return round_closed(
        closed, closed.lifetime_index, rnd, refusal, event, effects=(left, *view_events)
    )
