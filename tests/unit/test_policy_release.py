"""Table-driven tests of the release rule: one FlashInfer release per group, its own size.

A proposal states the release its rank builds with; the core refuses ranks
of one round (or of one running lifetime) that state different releases,
naming both and the ranks, and measures the ceiling with the release's own
size function. No I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from moe_sidecar import flashinfer
from moe_sidecar.core import policy
from moe_sidecar.core.effects import Step, Wait
from moe_sidecar.core.errors import ErrorCode, InvalidArgument
from moe_sidecar.core.group import Decision, GroupState, Proposal, Refusal, Requirement
from moe_sidecar.core.plan import Capacities
from moe_sidecar.flashinfer import v0_7_2_post1, v0_7_4
from tests.ceiling import CEILING, ceiling_of

pytestmark = pytest.mark.timeout(10)

OLD = v0_7_2_post1.RELEASE.name
NEW = v0_7_4.RELEASE.name
TIMEOUT = 30.0
LAYER = Requirement(Capacities(256, 3648, 14336, 8, 256), "model.layers.3.mlp")


def prop(rank: int, release: str, rnd: int = 1, lifetime: str = "a", local: int = 3) -> Proposal:
    return Proposal("g/ep3", 3, rank, local, f"{lifetime}{rank}", rnd, LAYER, release=release)


def arrive(state: GroupState | None, proposals: list[Proposal], now: float = 1.0) -> list[Step]:
    steps = []
    for p in proposals:
        step = policy.propose(state, p, now, TIMEOUT, ceiling=CEILING)
        steps.append(step)
        state = step.state
    return steps


@dataclass(frozen=True)
class RoundCase:
    name: str
    releases: tuple[str, ...]
    """The release each rank (0, 1, 2 in order) states in round 1."""
    refused_by: int | None
    """The rank whose proposal closes the round refused (None: decided)."""
    named: tuple[str, ...] = ()


ROUND_CASES = [
    RoundCase("all the newer release", (NEW, NEW, NEW), None),
    RoundCase("all the older release", (OLD, OLD, OLD), None),
    RoundCase("the last rank differs", (NEW, NEW, OLD), 2, ("rank(s) 0, 1", "rank 2")),
    RoundCase("the second rank differs", (OLD, NEW, NEW), 1, ("rank(s) 0", "rank 1")),
]


@pytest.mark.parametrize("case", ROUND_CASES, ids=lambda c: c.name)
def test_ranks_of_one_round_state_one_release(case: RoundCase) -> None:
    steps = arrive(None, [prop(rank, release) for rank, release in enumerate(case.releases)])
    if case.refused_by is None:
        decision = steps[-1].reply
        assert isinstance(decision, Decision)
        assert steps[-1].state.release == case.releases[0]
        return
    refusal = steps[case.refused_by].reply
    assert isinstance(refusal, Refusal) and refusal.code is ErrorCode.FAILED_PRECONDITION
    assert f"FlashInfer {OLD!r}" in refusal.message and f"FlashInfer {NEW!r}" in refusal.message
    for text in case.named:
        assert text in refusal.message
    # The round is closed for every rank in it: nothing is decided, nothing stored.
    assert steps[case.refused_by].state.plan is None
    assert steps[case.refused_by].state.open_round is None


def _decided_in(release: str) -> GroupState:
    steps = arrive(None, [prop(rank, release) for rank in range(3)])
    assert isinstance(steps[-1].reply, Decision)
    return steps[-1].state


def test_a_running_lifetime_keeps_its_release() -> None:
    state = _decided_in(NEW)
    step = arrive(state, [prop(0, OLD, rnd=2)], now=2.0)[0]
    refusal = step.reply
    assert isinstance(refusal, Refusal) and refusal.code is ErrorCode.FAILED_PRECONDITION
    assert "rank 0 builds with FlashInfer" in refusal.message
    assert f"ranks 1, 2 of the group build with FlashInfer {NEW!r}" in refusal.message
    assert step.state.release == NEW and step.state.plan == state.plan


def test_a_restart_may_bring_another_release() -> None:
    # Every rank restarting with another FlashInfer (an upgrade) is a new lifetime.
    state = _decided_in(OLD)
    steps = arrive(state, [prop(rank, NEW, lifetime="b") for rank in range(3)], now=3.0)
    assert all(isinstance(s.reply, Wait) for s in steps[:-1])
    assert isinstance(steps[-1].reply, Decision)
    assert steps[-1].state.release == NEW and steps[-1].state.lifetime_index == 2


@pytest.mark.parametrize("release", [OLD, NEW])
def test_the_ceiling_is_measured_in_the_proposals_release(release: str) -> None:
    other = NEW if release == OLD else OLD
    mine = flashinfer.workspace_size(release, LAYER.capacities, 3)
    theirs = flashinfer.workspace_size(other, LAYER.capacities, 3)
    assert mine != theirs
    # A ceiling between the two sizes: it admits the smaller release only.
    ceiling = ceiling_of(min(mine, theirs))
    if mine <= theirs:
        step = policy.propose(None, prop(0, release, local=1), 1.0, TIMEOUT, ceiling=ceiling)
        assert isinstance(step.reply, Decision)
        return
    with pytest.raises(InvalidArgument, match=f"derive a workspace of {mine} bytes"):
        policy.propose(None, prop(0, release, local=1), 1.0, TIMEOUT, ceiling=ceiling)
