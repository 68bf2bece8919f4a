"""The decision core: rounds, lifetimes, commits, resets. Pure.

Frozen values in (:mod:`moe_sidecar.core.group`), a :class:`~moe_sidecar.core.effects.Step`
out: the new state, the reply for the caller and the effects to carry out.
No grpc, no asyncio, no torch, no clock: the time is an argument (``now``, in
seconds of whatever clock the caller uses consistently). The sidecar's state
holder and the client's embedded mode both drive groups through these
functions, and plans only move through :mod:`moe_sidecar.core.plan`'s join.

The protocol:

* The n-th ``initialize()`` of a rank in one process lifetime is round n.
  A round closes when every local rank of the group has proposed it, and
  every one of them gets the same outcome.
* The round's need is the join of its proposals' capacities (and of what
  the lifetime has built, whose layers still run); the decided plan is
  :func:`~moe_sidecar.core.plan.grow` of the stored plan by that need, and the
  action :func:`~moe_sidecar.core.plan.decide_action` of what the lifetime built.
  The stored plan outlives process lifetimes, so round 1 of a restart
  starts from the historical union.
* Another ``top_k``/``num_experts`` than the plan, ranks disagreeing in a
  round, or a growth out of range closes the round as refused for everyone.
* A retried proposal for a closed round gets the same outcome back.
* A plan decided on another node arrives as a
  :class:`~moe_sidecar.core.cluster.ClusterPlan` and is merged with the cluster
  plans' join (:func:`merge`); steps that change a group's epoch or plan ask
  their executor to replicate it (:class:`~moe_sidecar.core.effects.Replicate`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from moe_sidecar.core import limits
from moe_sidecar.core.cluster import (
    MAX_HISTORY,
    ClusterPlan,
    LayoutMismatch,
    check_cluster_plan,
    cluster_plan_of,
    covers,
    join_cluster_plans,
    plan_origin,
)
from moe_sidecar.core.effects import (
    Answer,
    Deadline,
    Effect,
    EventKind,
    GroupEvent,
    Persist,
    Publish,
    Replicate,
    Step,
    Wait,
)
from moe_sidecar.core.errors import ErrorCode, InvalidArgument, PreconditionFailed, RoundAborted
from moe_sidecar.core.group import (
    CommitRecord,
    Decision,
    GroupState,
    Growth,
    OpenRound,
    Outcome,
    Proposal,
    RankRecord,
    Refusal,
)
from moe_sidecar.core.identity import short_id
from moe_sidecar.core.plan import (
    Action,
    Capacities,
    ShapeMismatch,
    decide_action,
    grow,
    join,
    join_capacities,
)

__all__ = [
    "MAX_HISTORY",
    "RETAINED_ROUNDS",
    "check_removable",
    "commit",
    "depart",
    "expire",
    "merge",
    "new_group",
    "propose",
    "reset",
    "resume",
    "validate_group_name",
    "validate_proposal",
]

RETAINED_ROUNDS = 8
"""Closed rounds kept per group to answer retries."""


# --- validation -----------------------------------------------------------


def validate_group_name(group: str) -> None:
    """Checks a group name.

    Raises:
        InvalidArgument: empty, over-long or non-printable.
    """
    limits.check_name("group", group, allow_empty=False)


def validate_proposal(p: Proposal) -> None:
    """Checks every field of a proposal before it touches any state.

    Raises:
        InvalidArgument: naming the first bad field and its value.
    """
    validate_group_name(p.group)
    limits.check_count("ep_size", p.ep_size, 1, limits.MAX_EP_SIZE, "FlashInfer's rank limit")
    limits.check_count("ep_rank", p.ep_rank, 0, p.ep_size - 1, f"ep_size is {p.ep_size}")
    limits.check_count("local_ranks", p.local_ranks, 1, p.ep_size, f"ep_size is {p.ep_size}")
    limits.check_name("lifetime", p.lifetime, allow_empty=False)
    limits.check_count("round", p.round, 1, limits.MAX_ROUND, "rounds count from 1")
    limits.check_capacities("requirement.capacities", p.requirement.capacities, p.ep_size)
    limits.check_name("requirement.layer", p.requirement.layer, allow_empty=True)


# --- wording --------------------------------------------------------------


def _layer_text(layer: str) -> str:
    return repr(layer) if layer else "(unnamed layer)"


def _who(p: Proposal) -> str:
    return f"rank {p.ep_rank} layer {_layer_text(p.requirement.layer)}"


def _shape_text(c: Capacities) -> str:
    return f"top_k={c.top_k}, num_experts={c.num_experts}"


def _shape_origin(state: GroupState) -> str:
    """Who fixed the group's shape, from the growth history of its epoch."""
    first = next((g for g in state.history if g.plan.epoch == state.epoch), None)
    if first is None:
        return "the group's plan"
    return f"rank {first.ep_rank} layer {_layer_text(first.layer)}"


# --- the round machine ----------------------------------------------------


def new_group(name: str, ep_size: int, local_ranks: int) -> GroupState:
    """An empty group: no plan, no lifetime yet."""
    return GroupState(name=name, ep_size=ep_size, local_ranks=local_ranks)


@dataclass(frozen=True)
class _Admitted:
    """A proposal allowed into its round, with what admitting it did."""

    state: GroupState
    record: RankRecord
    effects: tuple[Effect, ...]


def _with_rank(state: GroupState, record: RankRecord) -> GroupState:
    others = tuple(r for r in state.ranks if r.ep_rank != record.ep_rank)
    return replace(state, ranks=tuple(sorted((*others, record), key=lambda r: r.ep_rank)))


def _close(state: GroupState, outcome: Outcome) -> GroupState:
    return replace(
        state,
        open_round=None,
        last_closed_round=outcome.round,
        closed=(*state.closed, outcome)[-RETAINED_ROUNDS:],
    )


def _latency(rnd: OpenRound, now: float) -> float:
    return max(0.0, now - rnd.opened_at)


def _round_closed(
    state: GroupState,
    lifetime_index: int,
    rnd: OpenRound,
    outcome: Outcome,
    event: GroupEvent,
    *,
    effects: tuple[Effect, ...] = (),
    replicate: bool = False,
) -> Step:
    """The step that closes ``rnd`` (of lifetime ``lifetime_index``) with
    ``outcome``: persisted before anyone hears of it (and handed to the
    cluster store when the plan grew, ``replicate``), every waiter answered,
    the event published, the group's timer set to its next deadline."""
    return Step(
        state,
        reply=outcome,
        effects=(
            *effects,
            Persist(),
            *((Replicate(),) if replicate else ()),
            Answer(lifetime_index, rnd.number, outcome),
            Publish(event),
            Deadline(state.next_deadline()),
        ),
    )


def _check_layout(state: GroupState, p: Proposal) -> None:
    if p.ep_size != state.ep_size:
        raise PreconditionFailed(
            f"group {p.group!r} has ep_size={state.ep_size} but rank {p.ep_rank} proposes "
            f"ep_size={p.ep_size}; the group name must change with the parallel layout"
        )


def _check_local_ranks(state: GroupState, p: Proposal) -> None:
    if p.local_ranks != state.local_ranks:
        raise PreconditionFailed(
            f"group {p.group!r} has local_ranks={state.local_ranks} on this node but rank "
            f"{p.ep_rank} proposes local_ranks={p.local_ranks}"
        )


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


def _lifetime_started(state: GroupState, p: Proposal, now: float) -> Publish:
    return Publish(
        GroupEvent(
            state.name,
            EventKind.LIFETIME_STARTED,
            now,
            round=1,
            plan=state.plan,
            ep_rank=p.ep_rank,
            message=f"lifetime {state.lifetime_index} started by rank {p.ep_rank} "
            f"({short_id(p.lifetime)})",
        )
    )


def _first_lifetime(state: GroupState, p: Proposal, now: float) -> _Admitted:
    """The group's first lifetime begins with its first proposal."""
    state = replace(state, lifetime_index=1, local_ranks=p.local_ranks)
    record = RankRecord(ep_rank=p.ep_rank, lifetime=p.lifetime, lifetime_index=1)
    return _Admitted(state, record, (Persist(), _lifetime_started(state, p, now)))


def _admit_new_lifetime(
    state: GroupState,
    p: Proposal,
    record: RankRecord | None,
    now: float,
    round_timeout: float,
    node: str,
) -> _Admitted | Step:
    """A proposal from a lifetime the group has not seen for this rank.

    It joins the running lifetime while that is still at round 1 and the
    rank's place in it is free; otherwise it belongs to a restart
    (:func:`_join_restart`), which replaces the running lifetime only once
    every local rank has joined it.
    """
    if p.round != 1:
        raise PreconditionFailed(
            f"rank {p.ep_rank} of group {p.group!r} proposes round {p.round} from lifetime "
            f"{short_id(p.lifetime)}, which this sidecar does not know: a lifetime starts at "
            "round 1 (did the group restart without this rank, or was the sidecar's state "
            "dir lost?); restart this rank"
        )
    if state.lifetime_index == 0:
        return _first_lifetime(state, p, now)
    if p.local_ranks != state.local_ranks:
        raise PreconditionFailed(
            f"group {p.group!r} runs with local_ranks={state.local_ranks} on this node; a new "
            f"lifetime of rank {p.ep_rank} with local_ranks={p.local_ranks} is refused (it may "
            "not end the group's lifetime); use a group name for the new layout, or remove "
            "the group (an admin call) first"
        )
    taken = record is not None and record.lifetime_index == state.lifetime_index
    if taken or not _accepts_newcomers(state):
        return _join_restart(state, p, now, round_timeout, node)
    if state.last_closed_round == 1:
        # Round 1 of this lifetime was refused before this rank arrived: it
        # is part of the same start and shares the refusal.
        outcome = state.outcome_of(1)
        assert outcome is not None
        return Step(state, reply=outcome)
    joined = RankRecord(ep_rank=p.ep_rank, lifetime=p.lifetime, lifetime_index=state.lifetime_index)
    return _Admitted(state, joined, ())


def _join_restart(
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
    conflict = _conflict(state, pending, p)
    if conflict is not None:
        return _refuse_restart(state, pending, p, conflict, now)
    capacities = p.requirement.capacities
    pending = replace(
        pending,
        proposals=tuple(sorted((*pending.proposals, p), key=lambda q: q.ep_rank)),
        need=capacities if pending.need is None else join_capacities(pending.need, capacities),
    )
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
            Publish(
                GroupEvent(
                    state.name,
                    EventKind.ROUND_ABORTED,
                    now,
                    round=rnd.number,
                    message=message,
                    ranks=tuple(q.ep_rank for q in rnd.proposals),
                    latency=_latency(rnd, now),
                )
            ),
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
        state = _with_rank(
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
    effects.append(_lifetime_started(state, p, now))
    return _decide(state, pending, p, now, tuple(effects), node)


def _refuse_restart(
    state: GroupState, pending: OpenRound, p: Proposal, message: str, now: float
) -> Step:
    """Refuses a restart's round 1 for every rank in it; the running lifetime goes on."""
    refusal = Refusal(round=1, code=ErrorCode.FAILED_PRECONDITION, message=message)
    state = replace(state, pending=None)
    event = GroupEvent(
        state.name,
        EventKind.ROUND_REFUSED,
        now,
        round=1,
        ep_rank=p.ep_rank,
        layer=p.requirement.layer,
        message=message,
        ranks=tuple(sorted({q.ep_rank for q in pending.proposals} | {p.ep_rank})),
        latency=_latency(pending, now),
    )
    return _round_closed(state, state.lifetime_index + 1, pending, refusal, event)


def _admit_known(state: GroupState, p: Proposal, record: RankRecord) -> _Admitted | Step:
    """A proposal from the lifetime the group already knows for this rank."""
    if record.lifetime_index != state.lifetime_index:
        raise RoundAborted(
            f"rank {p.ep_rank} of group {p.group!r} belongs to lifetime {short_id(p.lifetime)}, "
            "which ended when other ranks of the group restarted; restart this rank"
        )
    _check_local_ranks(state, p)
    if p.round <= state.last_closed_round:
        outcome = state.outcome_of(p.round)
        if outcome is None:
            raise PreconditionFailed(
                f"rank {p.ep_rank} of group {p.group!r} retries round {p.round}, which "
                f"closed long ago (latest closed round: {state.last_closed_round})"
            )
        if isinstance(outcome, Decision) and not outcome.plan.covers(p.requirement.capacities):
            # A retry proposes what it proposed, which its round's decision covers.
            raise PreconditionFailed(
                f"rank {p.ep_rank} of group {p.group!r} re-proposed round {p.round} with "
                f"{p.requirement} after the round was decided with {outcome.plan}, which does "
                "not serve it; a retry must propose what the rank proposed"
            )
        return Step(state, reply=outcome)
    if p.round > state.last_closed_round + 1:
        raise PreconditionFailed(
            f"rank {p.ep_rank} of group {p.group!r} proposes round {p.round} but the "
            f"group's next round is {state.last_closed_round + 1}"
        )
    return _Admitted(state, record, ())


def _conflict(state: GroupState, rnd: OpenRound, p: Proposal) -> str | None:
    """Why ``p`` cannot join ``rnd``, or None."""
    need = p.requirement.capacities
    for q in rnd.proposals:
        other = q.requirement.capacities
        if other.shape != need.shape:
            return (
                f"ranks disagree in round {p.round} of group {p.group!r}: {_who(q)} has "
                f"{_shape_text(other)} but {_who(p)} has {_shape_text(need)}"
            )
        if (
            q.requirement.layer
            and p.requirement.layer
            and q.requirement.layer != p.requirement.layer
        ):
            return (
                f"ranks disagree in round {p.round} of group {p.group!r}: rank {q.ep_rank} is at "
                f"layer {q.requirement.layer!r} but rank {p.ep_rank} is at layer "
                f"{p.requirement.layer!r}; every rank must run the same layers in the same order"
            )
    base = state.plan or state.built
    if base is not None and base.capacities.shape != need.shape:
        stored = state.built is None
        return (
            f"heterogeneous MoE layers in group {p.group!r}: {_who(p)} has "
            f"{_shape_text(need)} but the plan{' (stored from an earlier lifetime)' if stored else ''} "
            f"has {_shape_text(base.capacities)}, fixed by {_shape_origin(state)}; FlashInfer's "
            "all-to-all needs one top_k and num_experts for every layer"
            + ("; ResetGroup forgets the stored plan" if stored else "")
        )
    return None


def _refuse(
    state: GroupState,
    rnd: OpenRound,
    p: Proposal,
    message: str,
    now: float,
    effects: tuple[Effect, ...],
    *,
    code: ErrorCode = ErrorCode.FAILED_PRECONDITION,
) -> Step:
    """Closes ``rnd`` with a refusal (FAILED_PRECONDITION, or ``code``) for
    every rank in it."""
    refusal = Refusal(round=rnd.number, code=code, message=message)
    state = _close(state, refusal)
    kind = EventKind.ROUND_ABORTED if code is ErrorCode.ABORTED else EventKind.ROUND_REFUSED
    event = GroupEvent(
        state.name,
        kind,
        now,
        round=rnd.number,
        ep_rank=p.ep_rank,
        layer=p.requirement.layer,
        message=message,
        ranks=tuple(sorted({q.ep_rank for q in rnd.proposals} | {p.ep_rank})),
        latency=_latency(rnd, now),
    )
    return _round_closed(state, state.lifetime_index, rnd, refusal, event, effects=effects)


def _gone_text(record: RankRecord) -> str:
    layer = repr(record.last_layer) if record.last_layer else "(unnamed)"
    return (
        f"rank {record.ep_rank} (last reported round {record.last_round}, layer {layer}) is "
        f"gone: {record.left}"
    )


def _decide(
    state: GroupState,
    rnd: OpenRound,
    p: Proposal,
    now: float,
    effects: tuple[Effect, ...],
    node: str,
) -> Step:
    """Closes a round every local rank proposed with one decision for all."""
    assert rnd.need is not None
    # The lifetime's earlier layers still run on what it built: the plan
    # must keep serving them, whatever a reset or another node did since.
    need = rnd.need if state.built is None else join_capacities(rnd.need, state.built.capacities)
    plan = grow(state.plan, need, epoch=state.epoch, last_generation=state.generation)
    grew = plan is not state.plan
    # The growth is told as caused by the first rank whose layer the old plan missed.
    cause = next(
        (
            q
            for q in rnd.proposals
            if not (state.plan and state.plan.covers(q.requirement.capacities))
        ),
        rnd.proposals[0],
    )
    if grew:
        try:
            limits.check_plan("plan", plan, state.ep_size)
        except InvalidArgument as error:
            return _refuse(
                state,
                rnd,
                p,
                f"round {rnd.number} of group {state.name!r}: {_who(cause)} would grow the plan "
                f"out of range ({error.message}); nothing was stored",
                now,
                effects,
            )
    action = decide_action(state.built, plan)
    layer = rnd.proposals[0].requirement.layer
    decision = Decision(round=rnd.number, action=action, plan=plan, grew=grew, layer=layer)
    state = replace(
        _close(state, decision),
        plan=plan,
        generation=plan.generation if grew else state.generation,
        # REUSE keeps what the ranks hold, which may exceed the plan after a reset.
        built=state.built if action is Action.REUSE else plan,
        history=(
            (
                *state.history,
                Growth(plan, cause.requirement.layer, cause.ep_rank, rnd.number, now, node),
            )[-MAX_HISTORY:]
            if grew
            else state.history
        ),
    )
    event = GroupEvent(
        state.name,
        EventKind.ROUND_DECIDED,
        now,
        round=rnd.number,
        action=action,
        plan=plan,
        layer=layer,
        ranks=tuple(q.ep_rank for q in rnd.proposals),
        grew=grew,
        latency=_latency(rnd, now),
    )
    return _round_closed(
        state, state.lifetime_index, rnd, decision, event, effects=effects, replicate=grew
    )


def _join_round(
    admitted: _Admitted, p: Proposal, now: float, round_timeout: float, node: str
) -> Step:
    """Adds an admitted proposal to its round; closes the round when it is complete."""
    state, effects = admitted.state, admitted.effects
    rnd = state.open_round or OpenRound(number=p.round, opened_at=now, deadline=now + round_timeout)
    earlier = rnd.proposal_of(p.ep_rank)
    if earlier is not None:
        if earlier.requirement != p.requirement:
            raise PreconditionFailed(
                f"rank {p.ep_rank} of group {p.group!r} re-proposed round {p.round} with "
                f"{p.requirement} after proposing {earlier.requirement}"
            )
        return Step(state, reply=Wait(state.lifetime_index, rnd.number, rnd.deadline))

    record = replace(
        admitted.record, last_round=p.round, last_layer=p.requirement.layer, last_seen=now, left=""
    )
    state = _with_rank(state, record)
    gone = [r for r in state.current_ranks() if r.left]
    if gone:
        message = (
            f"round {p.round} of group {p.group!r} cannot close: "
            + "; ".join(_gone_text(r) for r in gone)
            + "; restart every rank"
        )
        return _refuse(state, rnd, p, message, now, effects, code=ErrorCode.ABORTED)
    conflict = _conflict(state, rnd, p)
    if conflict is not None:
        return _refuse(state, rnd, p, conflict, now, effects)

    capacities = p.requirement.capacities
    rnd = replace(
        rnd,
        proposals=tuple(sorted((*rnd.proposals, p), key=lambda q: q.ep_rank)),
        need=capacities if rnd.need is None else join_capacities(rnd.need, capacities),
    )
    if len(rnd.proposals) < state.local_ranks:
        opens = state.open_round is None
        state = replace(state, open_round=rnd)
        return Step(
            state,
            reply=Wait(state.lifetime_index, rnd.number, rnd.deadline),
            effects=(*effects, *((Deadline(state.next_deadline()),) if opens else ())),
        )
    return _decide(state, rnd, p, now, effects, node)


def propose(
    state: GroupState | None, p: Proposal, now: float, round_timeout: float, *, node: str = ""
) -> Step:
    """Applies one proposal to a group.

    ``node`` names this node in the growth history (``--node-name``).

    ``state`` is None for a group this sidecar has never seen. The step's
    reply is :class:`~moe_sidecar.core.effects.Wait` when the round still misses
    ranks, else the round's outcome (a :class:`~moe_sidecar.core.group.Decision`
    or, when the round was refused for everyone, a
    :class:`~moe_sidecar.core.group.Refusal`); a retry of a closed round gets that
    round's outcome and no effects.

    Raises:
        InvalidArgument: a field is malformed (state unchanged).
        PreconditionFailed: the proposal contradicts the group alone (wrong
            layout, out-of-sequence round, a retry that changed content);
            state unchanged.
        RoundAborted: the rank belongs to a lifetime the group has left.
    """
    validate_proposal(p)
    if state is None:
        state = new_group(p.group, p.ep_size, p.local_ranks)
    _check_layout(state, p)
    record = state.rank(p.ep_rank)
    if record is None or record.lifetime != p.lifetime:
        admitted = _admit_new_lifetime(state, p, record, now, round_timeout, node)
    else:
        admitted = _admit_known(state, p, record)
    if isinstance(admitted, Step):
        return admitted
    try:
        return _join_round(admitted, p, now, round_timeout, node)
    except ShapeMismatch as error:  # pragma: no cover - _conflict checks shapes first
        raise PreconditionFailed(f"group {p.group!r}: {error}") from error


def _missing_text(missing: list[RankRecord]) -> list[str]:
    return [
        f"rank {r.ep_rank} (last reported round {r.last_round}, layer "
        + (repr(r.last_layer) if r.last_layer else "(unnamed)")
        + ")"
        for r in missing
    ]


def _expire_open(state: GroupState, rnd: OpenRound, now: float) -> Step:
    present = {p.ep_rank for p in rnd.proposals}
    missing = [r for r in state.current_ranks() if r.ep_rank not in present]
    unseen = state.local_ranks - len(present) - len(missing)
    parts = _missing_text(missing)
    if unseen > 0:
        parts.append(f"{unseen} rank(s) never seen in this lifetime")
    layer = rnd.proposals[0].requirement.layer if rnd.proposals else ""
    message = (
        f"round {rnd.number} of group {state.name!r} (layer {layer!r}) timed out after "
        f"{rnd.deadline - rnd.opened_at:.1f}s: {state.local_ranks - len(present)} of "
        f"{state.local_ranks} local ranks missing: {'; '.join(parts)}; "
        f"ranks present: {sorted(present)}"
    )
    refusal = Refusal(
        round=rnd.number,
        code=ErrorCode.DEADLINE_EXCEEDED,
        message=message,
        missing_ranks=tuple(r.ep_rank for r in missing),
    )
    event = GroupEvent(
        state.name,
        EventKind.RANK_TIMEOUT,
        now,
        round=rnd.number,
        layer=layer,
        message=message,
        missing_ranks=refusal.missing_ranks,
        ranks=tuple(sorted(present)),
        latency=_latency(rnd, now),
    )
    return _round_closed(_close(state, refusal), state.lifetime_index, rnd, refusal, event)


def _expire_restart(state: GroupState, pending: OpenRound, now: float) -> Step:
    present = sorted(p.ep_rank for p in pending.proposals)
    running = [r for r in state.current_ranks() if r.ep_rank not in present]
    message = (
        f"the restart of group {state.name!r} timed out after "
        f"{pending.deadline - pending.opened_at:.1f}s: {len(present)} of {state.local_ranks} "
        f"local ranks began a new lifetime (ranks {present}); a new lifetime begins only "
        "when every local rank of the group restarts, and the running lifetime's "
        + ("; ".join(_missing_text(running)) or "ranks")
        + " did not"
    )
    refusal = Refusal(
        round=1,
        code=ErrorCode.DEADLINE_EXCEEDED,
        message=message,
        missing_ranks=tuple(r.ep_rank for r in running),
    )
    state = replace(state, pending=None)
    event = GroupEvent(
        state.name,
        EventKind.RANK_TIMEOUT,
        now,
        round=1,
        message=message,
        missing_ranks=refusal.missing_ranks,
        ranks=tuple(present),
        latency=_latency(pending, now),
    )
    return _round_closed(state, state.lifetime_index + 1, pending, refusal, event)


def expire(state: GroupState, now: float) -> Step | None:
    """Fails the open round, or the pending restart, whose deadline has
    passed (the earlier one first); None when nothing is due.

    A refusal names every missing rank and the last layer each reported.
    """
    rnd, pending = state.open_round, state.pending
    open_due = rnd is not None and rnd.deadline <= now
    pending_due = pending is not None and pending.deadline <= now
    if (
        open_due
        and rnd is not None
        and not (pending_due and pending and pending.deadline < rnd.deadline)
    ):
        return _expire_open(state, rnd, now)
    if pending_due and pending is not None:
        return _expire_restart(state, pending, now)
    return None


def _validate_commit(state: GroupState, c: CommitRecord) -> None:
    limits.check_count("ep_rank", c.ep_rank, 0, state.ep_size - 1, f"ep_size is {state.ep_size}")
    limits.check_name("lifetime", c.lifetime, allow_empty=False)
    limits.check_count("round", c.round, 1, limits.MAX_ROUND, "rounds count from 1")
    limits.check_plan("plan", c.plan, state.ep_size)
    limits.check_seconds("build_seconds", c.build_seconds)


def _committed_decision(state: GroupState, c: CommitRecord) -> Decision:
    """The decision a commit refers to.

    Raises:
        PreconditionFailed: the rank, lifetime or round has none.
    """
    record = state.rank(c.ep_rank)
    if record is None or record.lifetime != c.lifetime:
        raise PreconditionFailed(
            f"rank {c.ep_rank} of group {state.name!r} commits from lifetime "
            f"{short_id(c.lifetime)}, which never proposed to this sidecar"
        )
    if record.lifetime_index != state.lifetime_index:
        raise PreconditionFailed(
            f"rank {c.ep_rank} of group {state.name!r} commits from lifetime "
            f"{short_id(c.lifetime)}, which ended when the group restarted"
        )
    outcome = state.outcome_of(c.round)
    if not isinstance(outcome, Decision):
        why = "was refused" if isinstance(outcome, Refusal) else "has no retained decision"
        raise PreconditionFailed(
            f"rank {c.ep_rank} of group {state.name!r} commits round {c.round}, which {why} "
            f"(latest closed round: {state.last_closed_round})"
        )
    return outcome


def _absorb(state: GroupState, c: CommitRecord, now: float, node: str) -> GroupState:
    """Joins a plan agreed across nodes into the stored plan and what the lifetime built.

    An agreed plan of a later epoch (another node had heard of a reset) starts
    that epoch here too; one of an earlier epoch (this node has been reset
    since the round) changes only what the lifetime built.
    """
    built = c.plan if state.built is None else join(state.built, c.plan)
    epoch, plan, history = state.epoch, state.plan, state.history
    if c.plan.epoch > state.epoch:
        epoch, plan, history = c.plan.epoch, c.plan, ()
    elif c.plan.epoch == state.epoch:
        plan = c.plan if state.plan is None else join(state.plan, c.plan)
    if plan == state.plan and built == state.built:
        return state
    if plan != state.plan:
        assert plan is not None
        growth = Growth(plan, "(agreed across nodes)", c.ep_rank, c.round, now, node)
        history = (*history, growth)[-MAX_HISTORY:]
    return replace(
        state,
        epoch=epoch,
        plan=plan,
        built=built,
        generation=max(
            state.generation, built.generation, plan.generation if plan is not None else 0
        ),
        history=history,
    )


def commit(state: GroupState, c: CommitRecord, now: float, *, node: str = "") -> Step:
    """Records the plan a rank holds after building and passing the barrier.

    The plan must be the one decided for that round. A group that spans
    more ranks than this node sees (``ep_size > local_ranks``) agrees across
    nodes with the join, so there the plan may be above the decided one in
    the lattice (same epoch and shape with at least every size, or a later
    epoch another node decided in), and it is joined into the stored plan,
    so a warm restart of this node starts from what the whole group held.

    Raises:
        InvalidArgument: a malformed field (state unchanged).
        PreconditionFailed: the rank, lifetime or round has no decision, or
            the plan does not match it (state unchanged).
    """
    _validate_commit(state, c)
    decided = _committed_decision(state, c).plan
    spans_nodes = state.ep_size > state.local_ranks
    matches = (
        c.plan.epoch > decided.epoch
        or (c.plan.epoch == decided.epoch and c.plan.covers(decided.capacities))
        if spans_nodes
        else c.plan == decided
    )
    if not matches:
        raise PreconditionFailed(
            f"rank {c.ep_rank} of group {state.name!r} commits {c.plan} for round {c.round}, "
            f"but the round decided {decided}"
            + ("; a commit may only cover the decision" if spans_nodes else "")
        )
    record = state.rank(c.ep_rank)
    assert record is not None
    before = state
    state = _with_rank(
        state,
        replace(
            record,
            committed_generation=c.plan.generation,
            build_seconds=c.build_seconds,
            last_seen=now,
        ),
    )
    if spans_nodes:
        state = _absorb(state, c, now, node)
    moved = state.plan != before.plan or state.epoch != before.epoch
    return Step(
        state,
        effects=(
            Persist(),
            *((Replicate(),) if moved else ()),
            Publish(
                GroupEvent(
                    state.name,
                    EventKind.COMMIT,
                    now,
                    round=c.round,
                    plan=c.plan,
                    ep_rank=c.ep_rank,
                    message=f"rank {c.ep_rank} holds generation {c.plan.generation} "
                    f"(built in {c.build_seconds:.3f}s)",
                )
            ),
        ),
    )


def depart(state: GroupState, ep_rank: int, lifetime: str, why: str, now: float) -> Step | None:
    """A rank's session ended: the rank (of lifetime ``lifetime``) is gone.

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
        rest = tuple(q for q in pending.proposals if q.ep_rank != ep_rank)
        need = None
        for q in rest:
            capacities = q.requirement.capacities
            need = capacities if need is None else join_capacities(need, capacities)
        state = replace(
            state, pending=replace(pending, proposals=rest, need=need) if rest else None
        )
        return Step(state, effects=(Deadline(state.next_deadline()),))
    record = state.rank(ep_rank)
    if (
        record is None
        or record.lifetime != lifetime
        or record.lifetime_index != state.lifetime_index
        or record.left
    ):
        return None
    record = replace(record, left=why, last_seen=now)
    state = _with_rank(state, record)
    left = Publish(
        GroupEvent(
            state.name,
            EventKind.RANK_LEFT,
            now,
            round=record.last_round,
            ep_rank=ep_rank,
            layer=record.last_layer,
            message=_gone_text(record),
        )
    )
    rnd = state.open_round
    if rnd is None:
        return Step(state, effects=(Persist(), left))
    message = f"round {rnd.number} of group {state.name!r} abandoned: {_gone_text(record)}"
    refusal = Refusal(round=rnd.number, code=ErrorCode.ABORTED, message=message)
    closed = _close(state, refusal)
    event = GroupEvent(
        state.name,
        EventKind.ROUND_ABORTED,
        now,
        round=rnd.number,
        ep_rank=ep_rank,
        layer=record.last_layer,
        message=message,
        ranks=tuple(q.ep_rank for q in rnd.proposals),
        latency=_latency(rnd, now),
    )
    return _round_closed(closed, closed.lifetime_index, rnd, refusal, event, effects=(left,))


def resume(state: GroupState, now: float, round_timeout: float) -> GroupState:
    """The group as a restarted sidecar takes it up: the time the sidecar was
    down does not count against the ranks, so an open round and an open
    restart get a full ``round_timeout`` from ``now``."""
    if state.open_round is not None:
        state = replace(state, open_round=replace(state.open_round, deadline=now + round_timeout))
    if state.pending is not None:
        state = replace(state, pending=replace(state.pending, deadline=now + round_timeout))
    return state


def check_removable(state: GroupState) -> None:
    """Whether an admin may remove the group now.

    Raises:
        PreconditionFailed: a round or a restart of the group is collecting
            proposals (its ranks are waiting for an answer).
    """
    if state.busy():
        waiting = len(state.open_round.proposals) if state.open_round else 0
        restarting = len(state.pending.proposals) if state.pending else 0
        raise PreconditionFailed(
            f"group {state.name!r} is in use: {waiting} rank(s) wait in an open round and "
            f"{restarting} in a restart; remove it once its ranks are gone"
        )


def reset(state: GroupState, now: float) -> Step:
    """Forgets the stored plan and its history: a new epoch begins.

    The generation counter is kept, so generations are never reused. A
    lifetime that is running keeps growing from what it has built.

    Raises:
        InvalidArgument: the epoch would leave its range.
    """
    limits.check_count("epoch", state.epoch + 1, 0, limits.MAX_GENERATION)
    state = replace(state, epoch=state.epoch + 1, plan=None, history=())
    return Step(
        state,
        effects=(
            Persist(),
            Replicate(),
            Publish(
                GroupEvent(
                    state.name,
                    EventKind.RESET,
                    now,
                    message=f"stored plan forgotten: epoch {state.epoch} begins (generation "
                    f"stays {state.generation})",
                )
            ),
        ),
    )


def merge(state: GroupState | None, remote: ClusterPlan, now: float, *, node: str = "") -> Step:
    """Merges a group's plan decided elsewhere (another node, the cluster store).

    ``state`` is None for a group this node has never seen. The group's
    epoch, plan, generation counter and history become the join of its own
    and ``remote`` (:func:`~moe_sidecar.core.cluster.join_cluster_plans`): a later
    epoch replaces the plan (a reset reaches this node), in one epoch the
    plans join, nothing ever shrinks. Rounds, lifetimes and what a lifetime
    built are this node's own and do not change: an open round decides from
    the merged plan when it closes.

    The step persists and publishes a PLAN_MERGED event when the group
    changed, and asks to replicate when the group holds something ``remote``
    lacks (so a store that sent an older document gets the join back). A
    merge that changes nothing has no effects.

    ``node`` names this node on a growth the join makes.

    Raises:
        InvalidArgument: a field of ``remote`` is out of range (it is
            untrusted input).
        PreconditionFailed: ``remote`` has another ``ep_size``, a plan of
            another ``top_k``/``num_experts`` in the same epoch, or one whose
            join with the group's would leave the ranges.
    """
    check_cluster_plan(remote)
    if state is None:
        state = new_group(remote.name, remote.ep_size, remote.ep_size)
    local = cluster_plan_of(state)
    try:
        joined = join_cluster_plans(local, remote, node=node, now=now)
    except LayoutMismatch as error:
        raise PreconditionFailed(f"cannot merge group {remote.name!r}: {error}") from None
    except ShapeMismatch as error:
        raise PreconditionFailed(
            f"cannot merge group {remote.name!r}: the plan from another node has {error}; "
            "FlashInfer's all-to-all needs one top_k and num_experts for every layer"
        ) from None
    try:
        # Two plans in range can join out of range (one node's tokens, another's bytes).
        check_cluster_plan(joined)
    except InvalidArgument as error:
        raise PreconditionFailed(
            f"cannot merge group {remote.name!r}: the join with the plan from another node "
            f"would be out of range ({error.message}); nothing was merged"
        ) from None
    merged = replace(
        state,
        epoch=joined.epoch,
        plan=joined.plan,
        generation=max(state.generation, joined.generation),
        history=joined.history,
    )
    effects: list[Effect] = []
    if cluster_plan_of(merged) != local:
        origin = plan_origin(joined.history, joined.plan)
        what = (
            f"epoch {joined.epoch} begins (reset on another node)"
            if joined.epoch > state.epoch
            else "plan merged"
        )
        effects += [
            Persist(),
            Publish(
                GroupEvent(
                    state.name,
                    EventKind.PLAN_MERGED,
                    now,
                    plan=joined.plan,
                    message=f"{what}: epoch {joined.epoch}, "
                    + (
                        f"generation {joined.plan.generation}"
                        if joined.plan is not None
                        else "no plan"
                    )
                    + (f", from node {origin.node!r}" if origin and origin.node else ""),
                    node=origin.node if origin is not None else "",
                )
            ),
        ]
    if not covers(remote, joined):
        effects.append(Replicate())
    return Step(merged, effects=tuple(effects))
