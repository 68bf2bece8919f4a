"""A replacement for a departed rank joins the running lifetime: the next
view adds it at a new generation. Table-driven, no I/O, no clock."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import pytest

from moe_sidecar.core import policy
from moe_sidecar.core.effects import Deadline, EventKind, Persist, Publish, Step, Wait
from moe_sidecar.core.errors import CoordinatorError, InvalidArgument, PreconditionFailed
from moe_sidecar.core.group import Decision, GroupState, Proposal, Requirement, summarize
from moe_sidecar.core.identity import proof_id
from moe_sidecar.core.membership import View, ViewState, acknowledge, join, leave
from moe_sidecar.core.plan import Action, Capacities
from moe_sidecar.store.row_codec import decode_group, encode_group
from moe_sidecar.wire import display
from moe_sidecar.wire.codec import (
    event_from_proto,
    event_to_proto,
    summary_from_proto,
    summary_to_proto,
)
from tests.ceiling import CEILING

pytestmark = pytest.mark.timeout(10)

GROUP = "rejoin:fp4/tp1-ep4/pp0"
WORLD = 4
GONE = 3
PROOF = proof_id("the-running-proof-token")
"""Proofs are ids past the boundary (what rows store)."""
RELEASE = "0.7.2.post1"
SMALL = Capacities(256, 100, 200, 2, 16)
BIG = Capacities(512, 100, 200, 2, 16)


def _proposal(
    rank: int,
    lifetime: str,
    *,
    proof: str = PROOF,
    capacities: Capacities = SMALL,
    release: str = RELEASE,
) -> Proposal:
    requirement = Requirement(capacities, "layer.0")
    return Proposal(GROUP, WORLD, rank, WORLD, lifetime, 1, requirement, proof, release)


def _decided(proof: str = PROOF) -> GroupState:
    state: GroupState | None = None
    for rank in range(WORLD):
        state = policy.propose(
            state, _proposal(rank, f"life-{rank}", proof=proof), 0.0, 30.0, ceiling=CEILING
        ).state
    assert state is not None and state.built is not None
    return state


def _departed(proof: str = PROOF) -> GroupState:
    """Rank 3's session broke: view 2 (ranks 0, 1, 2) PROPOSED."""
    step = policy.depart(_decided(proof), GONE, f"life-{GONE}", "killed", 10.0, ack_timeout=5.0)
    assert step is not None
    return step.state


def _committed(proof: str = PROOF) -> GroupState:
    """View 2 committed by the three survivors at 5 all-to-all rounds."""
    state = _departed(proof)
    for rank in range(GONE):
        state = policy.acknowledge_view(state, rank, f"life-{rank}", 2, 5, 11.0).state
    view = state.current_view()
    assert view is not None and view.state is ViewState.COMMITTED and view.number == 2
    return state


def _arrive(state: GroupState, p: Proposal) -> Step:
    return policy.propose(state, p, 20.0, 30.0, ceiling=CEILING)


def test_a_replacement_with_the_running_proof_gets_the_join_view() -> None:
    state = _committed()
    step = _arrive(state, _proposal(GONE, "life-3b"))
    generation = state.generation + 1
    assert state.plan is not None
    assert step.reply == Decision(
        1, Action.REBUILD, replace(state.plan, generation=generation), False, "layer.0"
    )
    view = step.state.current_view()
    assert view is not None
    assert view == View(
        3, (0, 1, 2, 3), generation, ViewState.PROPOSED, view.cause, 50.0, joined=(GONE,)
    )
    assert "rank 3 rejoined as lifetime life-3b" in view.cause
    assert step.state.generation == generation  # reserved: never issued again
    assert step.state.lifetime_index == state.lifetime_index  # no restart
    assert step.state.pending is None and step.state.plan == state.plan
    record = step.state.rank(GONE)
    assert record is not None and (record.lifetime, record.left) == ("life-3b", "")
    assert record.ended_lifetime == f"life-{GONE}"
    persist, publish, deadline = step.effects
    assert isinstance(persist, Persist) and deadline == Deadline(50.0)
    assert isinstance(publish, Publish) and publish.event.kind is EventKind.VIEW_CHANGED
    assert publish.event.view == view and publish.event.ep_rank == GONE
    assert publish.event.message.startswith(
        f"view 3 proposed: members 0, 1, 2, 3 (3 joined) at generation {generation}"
    )
    summary = summarize(step.state)
    listed = display.format_groups([summary])  # what `moe-sidecar groups` prints
    assert (
        f"  view 3 proposed: members 0, 1, 2, 3 (3 joined) at generation {generation}, due "
        in listed
    )
    [document] = display.groups_as_json([summary])
    assert document["view"]["joined"] == [GONE]
    # GetGroup and Watch carry who joined.
    assert summary_from_proto(summary_to_proto(summary)).view == view
    decoded = event_from_proto(event_to_proto(publish.event, (3, "")))
    assert decoded is not None and decoded.view == view


def test_every_member_acknowledging_commits_the_join_view() -> None:
    state = _arrive(_committed(), _proposal(GONE, "life-3b")).state
    lifetimes = {0: "life-0", 1: "life-1", 2: "life-2", GONE: "life-3b"}
    events = []
    for rank, rounds in ((0, 7), (GONE, 0), (1, 7), (2, 7)):
        step = policy.acknowledge_view(state, rank, lifetimes[rank], 3, rounds, 21.0)
        state = step.state
        events += [e.event for e in step.effects if isinstance(e, Publish)]
    view = state.current_view()
    assert view is not None and view.state is ViewState.COMMITTED
    assert [e.view for e in events] == [view]
    assert decode_group(encode_group(state)).current_view() == view


def test_the_old_lifetime_of_the_replaced_rank_counts_for_nothing() -> None:
    state = _arrive(_committed(), _proposal(GONE, "life-3b")).state
    assert policy.depart(state, GONE, f"life-{GONE}", "late", 22.0) is None
    with pytest.raises(PreconditionFailed):
        policy.acknowledge_view(state, GONE, f"life-{GONE}", 3, 0, 22.0)


def _expired() -> GroupState:
    step = policy.expire(_departed(), 15.0)
    assert step is not None
    return step.state


@dataclass(frozen=True)
class Refused:
    name: str
    state: Callable[[], GroupState]
    proposal: Proposal
    error: type[CoordinatorError]
    needle: str


REFUSED = [
    Refused(
        "a member still here",
        _committed,
        _proposal(1, "life-1b"),
        PreconditionFailed,
        "rank 1 of group 'rejoin:fp4/tp1-ep4/pp0' is still here as lifetime life-1",
    ),
    Refused(
        "the view still proposed",
        _departed,
        _proposal(GONE, "life-3b"),
        PreconditionFailed,
        "cannot rejoin now: view 2 is still proposed",
    ),
    Refused(
        "a failed view",
        _expired,
        _proposal(GONE, "life-3b"),
        PreconditionFailed,
        "view 2 failed",
    ),
    Refused(
        "a rank outside ep_size",
        _committed,
        _proposal(WORLD, "life-4"),
        InvalidArgument,
        "ep_rank",
    ),
    Refused(
        "another release",
        _committed,
        _proposal(GONE, "life-3b", release="0.7.4"),
        PreconditionFailed,
        "rejoins building with FlashInfer '0.7.4'",
    ),
    Refused(
        "a layer the stored plan does not serve",
        _committed,
        _proposal(GONE, "life-3b", capacities=BIG),
        PreconditionFailed,
        "a replacement rebuilds at the stored plan",
    ),
]


@pytest.mark.parametrize("case", REFUSED, ids=[c.name for c in REFUSED])
def test_a_rejoin_is_refused_changing_nothing(case: Refused) -> None:
    state = case.state()
    with pytest.raises(case.error) as info:
        _arrive(state, case.proposal)
    assert case.needle in info.value.message


@pytest.mark.parametrize(
    ("group_proof", "newcomer_proof"),
    [(PROOF, proof_id("a-new-restart-proof")), ("", "")],
    ids=["another proof", "a group without proofs"],
)
def test_without_the_running_proof_a_new_lifetime_is_a_restart(
    group_proof: str, newcomer_proof: str
) -> None:
    state = _committed(group_proof)
    step = _arrive(state, _proposal(GONE, "life-3b", proof=newcomer_proof))
    assert isinstance(step.reply, Wait) and step.reply.lifetime_index == state.lifetime_index + 1
    assert step.state.pending is not None and step.state.current_view() == state.current_view()


def test_the_survivors_counts_decide_a_join_the_newcomers_is_not_compared() -> None:
    committed = View(2, (0, 1, 2), 1, ViewState.COMMITTED, "rank 3 left")
    joining = join(committed, 3, 2, "rank 3 rejoined", 0.0, 5.0)
    assert joining.joined == (3,) and joining.members == (0, 1, 2, 3)
    agreed = joining
    for rank, rounds in ((0, 9), (1, 9), (2, 9), (3, 0)):
        agreed = acknowledge(agreed, rank, 3, rounds, 1.0)
    assert agreed.state is ViewState.COMMITTED
    torn = joining
    for rank, rounds in ((0, 9), (1, 8), (2, 9), (3, 0)):
        torn = acknowledge(torn, rank, 3, rounds, 1.0)
    assert torn.state is ViewState.FAILED
    assert "(rank 0 at 9, rank 1 at 8, rank 2 at 9)" in torn.cause


def test_a_member_leaving_an_open_join_keeps_the_newcomer_joined() -> None:
    committed = View(2, (0, 1, 2), 1, ViewState.COMMITTED, "rank 3 left")
    joining = join(committed, 3, 2, "rank 3 rejoined", 0.0, 5.0)
    following = leave(joining, 1, "rank 1 left", 1.0, 5.0)
    assert following is not None
    assert (following.members, following.generation, following.joined) == ((0, 2, 3), 2, (3,))


def test_a_replacements_retried_round_1_gets_the_same_rebuild() -> None:
    first = _arrive(_committed(), _proposal(GONE, "life-3b"))
    retried = _arrive(first.state, _proposal(GONE, "life-3b"))
    assert retried.reply == first.reply and retried.effects == ()
    assert retried.state == first.state
    survivor = _arrive(first.state, _proposal(0, "life-0"))  # the group's own round 1
    assert isinstance(survivor.reply, Decision) and survivor.reply.action is Action.BUILD


def test_a_replacement_leaving_before_its_join_commits_gives_back_the_built_generation() -> None:
    committed = _committed()
    joining = _arrive(committed, _proposal(GONE, "life-3b")).state
    step = policy.depart(joining, GONE, "life-3b", "killed again", 21.0, ack_timeout=5.0)
    assert step is not None
    view = step.state.current_view()
    assert view is not None and committed.built is not None
    assert (view.number, view.members, view.state) == (4, (0, 1, 2), ViewState.PROPOSED)
    assert view.generation == committed.built.generation and view.joined == ()
    # Once a join committed, its generation is the members' own: a later death keeps it.
    state = joining
    for rank, lifetime in ((0, "life-0"), (1, "life-1"), (2, "life-2"), (GONE, "life-3b")):
        state = policy.acknowledge_view(state, rank, lifetime, 3, 0, 21.0).state
    after = policy.depart(state, 1, "life-1", "killed", 22.0, ack_timeout=5.0)
    assert after is not None
    later = after.state.current_view()
    assert later is not None and later.generation == committed.generation + 1
