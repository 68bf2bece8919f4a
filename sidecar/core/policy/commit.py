"""A commit: the plan a rank holds after building and passing the barrier. Pure."""

from __future__ import annotations

from dataclasses import replace

from moe_sidecar.core import limits
from moe_sidecar.core.cluster import MAX_HISTORY
from moe_sidecar.core.effects import EventKind, Persist, Publish, Replicate, Step
from moe_sidecar.core.errors import PreconditionFailed, quote_name
from moe_sidecar.core.group import CommitRecord, Decision, GroupState, Growth, Refusal
from moe_sidecar.core.identity import short_id
from moe_sidecar.core.plan import EpochPlan, ShapeMismatch, join, join_epoch_plans
from moe_sidecar.core.policy.events import group_event
from moe_sidecar.core.policy.proof import mismatch_text, proof_text
from moe_sidecar.core.policy.rounds import refuse_proof
from moe_sidecar.core.policy.validation import validate_commit

__all__ = ["commit"]


def _committed_decision(state: GroupState, c: CommitRecord) -> Decision:
    """The decision a commit refers to.

    Raises:
        PreconditionFailed: the rank, lifetime or round has none.
    """
    record = state.rank(c.ep_rank)
    if record is None or record.lifetime != c.lifetime:
        raise PreconditionFailed(
            f"rank {c.ep_rank} of group {quote_name(state.name)} commits from lifetime "
            f"{short_id(c.lifetime)}, which never proposed to this sidecar"
        )
    if record.lifetime_index != state.lifetime_index:
        raise PreconditionFailed(
            f"rank {c.ep_rank} of group {quote_name(state.name)} commits from lifetime "
            f"{short_id(c.lifetime)}, which ended when the group restarted"
        )
    outcome = state.outcome_of(c.round)
    if not isinstance(outcome, Decision):
        why = "was refused" if isinstance(outcome, Refusal) else "has no retained decision"
        raise PreconditionFailed(
            f"rank {c.ep_rank} of group {quote_name(state.name)} commits round {c.round}, which "
            f"{why} (latest closed round: {state.last_closed_round})"
        )
    return outcome


def _check_matches_decision(state: GroupState, c: CommitRecord, *, spans_nodes: bool) -> None:
    """Checks the committed plan against its round's decision: equal to it on
    one node, at least it in the lattice across nodes.

    Raises:
        PreconditionFailed: no decision to commit, or a plan that does not match it.
    """
    decided = _committed_decision(state, c).plan
    matches = (
        c.plan.epoch > decided.epoch
        or (c.plan.epoch == decided.epoch and c.plan.covers(decided.capacities))
        if spans_nodes
        else c.plan == decided
    )
    if not matches:
        raise PreconditionFailed(
            f"rank {c.ep_rank} of group {quote_name(state.name)} commits {c.plan} for round "
            f"{c.round}, but the round decided {decided}"
            + ("; a commit may only cover the decision" if spans_nodes else "")
        )


def _absorb(state: GroupState, c: CommitRecord, now: float, node: str) -> GroupState:
    """Joins a plan agreed across nodes into the stored plan and what the lifetime built.

    An agreed plan of a later epoch (another node had heard of a reset) starts
    that epoch here too; one of an earlier epoch (this node has been reset
    since the round) changes only what the lifetime built.

    Raises:
        PreconditionFailed: the agreed plan has another shape than the
            group's plan of its epoch (or what the lifetime built).
    """
    try:
        built = c.plan if state.built is None else join(state.built, c.plan)
        held = join_epoch_plans(state.held, EpochPlan.of(c.plan))
    except ShapeMismatch as error:
        # Another node's plan of this epoch has another shape: the agreed
        # plan cannot join it, and nothing of the commit is recorded.
        raise PreconditionFailed(
            f"rank {c.ep_rank} of group {quote_name(state.name)} commits {c.plan} for round "
            f"{c.round}, which cannot join the group's plan ({error}); FlashInfer's "
            "all-to-all needs one top_k and num_experts for every layer"
        ) from None
    plan = held.plan
    if plan == state.plan and built == state.built:
        return state
    history = state.history if held.epoch == state.epoch else ()
    if plan != state.plan:
        assert plan is not None
        growth = Growth(plan, "(agreed across nodes)", c.ep_rank, c.round, now, node)
        history = (*history, growth)[-MAX_HISTORY:]
    return replace(
        state,
        epoch=held.epoch,
        plan=plan,
        built=built,
        generation=max(held.generation, built.generation),
        history=history,
    )


def commit(
    state: GroupState,
    c: CommitRecord,
    now: float,
    *,
    node: str = "",
    ceiling: limits.WorkspaceCeiling,
) -> Step:
    """Records the plan a rank holds after building and passing the barrier.

    The plan must be the one decided for that round. A group that spans
    more ranks than this node sees (``ep_size > local_ranks``) agrees across
    nodes with the join, so there the plan may be above the decided one in
    the lattice (same epoch and shape with at least every size, or a later
    epoch another node decided in), and it is joined into the stored plan,
    so a warm restart of this node starts from what the whole group held.

    A commit whose group proof is not the lifetime's gets a PERMISSION_DENIED
    refusal as the step's reply (counted and published; nothing else changes).

    Raises:
        InvalidArgument: a malformed field, or a plan above the per-rank
            workspace ``ceiling`` (state unchanged).
        PreconditionFailed: the rank, lifetime or round has no decision, the
            plan does not match it, or (across nodes) it cannot join the
            group's plan of its epoch, of another shape (state unchanged).
    """
    validate_commit(state, c, ceiling)
    _committed_decision(state, c)
    if c.proof != state.proof:
        why = (
            f"the group's lifetime {state.lifetime_index} runs with proof "
            f"{proof_text(state.proof or '')}"
        )
        return refuse_proof(
            state, c.ep_rank, c.round, mismatch_text(state.name, c.ep_rank, c.proof, why), now
        )
    spans_nodes = state.ep_size > state.local_ranks
    _check_matches_decision(state, c, spans_nodes=spans_nodes)
    record = state.rank(c.ep_rank)
    assert record is not None
    before = state
    state = state.with_rank(
        replace(
            record,
            committed_generation=c.plan.generation,
            build_seconds=c.build_seconds,
            last_seen=now,
        ),
    )
    if spans_nodes:
        state = _absorb(state, c, now, node)
    return _recorded(before, state, c, now)


def _recorded(before: GroupState, state: GroupState, c: CommitRecord, now: float) -> Step:
    """The step of a commit recorded (``before`` became ``state``): persisted,
    replicated when the stored plan or epoch moved, published."""
    moved = state.plan != before.plan or state.epoch != before.epoch
    event = group_event(
        state,
        EventKind.COMMIT,
        now,
        round=c.round,
        plan=c.plan,
        ep_rank=c.ep_rank,
        message=f"rank {c.ep_rank} holds generation {c.plan.generation} "
        f"(built in {c.build_seconds:.3f}s)",
    )
    return Step(state, effects=(Persist(), *((Replicate(),) if moved else ()), Publish(event)))
