"""A group taken up from its stored row: the REUSE rounds recorded beside
it, and rows that lag their REUSE rounds. Pure.

A round decided REUSE changes nothing a restart needs but its outcome (no
plan, epoch, generation, history or built plan; only the retained outcomes
and the ranks' last round and layer), so the group's row is not rewritten:
one short record (the lifetime, the round and its layer) is written before
the round is answered (:class:`~moe_sidecar.core.effects.RecordReuse`), and
:func:`replay_reuse` applies each record to the row it follows. So a
retried proposal of a round answered before a ``kill -9`` gets the answer it
had: one round, one answer.

Rows written by a sidecar that recorded nothing of its REUSE rounds may end
at round ``k`` while the ranks went on to round ``n > k + 1``: every round
between closed REUSE with the stored plan, since any other outcome would
have been written. A restarted sidecar (the caller says so: ``recovered``)
takes a proposal of a known lifetime for such a round as that proof, and
:func:`catch_up` records the missing rounds as the REUSE decisions they were.
"""

from __future__ import annotations

from dataclasses import replace

from moe_sidecar.core.effects import Answer, Deadline, Effect, Persist
from moe_sidecar.core.errors import PreconditionFailed, quote_name
from moe_sidecar.core.group import RETAINED_ROUNDS, Decision, GroupState, Proposal
from moe_sidecar.core.plan import Action
from moe_sidecar.core.policy.events import requirement_text

__all__ = ["catch_up", "may_catch_up", "replay_reuse"]


def replay_reuse(
    state: GroupState, lifetime_index: int, round_number: int, layer: str
) -> GroupState | None:
    """``state`` with round ``round_number`` of lifetime ``lifetime_index``
    closed REUSE at ``layer`` with the stored plan (the record of
    :class:`~moe_sidecar.core.effects.RecordReuse`), or None when the record
    does not follow ``state``: another lifetime, not the next round, or no
    plan built to reuse (the row was written after the record, or the
    record belongs to a row since replaced).

    Every local rank proposed the round, so each rank of the lifetime is
    recorded at it.
    """
    plan = state.plan
    if (
        plan is None
        or state.built is None
        or lifetime_index != state.lifetime_index
        or round_number != state.last_closed_round + 1
        or (state.open_round is not None and state.open_round.number != round_number)
    ):
        return None
    decision = Decision(round_number, Action.REUSE, plan, False, layer)
    ranks = tuple(
        replace(r, last_round=round_number, last_layer=layer)
        if r.lifetime_index == lifetime_index and not r.left
        else r
        for r in state.ranks
    )
    return replace(
        state,
        open_round=None,
        last_closed_round=round_number,
        closed=(*state.closed, decision)[-RETAINED_ROUNDS:],
        ranks=ranks,
    )


def may_catch_up(state: GroupState, recovered: bool) -> bool:
    """Whether rounds after ``state``'s last closed round may have closed
    REUSE without a write: the state came from a row (``recovered``) and its
    lifetime has a built and a stored plan to reuse."""
    return recovered and state.built is not None and state.plan is not None


def catch_up(state: GroupState, p: Proposal) -> tuple[GroupState, tuple[Effect, ...]]:
    """``state`` with every round before ``p.round`` closed as the REUSE
    decision it was: an open round (stored before the restart, which ``p``'s
    rank has passed) is answered so; the rest are retained for retries.

    Raises:
        PreconditionFailed: the stored plan does not cover a proposal of the
            open round, so that round cannot have been REUSE.
    """
    plan = state.plan
    assert plan is not None
    waiting = state.open_round.proposals if state.open_round is not None else ()
    for q in waiting:
        if not plan.covers(q.requirement.capacities):
            raise PreconditionFailed(
                f"rank {p.ep_rank} of group {quote_name(p.group)} proposes round {p.round} "
                f"but the group's next round is {state.last_closed_round + 1}, and rank "
                f"{q.ep_rank}'s {requirement_text(q.requirement)} is not covered by the "
                f"stored plan {plan}, so the rounds between cannot have been reused"
            )
    answers: tuple[Effect, ...] = ()
    first = max(state.last_closed_round + 1, p.round - RETAINED_ROUNDS)
    lost = [Decision(r, Action.REUSE, plan, False, "") for r in range(first, p.round)]
    if state.open_round is not None:
        number = state.open_round.number
        layer = waiting[0].requirement.layer if waiting else ""
        decision = Decision(number, Action.REUSE, plan, False, layer)
        answers = (Answer(state.lifetime_index, number, decision),)
        lost = [decision if d.round == number else d for d in lost]
    state = replace(
        state,
        open_round=None,
        last_closed_round=p.round - 1,
        closed=(*state.closed, *lost)[-RETAINED_ROUNDS:],
    )
    return state, (Persist(), *answers, Deadline(state.next_deadline()))
