"""Table-driven tests of the pure decision core: no I/O, no clock."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace

import pytest

from moe_sidecar.core import limits, policy
from moe_sidecar.core.cluster import ClusterPlan
from moe_sidecar.core.effects import Answer, Deadline, EventKind, Persist, Publish, Step, Wait
from moe_sidecar.core.errors import (
    ErrorCode,
    InvalidArgument,
    PreconditionFailed,
    RoundAborted,
)
from moe_sidecar.core.group import (
    CommitRecord,
    Decision,
    GroupState,
    Outcome,
    Proposal,
    Refusal,
    Requirement,
)
from moe_sidecar.core.plan import Action, Capacities, Plan
from moe_sidecar.flashinfer.v0_7_2_post1 import capacities_workspace_bytes
from tests.ceiling import CEILING

pytestmark = pytest.mark.timeout(10)

GROUP = "deepseek-v3:fp4/tp1-ep2/pp0"
TIMEOUT = 30.0


def caps(tokens: int = 256, dispatch: int = 100, combine: int = 200, top_k: int = 2) -> Capacities:
    return Capacities(
        max_tokens=tokens,
        dispatch_bytes_per_token=dispatch,
        combine_bytes_per_token=combine,
        top_k=top_k,
        num_experts=16,
    )


NVFP4 = Requirement(caps(), "l0")
BF16 = Requirement(caps(dispatch=400), "mtp")
MORE_TOKENS = Requirement(caps(tokens=512), "l1")


OWNER = hashlib.sha256(b"the group's owner key and name").hexdigest()
"""The owner id every rank of the group's real lifetimes carries: restarts inherit the plan."""


def prop(
    rank: int,
    rnd: int,
    req: Requirement,
    *,
    lifetime: str | None = None,
    ep_size: int = 2,
    local_ranks: int = 2,
    group: str = GROUP,
) -> Proposal:
    return Proposal(
        group=group,
        ep_size=ep_size,
        ep_rank=rank,
        local_ranks=local_ranks,
        lifetime=lifetime if lifetime is not None else f"life-{rank}",
        round=rnd,
        requirement=req,
        owner=OWNER,
    )


def run_round(
    state: GroupState | None,
    rnd: int,
    reqs: list[Requirement],
    *,
    now: float = 0.0,
    lifetime: str | None = None,
) -> tuple[GroupState, Outcome, Step]:
    """Every local rank proposes ``rnd``; returns the state, the outcome and the closing step."""
    step: Step | None = None
    for rank, req in enumerate(reqs):
        step = policy.propose(
            state, prop(rank, rnd, req, lifetime=lifetime), now, TIMEOUT, ceiling=CEILING
        )
        state = step.state
        if isinstance(step.reply, (Decision, Refusal)):
            return state, step.reply, step
        assert isinstance(step.reply, Wait), step
    raise AssertionError(f"round {rnd} did not close: {step}")


def run_sequence(
    layers: list[Requirement], state: GroupState | None = None, *, lifetime: str | None = None
) -> tuple[GroupState, list[Outcome]]:
    outcomes = []
    for n, req in enumerate(layers, start=1):
        state, outcome, _ = run_round(state, n, [req, req], lifetime=lifetime)
        outcomes.append(outcome)
    assert state is not None
    return state, outcomes


def events(step: Step) -> list[EventKind]:
    return [e.event.kind for e in step.effects if isinstance(e, Publish)]


# --- the union rule, one row per sequence --------------------------------------


@dataclass(frozen=True)
class Row:
    name: str
    layers: list[Requirement]
    actions: list[Action]
    capacities: list[Capacities]
    generations: list[int]
    stored: GroupState | None = field(default=None)


ROWS = [
    Row("first round builds", [NVFP4], [Action.BUILD], [caps()], [1]),
    Row(
        "covered layer reuses",
        [NVFP4, NVFP4],
        [Action.BUILD, Action.REUSE],
        [caps(), caps()],
        [1, 1],
    ),
    Row(
        "bigger dispatch rebuilds",
        [NVFP4, BF16],
        [Action.BUILD, Action.REBUILD],
        [caps(), caps(dispatch=400)],
        [1, 2],
    ),
    Row(
        "more tokens rebuild",
        [NVFP4, MORE_TOKENS],
        [Action.BUILD, Action.REBUILD],
        [caps(), caps(tokens=512)],
        [1, 2],
    ),
    Row(
        "never shrinks (the regression sequence)",
        [NVFP4, BF16, NVFP4],
        [Action.BUILD, Action.REBUILD, Action.REUSE],
        [caps(), caps(dispatch=400), caps(dispatch=400)],
        [1, 2, 2],
    ),
    Row(
        "the union of sizes from different layers",
        [BF16, MORE_TOKENS],
        [Action.BUILD, Action.REBUILD],
        [caps(dispatch=400), caps(tokens=512, dispatch=400)],
        [1, 2],
    ),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_union_rule(row: Row) -> None:
    _, outcomes = run_sequence(row.layers, row.stored)
    decisions = [o for o in outcomes if isinstance(o, Decision)]
    assert len(decisions) == len(outcomes)
    assert [d.action for d in decisions] == row.actions
    assert [d.plan.capacities for d in decisions] == row.capacities
    assert [d.plan.generation for d in decisions] == row.generations


def test_ranks_with_different_needs_take_the_join() -> None:
    small = Requirement(caps(dispatch=50, combine=300), "l0")
    _, outcome, _ = run_round(None, 1, [small, NVFP4])
    assert isinstance(outcome, Decision)
    assert outcome.plan.capacities == caps(dispatch=100, combine=300)


def test_growth_history_names_the_layer() -> None:
    state, _ = run_sequence([NVFP4, BF16, NVFP4, MORE_TOKENS])
    assert [(g.plan.generation, g.layer, g.round) for g in state.history] == [
        (1, "l0", 1),
        (2, "mtp", 2),
        (3, "l1", 4),
    ]
    assert state.history[-1].plan.capacities == caps(tokens=512, dispatch=400)


def test_a_plan_of_mixed_token_counts_serves_every_layer() -> None:
    # An NVFP4 layer at 20 tokens, then a bf16 layer at 16: the union of
    # capacities serves both at the plan's token count, so the workspace is
    # bigger than either layer's own (FlashInfer's auxiliary data grows with
    # the token count a workspace is built for).
    nvfp4 = Requirement(caps(tokens=20, dispatch=160, combine=512), "l0")
    bf16 = Requirement(caps(tokens=16, dispatch=528, combine=512), "mtp")
    _, outcomes = run_sequence([nvfp4, bf16])
    decision = outcomes[1]
    assert isinstance(decision, Decision) and decision.action is Action.REBUILD
    assert decision.plan.capacities == caps(tokens=20, dispatch=528, combine=512)
    built = capacities_workspace_bytes(decision.plan.capacities, 2)
    assert built > max(
        capacities_workspace_bytes(nvfp4.capacities, 2),
        capacities_workspace_bytes(bf16.capacities, 2),
    )


# --- effects ------------------------------------------------------------------------


def test_a_joining_proposal_opens_a_deadline_and_persists_nothing() -> None:
    first = policy.propose(None, prop(0, 1, NVFP4), 5.0, TIMEOUT, ceiling=CEILING)
    assert first.reply == Wait(lifetime_index=1, round=1, deadline=5.0 + TIMEOUT)
    assert Deadline(5.0 + TIMEOUT) in first.effects
    assert events(first) == [EventKind.LIFETIME_STARTED]


def test_the_closing_proposal_persists_answers_publishes_and_disarms() -> None:
    state = policy.propose(None, prop(0, 1, NVFP4), 5.0, TIMEOUT, ceiling=CEILING).state
    closing = policy.propose(state, prop(1, 1, NVFP4), 6.0, TIMEOUT, ceiling=CEILING)
    decision = closing.reply
    assert isinstance(decision, Decision)
    assert isinstance(closing.effects[0], Persist) and closing.persists
    assert Answer(1, 1, decision) in closing.effects
    (published,) = [e.event for e in closing.effects if isinstance(e, Publish)]
    assert published.kind is EventKind.ROUND_DECIDED and published.ranks == (0, 1)
    assert published.latency == 1.0 and published.grew
    assert closing.effects[-1] == Deadline(None)


def test_a_one_rank_round_leaves_no_timer() -> None:
    step = policy.propose(None, prop(0, 1, NVFP4, local_ranks=1), 0.0, TIMEOUT, ceiling=CEILING)
    assert isinstance(step.reply, Decision)
    assert [e for e in step.effects if isinstance(e, Deadline)] == [Deadline(None)]


# --- refusals -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changed", "expected"),
    [
        (Requirement(replace(caps(), top_k=4), "mtp"), "top_k=4"),
        (Requirement(replace(caps(), num_experts=32), "mtp"), "num_experts=32"),
    ],
    ids=["top_k", "num_experts"],
)
def test_heterogeneous_layer_refused_naming_both_layers(
    changed: Requirement, expected: str
) -> None:
    state, _ = run_sequence([NVFP4])
    step = policy.propose(state, prop(0, 2, changed), 1.0, TIMEOUT, ceiling=CEILING)
    refusal = step.reply
    assert isinstance(refusal, Refusal)
    assert refusal.code is ErrorCode.FAILED_PRECONDITION
    assert "'mtp'" in refusal.message and "'l0'" in refusal.message
    assert "rank 0" in refusal.message
    assert expected in refusal.message
    assert isinstance(refusal.error(), PreconditionFailed)
    assert events(step) == [EventKind.ROUND_REFUSED]
    # The plan is untouched, and the other rank gets the same refusal.
    assert step.state.plan is not None and step.state.plan.generation == 1
    late = policy.propose(step.state, prop(1, 2, changed), 2.0, TIMEOUT, ceiling=CEILING)
    assert late.reply == refusal and late.effects == ()


@pytest.mark.parametrize(
    ("other", "needle"),
    [
        (Requirement(replace(caps(), top_k=4), "l0"), "top_k=4"),
        (Requirement(replace(caps(), num_experts=8), "l0"), "num_experts=8"),
        (Requirement(caps(), "l7"), "'l7'"),
    ],
    ids=["top_k", "num_experts", "layer"],
)
def test_ranks_disagreeing_inside_a_round(other: Requirement, needle: str) -> None:
    first = policy.propose(None, prop(0, 1, NVFP4), 0.0, TIMEOUT, ceiling=CEILING)
    assert isinstance(first.reply, Wait)
    second = policy.propose(first.state, prop(1, 1, other), 0.5, TIMEOUT, ceiling=CEILING)
    refusal = second.reply
    assert isinstance(refusal, Refusal)
    assert "ranks disagree" in refusal.message
    assert "rank 0" in refusal.message and "rank 1" in refusal.message and needle in refusal.message
    # Rank 0, waiting on round 1, is answered by the step; its retry sees the same refusal.
    assert Answer(1, 1, refusal) in second.effects
    retry = policy.propose(second.state, prop(0, 1, NVFP4), 1.0, TIMEOUT, ceiling=CEILING)
    assert retry.reply == refusal


def test_a_growth_out_of_range_is_refused_and_never_stored() -> None:
    # Each layer is valid alone (and under the workspace ceiling); their
    # union derives more than 1 TiB per rank.
    wide = Requirement(caps(tokens=64, dispatch=limits.MAX_BYTES_PER_TOKEN), "wide")
    long = Requirement(caps(tokens=limits.MAX_TOKENS // 32, dispatch=100), "long")
    state, _ = run_sequence([wide])
    before = state.plan
    state, refusal, _ = run_round(state, 2, [long, long])
    assert isinstance(refusal, Refusal) and refusal.code is ErrorCode.FAILED_PRECONDITION
    assert "layer 'long'" in refusal.message and "out of range" in refusal.message
    assert state.plan == before and state.generation == 1


def test_retried_proposal_for_closed_round_is_answered_identically() -> None:
    state, outcomes = run_sequence([NVFP4, BF16])
    for rank in (0, 1):
        for rnd, req in ((1, NVFP4), (2, BF16)):
            step = policy.propose(state, prop(rank, rnd, req), 99.0, TIMEOUT, ceiling=CEILING)
            assert step.reply == outcomes[rnd - 1]
            assert step.state is state and step.effects == ()


def test_retry_while_round_open_keeps_waiting() -> None:
    first = policy.propose(None, prop(0, 1, NVFP4), 0.0, TIMEOUT, ceiling=CEILING)
    again = policy.propose(first.state, prop(0, 1, NVFP4), 1.0, TIMEOUT, ceiling=CEILING)
    assert isinstance(first.reply, Wait) and again.reply == first.reply
    assert again.effects == ()
    with pytest.raises(PreconditionFailed, match="re-proposed round 1"):
        policy.propose(again.state, prop(0, 1, BF16), 1.0, TIMEOUT, ceiling=CEILING)


def test_a_retry_of_a_closed_round_needing_more_than_its_decision_is_refused() -> None:
    # Found by bench/fuzz_sidecar.py: it was answered with the round's decision,
    # a plan that does not serve what the "retry" proposed.
    state, _ = run_sequence([NVFP4])
    with pytest.raises(PreconditionFailed, match=r"re-proposed round 1 .* does not serve it"):
        policy.propose(state, prop(0, 1, BF16), 1.0, TIMEOUT, ceiling=CEILING)


def test_round_past_deadline_names_missing_ranks_and_their_last_layer() -> None:
    state, _ = run_sequence([NVFP4])
    waiting = policy.propose(state, prop(0, 2, BF16), 10.0, TIMEOUT, ceiling=CEILING)
    assert isinstance(waiting.reply, Wait) and waiting.reply.deadline == 10.0 + TIMEOUT
    assert policy.expire(waiting.state, 10.0 + TIMEOUT - 0.001) is None
    expired = policy.expire(waiting.state, 10.0 + TIMEOUT)
    assert expired is not None
    refusal = expired.reply
    assert isinstance(refusal, Refusal)
    assert refusal.code is ErrorCode.DEADLINE_EXCEEDED
    assert refusal.missing_ranks == (1,)
    assert "rank 1 (last reported round 1, layer 'l0')" in refusal.message
    assert "ranks present: [0]" in refusal.message
    assert events(expired) == [EventKind.RANK_TIMEOUT] and expired.persists
    assert expired.state.open_round is None and expired.state.last_closed_round == 2
    # The late rank gets the same timeout.
    late = policy.propose(expired.state, prop(1, 2, BF16), 50.0, TIMEOUT, ceiling=CEILING)
    assert late.reply == refusal


def test_timeout_counts_ranks_never_seen() -> None:
    state = policy.propose(
        None, prop(0, 1, NVFP4, ep_size=4, local_ranks=3), 0.0, TIMEOUT, ceiling=CEILING
    ).state
    expired = policy.expire(state, TIMEOUT)
    assert expired is not None and isinstance(expired.reply, Refusal)
    assert "2 of 3 local ranks missing" in expired.reply.message
    assert "2 rank(s) never seen" in expired.reply.message


# --- lifetimes ------------------------------------------------------------------


def test_new_lifetime_starts_from_the_stored_plan() -> None:
    state, _ = run_sequence([NVFP4, BF16, NVFP4])
    # Both ranks restart: new lifetime ids, round 1 again, first layer small.
    state = policy.propose(
        state, prop(0, 1, NVFP4, lifetime="b0"), 100.0, TIMEOUT, ceiling=CEILING
    ).state
    decision = policy.propose(
        state, prop(1, 1, NVFP4, lifetime="b1"), 100.0, TIMEOUT, ceiling=CEILING
    ).reply
    assert isinstance(decision, Decision)
    assert decision.action is Action.BUILD
    assert decision.plan.capacities == caps(dispatch=400)  # the historical union
    assert decision.plan.generation == 2 and not decision.grew


def test_second_lifetime_builds_once() -> None:
    state, _ = run_sequence([NVFP4, BF16, NVFP4])
    actions = []
    for n, req in enumerate([NVFP4, BF16, NVFP4], start=1):
        for rank in (0, 1):
            step = policy.propose(
                state,
                prop(rank, n, req, lifetime=f"second-{rank}"),
                200.0,
                TIMEOUT,
                ceiling=CEILING,
            )
            state = step.state
        assert isinstance(step.reply, Decision)
        actions.append(step.reply.action)
    assert actions == [Action.BUILD, Action.REUSE, Action.REUSE]
    assert state.lifetime_index == 2


def _restart(state: GroupState, req: Requirement = NVFP4, now: float = 5.0) -> Step:
    """Both ranks begin new lifetimes; returns the step of the second."""
    state = policy.propose(
        state, prop(0, 1, req, lifetime="new-0"), now, TIMEOUT, ceiling=CEILING
    ).state
    return policy.propose(state, prop(1, 1, req, lifetime="new-1"), now, TIMEOUT, ceiling=CEILING)


def test_rank_of_an_ended_lifetime_is_aborted() -> None:
    state, _ = run_sequence([NVFP4])
    state = _restart(state).state
    restarted = state.rank(1)
    assert restarted is not None and restarted.ended_lifetime == "life-1"
    for rnd in (1, 2):
        with pytest.raises(RoundAborted, match="belongs to lifetime life-1, which ended"):
            policy.propose(state, prop(1, rnd, NVFP4), 5.0, TIMEOUT, ceiling=CEILING)


def test_one_restarted_rank_waits_for_the_rest_and_ends_nothing() -> None:
    state, _ = run_sequence([NVFP4])
    state = policy.propose(state, prop(0, 2, BF16), 5.0, TIMEOUT, ceiling=CEILING).state
    step = policy.propose(state, prop(1, 1, NVFP4, lifetime="new-1"), 6.0, TIMEOUT, ceiling=CEILING)
    assert step.reply == Wait(lifetime_index=2, round=1, deadline=6.0 + TIMEOUT)
    assert not step.persists and events(step) == []
    assert step.state.lifetime_index == 1 and step.state.open_round is not None
    assert step.state.pending is not None and step.state.open_round.deadline == 5.0 + TIMEOUT
    # The running lifetime goes on: its rank 1 closes round 2.
    closing = policy.propose(step.state, prop(1, 2, BF16), 7.0, TIMEOUT, ceiling=CEILING)
    assert isinstance(closing.reply, Decision) and closing.reply.action is Action.REBUILD
    # The timer now follows the restart's deadline.
    assert closing.effects[-1] == Deadline(6.0 + TIMEOUT)


def test_a_whole_restart_aborts_the_open_round_and_starts_from_the_stored_plan() -> None:
    state, _ = run_sequence([NVFP4, BF16])
    state = policy.propose(state, prop(0, 3, NVFP4), 5.0, TIMEOUT, ceiling=CEILING).state
    step = _restart(state, now=6.0)
    decision = step.reply
    assert isinstance(decision, Decision) and decision.action is Action.BUILD
    assert decision.plan.capacities == caps(dispatch=400) and not decision.grew
    (aborted, answered) = [e for e in step.effects if isinstance(e, Answer)]
    assert (aborted.lifetime_index, aborted.round) == (1, 3)
    assert isinstance(aborted.outcome, Refusal) and aborted.outcome.code is ErrorCode.ABORTED
    assert "the group restarted" in aborted.outcome.message
    assert (answered.lifetime_index, answered.round, answered.outcome) == (2, 1, decision)
    assert events(step) == [
        EventKind.ROUND_ABORTED,
        EventKind.LIFETIME_STARTED,
        EventKind.ROUND_DECIDED,
    ]
    assert step.state.lifetime_index == 2 and step.state.pending is None
    assert [(r.lifetime, r.lifetime_index) for r in step.state.ranks] == [
        ("new-0", 2),
        ("new-1", 2),
    ]


def test_a_single_stranger_cannot_end_the_running_lifetime() -> None:
    state, _ = run_sequence([NVFP4])
    plan = state.plan
    stranger = prop(0, 1, Requirement(caps(dispatch=1 << 20), ""), lifetime="stranger")
    waiting = policy.propose(state, stranger, 10.0, TIMEOUT, ceiling=CEILING)
    assert isinstance(waiting.reply, Wait) and waiting.state.lifetime_index == 1
    # The real ranks go on undisturbed.
    state, outcome, _ = run_round(waiting.state, 2, [NVFP4, NVFP4], now=11.0)
    assert isinstance(outcome, Decision) and outcome.action is Action.REUSE
    # The stranger's restart times out; nothing it proposed was stored.
    expired = policy.expire(state, 10.0 + TIMEOUT)
    assert expired is not None and isinstance(expired.reply, Refusal)
    assert expired.reply.code is ErrorCode.DEADLINE_EXCEEDED
    assert "1 of 2 local ranks began a new lifetime (ranks [0])" in expired.reply.message
    assert "rank 1 (last reported round 2" in expired.reply.message
    answered = next(e for e in expired.effects if isinstance(e, Answer))
    assert (answered.lifetime_index, answered.round) == (2, 1)
    assert expired.state.plan == plan and expired.state.pending is None
    assert expired.state.lifetime_index == 1


def test_a_new_lifetime_of_another_layout_is_refused() -> None:
    state, _ = run_sequence([NVFP4])
    with pytest.raises(PreconditionFailed, match="local_ranks=1 is refused"):
        policy.propose(
            state, prop(0, 1, NVFP4, lifetime="x", local_ranks=1), 5.0, TIMEOUT, ceiling=CEILING
        )


def test_two_lifetimes_cannot_claim_one_rank_of_a_restart() -> None:
    state, _ = run_sequence([NVFP4])
    state = policy.propose(
        state, prop(0, 1, NVFP4, lifetime="first"), 5.0, TIMEOUT, ceiling=CEILING
    ).state
    with pytest.raises(PreconditionFailed, match="two processes claim one rank"):
        policy.propose(state, prop(0, 1, NVFP4, lifetime="second"), 5.0, TIMEOUT, ceiling=CEILING)


def test_a_restart_with_another_model_is_refused_and_the_lifetime_runs_on() -> None:
    state, _ = run_sequence([NVFP4])
    other_model = Requirement(replace(caps(), top_k=4), "l0")
    first = policy.propose(
        state, prop(0, 1, other_model, lifetime="b0"), 9.0, TIMEOUT, ceiling=CEILING
    )
    assert isinstance(first.reply, Refusal)
    assert "top_k=4" in first.reply.message and first.state.pending is None
    answered = next(e for e in first.effects if isinstance(e, Answer))
    assert (answered.lifetime_index, answered.round) == (2, 1)
    second = policy.propose(
        first.state, prop(1, 1, other_model, lifetime="b1"), 9.5, TIMEOUT, ceiling=CEILING
    )
    assert isinstance(second.reply, Refusal)
    assert second.state.lifetime_index == 1


def test_newcomers_join_the_first_lifetime_while_round_one_is_open() -> None:
    state, _, _ = run_round(None, 1, [NVFP4, NVFP4])
    step = policy.propose(state, prop(0, 1, NVFP4, lifetime="again"), 3.0, TIMEOUT, ceiling=CEILING)
    # Round 1 decided: a newcomer after it belongs to a restart.
    assert step.reply == Wait(lifetime_index=2, round=1, deadline=3.0 + TIMEOUT)
    assert EventKind.LIFETIME_STARTED not in events(step)
    assert step.state.lifetime_index == 1


def test_unknown_lifetime_must_start_at_round_one() -> None:
    with pytest.raises(PreconditionFailed, match="does not know"):
        policy.propose(None, prop(0, 3, NVFP4), 0.0, TIMEOUT, ceiling=CEILING)


def test_reset_begins_an_epoch_but_keeps_the_generation() -> None:
    state, _ = run_sequence([NVFP4, BF16])
    step = policy.reset(state, 7.0)
    assert events(step) == [EventKind.RESET] and step.persists
    state = step.state
    assert state.plan is None and state.history == () and state.epoch == 1
    state, outcomes = run_sequence([NVFP4], state, lifetime="after-reset")
    decision = outcomes[0]
    assert isinstance(decision, Decision)
    assert decision.plan == Plan(caps(), epoch=1, generation=3)


def test_a_running_lifetime_keeps_what_it_built_across_a_reset() -> None:
    state, _ = run_sequence([NVFP4, BF16])
    state = policy.reset(state, 7.0).state
    state, decision, _ = run_round(state, 3, [NVFP4, NVFP4])
    assert isinstance(decision, Decision)
    assert decision.action is Action.REUSE
    assert decision.plan.capacities == caps(dispatch=400) and decision.plan.epoch == 1


# --- commits --------------------------------------------------------------------


def _decided(layers: list[Requirement], local_ranks: int = 2) -> tuple[GroupState, Decision]:
    state: GroupState | None = None
    outcome: Outcome | None = None
    for n, req in enumerate(layers, start=1):
        for rank in range(local_ranks):
            step = policy.propose(
                state, prop(rank, n, req, local_ranks=local_ranks), 0.0, TIMEOUT, ceiling=CEILING
            )
            state, outcome = step.state, step.reply  # type: ignore[assignment]
    assert state is not None and isinstance(outcome, Decision)
    return state, outcome


def test_commit_records_the_generation() -> None:
    state, decision = _decided([NVFP4])
    step = policy.commit(
        state, CommitRecord(0, "life-0", 1, decision.plan, 0.02), 3.0, ceiling=CEILING
    )
    rank0 = step.state.rank(0)
    assert rank0 is not None and rank0.committed_generation == 1
    assert rank0.build_seconds == 0.02
    assert events(step) == [EventKind.COMMIT] and step.persists
    assert step.state.plan == state.plan


def test_a_group_spanning_nodes_commits_and_absorbs_the_agreed_plan() -> None:
    # One of two ranks on this node: the other node's layer made the agreed
    # plan bigger. The commit joins it into the stored plan and the built one.
    state, _ = _decided([NVFP4], local_ranks=1)
    agreed = Plan(caps(dispatch=900), epoch=0, generation=2)
    step = policy.commit(state, CommitRecord(0, "life-0", 1, agreed, 0.0), 3.0, ceiling=CEILING)
    rank0 = step.state.rank(0)
    assert rank0 is not None and rank0.committed_generation == 2
    assert step.state.plan == agreed and step.state.built == agreed
    assert step.state.generation == 2
    assert step.state.history[-1].layer == "(agreed across nodes)"
    # The next round of the same size reuses what the ranks hold.
    step = policy.propose(
        step.state, prop(0, 2, NVFP4, local_ranks=1), 4.0, TIMEOUT, ceiling=CEILING
    )
    assert isinstance(step.reply, Decision) and step.reply.action is Action.REUSE
    assert step.reply.plan == agreed


def test_a_commit_whose_agreed_plan_has_another_shape_than_the_stored_one_is_refused() -> None:
    # After a reset here, another node's plan of epoch 1 (top_k=4) merged in;
    # a rank then commits an agreed plan of epoch 1 with top_k=2: the two
    # cannot join. The commit is refused (FAILED_PRECONDITION) naming both shapes.
    state, _ = _decided([NVFP4], local_ranks=1)
    state = policy.reset(state, 2.0).state
    other = Plan(caps(top_k=4), epoch=1, generation=3)
    remote = ClusterPlan(GROUP, 2, epoch=1, plan=other, generation=3)
    state = policy.merge(state, remote, 3.0, ceiling=CEILING).state
    agreed = Plan(caps(dispatch=900), epoch=1, generation=4)
    with pytest.raises(PreconditionFailed, match="top_k=4, num_experts=16 cannot join top_k=2"):
        policy.commit(state, CommitRecord(0, "life-0", 1, agreed, 0.0), 4.0, ceiling=CEILING)


def test_a_group_on_one_node_commits_exactly_the_decision() -> None:
    state, _ = _decided([NVFP4])
    bigger = Plan(caps(dispatch=900), epoch=0, generation=1)
    with pytest.raises(PreconditionFailed, match="the round decided"):
        policy.commit(state, CommitRecord(0, "life-0", 1, bigger, 0.0), 3.0, ceiling=CEILING)


def _commit(rnd: int = 1, plan: Plan | None = None, **changes: object) -> CommitRecord:
    record = CommitRecord(0, "life-0", rnd, plan or Plan(caps(), 0, 1), 0.0)
    return replace(record, **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("record", "error", "needle"),
    [
        (_commit(lifetime="stranger"), PreconditionFailed, "never proposed"),
        (_commit(rnd=2), PreconditionFailed, "has no retained decision"),
        (_commit(ep_rank=5), InvalidArgument, "ep_rank=5"),
        (_commit(rnd=0), InvalidArgument, "round=0"),
        (_commit(plan=Plan(caps(), 0, 0)), InvalidArgument, "plan.generation=0"),
        (_commit(plan=Plan(caps(), 0, 999)), PreconditionFailed, "the round decided"),
        (_commit(plan=Plan(caps(dispatch=1 << 20), 0, 1)), PreconditionFailed, "the round decided"),
        (_commit(plan=Plan(caps(top_k=4), 0, 1)), PreconditionFailed, "top_k=4"),
        (_commit(plan=Plan(caps(tokens=0), 0, 1)), InvalidArgument, "max_tokens=0"),
        (_commit(build_seconds=-1.0), InvalidArgument, "build_seconds"),
        (_commit(build_seconds=float("nan")), InvalidArgument, "build_seconds"),
    ],
)
def test_bad_commits_change_nothing(
    record: CommitRecord, error: type[Exception], needle: str
) -> None:
    state, _ = _decided([NVFP4])
    with pytest.raises(error, match=needle.replace("(", r"\(")):
        policy.commit(state, record, 1.0, ceiling=CEILING)


# --- validation -----------------------------------------------------------------


def _with(capacities: Capacities | None = None, layer: str = "l0", **top: object) -> Proposal:
    base = prop(0, 1, NVFP4)
    requirement = Requirement(capacities or caps(), layer)
    return replace(base, requirement=requirement, **top)  # type: ignore[arg-type]


BAD = [
    (_with(group=""), "group=''"),
    (_with(group="x" * 257), "257 characters"),
    (_with(group="bad\nname"), "printable"),
    (_with(ep_size=0), "ep_size=0"),
    (_with(ep_size=65, local_ranks=1), "ep_size=65"),
    (_with(ep_rank=2), "ep_rank=2"),
    (_with(local_ranks=0), "local_ranks=0"),
    (_with(local_ranks=3), "local_ranks=3"),
    (_with(lifetime=""), "lifetime=''"),
    (_with(round=0), "round=0"),
    (_with(caps(tokens=0)), "requirement.capacities.max_tokens=0"),
    (_with(caps(tokens=1 << 31)), "requirement.capacities.max_tokens=2147483648"),
    (_with(caps(dispatch=0)), "requirement.capacities.dispatch_bytes_per_token=0"),
    (_with(caps(combine=(1 << 22) + 1)), "requirement.capacities.combine_bytes_per_token=4194305"),
    (_with(caps(top_k=0)), "requirement.capacities.top_k=0"),
    (_with(caps(top_k=23)), "requirement.capacities.top_k=23"),
    (_with(replace(caps(), num_experts=1)), "requirement.capacities.num_experts=1"),
    (_with(replace(caps(), eplb_experts=-1)), "requirement.capacities.eplb_experts=-1"),
    (_with(caps(tokens=1 << 30, dispatch=1 << 20)), "at most 1099511627776"),
    (_with(layer="y" * 300), "requirement.layer"),
]


@pytest.mark.parametrize(("proposal", "needle"), BAD, ids=[n for _, n in BAD])
def test_bad_proposals_change_nothing(proposal: Proposal, needle: str) -> None:
    state, _ = run_sequence([NVFP4])
    with pytest.raises(InvalidArgument) as info:
        policy.propose(state, proposal, 1.0, TIMEOUT, ceiling=CEILING)
    assert needle in str(info.value)


@pytest.mark.parametrize(
    ("proposal", "needle"),
    [
        (prop(0, 2, NVFP4, ep_size=4, local_ranks=2), "ep_size=4"),
        (prop(0, 2, NVFP4, local_ranks=1), "local_ranks=1"),
        (prop(0, 5, NVFP4), "next round is 2"),
    ],
)
def test_proposals_contradicting_the_group(proposal: Proposal, needle: str) -> None:
    state, _ = run_sequence([NVFP4])
    with pytest.raises(PreconditionFailed, match=needle):
        policy.propose(state, proposal, 1.0, TIMEOUT, ceiling=CEILING)
