"""A proposal: admitting it (a known lifetime, a new one, a restart) and
adding it to its round. Pure.

The n-th ``initialize()`` of a rank in one process lifetime is round n. A
round closes when every local rank of the group has proposed it, and every
one of them gets the same outcome; a retried proposal for a closed round
gets the same outcome back. The stored plan outlives process lifetimes, so
round 1 of a restart starts from the historical union.

Which proposals a round takes is the group proof's rule (:mod:`.proof`).

A group's layout on this node (``local_ranks``) belongs to its running
lifetime. A new lifetime with fewer local ranks is refused (one stranger
with ``local_ranks=1`` may not end a group's lifetime); one with more local
ranks is collected as a restart, and when every one of its local ranks has
proposed with one proof it takes the group over (the real ranks taking back
a group squatted first with fewer ranks). Such a takeover does not inherit
the stored plan: a new epoch begins, as after a reset, so nothing the
earlier lifetime grew is built by the new one (the generation counter goes
on, generations are never reused). Nor does a group's first lifetime on this
node whose round 1 does not carry the owner of a plan stored here (merged
from another node): :mod:`.owner`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from moe_sidecar.core import limits
from moe_sidecar.core.effects import Deadline, Effect, Persist, Step, Wait
from moe_sidecar.core.errors import (
    ErrorCode,
    InvalidArgument,
    PreconditionFailed,
    RoundAborted,
    quote_name,
)
from moe_sidecar.core.group import Decision, GroupState, OpenRound, Proposal, RankRecord, Refusal
from moe_sidecar.core.identity import short_id
from moe_sidecar.core.plan import ShapeMismatch
from moe_sidecar.core.policy.events import gone_text, lifetime_started, requirement_text
from moe_sidecar.core.policy.proof import Verdict, contest, mismatch_text, proof_text
from moe_sidecar.core.policy.recovery import catch_up, may_catch_up
from moe_sidecar.core.policy.rejoin import claims_running_lifetime, rejoin, rejoin_retry
from moe_sidecar.core.policy.restart import join_restart
from moe_sidecar.core.policy.rounds import (
    decide_round,
    displace,
    refuse_proof,
    refuse_round,
    why_cannot_join,
)
from moe_sidecar.core.policy.validation import validate_known_proposal, validate_proposal

__all__ = ["propose"]


@dataclass(frozen=True)
class _Admitted:
    """A proposal allowed into its round, with what admitting it did."""

    state: GroupState
    record: RankRecord
    effects: tuple[Effect, ...]


def _accepts_newcomers(state: GroupState) -> bool:
    """Whether a rank arriving with a new lifetime joins the current one.

    It does while the lifetime is still at round 1: round 1 open, or closed
    by a refusal before every local rank arrived (a round 1 that decided had
    every local rank, so a newcomer after it belongs to a restart).
    """
    if state.open_round is not None:
        return state.open_round.number == 1
    if state.last_closed_round == 0:
        return True
    return state.last_closed_round == 1 and isinstance(state.outcome_of(1), Refusal)


def _first_lifetime(state: GroupState, p: Proposal, now: float) -> _Admitted:
    """The group's first lifetime begins with its first proposal."""
    state = replace(state, lifetime_index=1, local_ranks=p.local_ranks)
    record = RankRecord(ep_rank=p.ep_rank, lifetime=p.lifetime, lifetime_index=1)
    return _Admitted(state, record, (Persist(), lifetime_started(state, p, now)))


def _held_by_other_proof(state: GroupState, p: Proposal) -> bool:
    """Whether ``p``'s slot in the running lifetime's open round is held by a
    proposal of another proof while the lifetime has no proof yet: then
    ``p`` contests the slot in that round instead of starting a restart."""
    rnd = state.open_round
    if state.proof is not None or rnd is None or rnd.number != 1:
        return False
    holder = rnd.proposal_of(p.ep_rank)
    return holder is not None and holder.proof != p.proof


def _admit_new_lifetime(
    state: GroupState,
    p: Proposal,
    record: RankRecord | None,
    now: float,
    round_timeout: float,
    node: str,
    ceiling: limits.WorkspaceCeiling,
) -> _Admitted | Step:
    """A proposal from a lifetime the group has not seen for this rank.

    It joins the running lifetime while that is still at round 1 and the
    rank's place in it is free, or as the replacement of a departed rank
    when it carries the running lifetime's proof (:mod:`.rejoin`);
    otherwise it belongs to a restart
    (:func:`join_restart`), which replaces the running lifetime only once
    every local rank has joined it.
    """
    if record is not None and record.ended_lifetime == p.lifetime:
        raise RoundAborted(
            f"rank {p.ep_rank} of group {quote_name(p.group)} belongs to lifetime "
            f"{short_id(p.lifetime)}, which ended when other ranks of the group restarted; restart this rank"
        )
    if p.round != 1:
        raise PreconditionFailed(
            f"rank {p.ep_rank} of group {quote_name(p.group)} proposes round {p.round} from "
            f"lifetime {short_id(p.lifetime)}, which this sidecar does not know: a lifetime "
            "starts at round 1 (did the group restart without this rank, or was the sidecar's "
            "state dir lost?); restart this rank"
        )
    if state.lifetime_index == 0:
        return _first_lifetime(state, p, now)
    if p.local_ranks < state.local_ranks:
        raise PreconditionFailed(
            f"group {quote_name(p.group)} runs with local_ranks={state.local_ranks} on this node; "
            f"a new lifetime of rank {p.ep_rank} with local_ranks={p.local_ranks} is refused "
            "(fewer local ranks may not end the group's lifetime); use a group name for the new "
            "layout, or remove the group (an admin call) first"
        )
    if p.local_ranks > state.local_ranks:
        # More local ranks than the running lifetime: a takeover, complete
        # only once every one of them proposed with one proof.
        return join_restart(state, p, now, round_timeout, node, ceiling)
    if claims_running_lifetime(state, p, record):
        # The running lifetime's proof: a replacement the survivors let in
        # (a restart draws a new proof), joining the next view.
        assert record is not None
        return rejoin(state, p, record, now, round_timeout)
    taken = record is not None and record.lifetime_index == state.lifetime_index
    if taken and _held_by_other_proof(state, p):
        taken = False
    if taken or not _accepts_newcomers(state) or state.never_ran():
        # A lifetime whose round 1 was refused ran nothing: every new
        # lifetime, of a rank that was in it or of one that never came,
        # begins the group's next start (a restart with nothing to wait for).
        return join_restart(state, p, now, round_timeout, node, ceiling)
    joined = RankRecord(ep_rank=p.ep_rank, lifetime=p.lifetime, lifetime_index=state.lifetime_index)
    return _Admitted(state, joined, ())


def _admit_known(
    state: GroupState, p: Proposal, record: RankRecord, now: float, recovered: bool
) -> _Admitted | Step:
    """A proposal from the lifetime the group already knows for this rank."""
    if record.lifetime_index != state.lifetime_index:
        raise RoundAborted(
            f"rank {p.ep_rank} of group {quote_name(p.group)} belongs to lifetime "
            f"{short_id(p.lifetime)}, which ended when other ranks of the group restarted; "
            "restart this rank"
        )
    if state.proof is not None and p.proof != state.proof:
        why = (
            f"the group's lifetime {state.lifetime_index} runs with proof {proof_text(state.proof)}"
        )
        return refuse_proof(
            state, p.ep_rank, p.round, mismatch_text(p.group, p.ep_rank, p.proof, why), now
        )
    if p.local_ranks != state.local_ranks:
        # A running lifetime keeps its number of ranks on this node.
        raise PreconditionFailed(
            f"group {quote_name(p.group)} has local_ranks={state.local_ranks} on this node but "
            f"rank {p.ep_rank} proposes local_ranks={p.local_ranks}"
        )
    if p.round <= state.last_closed_round:
        again = rejoin_retry(state, p)
        if again is not None:
            # A replacement's round 1 was answered apart from the group's rounds.
            return again
        outcome = state.outcome_of(p.round)
        if outcome is None:
            raise PreconditionFailed(
                f"rank {p.ep_rank} of group {quote_name(p.group)} retries round {p.round}, which "
                f"closed long ago (latest closed round: {state.last_closed_round})"
            )
        if isinstance(outcome, Decision) and not outcome.plan.covers(p.requirement.capacities):
            # A retry proposes what it proposed, which its round's decision covers.
            raise PreconditionFailed(
                f"rank {p.ep_rank} of group {quote_name(p.group)} re-proposed round {p.round} with "
                f"{requirement_text(p.requirement)} after the round was decided with "
                f"{outcome.plan}, which does not serve it; a retry must propose what the rank "
                "proposed"
            )
        return Step(state, reply=outcome)
    if p.round > state.last_closed_round + 1 and may_catch_up(state, recovered):
        # The stored row lags: the rounds between closed REUSE unrecorded.
        state, effects = catch_up(state, p)
        return _Admitted(state, record, effects)
    if p.round > state.last_closed_round + 1:
        raise PreconditionFailed(
            f"rank {p.ep_rank} of group {quote_name(p.group)} proposes round {p.round} but the "
            f"group's next round is {state.last_closed_round + 1}"
        )
    return _Admitted(state, record, ())


def _join_round(
    admitted: _Admitted,
    p: Proposal,
    now: float,
    round_timeout: float,
    node: str,
    ceiling: limits.WorkspaceCeiling,
) -> Step:
    """Adds an admitted proposal to its round (by the proof's rule); closes
    the round when every local slot holds one proof's proposals."""
    state, effects = admitted.state, admitted.effects
    rnd = state.open_round or OpenRound(
        number=p.round, opened_at=now, deadline=now + round_timeout, first_proof=p.proof
    )
    earlier = rnd.proposal_of(p.ep_rank)
    # Once the lifetime's proof is fixed every admitted proposal carries it
    # (rule 2): no contest, and the round closes on its count alone.
    contested = state.proof is None and (
        (earlier is not None and earlier.proof != p.proof) or (earlier is None and rnd.proposals)
    )
    if contested:
        verdict = contest(rnd, p, state.local_ranks)
        if verdict.verdict is Verdict.REFUSE:
            message = mismatch_text(p.group, p.ep_rank, p.proof, verdict.reason)
            return refuse_proof(state, p.ep_rank, p.round, message, now)
        if verdict.displaced is not None:
            state, rnd, displaced = displace(
                state, rnd, state.lifetime_index, verdict.displaced, p, now
            )
            effects = (*effects, *displaced)
            earlier = None
    if earlier is not None:
        if earlier.requirement != p.requirement:
            raise PreconditionFailed(
                f"rank {p.ep_rank} of group {quote_name(p.group)} re-proposed round {p.round} with "
                f"{requirement_text(p.requirement)} after proposing "
                f"{requirement_text(earlier.requirement)}"
            )
        return Step(state, reply=Wait(state.lifetime_index, rnd.number, rnd.deadline))

    # The group is copied once below, with the rank's record and the round.
    ranks = state.ranks_with(_seen(admitted.record, p, now))
    gone = [r for r in ranks if r.left and r.lifetime_index == state.lifetime_index]
    if gone:
        state = replace(state, ranks=ranks)
        message = (
            f"round {p.round} of group {quote_name(p.group)} cannot close: "
            + "; ".join(gone_text(r) for r in gone)
            + "; restart every rank"
        )
        return refuse_round(state, rnd, p, message, now, effects, code=ErrorCode.ABORTED)
    conflict = why_cannot_join(state, rnd, p)
    if conflict is not None:
        if not rnd.with_proposal(p).single_proof():
            # Beside another proof's proposals, a conflict refuses only its maker.
            raise PreconditionFailed(conflict)
        return refuse_round(replace(state, ranks=ranks), rnd, p, conflict, now, effects)

    return _add_proposal(state, ranks, rnd, p, now, effects, node, ceiling)


def _seen(known: RankRecord, p: Proposal, now: float) -> RankRecord:
    """The rank's record once ``p`` joined its round: back (not ``left``),
    at ``p``'s round and layer, seen ``now``."""
    return replace(
        known, last_round=p.round, last_layer=p.requirement.layer, last_seen=now, left=""
    )


def _add_proposal(
    state: GroupState,
    ranks: tuple[RankRecord, ...],
    rnd: OpenRound,
    p: Proposal,
    now: float,
    effects: tuple[Effect, ...],
    node: str,
    ceiling: limits.WorkspaceCeiling,
) -> Step:
    """Adds ``p``, which may join, to ``rnd`` (``ranks``: the group's ranks
    with ``p``'s record): it waits for the round's other ranks, or closes
    the round once every local slot holds one proof's proposals."""
    rnd = rnd.with_proposal(p)
    full = (
        len(rnd.proposals) >= state.local_ranks
        if state.proof is not None
        else rnd.closing_proof(state.local_ranks) is not None
    )
    if not full:
        opens = state.open_round is None
        state = replace(state, ranks=ranks, open_round=rnd)
        return Step(
            state,
            reply=Wait(state.lifetime_index, rnd.number, rnd.deadline),
            effects=(*effects, *((Deadline(state.next_deadline()),) if opens else ())),
        )
    state = replace(state, ranks=ranks)
    if state.disowns_stored_plan(rnd):
        # A first lifetime here without the stored plan's owner (it may have
        # come from another node) begins a new epoch, as a disowned restart does.
        try:
            limits.check_count("epoch", state.epoch + 1, 0, limits.MAX_GENERATION)
        except InvalidArgument as error:
            return refuse_round(state, rnd, p, error.message, now, effects)
        state = replace(state, epoch=state.epoch + 1, plan=None, history=())
    return decide_round(state, rnd, p, now, effects, node, ceiling)


def propose(
    state: GroupState | None,
    p: Proposal,
    now: float,
    round_timeout: float,
    *,
    node: str = "",
    ceiling: limits.WorkspaceCeiling,
    recovered: bool = False,
) -> Step:
    """Applies one proposal to a group.

    ``recovered``: ``state`` was read from its stored row by a restarted
    sidecar and no round has been decided since, so the row may lag rounds
    that closed REUSE unrecorded (a row of a release that recorded none, :mod:`.recovery`): a known lifetime's
    proposal for a later round catches the group up instead of being refused.

    ``node`` names this node in the growth history (``--node-name``);
    ``ceiling`` is the per-rank workspace ceiling in bytes
    (``--max-workspace-bytes``): a proposal, or a decided plan, above it is
    refused.

    ``state`` is None for a group this sidecar has never seen. The step's
    reply is :class:`~moe_sidecar.core.effects.Wait` when the round still misses
    ranks, else the round's outcome (a :class:`~moe_sidecar.core.group.Decision`
    or, when the round was refused for everyone, a
    :class:`~moe_sidecar.core.group.Refusal`); a retry of a closed round gets that
    round's outcome and no effects. A proposal whose group proof does not
    match (:mod:`.proof`) gets a PERMISSION_DENIED refusal of its own, and
    the round goes on without it.

    Raises:
        InvalidArgument: a field is malformed, or the proposal's workspace is
            above ``ceiling`` (state unchanged).
        PreconditionFailed: the proposal contradicts the group alone (wrong
            layout, out-of-sequence round, a retry that changed content);
            state unchanged.
        RoundAborted: the rank belongs to a lifetime the group has left.
    """
    record = state.rank(p.ep_rank) if state is not None else None
    if (
        state is not None
        and record is not None
        and record.lifetime == p.lifetime
        and p.group == state.name
        and p.ep_size == state.ep_size
        and p.local_ranks == state.local_ranks
    ):
        # A lifetime the group knows: only its round and requirement can be new.
        validate_known_proposal(p, ceiling, proof_known=p.proof == state.proof)
    else:
        validate_proposal(p, ceiling)
    if state is None:
        state = GroupState(name=p.group, ep_size=p.ep_size, local_ranks=p.local_ranks)
    if p.ep_size != state.ep_size:
        # A group's EP size is part of its name: another one is refused.
        raise PreconditionFailed(
            f"group {quote_name(p.group)} has ep_size={state.ep_size} but rank {p.ep_rank} "
            f"proposes ep_size={p.ep_size}; the group name must change with the parallel layout"
        )
    if record is None or record.lifetime != p.lifetime:
        admitted = _admit_new_lifetime(state, p, record, now, round_timeout, node, ceiling)
    else:
        admitted = _admit_known(state, p, record, now, recovered)
    if isinstance(admitted, Step):
        return admitted
    try:
        return _join_round(admitted, p, now, round_timeout, node, ceiling)
    except ShapeMismatch as error:  # pragma: no cover - why_cannot_join checks shapes first
        raise PreconditionFailed(f"group {quote_name(p.group)}: {error}") from error
