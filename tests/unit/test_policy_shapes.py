"""Table-driven tests of the shape rule of the pure decision core
(:mod:`moe_sidecar.core.policy.rounds`): a round is decided only when its
proposals, the group's plan and what the running lifetime built have one
``top_k``/``num_experts``. No I/O, no clock."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import pytest

from moe_sidecar.core import policy
from moe_sidecar.core.cluster import ClusterPlan
from moe_sidecar.core.effects import Answer, EventKind, Publish, Step, Wait
from moe_sidecar.core.errors import ErrorCode, PreconditionFailed
from moe_sidecar.core.group import (
    Decision,
    GroupState,
    Growth,
    OpenRound,
    Proposal,
    Refusal,
    Requirement,
)
from moe_sidecar.core.plan import Action, Capacities, Plan
from moe_sidecar.core.policy.rounds import decide_round
from tests.ceiling import CEILING

pytestmark = pytest.mark.timeout(10)

GROUP = "g/ep8"
EP_SIZE = 8
"""The group spans nodes: its other ranks run on another node's sidecar."""
TIMEOUT = 30.0
BUILT = Requirement(Capacities(256, 100, 200, 2, 16), "l0")
"""What the running lifetime built in its round 1: top_k=2."""
MERGED = Plan(Capacities(256, 100, 200, 4, 16), epoch=1, generation=3)
"""The plan another node decided after the reset: top_k=4."""
OF_THE_PLAN = Requirement(MERGED.capacities, "l0")


OWNER = hashlib.sha256(b"the group's owner key and name").hexdigest()
"""The owner id every rank of the group's real lifetimes carries: restarts inherit the plan."""


def prop(rank: int, rnd: int, req: Requirement, local_ranks: int, lifetime: str = "") -> Proposal:
    lifetime = lifetime or f"life-{rank}"
    return Proposal(GROUP, EP_SIZE, rank, local_ranks, lifetime, rnd, req, owner=OWNER)


def remote() -> ClusterPlan:
    """Epoch 1 as another node holds it: its rank 5 grew a top_k=4 plan."""
    growth = Growth(MERGED, "model.layers.3.mlp", 5, 1, 6.0, "node-b")
    return ClusterPlan(GROUP, EP_SIZE, epoch=1, plan=MERGED, generation=3, history=(growth,))


def built_then_reset(local_ranks: int) -> GroupState:
    """Round 1 of a lifetime decided (and built) top_k=2; then a reset here."""
    state: GroupState | None = None
    for rank in range(local_ranks):
        state = policy.propose(
            state, prop(rank, 1, BUILT, local_ranks), 1.0, TIMEOUT, ceiling=CEILING
        ).state
    assert state is not None and state.built is not None and state.open_round is None
    return policy.reset(state, 2.0).state


def events(step: Step) -> list[EventKind]:
    return [e.event.kind for e in step.effects if isinstance(e, Publish)]


@dataclass(frozen=True)
class Split:
    name: str
    proposed: Requirement
    """What every rank proposes in round 2."""
    before_merge: int
    """How many ranks proposed round 2 before the plan merged in."""
    local_ranks: int
    ranks_named: str


SPLITS = [
    Split(
        "merged before the round, the plan's shape proposed", OF_THE_PLAN, 0, 2, "rank 0 proposes"
    ),
    Split("merged before the round, the built shape proposed", BUILT, 0, 2, "rank 0 proposes"),
    Split("merged while the round is open", BUILT, 1, 2, "ranks 0, 1 propose"),
    Split("merged while four ranks wait", BUILT, 3, 4, "ranks 0, 1, 2, 3 propose"),
]


@pytest.mark.parametrize("row", SPLITS, ids=[r.name for r in SPLITS])
def test_a_plan_of_another_shape_merged_after_a_reset_refuses_the_round_for_every_rank(
    row: Split,
) -> None:
    state = built_then_reset(row.local_ranks)
    for rank in range(row.before_merge):
        step = policy.propose(
            state, prop(rank, 2, row.proposed, row.local_ranks), 3.0, TIMEOUT, ceiling=CEILING
        )
        assert isinstance(step.reply, Wait)
        state = step.state
    state = policy.merge(state, remote(), 4.0, ceiling=CEILING).state
    assert state.plan == MERGED and state.built is not None and state.built.capacities.top_k == 2

    closing = row.before_merge
    step = policy.propose(
        state, prop(closing, 2, row.proposed, row.local_ranks), 5.0, TIMEOUT, ceiling=CEILING
    )

    # One refusal, at once, and the round is closed: no rank waits for the timeout.
    refusal = step.reply
    assert isinstance(refusal, Refusal) and refusal.code is ErrorCode.FAILED_PRECONDITION
    assert isinstance(refusal.error(), PreconditionFailed)
    assert step.state.open_round is None and step.state.last_closed_round == 2
    assert events(step) == [EventKind.ROUND_REFUSED] and step.persists
    # Every rank that waited in the round is answered by the same step.
    answered = [e for e in step.effects if isinstance(e, Answer)]
    assert answered == [Answer(1, 2, refusal)]
    # The message names both shapes, the ranks and the layers involved.
    message = refusal.message
    assert "top_k=4, num_experts=16" in message and "top_k=2, num_experts=16" in message
    assert row.ranks_named in message and "layer 'l0'" in message
    assert "rank 5 layer 'model.layers.3.mlp' on node 'node-b'" in message
    assert "what they built (generation 1)" in message and "restart every rank" in message
    # Nothing was stored; the ranks yet to come get the same refusal, and no effects.
    assert step.state.plan == MERGED and step.state.generation == 3
    for rank in range(closing + 1, row.local_ranks):
        late = policy.propose(
            step.state, prop(rank, 2, row.proposed, row.local_ranks), 6.0, TIMEOUT, ceiling=CEILING
        )
        assert late.reply == refusal and late.effects == ()


def test_a_round_whose_shapes_part_at_its_decision_is_refused_for_every_rank() -> None:
    # decide_round on its own: a round that reaches its decision with a need
    # the built workspace cannot join still closes with one refusal for all.
    state = policy.merge(built_then_reset(2), remote(), 4.0, ceiling=CEILING).state
    rnd = OpenRound(number=2, opened_at=3.0, deadline=3.0 + TIMEOUT)
    for rank in range(2):
        rnd = rnd.with_proposal(prop(rank, 2, OF_THE_PLAN, 2))
    step = decide_round(state, rnd, rnd.proposals[-1], 5.0, (), "node-a", ceiling=CEILING)
    refusal = step.reply
    assert isinstance(refusal, Refusal) and refusal.code is ErrorCode.FAILED_PRECONDITION
    assert "ranks 0, 1 propose" in refusal.message and "top_k=2" in refusal.message
    assert Answer(1, 2, refusal) in step.effects
    assert step.state.open_round is None and step.state.plan == MERGED


def test_restarted_ranks_build_from_the_merged_plan() -> None:
    state = policy.merge(built_then_reset(2), remote(), 4.0, ceiling=CEILING).state
    state = policy.propose(
        state, prop(0, 1, OF_THE_PLAN, 2, "new-0"), 5.0, TIMEOUT, ceiling=CEILING
    ).state
    decision = policy.propose(
        state, prop(1, 1, OF_THE_PLAN, 2, "new-1"), 5.0, TIMEOUT, ceiling=CEILING
    ).reply
    assert isinstance(decision, Decision) and decision.action is Action.BUILD
    assert decision.plan == MERGED and not decision.grew


def test_a_restart_after_a_reset_builds_another_model_without_the_ended_lifetime() -> None:
    # The reset forgot the plan; the running lifetime built top_k=2. A restart
    # of every rank with a top_k=4 model builds anew: what the ending lifetime
    # built is not the new one's.
    state = built_then_reset(2)
    state = policy.propose(
        state, prop(0, 1, OF_THE_PLAN, 2, "new-0"), 5.0, TIMEOUT, ceiling=CEILING
    ).state
    decision = policy.propose(
        state, prop(1, 1, OF_THE_PLAN, 2, "new-1"), 5.0, TIMEOUT, ceiling=CEILING
    ).reply
    assert isinstance(decision, Decision) and decision.action is Action.BUILD
    assert decision.plan.capacities == OF_THE_PLAN.capacities and decision.plan.epoch == 1
