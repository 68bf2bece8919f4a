"""Group states for the codec and store tests, made by the real decision core."""

from __future__ import annotations

import hashlib
from dataclasses import replace

from moe_sidecar.core import policy
from moe_sidecar.core.group import CommitRecord, Decision, GroupState, Proposal, Requirement
from moe_sidecar.core.plan import Capacities
from moe_sidecar.flashinfer import v0_7_4
from tests.ceiling import CEILING

SMALL = Requirement(Capacities(256, 100, 200, 2, 16), "l0")
BIG = Requirement(Capacities(512, 400, 200, 2, 16, eplb_experts=16), "mtp")
RICH_RELEASE = v0_7_4.RELEASE.name
OWNER = hashlib.sha256(b"the group's owner key and name").hexdigest()


def _proposal(rank: int, rnd: int, req: Requirement, lifetime: str = "a") -> Proposal:
    # A release other than the default, so the rows carry it.
    # And an owner, so the rows carry one.
    return Proposal(
        "g/ep4", 4, rank, 3, f"{lifetime}{rank}", rnd, req, release=RICH_RELEASE, owner=OWNER
    )


def rich_state() -> GroupState:
    """A group with history, a commit, a refusal, a timeout and an open round."""
    state: GroupState | None = None
    decision = None
    for rnd, req in ((1, SMALL), (2, BIG)):
        for rank in range(3):
            step = policy.propose(
                state, _proposal(rank, rnd, req), 1.0 * rnd, 30.0, ceiling=CEILING
            )
            state, decision = step.state, step.reply
    assert state is not None and isinstance(decision, Decision)
    state = policy.commit(
        state, CommitRecord(0, "a0", 2, decision.plan, 0.125), 3.0, ceiling=CEILING
    ).state
    other = Requirement(replace(BIG.capacities, top_k=4), "mtp")
    state = policy.propose(state, _proposal(0, 3, other), 4.0, 30.0, ceiling=CEILING).state
    state = policy.propose(state, _proposal(0, 4, BIG), 5.0, 30.0, ceiling=CEILING).state
    expired = policy.expire(state, 100.0)
    assert expired is not None
    state = policy.propose(expired.state, _proposal(1, 5, BIG), 101.0, 30.0, ceiling=CEILING).state
    assert state.open_round is not None and state.open_round.need is not None
    return state
