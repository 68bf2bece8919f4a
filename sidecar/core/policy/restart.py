"""A restart: every local rank of a group begins a new process lifetime. Pure.

The proposals of a new lifetime's round 1 are collected apart (the group's
``pending`` round); the running lifetime is untouched until every local
rank has joined, then it ends and round 1 of the next lifetime is decided.
"""

from __future__ import annotations

from dataclasses import replace

from moe_sidecar.core.effects import (
    Answer,
    Deadline,
    Effect,
    EventKind,
    Persist,
    Publish,
    Step,
    Wait,
)
from moe_sidecar.core.errors import ErrorCode, PreconditionFailed
from moe_sidecar.core.group import GroupState, OpenRound, Proposal, RankRecord, Refusal
from moe_sidecar.core.identity import short_id
from moe_sidecar.core.policy.events import group_event, lifetime_started
from moe_sidecar.core.policy.rounds import (
    decide_round,
    round_closed,
    why_cannot_join,
    with_proposal,
    with_rank,
)

__all__ = ["join_restart"]


def join_restart(
    state: GroupState, p: Proposal, now: float, round_timeout: float, node: str
) -> Step:
    """Adds a new lifetime's round-1 proposal to the pending restart.

    The running lifetime is untouched until every local rank has proposed
    here; then it ends (its open round, if any, is aborted) and this round
    is decided as round 1 of the next lifetime.
    """
    pending = state.pending or OpenRound(number=1, opened_at=now, deadline=now + round_timeout)
    index = state.lifetime_index + 1
    earlier = pending.proposal_of(p.ep_rank)
    if earlier is not None:
        if earlier.lifetime != p.lifetime:
            raise PreconditionFailed(
                f"rank {p.ep_rank} of group {p.group!r}: another lifetime "
                f"({short_id(earlier.lifetime)}) already joined the group's restart as this "
                f"rank; lifetime {short_id(p.lifetime)} is refused (two processes claim one rank)"
            )
        if earlier.requirement != p.requirement:
            raise PreconditionFailed(
                f"rank {p.ep_rank} of group {p.group!r} re-proposed round 1 with "
                f"{p.requirement} after proposing {earlier.requirement}"
            )
        return Step(state, reply=Wait(index, 1, pending.deadline))
    conflict = why_cannot_join(state, pending, p)
    if conflict is not None:
        return _refuse_restart(state, pending, p, conflict, now)
    pending = with_proposal(pending, p)
    if len(pending.proposals) < state.local_ranks:
        state = replace(state, pending=pending)
        return Step(
            state,
            reply=Wait(index, 1, pending.deadline),
            effects=(Deadline(state.next_deadline()),),
        )
    return _restart(state, pending, p, now, node)


def _restart(state: GroupState, pending: OpenRound, p: Proposal, now: float, node: str) -> Step:
    """Every local rank began a new lifetime: the running one ends, round 1 of
    the new one is decided."""
    effects: list[Effect] = [Persist()]
    rnd = state.open_round
    if rnd is not None:
        message = (
            f"round {rnd.number} of group {p.group!r} abandoned: every local rank of the group "
            "began a new lifetime (the group restarted)"
        )
        aborted = Refusal(round=rnd.number, code=ErrorCode.ABORTED, message=message)
        effects += [
            Answer(state.lifetime_index, rnd.number, aborted),
            Publish(group_event(state, EventKind.ROUND_ABORTED, now, closes=rnd, message=message)),
        ]
    index = state.lifetime_index + 1
    state = replace(
        state,
        lifetime_index=index,
        built=None,
        last_closed_round=0,
        closed=(),
        open_round=None,
        pending=None,
    )
    for q in pending.proposals:
        state = with_rank(
            state,
            RankRecord(
                ep_rank=q.ep_rank,
                lifetime=q.lifetime,
                lifetime_index=index,
                last_round=1,
                last_layer=q.requirement.layer,
                last_seen=now,
            ),
        )
    effects.append(lifetime_started(state, p, now))
    return decide_round(state, pending, p, now, tuple(effects), node)


def _refuse_restart(
    state: GroupState, pending: OpenRound, p: Proposal, message: str, now: float
) -> Step:
    """Refuses a restart's round 1 for every rank in it; the running lifetime goes on."""
    refusal = Refusal(round=1, code=ErrorCode.FAILED_PRECONDITION, message=message)
    state = replace(state, pending=None)
    event = group_event(
        state,
        EventKind.ROUND_REFUSED,
        now,
        closes=pending,
        round=1,
        ep_rank=p.ep_rank,
        layer=p.requirement.layer,
        message=message,
        ranks=tuple(sorted({q.ep_rank for q in pending.proposals} | {p.ep_rank})),
    )
    return round_closed(state, state.lifetime_index + 1, pending, refusal, event)
