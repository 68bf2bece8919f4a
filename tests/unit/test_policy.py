"""Table-driven tests of the pure decision core: no I/O, no clock."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest
from moe_sidecar import policy, sizing
from moe_sidecar.errors import (
    ErrorCode,
    InvalidArgument,
    PreconditionFailed,
    RoundAborted,
)
from moe_sidecar.policy import (
    Action,
    Answered,
    Closed,
    CommitRecord,
    Decision,
    GroupState,
    Plan,
    Proposal,
    Refusal,
    Requirement,
    Waiting,
)

pytestmark = pytest.mark.timeout(10)

GROUP = "deepseek-v3:fp4/tp1-ep2/pp0"
TIMEOUT = 30.0

NVFP4 = Requirement(workspace_bytes=10_000, max_num_tokens=256, top_k=2, num_experts=16, layer="l0")
BF16 = Requirement(workspace_bytes=30_000, max_num_tokens=256, top_k=2, num_experts=16, layer="mtp")
MORE_TOKENS = Requirement(
    workspace_bytes=10_000, max_num_tokens=512, top_k=2, num_experts=16, layer="l1"
)


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
    )


def run_round(
    state: GroupState | None,
    rnd: int,
    reqs: list[Requirement],
    *,
    now: float = 0.0,
    lifetime: str | None = None,
) -> tuple[GroupState, policy.Outcome]:
    """Every local rank proposes ``rnd``; returns the state and the outcome."""
    result: policy.ProposeResult | None = None
    for rank, req in enumerate(reqs):
        state, result = policy.propose(state, prop(rank, rnd, req, lifetime=lifetime), now, TIMEOUT)
        if isinstance(result, Closed):
            assert state is not None
            return state, result.outcome
        assert isinstance(result, Waiting), result
    raise AssertionError(f"round {rnd} did not close: {result}")


def run_sequence(
    layers: list[Requirement], state: GroupState | None = None, *, lifetime: str | None = None
) -> tuple[GroupState, list[policy.Outcome]]:
    outcomes = []
    for n, req in enumerate(layers, start=1):
        state, outcome = run_round(state, n, [req, req], lifetime=lifetime)
        outcomes.append(outcome)
    assert state is not None
    return state, outcomes


# --- the union rule, one row per sequence --------------------------------------


@dataclass(frozen=True)
class Row:
    name: str
    layers: list[Requirement]
    actions: list[Action]
    workspace: list[int]
    tokens: list[int]
    generations: list[int]
    stored: GroupState | None = field(default=None)


ROWS = [
    Row("first round builds", [NVFP4], [Action.BUILD], [10_000], [256], [1]),
    Row(
        "covered layer reuses",
        [NVFP4, NVFP4],
        [Action.BUILD, Action.REUSE],
        [10_000, 10_000],
        [256, 256],
        [1, 1],
    ),
    Row(
        "bigger workspace rebuilds",
        [NVFP4, BF16],
        [Action.BUILD, Action.REBUILD],
        [10_000, 30_000],
        [256, 256],
        [1, 2],
    ),
    Row(
        "more tokens rebuild",
        [NVFP4, MORE_TOKENS],
        [Action.BUILD, Action.REBUILD],
        [10_000, 10_000],
        [256, 512],
        [1, 2],
    ),
    Row(
        "never shrinks (the regression sequence)",
        [NVFP4, BF16, NVFP4],
        [Action.BUILD, Action.REBUILD, Action.REUSE],
        [10_000, 30_000, 30_000],
        [256, 256, 256],
        [1, 2, 2],
    ),
    Row(
        "union of bytes and tokens from different layers",
        [BF16, MORE_TOKENS],
        [Action.BUILD, Action.REBUILD],
        [30_000, 30_000],
        [256, 512],
        [1, 2],
    ),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_union_rule(row: Row) -> None:
    _, outcomes = run_sequence(row.layers, row.stored)
    decisions = [o for o in outcomes if isinstance(o, Decision)]
    assert len(decisions) == len(outcomes)
    assert [d.action for d in decisions] == row.actions
    assert [d.plan.workspace_bytes for d in decisions] == row.workspace
    assert [d.plan.max_num_tokens for d in decisions] == row.tokens
    assert [d.plan.generation for d in decisions] == row.generations


def test_ranks_with_different_needs_take_the_max() -> None:
    small = replace(NVFP4, workspace_bytes=5_000)
    state, outcome = run_round(None, 1, [small, NVFP4])
    assert isinstance(outcome, Decision)
    assert outcome.plan.workspace_bytes == 10_000
    assert state.history[-1].ep_rank == 1


def test_growth_history_names_the_layer() -> None:
    state, _ = run_sequence([NVFP4, BF16, NVFP4, MORE_TOKENS])
    assert [(g.generation, g.layer, g.round) for g in state.history] == [
        (1, "l0", 1),
        (2, "mtp", 2),
        (3, "l1", 4),
    ]
    assert state.history[-1].workspace_bytes == 30_000
    assert state.history[-1].max_num_tokens == 512


def _sized(label: str, tokens: int, x_bytes: int, x_sf_bytes: int) -> Requirement:
    """A layer's requirement as the client states it (hidden 256, top_k 2, EP 2)."""
    s = sizing.layer_sizes(2, tokens, 2, 256, x_bytes, x_sf_bytes)
    return Requirement(s.workspace_bytes, tokens, 2, 16, label, s.payload_bytes)


def test_plan_serves_every_payload_at_the_plans_token_count() -> None:
    # An NVFP4 layer at 20 tokens, then a bf16 layer at 16: the bf16 layer's
    # payload must fit beside the auxiliary data of a 20-token workspace,
    # which is more than either layer's own size.
    nvfp4 = _sized("l0", 20, 128, 16)
    bf16 = _sized("mtp", 16, 512, 0)
    state, outcomes = run_sequence([nvfp4, bf16])
    decision = outcomes[1]
    assert isinstance(decision, Decision)
    assert decision.action is Action.REBUILD
    assert decision.plan.max_num_tokens == 20
    assert decision.plan.payload_bytes == bf16.payload_bytes
    assert decision.plan.workspace_bytes == sizing.workspace_for_payload(2, 20, bf16.payload_bytes)
    assert decision.plan.workspace_bytes > max(nvfp4.workspace_bytes, bf16.workspace_bytes)
    assert state.history[-1].layer == "mtp"


def test_more_tokens_lift_the_room_for_an_earlier_payload() -> None:
    bf16 = _sized("mtp", 16, 512, 0)
    nvfp4 = _sized("l0", 20, 128, 16)
    _, outcomes = run_sequence([bf16, nvfp4])
    decision = outcomes[1]
    assert isinstance(decision, Decision)
    assert decision.action is Action.REBUILD
    assert decision.plan.workspace_bytes == sizing.workspace_for_payload(2, 20, bf16.payload_bytes)
    assert decision.plan.workspace_bytes > max(nvfp4.workspace_bytes, bf16.workspace_bytes)


# --- refusals -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changed", "expected"),
    [
        (replace(BF16, top_k=4), "top_k=4"),
        (replace(BF16, num_experts=32), "num_experts=32"),
    ],
    ids=["top_k", "num_experts"],
)
def test_heterogeneous_layer_refused_naming_both_layers(
    changed: Requirement, expected: str
) -> None:
    state, _ = run_sequence([NVFP4])
    state, result = policy.propose(state, prop(0, 2, changed), 1.0, TIMEOUT)
    assert isinstance(result, Closed)
    refusal = result.outcome
    assert isinstance(refusal, Refusal)
    assert refusal.code is ErrorCode.FAILED_PRECONDITION
    assert "'mtp'" in refusal.message and "'l0'" in refusal.message
    assert "rank 0" in refusal.message
    assert expected in refusal.message
    assert isinstance(refusal.error(), PreconditionFailed)
    # The plan is untouched, and the other rank gets the same refusal.
    assert state.plan is not None and state.plan.generation == 1
    state, late = policy.propose(state, prop(1, 2, changed), 2.0, TIMEOUT)
    assert late == Answered(refusal)


@pytest.mark.parametrize(
    ("other", "needle"),
    [
        (replace(NVFP4, top_k=4), "top_k=4"),
        (replace(NVFP4, num_experts=8), "num_experts=8"),
        (replace(NVFP4, layer="l7"), "'l7'"),
    ],
    ids=["top_k", "num_experts", "layer"],
)
def test_ranks_disagreeing_inside_a_round(other: Requirement, needle: str) -> None:
    state, first = policy.propose(None, prop(0, 1, NVFP4), 0.0, TIMEOUT)
    assert isinstance(first, Waiting)
    state, result = policy.propose(state, prop(1, 1, other), 0.5, TIMEOUT)
    assert isinstance(result, Closed) and isinstance(result.outcome, Refusal)
    message = result.outcome.message
    assert "ranks disagree" in message
    assert "rank 0" in message and "rank 1" in message and needle in message
    # Rank 0, still waiting on round 1, is answered by the holder from the
    # closed round; a retry of rank 0 sees the same refusal.
    state, retry = policy.propose(state, prop(0, 1, NVFP4), 1.0, TIMEOUT)
    assert retry == Answered(result.outcome)


def test_retried_proposal_for_closed_round_is_answered_identically() -> None:
    state, outcomes = run_sequence([NVFP4, BF16])
    for rank in (0, 1):
        for rnd, req in ((1, NVFP4), (2, BF16)):
            state2, result = policy.propose(state, prop(rank, rnd, req), 99.0, TIMEOUT)
            assert result == Answered(outcomes[rnd - 1])
            assert state2 == state


def test_retry_while_round_open_keeps_waiting() -> None:
    state, first = policy.propose(None, prop(0, 1, NVFP4), 0.0, TIMEOUT)
    state2, again = policy.propose(state, prop(0, 1, NVFP4), 1.0, TIMEOUT)
    assert isinstance(first, Waiting) and isinstance(again, Waiting)
    assert again.round == 1 and again.deadline == first.deadline
    with pytest.raises(PreconditionFailed, match="re-proposed round 1"):
        policy.propose(state2, prop(0, 1, BF16), 1.0, TIMEOUT)


def test_round_past_deadline_names_missing_ranks_and_their_last_layer() -> None:
    state, _ = run_sequence([NVFP4])
    state, waiting = policy.propose(state, prop(0, 2, BF16), 10.0, TIMEOUT)
    assert isinstance(waiting, Waiting) and waiting.deadline == 10.0 + TIMEOUT
    unchanged, nothing = policy.expire(state, 10.0 + TIMEOUT - 0.001)
    assert nothing is None and unchanged == state
    state, refusal = policy.expire(state, 10.0 + TIMEOUT)
    assert refusal is not None
    assert refusal.code is ErrorCode.DEADLINE_EXCEEDED
    assert refusal.missing_ranks == (1,)
    assert "rank 1 (last reported round 1, layer 'l0')" in refusal.message
    assert "ranks present: [0]" in refusal.message
    assert state.open_round is None and state.last_closed_round == 2
    # The late rank gets the same timeout.
    _, late = policy.propose(state, prop(1, 2, BF16), 50.0, TIMEOUT)
    assert late == Answered(refusal)


def test_timeout_counts_ranks_never_seen() -> None:
    state, _ = policy.propose(None, prop(0, 1, NVFP4, ep_size=4, local_ranks=3), 0.0, TIMEOUT)
    _, refusal = policy.expire(state, TIMEOUT)
    assert refusal is not None
    assert "2 of 3 local ranks missing" in refusal.message
    assert "2 rank(s) never seen" in refusal.message


# --- lifetimes ------------------------------------------------------------------


def test_new_lifetime_starts_from_the_stored_plan() -> None:
    state, _ = run_sequence([NVFP4, BF16, NVFP4])
    # Both ranks restart: new lifetime ids, round 1 again, first layer small.
    state, _ = policy.propose(state, prop(0, 1, NVFP4, lifetime="b0"), 100.0, TIMEOUT)
    state, result = policy.propose(state, prop(1, 1, NVFP4, lifetime="b1"), 100.0, TIMEOUT)
    assert isinstance(result, Closed)
    decision = result.outcome
    assert isinstance(decision, Decision)
    assert decision.action is Action.BUILD
    assert decision.plan.workspace_bytes == 30_000  # the historical union
    assert decision.plan.generation == 2 and not decision.grew
    assert state.lifetime_index == 2


def test_second_lifetime_builds_once() -> None:
    state, _ = run_sequence([NVFP4, BF16, NVFP4])
    actions = []
    for n, req in enumerate([NVFP4, BF16, NVFP4], start=1):
        for rank in (0, 1):
            state, result = policy.propose(
                state, prop(rank, n, req, lifetime=f"second-{rank}"), 200.0, TIMEOUT
            )
        assert isinstance(result, Closed) and isinstance(result.outcome, Decision)
        actions.append(result.outcome.action)
    assert actions == [Action.BUILD, Action.REUSE, Action.REUSE]


def test_rank_of_an_ended_lifetime_is_aborted() -> None:
    state, _ = run_sequence([NVFP4])
    state, _ = policy.propose(state, prop(0, 1, NVFP4, lifetime="new-0"), 5.0, TIMEOUT)
    with pytest.raises(RoundAborted, match="restart this rank"):
        policy.propose(state, prop(1, 2, NVFP4), 5.0, TIMEOUT)


def test_restart_mid_round_aborts_the_open_round() -> None:
    state, _ = run_sequence([NVFP4])
    state, _ = policy.propose(state, prop(0, 2, BF16), 5.0, TIMEOUT)
    state, result = policy.propose(state, prop(1, 1, NVFP4, lifetime="new-1"), 6.0, TIMEOUT)
    assert isinstance(result, Waiting) and result.new_lifetime
    assert result.aborted is not None and result.aborted.code is ErrorCode.ABORTED
    assert "rank 1 restarted" in result.aborted.message


def test_restart_refused_in_round_one_is_one_lifetime() -> None:
    state, _ = run_sequence([NVFP4])
    other_model = replace(NVFP4, top_k=4)
    state, first = policy.propose(state, prop(0, 1, other_model, lifetime="b0"), 9.0, TIMEOUT)
    assert isinstance(first, Closed)
    assert isinstance(first.outcome, Refusal)
    assert first.new_lifetime
    # The second rank of the same restart shares the refusal; no third lifetime.
    after, second = policy.propose(state, prop(1, 1, other_model, lifetime="b1"), 9.5, TIMEOUT)
    assert second == Answered(first.outcome)
    assert after.lifetime_index == state.lifetime_index == 2


def test_newcomer_after_a_decided_round_one_is_a_restart() -> None:
    state, _ = run_round(None, 1, [NVFP4, NVFP4])
    state, result = policy.propose(state, prop(0, 1, NVFP4, lifetime="again"), 3.0, TIMEOUT)
    assert isinstance(result, Waiting)
    assert result.new_lifetime
    assert state.lifetime_index == 2


def test_unknown_lifetime_must_start_at_round_one() -> None:
    with pytest.raises(PreconditionFailed, match="never seen"):
        policy.propose(None, prop(0, 3, NVFP4), 0.0, TIMEOUT)


def test_reset_forgets_the_plan_but_not_the_generation() -> None:
    state, _ = run_sequence([NVFP4, BF16])
    state = policy.reset(state)
    assert state.plan is None and state.history == ()
    state, outcomes = run_sequence([NVFP4], state, lifetime="after-reset")
    decision = outcomes[0]
    assert isinstance(decision, Decision)
    assert decision.plan.workspace_bytes == 10_000
    assert decision.plan.generation == 3


# --- commits --------------------------------------------------------------------


def test_commit_records_the_generation() -> None:
    state, outcomes = run_sequence([NVFP4])
    decision = outcomes[0]
    assert isinstance(decision, Decision)
    state = policy.commit(state, CommitRecord(0, "life-0", 1, decision.plan, 0.02), 3.0)
    rank0 = state.rank(0)
    assert rank0 is not None and rank0.committed_generation == 1
    assert rank0.build_seconds == 0.02


def test_commit_of_a_larger_agreed_plan_is_absorbed() -> None:
    state, outcomes = run_sequence([NVFP4])
    decision = outcomes[0]
    assert isinstance(decision, Decision)
    agreed = replace(decision.plan, workspace_bytes=50_000)
    state = policy.commit(state, CommitRecord(0, "life-0", 1, agreed, 0.0), 3.0)
    assert state.plan is not None and state.plan.workspace_bytes == 50_000
    assert state.plan.generation == 2
    assert state.history[-1].layer == "(agreed across nodes)"
    # The next round of the same size reuses what was built.
    state, outcome = run_round(state, 2, [BF16, BF16])
    assert isinstance(outcome, Decision) and outcome.action is Action.REUSE


@pytest.mark.parametrize(
    ("record", "error", "needle"),
    [
        (
            CommitRecord(0, "stranger", 1, Plan(1, 1, 2, 16, 1), 0.0),
            PreconditionFailed,
            "never proposed",
        ),
        (
            CommitRecord(0, "life-0", 2, Plan(1, 1, 2, 16, 1), 0.0),
            PreconditionFailed,
            "has not closed",
        ),
        (CommitRecord(5, "life-0", 1, Plan(1, 1, 2, 16, 1), 0.0), InvalidArgument, "ep_rank=5"),
        (
            CommitRecord(0, "life-0", 1, Plan(0, 1, 2, 16, 1), 0.0),
            InvalidArgument,
            "plan.workspace_bytes=0",
        ),
        (
            CommitRecord(0, "life-0", 1, Plan(1, 1, 2, 16, 0), 0.0),
            InvalidArgument,
            "plan.generation=0",
        ),
        (CommitRecord(0, "life-0", 1, Plan(1, 1, 4, 16, 1), 0.0), PreconditionFailed, "top_k=4"),
        (
            CommitRecord(0, "life-0", 1, Plan(1, 1, 2, 16, 1), -1.0),
            InvalidArgument,
            "build_seconds",
        ),
    ],
)
def test_bad_commits(record: CommitRecord, error: type[Exception], needle: str) -> None:
    state, _ = run_sequence([NVFP4])
    with pytest.raises(error, match=needle.replace("(", r"\(")):
        policy.commit(state, record, 1.0)


# --- validation -----------------------------------------------------------------


def _with(**changes: object) -> Proposal:
    base = prop(0, 1, NVFP4)
    req_changes = {k[4:]: v for k, v in changes.items() if k.startswith("req_")}
    top = {k: v for k, v in changes.items() if not k.startswith("req_")}
    return replace(base, requirement=replace(base.requirement, **req_changes), **top)  # type: ignore[arg-type]


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
    (_with(req_workspace_bytes=0), "requirement.workspace_bytes=0"),
    (_with(req_workspace_bytes=(1 << 40) + 1), "requirement.workspace_bytes=1099511627777"),
    (_with(req_max_num_tokens=0), "requirement.max_num_tokens=0"),
    (_with(req_max_num_tokens=1 << 31), "requirement.max_num_tokens=2147483648"),
    (_with(req_top_k=0), "requirement.top_k=0"),
    (_with(req_top_k=23), "requirement.top_k=23"),
    (_with(req_num_experts=1), "requirement.num_experts=1"),
    (_with(req_layer="y" * 300), "requirement.layer"),
    (_with(req_payload_bytes=10_001), "requirement.payload_bytes=10001"),
]


@pytest.mark.parametrize(("proposal", "needle"), BAD, ids=[n for _, n in BAD])
def test_bad_proposals_change_nothing(proposal: Proposal, needle: str) -> None:
    state, _ = run_sequence([NVFP4])
    with pytest.raises(InvalidArgument) as info:
        policy.propose(state, proposal, 1.0, TIMEOUT)
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
        policy.propose(state, proposal, 1.0, TIMEOUT)
