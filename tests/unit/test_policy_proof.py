"""Table-driven tests of the group proof's rule and the workspace ceiling in
the pure decision core (:mod:`moe_sidecar.core.policy.proof`): no I/O, no clock."""

from __future__ import annotations

import hashlib
from dataclasses import replace

import pytest

from moe_sidecar import flashinfer
from moe_sidecar.core import limits, policy
from moe_sidecar.core.cluster import cluster_plan_of
from moe_sidecar.core.effects import Dismiss, EventKind, Publish, Step, Wait
from moe_sidecar.core.errors import ErrorCode, InvalidArgument, PreconditionFailed
from moe_sidecar.core.group import (
    CommitRecord,
    Decision,
    GroupState,
    Proposal,
    Refusal,
    Requirement,
)
from moe_sidecar.core.plan import Capacities, Plan
from tests.ceiling import CEILING, ceiling_of

pytestmark = pytest.mark.timeout(10)

GROUP = "g/ep4"
TIMEOUT = 30.0
SMALL = Requirement(Capacities(256, 100, 200, 2, 16), "l0")
BIG = Requirement(Capacities(1 << 20, 4096, 200, 2, 16), "")
"""A stranger's layer: about 16 GiB per rank at EP 4."""
OTHER_SHAPE = Requirement(Capacities(256, 100, 200, 4, 16), "x")


OWNER = hashlib.sha256(b"the group's owner key and name").hexdigest()
"""The owner id every rank of the group's real lifetimes carries: restarts inherit the plan."""


def prop(
    rank: int,
    proof: str,
    *,
    rnd: int = 1,
    req: Requirement = SMALL,
    local_ranks: int = 4,
    lifetime: str | None = None,
    ep_size: int = 4,
    owner: str = OWNER,
) -> Proposal:
    return Proposal(
        group=GROUP,
        ep_size=ep_size,
        ep_rank=rank,
        local_ranks=local_ranks,
        lifetime=lifetime or f"{proof}-{rank}-{local_ranks}",
        round=rnd,
        requirement=req,
        proof=proof,
        owner=owner,
    )


def kind(step: Step) -> str:
    """What a proposal's step did: wait, refused (its proof), decides; with
    ``+dismiss`` when it took a slot back from another proof."""
    dismissed = any(isinstance(e, Dismiss) for e in step.effects)
    reply = step.reply
    if isinstance(reply, Refusal):
        assert reply.code is ErrorCode.PERMISSION_DENIED, reply
        assert "the group proof does not match" in reply.message
        name = "refused"
    elif isinstance(reply, Wait):
        name = "wait"
    else:
        assert isinstance(reply, Decision), reply
        name = "decides"
    return name + ("+dismiss" if dismissed else "")


def running(proof: str = "old", local_ranks: int = 4) -> GroupState:
    """A group whose first lifetime decided round 1 with ``proof``."""
    state: GroupState | None = None
    step: Step | None = None
    for rank in range(local_ranks):
        step = policy.propose(
            state, prop(rank, proof, local_ranks=local_ranks), 0.0, TIMEOUT, ceiling=CEILING
        )
        state = step.state
    assert step is not None and isinstance(step.reply, Decision)
    assert step.state.proof == proof
    return step.state


def arrive(
    state: GroupState | None, arrivals: list[tuple[int, str]], local_ranks: int = 4
) -> tuple[GroupState | None, list[str], list[Step]]:
    kinds: list[str] = []
    steps: list[Step] = []
    for rank, proof in arrivals:
        req = BIG if proof.startswith("S") else SMALL
        step = policy.propose(
            state,
            prop(rank, proof, req=req, local_ranks=local_ranks),
            1.0,
            TIMEOUT,
            ceiling=CEILING,
        )
        kinds.append(kind(step))
        steps.append(step)
        state = step.state
    return state, kinds, steps


# (arrivals as (rank, proof), what each did, the proof the round closed with)
# "A": the real ranks' proof, "S"/"S2": strangers'.
CASES = {
    "all real ranks": (
        [(0, "A"), (1, "A"), (2, "A"), (3, "A")],
        ["wait", "wait", "wait", "decides"],
        "A",
    ),
    "a stranger for the last slot, against a majority: refused at once": (
        [(0, "A"), (1, "A"), (2, "A"), (3, "S"), (3, "A")],
        ["wait", "wait", "wait", "refused", "decides"],
        "A",
    ),
    "a stranger without any proof is a stranger": (
        [(0, "A"), (1, "A"), (2, "A"), (3, ""), (3, "A")],
        ["wait", "wait", "wait", "refused", "decides"],
        "A",
    ),
    "a stranger early: the real rank takes its slot back": (
        [(0, "A"), (3, "S"), (1, "A"), (2, "A"), (3, "A")],
        ["wait", "wait", "wait", "wait", "decides+dismiss"],
        "A",
    ),
    "a stranger first: the real ranks, more, take the slot back": (
        [(3, "S"), (0, "A"), (1, "A"), (2, "A"), (3, "A")],
        ["wait", "wait", "wait", "wait", "decides+dismiss"],
        "A",
    ),
    "a stranger cannot take a slot from a proof holding more": (
        [(0, "A"), (1, "A"), (2, "A"), (0, "S"), (3, "A")],
        ["wait", "wait", "wait", "refused", "decides"],
        "A",
    ),
    "two slots each, the real ranks opened the round: the tie is theirs": (
        [(0, "A"), (1, "A"), (2, "S"), (3, "S"), (2, "A"), (3, "A")],
        ["wait", "wait", "wait", "wait", "wait+dismiss", "decides+dismiss"],
        "A",
    ),
    "two strangers: each is refused or displaced": (
        [(0, "A"), (3, "S"), (1, "A"), (2, "S2"), (2, "A"), (3, "A")],
        ["wait", "wait", "wait", "wait", "wait+dismiss", "decides+dismiss"],
        "A",
    ),
    "a stranger holding most slots first: a real rank is refused (squatted first)": (
        [(0, "S"), (1, "S"), (2, "S"), (3, "A"), (3, "S")],
        ["wait", "wait", "wait", "refused", "decides"],
        "S",
    ),
}


@pytest.mark.parametrize("start", ["first lifetime", "restart"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_round_closes_only_with_one_proof_in_every_slot(case: str, start: str) -> None:
    arrivals, expected, winner = CASES[case]
    before = running() if start == "restart" else None
    state, kinds, steps = arrive(before, arrivals)
    assert kinds == expected
    closing = steps[-1]
    assert isinstance(closing.reply, Decision) and state is not None
    assert state.proof == winner
    # The decision is the winning proof's need alone (the strangers ask for BIG).
    assert closing.reply.plan.capacities == (SMALL if winner == "A" else BIG).capacities
    assert state.lifetime_index == (2 if start == "restart" else 1)
    assert {r.lifetime.split("-")[0] for r in state.current_ranks()} == {winner}
    refused = sum(k.startswith("refused") or "dismiss" in k for k in kinds)
    assert state.refused_proposals == refused
    for step in steps:
        events = [e.event for e in step.effects if isinstance(e, Publish)]
        if step.reply is not None and kind(step).startswith(("refused", "wait+", "decides+")):
            assert any(e.kind is EventKind.PROOF_REFUSED for e in events), kind(step)


def test_a_refused_proposal_leaves_the_round_untouched_and_persists_nothing() -> None:
    state, _, _ = arrive(None, [(0, "A"), (1, "A"), (2, "A")])
    assert state is not None
    step = policy.propose(state, prop(3, "S", req=BIG), 2.0, TIMEOUT, ceiling=CEILING)
    assert isinstance(step.reply, Refusal) and step.reply.code is ErrorCode.PERMISSION_DENIED
    assert "group 'g/ep4' rank 3: the group proof does not match" in step.reply.message
    assert "already holds 3 of the 4 local ranks" in step.reply.message
    assert step.state == replace(state, refused_proposals=1)
    assert not step.persists


def test_a_displaced_proposal_is_answered_alone() -> None:
    _, _, steps = arrive(None, [(0, "A"), (3, "S"), (1, "A"), (2, "A"), (3, "A")])
    dismissed = [e for e in steps[-1].effects if isinstance(e, Dismiss)]
    assert [(d.lifetime_index, d.round, d.lifetime) for d in dismissed] == [(1, 1, "S-3-4")]
    assert dismissed[0].outcome.code is ErrorCode.PERMISSION_DENIED
    assert "was taken back by a proposal with proof" in dismissed[0].outcome.message


def test_once_a_lifetime_has_a_proof_every_other_proof_is_refused() -> None:
    state = running("A")
    stolen = prop(0, "S", rnd=2, lifetime="A-0-4")  # the lifetime leaked, not the proof
    step = policy.propose(state, stolen, 1.0, TIMEOUT, ceiling=CEILING)
    assert isinstance(step.reply, Refusal) and step.reply.code is ErrorCode.PERMISSION_DENIED
    assert "runs with proof" in step.reply.message
    ok = policy.propose(state, prop(0, "A", rnd=2, lifetime="A-0-4"), 1.0, TIMEOUT, ceiling=CEILING)
    assert isinstance(ok.reply, Wait)


@pytest.mark.parametrize(
    ("proof", "refused"),
    [("A", False), ("S", True), ("", True)],
)
def test_a_commit_carries_the_lifetimes_proof(proof: str, refused: bool) -> None:
    state = running("A")
    decision = state.outcome_of(1)
    assert isinstance(decision, Decision)
    record = CommitRecord(0, "A-0-4", 1, decision.plan, 1.0, proof=proof)
    step = policy.commit(state, record, 2.0, ceiling=CEILING)
    if refused:
        assert isinstance(step.reply, Refusal) and step.reply.code is ErrorCode.PERMISSION_DENIED
        assert step.state.rank(0) == state.rank(0) and step.state.refused_proposals == 1
    else:
        assert step.reply is None and step.state.rank(0).committed_generation == 1  # type: ignore[union-attr]


def test_a_strangers_other_shape_refuses_only_itself() -> None:
    state, _, _ = arrive(None, [(0, "A")])
    both = policy.propose(state, prop(3, "S", req=OTHER_SHAPE), 1.0, TIMEOUT, ceiling=CEILING)
    with pytest.raises(PreconditionFailed, match="ranks disagree"):
        # Its own proof's proposals disagree: that refuses it alone, in a mixed round.
        policy.propose(both.state, prop(2, "S", req=SMALL), 1.0, TIMEOUT, ceiling=CEILING)
    # Another proof's other shape does not make the real ranks' round refused.
    mixed = policy.propose(state, prop(3, "S", req=OTHER_SHAPE), 1.0, TIMEOUT, ceiling=CEILING)
    assert kind(mixed) == "wait"
    _, kinds, _ = arrive(mixed.state, [(1, "A"), (2, "A"), (3, "A")])
    assert kinds == ["wait", "wait", "decides+dismiss"]


def test_a_stranger_leaving_a_mixed_round_is_withdrawn_not_a_departure() -> None:
    state, _, _ = arrive(None, [(0, "A"), (3, "S")])
    assert state is not None
    step = policy.depart(state, 3, "S-3-4", "its session stream closed", 2.0)
    assert step is not None and step.state.open_round is not None
    assert [p.ep_rank for p in step.state.open_round.proposals] == [0]
    assert step.state.rank(3) is None and step.reply is None
    _, kinds, _ = arrive(step.state, [(1, "A"), (2, "A"), (3, "A")])
    assert kinds == ["wait", "wait", "decides"]


# --- squatting: a takeover by more local ranks ---------------------------------------


def test_the_real_ranks_take_a_squatted_group_back_without_its_plan() -> None:
    squat = policy.propose(
        None, prop(0, "S", req=BIG, local_ranks=1), 0.0, TIMEOUT, ceiling=CEILING
    )
    assert isinstance(squat.reply, Decision) and squat.state.plan is not None
    state, kinds, steps = arrive(squat.state, [(r, "A") for r in range(4)])
    assert kinds == ["wait", "wait", "wait", "decides"]
    assert state is not None and isinstance(steps[-1].reply, Decision)
    assert steps[-1].reply.plan.capacities == SMALL.capacities  # not the squatter's BIG
    assert (state.epoch, state.local_ranks, state.proof) == (1, 4, "A")
    assert state.generation == 2 and [g.plan for g in state.history] == [state.plan]
    assert steps[-1].replicates


def test_fewer_local_ranks_never_end_a_lifetime_and_a_restart_keeps_one_layout() -> None:
    state = running("A")
    with pytest.raises(PreconditionFailed, match="fewer local ranks may not end"):
        policy.propose(state, prop(0, "S", req=BIG, local_ranks=1), 1.0, TIMEOUT, ceiling=CEILING)
    pair = running("A", local_ranks=2)
    opened = policy.propose(
        pair, prop(0, "B"), 1.0, TIMEOUT, ceiling=CEILING
    )  # a takeover by 4 local ranks
    with pytest.raises(PreconditionFailed, match="restart collects local_ranks=4"):
        policy.propose(opened.state, prop(1, "S", local_ranks=3), 1.0, TIMEOUT, ceiling=CEILING)


def test_a_restart_with_the_same_layout_inherits_the_stored_plan() -> None:
    state = running("A")
    grown = policy.propose(
        state, prop(0, "A", rnd=2, lifetime="A-0-4"), 0.0, TIMEOUT, ceiling=CEILING
    ).state
    _, kinds, steps = arrive(grown, [(r, "B") for r in range(4)])
    assert kinds[-1] == "decides"
    assert steps[-1].state.epoch == 0  # no takeover: the union goes on


# --- the workspace ceiling -------------------------------------------------------------

LOW = ceiling_of(1 << 30)
"""A ceiling of 1 GiB per rank, in the releases' own arithmetic."""


def _stored_plan() -> Plan:
    plan = running("A").plan
    assert plan is not None
    return plan


@pytest.mark.parametrize(
    ("what", "call"),
    [
        (
            "a proposal",
            lambda: policy.propose(None, prop(0, "A", req=BIG), 0.0, TIMEOUT, ceiling=LOW),
        ),
        (
            "a proposal under the default ceiling, of the reported attack's 12.5 M tokens",
            lambda: policy.propose(
                None,
                prop(0, "A", req=Requirement(Capacities(12_500_000, 4800, 200, 2, 16), "")),
                0.0,
                TIMEOUT,
                ceiling=CEILING,
            ),
        ),
        (
            "a commit",
            lambda: policy.commit(
                running("A"),
                CommitRecord(
                    0,
                    "A-0-4",
                    1,
                    replace(_stored_plan(), capacities=BIG.capacities),
                    1.0,
                    proof="A",
                ),
                1.0,
                ceiling=LOW,
            ),
        ),
        (
            "a cluster document",
            lambda: policy.merge(
                None,
                cluster_plan_of(
                    policy.propose(
                        None, prop(0, "A", req=BIG, local_ranks=1), 0.0, TIMEOUT, ceiling=CEILING
                    ).state
                ),
                1.0,
                ceiling=LOW,
            ),
        ),
    ],
)
def test_the_ceiling_refuses_naming_itself(what: str, call: object) -> None:
    assert callable(call)
    with pytest.raises(InvalidArgument, match=r"above the per-rank workspace ceiling of \d+ bytes"):
        call()


def test_a_round_whose_plan_would_pass_the_ceiling_is_refused() -> None:
    # Each layer under the ceiling alone; their union above it.
    tokens = Requirement(Capacities(1 << 18, 100, 200, 2, 16), "tokens")
    wide = Requirement(Capacities(256, 4096, 200, 2, 16), "wide")
    ceiling = LOW
    first: Step = policy.propose(
        None, prop(0, "A", req=tokens, local_ranks=1), 0.0, TIMEOUT, ceiling=CEILING
    )
    step = policy.propose(
        first.state,
        prop(0, "A", req=wide, local_ranks=1, rnd=2, lifetime="A-0-1"),
        1.0,
        TIMEOUT,
        ceiling=ceiling,
    )
    assert isinstance(step.reply, Refusal) and step.reply.code is ErrorCode.FAILED_PRECONDITION
    assert "would grow the plan out of range" in step.reply.message
    assert f"workspace ceiling of {ceiling.max_bytes} bytes" in step.reply.message
    assert step.state.plan == first.state.plan


def test_a_stored_plan_above_a_lowered_ceiling_is_never_answered() -> None:
    state = policy.propose(
        None, prop(0, "A", req=BIG, local_ranks=1), 0.0, TIMEOUT, ceiling=CEILING
    ).state
    step = policy.propose(state, prop(0, "B", req=SMALL, local_ranks=1), 1.0, TIMEOUT, ceiling=LOW)
    assert isinstance(step.reply, Refusal) and step.reply.code is ErrorCode.FAILED_PRECONDITION
    assert "needs the stored plan" in step.reply.message and "ResetGroup" in step.reply.message


@pytest.mark.parametrize("release", [r.name for r in flashinfer.RELEASES])
def test_the_ceiling_check_is_one_pure_function_of_the_release(release: str) -> None:
    small = flashinfer.workspace_size(release, SMALL.capacities, 4)
    limits.check_workspace_ceiling("plan", SMALL.capacities, 4, ceiling_of(small), release)
    with pytest.raises(InvalidArgument) as caught:
        limits.check_workspace_ceiling("plan", SMALL.capacities, 4, ceiling_of(small - 1), release)
    assert caught.value.field == "plan" and caught.value.value == small
    with pytest.raises(InvalidArgument) as caught:
        limits.check_workspace_ceiling("plan", BIG.capacities, 4, LOW, release)
    big = flashinfer.workspace_size(release, BIG.capacities, 4)
    assert caught.value.field == "plan" and caught.value.value == big


def test_a_release_the_size_function_does_not_know_is_refused_naming_it() -> None:
    with pytest.raises(InvalidArgument) as caught:
        limits.check_workspace_ceiling("plan", SMALL.capacities, 4, CEILING, "9.9.9")
    assert caught.value.field == "release" and "'9.9.9'" in caught.value.message
