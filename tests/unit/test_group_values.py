"""Table-driven tests of the round and the group as values
(:class:`~moe_sidecar.core.group.OpenRound`, :class:`~moe_sidecar.core.group.GroupState`):
what each method answers and the copy it makes, with the original untouched.
No I/O, no clock."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from moe_sidecar.core.errors import ErrorCode
from moe_sidecar.core.group import (
    RETAINED_ROUNDS,
    Decision,
    GroupState,
    OpenRound,
    Proposal,
    RankRecord,
    Refusal,
    Requirement,
)
from moe_sidecar.core.plan import Action, Capacities, Plan, ShapeMismatch

pytestmark = pytest.mark.timeout(10)

GROUP = "g/ep4"
LOCAL = 4


def caps(tokens: int = 256, top_k: int = 2) -> Capacities:
    return Capacities(tokens, 100, 200, top_k, 16)


def prop(
    rank: int,
    *,
    tokens: int = 256,
    top_k: int = 2,
    proof: str = "p",
    owner: str = "",
    local_ranks: int = LOCAL,
) -> Proposal:
    """Rank ``rank``'s round-1 proposal at layer l0."""
    need = Requirement(caps(tokens, top_k), "l0")
    return Proposal(GROUP, LOCAL, rank, local_ranks, f"life-{rank}", 1, need, proof, owner=owner)


def opened(*proposals: Proposal) -> OpenRound:
    rnd = OpenRound(number=1, opened_at=0.0, deadline=30.0)
    for p in proposals:
        rnd = rnd.with_proposal(p)
    return rnd


def test_a_proposal_joins_in_rank_order_and_the_need_joins_its_shape_only() -> None:
    empty = OpenRound(number=1, opened_at=0.0, deadline=30.0)
    rnd = opened(prop(2, tokens=512, proof="a"), prop(0, proof="a"), prop(1, top_k=4, proof="b"))
    assert [q.ep_rank for q in rnd.proposals] == [0, 1, 2]
    # The top_k=4 proposal (another proof's) stays out of the need.
    assert rnd.need == caps(512)
    assert rnd.first_proof == "a"  # the proposal that opened the round
    assert empty.proposals == () and empty.need is None  # the original is untouched


def test_a_proposal_leaves_with_its_need_and_the_opening_proof_stays() -> None:
    rnd = opened(prop(0, tokens=1024, proof="a"), prop(1, proof="b"), prop(2, tokens=512))
    rest = rnd.without(0)
    assert [q.ep_rank for q in rest.proposals] == [1, 2]
    assert rest.need == caps(512)  # rebuilt from the rest: rank 0's 1024 tokens are gone
    assert rest.first_proof == "a"  # though the rank that opened it left
    assert rnd.without(3) == rnd  # a rank that did not propose: nothing changes
    assert rnd.proposal_of(0) is not None and len(rnd.proposals) == 3


@dataclass(frozen=True)
class SlotsRow:
    name: str
    proofs: tuple[str, ...]
    """The proof of rank r's proposal."""
    single: bool
    closes_with: str | None
    """The proof the round closes with at LOCAL local ranks."""


SLOTS = [
    SlotsRow("an empty round", (), True, None),
    SlotsRow("one proof, slots missing", ("a", "a", "a"), True, None),
    SlotsRow("one proof in every slot", ("a",) * LOCAL, True, "a"),
    SlotsRow("two proofs in every slot", ("a", "a", "a", "b"), False, None),
    SlotsRow("two proofs, slots missing", ("a", "b"), False, None),
]


@pytest.mark.parametrize("row", SLOTS, ids=[r.name for r in SLOTS])
def test_the_slots_each_proof_holds_and_the_proof_a_round_closes_with(row: SlotsRow) -> None:
    rnd = opened(*(prop(rank, proof=proof) for rank, proof in enumerate(row.proofs)))
    assert sum(rnd.slots_by_proof().values()) == len(row.proofs)
    assert rnd.single_proof() is row.single
    assert rnd.closing_proof(LOCAL) == row.closes_with


@pytest.mark.parametrize(
    ("owners", "stored"),
    [(("o", "o"), "o"), (("o", "x"), ""), (("", ""), ""), ((), "")],
    ids=["one owner", "two owners", "none carried", "no proposals"],
)
def test_the_owner_a_round_stores(owners: tuple[str, ...], stored: str) -> None:
    assert opened(*(prop(rank, owner=o) for rank, o in enumerate(owners))).owner() == stored


def record(rank: int, lifetime: str = "") -> RankRecord:
    return RankRecord(ep_rank=rank, lifetime=lifetime or f"life-{rank}", lifetime_index=1)


@pytest.mark.parametrize(
    ("ranks", "replacing", "expected"),
    [
        ((0, 2), 1, (0, 1, 2)),  # inserted in rank order
        ((1, 2), 0, (0, 1, 2)),
        ((0, 1), 3, (0, 1, 3)),  # appended
        ((0, 1, 2), 1, (0, 1, 2)),  # replaced where it is
    ],
)
def test_a_rank_record_takes_its_rank_s_place(
    ranks: tuple[int, ...], replacing: int, expected: tuple[int, ...]
) -> None:
    state = GroupState(GROUP, LOCAL, LOCAL, ranks=tuple(record(r) for r in ranks))
    new = record(replacing, "new-life")
    changed = state.with_rank(new)
    assert tuple(r.ep_rank for r in changed.ranks) == expected
    assert changed.rank(replacing) == new
    assert changed.ranks == state.ranks_with(new)
    assert tuple(r.ep_rank for r in state.ranks) == ranks  # the original is untouched


def test_a_closed_round_is_kept_for_retries_up_to_the_retained_rounds() -> None:
    plan = Plan(caps(), epoch=0, generation=1)
    state = GroupState(GROUP, LOCAL, LOCAL, open_round=opened(prop(0)))
    for n in range(1, RETAINED_ROUNDS + 3):
        state = state.closed_by(Decision(n, Action.REUSE, plan, False, "l0"))
    refusal = Refusal(RETAINED_ROUNDS + 3, ErrorCode.ABORTED, "gone")
    state = state.closed_by(refusal)
    assert state.open_round is None and state.last_closed_round == RETAINED_ROUNDS + 3
    assert len(state.closed) == RETAINED_ROUNDS and state.closed[-1] == refusal
    assert state.outcome_of(3) is None and state.outcome_of(4) is not None


def test_the_plan_a_round_decides_joins_its_proposals_and_what_was_built() -> None:
    built = Plan(Capacities(256, 900, 200, 2, 16), epoch=0, generation=1)
    state = GroupState(GROUP, LOCAL, LOCAL, plan=built, generation=1, built=built)
    plan = state.decided_plan(opened(prop(0, tokens=512), prop(1)))
    # The proposals' 512 tokens and the built 900 dispatch bytes, as generation 2.
    assert plan == Plan(Capacities(512, 900, 200, 2, 16), epoch=0, generation=2)
    covered = state.decided_plan(opened(prop(0), prop(1)))
    assert covered is built  # covered: the stored plan itself, no new generation
    with pytest.raises(ShapeMismatch):
        state.decided_plan(opened(prop(0, top_k=4)))


@pytest.mark.parametrize(
    ("stored_owner", "owners", "number", "proof", "disowns"),
    [
        ("o", ("o", "o"), 1, None, False),  # its owner: the plan is inherited
        ("o", ("o", "x"), 1, None, True),
        ("", ("", ""), 1, None, True),  # no owner on either side never matches
        ("o", ("x", "x"), 2, None, False),  # not a lifetime's first round
        ("o", ("x", "x"), 1, "p", False),  # the lifetime's proof is fixed: it ran
    ],
)
def test_whether_a_first_round_disowns_the_stored_plan(
    stored_owner: str, owners: tuple[str, ...], number: int, proof: str | None, disowns: bool
) -> None:
    plan = Plan(caps(), epoch=0, generation=1)
    state = GroupState(GROUP, LOCAL, LOCAL, plan=plan, owner=stored_owner, proof=proof)
    rnd = opened(*(prop(rank, owner=o) for rank, o in enumerate(owners)))
    rnd = OpenRound(number, 0.0, 30.0, rnd.proposals, rnd.need, rnd.first_proof)
    assert state.disowns_stored_plan(rnd) is disowns
    assert GroupState(GROUP, LOCAL, LOCAL, owner=stored_owner).disowns_stored_plan(rnd) is False


def test_a_lifetime_whose_round_1_was_refused_never_ran() -> None:
    refused = Refusal(1, ErrorCode.DEADLINE_EXCEEDED, "timed out")
    state = GroupState(GROUP, LOCAL, LOCAL, lifetime_index=1).closed_by(refused)
    assert state.never_ran()
    assert not state.closed_by(Refusal(2, ErrorCode.ABORTED, "gone")).never_ran()
    decided = Decision(1, Action.BUILD, Plan(caps(), 0, 1), True, "l0")
    assert not GroupState(GROUP, LOCAL, LOCAL).closed_by(decided).never_ran()
    assert not GroupState(GROUP, LOCAL, LOCAL).never_ran()  # nothing closed yet


def test_a_restart_collects_its_first_proposal_s_layout() -> None:
    state = GroupState(GROUP, LOCAL, LOCAL)
    assert state.restart_layout() == LOCAL
    pending = opened(prop(0, local_ranks=LOCAL - 1))
    assert GroupState(GROUP, LOCAL, LOCAL, pending=pending).restart_layout() == LOCAL - 1
