"""A restart: every local rank of a group begins a new process lifetime. Pure.

The proposals of a new lifetime's round 1 are collected apart (the group's
``pending`` round); the running lifetime is untouched until every local
rank has joined, then it ends and round 1 of the next lifetime is decided.
Which proposals the restart takes is the group proof's rule (:mod:`.proof`):
it completes only when every local rank proposed with one proof.

A group whose running lifetime never ran (its round 1 was refused: a rank
missing past the deadline, a stranger's proof holding a slot) has nothing to
wait for: every new lifetime's round 1, of a rank that was in the failed
start or of one that never came, joins the restart, which is the group's
next start (:meth:`~moe_sidecar.core.group.GroupState.never_ran`).

A restart with more local ranks than the running lifetime (its layout is
the first proposal's) takes the group over (see :mod:`.propose`) and does not
inherit the stored plan: a new epoch begins with none. Nor does a restart
whose proposals do not carry the group's stored owner (:mod:`.owner`: a
stranger that squatted every slot stored that plan, or the ranks lost their
owner key).
"""

from __future__ import annotations

from dataclasses import replace

from moe_sidecar.core import limits
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
from moe_sidecar.core.errors import ErrorCode, InvalidArgument, PreconditionFailed, quote_name
from moe_sidecar.core.group import GroupState, OpenRound, Proposal, RankRecord, Refusal
from moe_sidecar.core.identity import short_id
from moe_sidecar.core.policy.events import group_event, lifetime_started, requirement_text
from moe_sidecar.core.policy.proof import Verdict, contest, mismatch_text
from moe_sidecar.core.policy.rounds import (
    decide_round,
    displace,
    refuse_proof,
    round_closed,
    why_cannot_join,
)

__all__ = ["join_restart"]


def join_restart(
    state: GroupState,
    p: Proposal,
    now: float,
    round_timeout: float,
    node: str,
    ceiling: limits.WorkspaceCeiling,
) -> Step:
    """Adds a new lifetime's round-1 proposal to the pending restart.

    The running lifetime is untouched until every local rank of the
    restart's layout has proposed here with one proof; then it ends (its
    open round, if any, is aborted) and this round is decided as round 1 of
    the next lifetime.

    Raises:
        PreconditionFailed: the restart collects another ``local_ranks``, two
            lifetimes claim one rank with one proof, or a retry changed content.
    """
    pending = state.pending or OpenRound(
        number=1, opened_at=now, deadline=now + round_timeout, first_proof=p.proof
    )
    layout = pending.proposals[0].local_ranks if pending.proposals else p.local_ranks
    if p.local_ranks != layout:
        raise PreconditionFailed(
            f"rank {p.ep_rank} of group {quote_name(p.group)} begins a new lifetime with "
            f"local_ranks={p.local_ranks}, but the group's restart collects local_ranks={layout}"
        )
    index = state.lifetime_index + 1
    effects: tuple[Effect, ...] = ()
    earlier = pending.proposal_of(p.ep_rank)
    if (earlier is not None and earlier.proof != p.proof) or (
        earlier is None and pending.proposals
    ):
        verdict = contest(pending, p, layout)
        if verdict.verdict is Verdict.REFUSE:
            message = mismatch_text(p.group, p.ep_rank, p.proof, verdict.reason)
            return refuse_proof(state, p.ep_rank, 1, message, now)
        if verdict.displaced is not None:
            state, pending, effects = displace(state, pending, index, verdict.displaced, p, now)
            earlier = None
    if earlier is not None:
        _check_retry(earlier, p)
        return Step(state, reply=Wait(index, 1, pending.deadline))
    inherits = layout == state.local_ranks and state.inherits_stored_plan((p,))
    conflict = why_cannot_join(state, pending, p, inherits=inherits, restart=True)
    if conflict is not None:
        if not pending.with_proposal(p).single_proof():
            # Beside another proof's proposals, a conflict refuses only its maker.
            raise PreconditionFailed(conflict)
        return _refuse_restart(state, pending, p, conflict, now)
    pending = pending.with_proposal(p)
    if pending.closing_proof(layout) is None:
        state = replace(state, pending=pending)
        return Step(
            state,
            reply=Wait(index, 1, pending.deadline),
            effects=(*effects, Deadline(state.next_deadline())),
        )
    return _restart(state, pending, p, now, node, ceiling, effects)


def _check_retry(earlier: Proposal, p: Proposal) -> None:
    """Checks that ``p``, of a rank whose slot in the restart ``earlier``
    (of ``p``'s proof) holds, is a retry of it.

    Raises:
        PreconditionFailed: another lifetime claims the rank, or the retry
            changed content.
    """
    if earlier.lifetime != p.lifetime:
        raise PreconditionFailed(
            f"rank {p.ep_rank} of group {quote_name(p.group)}: another lifetime "
            f"({short_id(earlier.lifetime)}) already joined the group's restart as this "
            f"rank; lifetime {short_id(p.lifetime)} is refused (two processes claim one rank)"
        )
    if earlier.requirement != p.requirement:
        raise PreconditionFailed(
            f"rank {p.ep_rank} of group {quote_name(p.group)} re-proposed round 1 with "
            f"{requirement_text(p.requirement)} after proposing "
            f"{requirement_text(earlier.requirement)}"
        )


def _restart(
    state: GroupState,
    pending: OpenRound,
    p: Proposal,
    now: float,
    node: str,
    ceiling: limits.WorkspaceCeiling,
    displaced: tuple[Effect, ...],
) -> Step:
    """Every local rank began a new lifetime: the running one ends, round 1 of
    the new one is decided. A new layout (see :mod:`.propose`), or a stored
    plan the new lifetime does not own (:mod:`.owner`), begins a new epoch
    without the stored plan."""
    layout = pending.proposals[0].local_ranks
    takeover = layout != state.local_ranks
    disowned = state.plan is not None and not state.inherits_stored_plan(pending.proposals)
    if takeover or disowned:
        try:
            limits.check_count("epoch", state.epoch + 1, 0, limits.MAX_GENERATION)
        except InvalidArgument as error:
            return _refuse_restart(state, pending, p, error.message, now)
        state = replace(state, epoch=state.epoch + 1, plan=None, history=(), local_ranks=layout)
    effects: list[Effect] = [Persist(), *displaced]
    rnd = state.open_round
    if rnd is not None:
        message = (
            f"round {rnd.number} of group {quote_name(p.group)} abandoned: every local rank of "
            "the group began a new lifetime (the group restarted)"
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
        proof=pending.proposals[0].proof,
        owner=pending.owner(),
    )
    for q in pending.proposals:
        ended = state.rank(q.ep_rank)
        state = state.with_rank(
            RankRecord(
                ep_rank=q.ep_rank,
                lifetime=q.lifetime,
                lifetime_index=index,
                last_round=1,
                last_layer=q.requirement.layer,
                last_seen=now,
                ended_lifetime=ended.lifetime if ended is not None else "",
            ),
        )
    effects.append(lifetime_started(state, p, now))
    return decide_round(state, pending, p, now, tuple(effects), node, ceiling)


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
