"""What every round shares: closing it with a decision or a refusal. Pure.

A round's need is the join of its proposals' capacities (and of what the
lifetime has built, whose layers still run); the decided plan is
:func:`~moe_sidecar.core.plan.grow` of the stored plan by that need, and the
action :func:`~moe_sidecar.core.plan.decide_action` of what the lifetime built.
Another ``top_k``/``num_experts`` than the plan, ranks disagreeing in a round,
or a growth out of range (or above the per-rank workspace ceiling) closes the
round as refused for everyone. Which proposals a round takes is
:mod:`.proof`'s rule; a proposal refused by it leaves the round untouched.

The shape rule: a round of a running lifetime is decided only when its
proposals, the plan and what the lifetime built have one shape. The plan
and what was built part only when a plan of another shape merges in from
another node after a reset while the lifetime runs on: then no round of that
lifetime can be decided, and each is refused (FAILED_PRECONDITION) as soon
as one of its proposals arrives, and so for every rank in it at once,
naming both shapes, the ranks and the layer, until the ranks restart. A
restart's round 1 builds anew, so only the plan it inherits (if any) must
have its shape, never what the ending lifetime built.
"""

from __future__ import annotations

from dataclasses import replace

from moe_sidecar.core import limits
from moe_sidecar.core.cluster import MAX_HISTORY
from moe_sidecar.core.effects import (
    Answer,
    Deadline,
    Dismiss,
    Effect,
    EventKind,
    GroupEvent,
    Persist,
    Publish,
    RecordReuse,
    Replicate,
    Step,
)
from moe_sidecar.core.errors import ErrorCode, InvalidArgument, quote_name
from moe_sidecar.core.group import (
    RETAINED_ROUNDS,
    Decision,
    GroupState,
    Growth,
    OpenRound,
    Outcome,
    Proposal,
    Refusal,
)
from moe_sidecar.core.plan import Action, Plan, ShapeMismatch, decide_action
from moe_sidecar.core.policy.events import (
    group_event,
    layer_text,
    shape_origin,
    shape_text,
    who,
)
from moe_sidecar.core.policy.proof import proof_text

__all__ = [
    "decide_round",
    "displace",
    "refuse_proof",
    "refuse_round",
    "round_closed",
    "why_cannot_join",
]


def round_closed(
    state: GroupState,
    lifetime_index: int,
    rnd: OpenRound,
    outcome: Outcome,
    event: GroupEvent,
    *,
    effects: tuple[Effect, ...] = (),
    replicate: bool = False,
    persist: bool = True,
) -> Step:
    """The step that closes ``rnd`` (of lifetime ``lifetime_index``) with
    ``outcome``: persisted before anyone hears of it (a decision that is not
    ``persist``ed, a REUSE that changed nothing else, by its short record
    alone, :class:`~moe_sidecar.core.effects.RecordReuse`; and handed to the
    cluster store when the plan grew, ``replicate``), every waiter answered,
    the event published, the group's timer set to its next deadline."""
    durable: Effect = Persist()
    if not persist and isinstance(outcome, Decision):
        durable = RecordReuse(lifetime_index, rnd.number, outcome.layer)
    return Step(
        state,
        reply=outcome,
        effects=(
            *effects,
            durable,
            *((Replicate(),) if replicate else ()),
            Answer(lifetime_index, rnd.number, outcome),
            Publish(event),
            Deadline(state.next_deadline()),
        ),
    )


def why_cannot_join(
    state: GroupState,
    rnd: OpenRound,
    p: Proposal,
    *,
    inherits: bool = True,
    restart: bool = False,
) -> str | None:
    """Why ``p`` cannot join ``rnd``, or None.

    ``p`` is compared with the proposals of its own proof (another proof's
    layers are not its ranks'); when the round's plan starts from the
    group's (``inherits``), with that plan's shape; and unless ``rnd`` is a
    restart's round 1 (``restart``: the new lifetime builds anew), with the
    shape of what the running lifetime built. A plan and a built workspace
    of different shapes refuse every proposal (the module's shape rule).
    """
    need = p.requirement.capacities
    release = _release_conflict(state, rnd, p, restart=restart)
    if release is not None:
        return release
    for q in rnd.proposals:
        if q.proof != p.proof:
            continue
        other = q.requirement.capacities
        if other.shape != need.shape:
            return (
                f"ranks disagree in round {p.round} of group {quote_name(p.group)}: {who(q)} has "
                f"{shape_text(other)} but {who(p)} has {shape_text(need)}"
            )
        if (
            q.requirement.layer
            and p.requirement.layer
            and q.requirement.layer != p.requirement.layer
        ):
            return (
                f"ranks disagree in round {p.round} of group {quote_name(p.group)}: rank "
                f"{q.ep_rank} is at layer {quote_name(q.requirement.layer)} but rank {p.ep_rank} "
                f"is at layer {quote_name(p.requirement.layer)}; every rank must run the same "
                "layers in the same order"
            )
    plan = state.plan if inherits else None
    built = None if restart else state.built
    if plan is not None and built is not None and plan.capacities.shape != built.capacities.shape:
        return _split_shapes_text(state, rnd, p, plan, built)
    base = plan or built
    if base is not None and base.capacities.shape != need.shape:
        stored = built is None
        return (
            f"heterogeneous MoE layers in group {quote_name(p.group)}: {who(p)} has "
            f"{shape_text(need)} but the plan{' (stored from an earlier lifetime)' if stored else ''} "
            f"has {shape_text(base.capacities)}, fixed by {shape_origin(state)}; FlashInfer's "
            "all-to-all needs one top_k and num_experts for every layer"
            + ("; ResetGroup forgets the stored plan" if stored else "")
        )
    return None


def _release_conflict(
    state: GroupState, rnd: OpenRound, p: Proposal, *, restart: bool
) -> str | None:
    """Why ``p``'s FlashInfer release keeps it out of ``rnd``, or None: the
    round's ranks (of ``p``'s proof) state another release, or (unless a
    restart's round 1, which may bring an upgrade) the running lifetime was
    decided with another. One workspace has one release's layout."""
    others = [q for q in rnd.proposals if q.proof == p.proof and q.release != p.release]
    if others:
        ranks = ", ".join(str(q.ep_rank) for q in others)
        return (
            f"ranks disagree in round {p.round} of group {quote_name(p.group)}: rank(s) {ranks} "
            f"build with FlashInfer {others[0].release!r} but rank {p.ep_rank} builds with "
            f"FlashInfer {p.release!r}; every rank of a group must run one FlashInfer release"
        )
    if restart or state.built is None or not state.release or state.release == p.release:
        # Not fixed yet (no decided round in this lifetime, or a row stored
        # before releases were recorded): the next decided round fixes it.
        return None
    ranks = ", ".join(
        str(r.ep_rank) for r in state.current_ranks() if r.ep_rank != p.ep_rank and not r.left
    )
    held = f"ranks {ranks} of" if ranks else "the running lifetime of"
    return (
        f"round {p.round} of group {quote_name(p.group)}: rank {p.ep_rank} builds with "
        f"FlashInfer {p.release!r} but {held} the group build with FlashInfer "
        f"{state.release!r}; every rank of a group must run one FlashInfer release "
        "(restart every rank to change it)"
    )


def _split_shapes_text(
    state: GroupState, rnd: OpenRound, p: Proposal, plan: Plan, built: Plan
) -> str:
    """Why a round of a lifetime whose ``built`` workspace has another shape
    than the group's ``plan`` cannot be decided, naming both shapes, the
    round's ranks and layer, and who fixed the plan's shape."""
    ranks = sorted({q.ep_rank for q in rnd.proposals if q.proof == p.proof} | {p.ep_rank})
    proposers = (
        f"rank {ranks[0]} proposes"
        if len(ranks) == 1
        else f"ranks {', '.join(map(str, ranks))} propose"
    )
    first = next((g for g in state.history if g.plan.epoch == state.epoch), None)
    node = f" on node {first.node!r}" if first is not None and first.node else ""
    return (
        f"round {p.round} of group {quote_name(p.group)} cannot be decided: {proposers} layer "
        f"{layer_text(p.requirement.layer)} with {shape_text(p.requirement.capacities)}; the "
        f"group's plan (epoch {plan.epoch}, merged from another node after a reset) has "
        f"{shape_text(plan.capacities)}, fixed by {shape_origin(state)}{node}, but this "
        f"lifetime's ranks still run on what they built (generation {built.generation}), which "
        f"has {shape_text(built.capacities)}; FlashInfer's all-to-all needs one top_k and "
        "num_experts for every layer: restart every rank of the group to build from the plan"
    )


def refuse_round(
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
    state = state.closed_by(refusal)
    kind = EventKind.ROUND_ABORTED if code is ErrorCode.ABORTED else EventKind.ROUND_REFUSED
    event = group_event(
        state,
        kind,
        now,
        closes=rnd,
        ep_rank=p.ep_rank,
        layer=p.requirement.layer,
        message=message,
        ranks=tuple(sorted({q.ep_rank for q in rnd.proposals} | {p.ep_rank})),
    )
    return round_closed(state, state.lifetime_index, rnd, refusal, event, effects=effects)


def refuse_proof(
    state: GroupState, ep_rank: int, round_number: int, message: str, now: float
) -> Step:
    """The step that refuses one proposal or commit whose proof does not match
    (PERMISSION_DENIED): nothing of the group's rounds changes; the refusal
    is counted in the group and published. It persists nothing of its own:
    the count rides along with the group's next write."""
    state = replace(state, refused_proposals=state.refused_proposals + 1)
    refusal = Refusal(round=round_number, code=ErrorCode.PERMISSION_DENIED, message=message)
    event = group_event(
        state, EventKind.PROOF_REFUSED, now, round=round_number, ep_rank=ep_rank, message=message
    )
    return Step(state, reply=refusal, effects=(Publish(event),))


def displace(
    state: GroupState,
    rnd: OpenRound,
    lifetime_index: int,
    holder: Proposal,
    taker: Proposal,
    now: float,
) -> tuple[GroupState, OpenRound, tuple[Effect, ...]]:
    """``rnd`` without ``holder``, whose slot ``taker`` (of a proof holding
    more slots) takes: the holder's call is answered PERMISSION_DENIED, the
    refusal counted and published.

    Returns the group counted, the round without the holder, and the effects."""
    message = (
        f"group {quote_name(state.name)} rank {holder.ep_rank}: the group proof does not match "
        f"({proof_text(holder.proof)}): the rank's slot in round {rnd.number} was taken back by "
        f"a proposal with proof {proof_text(taker.proof)}, which the rest of the round's ranks "
        "hold; a process that is not one of the group's ranks cannot propose for it"
    )
    refusal = Refusal(round=rnd.number, code=ErrorCode.PERMISSION_DENIED, message=message)
    state = replace(state, refused_proposals=state.refused_proposals + 1)
    event = group_event(
        state,
        EventKind.PROOF_REFUSED,
        now,
        round=rnd.number,
        ep_rank=holder.ep_rank,
        message=message,
    )
    effects: tuple[Effect, ...] = (
        Dismiss(lifetime_index, rnd.number, holder.lifetime, refusal),
        Publish(event),
    )
    return state, rnd.without(holder.ep_rank), effects


def _decided_state(
    state: GroupState, rnd: OpenRound, decision: Decision, cause: Proposal, now: float, node: str
) -> GroupState:
    """``state`` once ``rnd`` is decided: the plan, the counter, what the ranks
    build, and the growth (told as caused by ``cause``) in the history."""
    plan = decision.plan
    history = state.history
    if decision.grew:
        growth = Growth(plan, cause.requirement.layer, cause.ep_rank, rnd.number, now, node)
        history = (*history, growth)[-MAX_HISTORY:]
    # One copy of the group: the open round closed (as GroupState.closed_by
    # does) together with the decision's fields.
    return replace(
        state,
        open_round=None,
        last_closed_round=decision.round,
        closed=(*state.closed, decision)[-RETAINED_ROUNDS:],
        # The lifetime's first decided round fixes its proof (one for every slot).
        proof=rnd.proposals[0].proof if state.proof is None else state.proof,
        # So does its owner, which a restart must carry to inherit the plan (.owner).
        owner=rnd.owner() if state.proof is None else state.owner,
        # Every proposal of a lifetime states one release (why_cannot_join).
        release=rnd.proposals[0].release,
        plan=plan,
        generation=plan.generation if decision.grew else state.generation,
        # REUSE keeps what the ranks hold, which may exceed the plan after a reset.
        built=state.built if decision.action is Action.REUSE else plan,
        history=history,
    )


def decide_round(
    state: GroupState,
    rnd: OpenRound,
    p: Proposal,
    now: float,
    effects: tuple[Effect, ...],
    node: str,
    ceiling: limits.WorkspaceCeiling,
) -> Step:
    """Closes a round every local rank proposed (with one proof) with one
    outcome for all: a decision, or a refusal for every rank in it.

    A decided plan above ``ceiling`` workspace bytes per rank is never
    answered, wherever it came from (this round's growth, a stored row, a
    merge, a lowered ceiling): the round is refused, naming the ceiling.
    A round whose need, plan and built workspace have no one shape (the
    module's shape rule; :func:`why_cannot_join` refuses its proposals
    first) is refused, naming the shapes.
    """
    try:
        plan = state.decided_plan(rnd)
    except ShapeMismatch as error:
        # Refused here rather than raised: the round's waiting ranks must
        # hear the same answer as its last proposer, not its timeout.
        message = why_cannot_join(state, rnd, p) or (
            f"round {rnd.number} of group {quote_name(state.name)} cannot be decided: {error}; "
            "FlashInfer's all-to-all needs one top_k and num_experts for every layer"
        )
        return refuse_round(state, rnd, p, message, now, effects)
    grew = plan is not state.plan
    # A growth is told as caused by the first proposal whose layer the old plan missed.
    old = state.plan
    cause = next(
        (q for q in rnd.proposals if not (old and old.covers(q.requirement.capacities))),
        rnd.proposals[0],
    )
    try:
        if grew:
            limits.check_plan("plan", plan, state.ep_size)
        limits.check_workspace_ceiling("plan", plan.capacities, state.ep_size, ceiling, p.release)
    except InvalidArgument as error:
        what = "would grow the plan" if grew else "needs the stored plan, which is"
        message = (
            f"round {rnd.number} of group {quote_name(state.name)}: {who(cause)} {what} out of "
            f"range ({error.message}); nothing was stored"
            + ("" if grew else "; ResetGroup forgets the stored plan")
        )
        return refuse_round(state, rnd, p, message, now, effects)
    action = decide_action(state.built, plan)
    layer = rnd.proposals[0].requirement.layer
    decision = Decision(round=rnd.number, action=action, plan=plan, grew=grew, layer=layer)
    # A REUSE that grew nothing in a lifetime whose proof was already fixed
    # changes only the retained outcomes and the ranks' last round, layer and
    # time: its short record is written instead of the group
    # (:func:`~.recovery.replay_reuse` re-derives the outcome from it).
    persist = action is not Action.REUSE or grew or state.proof is None
    state = _decided_state(state, rnd, decision, cause, now, node)
    event = group_event(
        state,
        EventKind.ROUND_DECIDED,
        now,
        closes=rnd,
        action=action,
        plan=plan,
        layer=layer,
        grew=grew,
    )
    return round_closed(
        state,
        state.lifetime_index,
        rnd,
        decision,
        event,
        effects=effects,
        replicate=grew,
        persist=persist,
    )
