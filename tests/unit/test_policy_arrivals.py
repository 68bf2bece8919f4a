"""The arrivals of a lifetime's first round (``moe_sidecar.core.policy.arrivals``),
table-driven, no I/O: who is shown, who is named at the deadline, and what a
stranger's arrival cannot do."""

from __future__ import annotations

from dataclasses import replace

import pytest

from moe_sidecar.core.errors import ErrorCode, InvalidArgument
from moe_sidecar.core.group import GroupState, OpenRound, Proposal, RankRecord, Requirement
from moe_sidecar.core.plan import Capacities
from moe_sidecar.core.policy.arrivals import (
    UNCOUNTED,
    Arrival,
    Arrivals,
    arrive,
    arrived_ranks,
    expire_arrivals,
    has_proposed,
    proposed,
    withdraw,
)

pytestmark = pytest.mark.timeout(30)

TIMEOUT = 10.0


def _arrival(rank: int, lifetime: str = "", ep_size: int = 4, local: int = 4) -> Arrival:
    return Arrival("g", ep_size, rank, local, lifetime or f"lifetime-{rank}")


def _held(*arrivals: tuple[Arrival, float]) -> Arrivals:
    held = Arrivals()
    for a, at in arrivals:
        held = arrive(held, a, at, TIMEOUT)
    return held


@pytest.mark.parametrize(
    ("arrivals", "now", "timed_out", "named", "still_waiting"),
    [
        # Rank 0 came at 0, rank 1 at 5: at 10 only rank 0's wait ends.
        (
            [(0, 0.0), (1, 5.0)],
            10.0,
            [0],
            ["rank 2 (never arrived)", "rank 3 (never arrived)"],
            [1],
        ),
        ([(0, 0.0), (1, 5.0)], 9.9, [], [], [0, 1]),
        ([(0, 0.0), (1, 5.0)], 15.0, [0, 1], ["rank 2 (never arrived)"], []),
    ],
)
def test_each_arrival_ends_at_its_own_deadline_naming_the_ranks_not_there(
    arrivals: list[tuple[int, float]],
    now: float,
    timed_out: list[int],
    named: list[str],
    still_waiting: list[int],
) -> None:
    held = _held(*((_arrival(rank), at) for rank, at in arrivals))
    after, answers = expire_arrivals(held, now, None)
    assert [a.ep_rank for a, _ in answers] == timed_out
    for _, refusal in answers:
        assert refusal.code is ErrorCode.DEADLINE_EXCEEDED
        for text in named:
            assert text in refusal.message, refusal.message
        assert "rank 0 (" not in refusal.message and "rank 1 (" not in refusal.message
        assert refusal.missing_ranks == (2, 3)
    assert sorted(a.ep_rank for a in after.waiting) == still_waiting


def test_a_timeout_names_the_last_layer_of_an_earlier_lifetime_and_a_rank_gone() -> None:
    known = GroupState(
        name="g",
        ep_size=4,
        local_ranks=4,
        ranks=(RankRecord(3, "old", 1, last_round=59, last_layer="model.layers.61.mlp"),),
    )
    held = _held((_arrival(0), 0.0), (_arrival(1), 0.0), (_arrival(2), 1.0))
    held = withdraw(held, "lifetime-2")  # rank 2's call ended: it died
    _, answers = expire_arrivals(held, 10.0, known)
    message = answers[0][1].message
    assert "rank 3 (never arrived, last layer 'model.layers.61.mlp')" in message, message
    assert "rank 2 (arrived, then its call ended (it died or gave up))" in message, message
    assert "ranks arrived: [0, 1]" in message


@pytest.mark.parametrize(
    ("steps", "shown", "left"),
    [
        # A rank's own proposal answers its arrival; the others stay shown.
        ([("arrive", 0, "a"), ("arrive", 1, "b"), ("propose", 0, "a")], (1,), ()),
        # A retry of one lifetime replaces its arrival (one rank, shown once).
        ([("arrive", 0, "a"), ("arrive", 0, "a")], (0,), ()),
        # A stranger arriving as rank 1 is shown as arrived; the real rank 1 too.
        ([("arrive", 1, "real"), ("arrive", 1, "stranger")], (1,), ()),
        # A withdrawn arrival is remembered as gone until a process of its rank proposes.
        ([("arrive", 0, "a"), ("arrive", 1, "b"), ("withdraw", 1, "b")], (0,), (1,)),
        ([("arrive", 1, "b"), ("withdraw", 1, "b"), ("propose", 1, "c")], (), ()),
        # Withdrawing a lifetime that is not waiting changes nothing.
        ([("arrive", 0, "a"), ("withdraw", 1, "x")], (0,), ()),
    ],
)
def test_who_is_shown_as_arrived_and_who_as_gone(
    steps: list[tuple[str, int, str]], shown: tuple[int, ...], left: tuple[int, ...]
) -> None:
    held = Arrivals()
    for verb, rank, lifetime in steps:
        if verb == "arrive":
            held = arrive(held, _arrival(rank, lifetime), 0.0, TIMEOUT)
        elif verb == "propose":
            held = proposed(held, lifetime, rank)
        else:
            held = withdraw(held, lifetime)
    assert arrived_ranks(held) == shown
    assert held.left == left


def test_ranks_already_proposing_are_not_counted_as_arrived_twice() -> None:
    held = _held((_arrival(0), 0.0), (_arrival(1), 0.0))
    # Rank 0 has proposed (it waits in the open round); its arrival is not shown twice.
    proposal = Proposal("g", 4, 0, 4, "real-0", 1, Requirement(Capacities(16, 200, 400, 2, 8)))
    state = GroupState("g", 4, 4, open_round=OpenRound(1, 0.0, 10.0, proposals=(proposal,)))
    assert arrived_ranks(held, state) == (1,)


_PROPOSAL = Proposal("g", 4, 0, 4, "real-0", 1, Requirement(Capacities(16, 200, 400, 2, 8)))


@pytest.mark.parametrize(
    ("state", "arrival", "expected"),
    [
        (None, _arrival(0, "real-0"), False),
        (GroupState("g", 4, 4), _arrival(0, "real-0"), False),
        # Its proposal waits in the open round, or in a restart.
        (
            GroupState("g", 4, 4, open_round=OpenRound(1, 0.0, 10.0, (_PROPOSAL,))),
            _arrival(0, "real-0"),
            True,
        ),
        (
            GroupState("g", 4, 4, pending=OpenRound(1, 0.0, 10.0, (_PROPOSAL,))),
            _arrival(0, "real-0"),
            True,
        ),
        # Its round closed: the group knows the rank by this lifetime.
        (GroupState("g", 4, 4, ranks=(RankRecord(0, "real-0", 0),)), _arrival(0, "real-0"), True),
        # Another lifetime of the rank, or another rank, proposed: this one waits.
        (GroupState("g", 4, 4, ranks=(RankRecord(0, "old-0", 0),)), _arrival(0, "real-0"), False),
        (
            GroupState("g", 4, 4, open_round=OpenRound(1, 0.0, 10.0, (_PROPOSAL,))),
            _arrival(1, "real-0"),
            False,
        ),
    ],
)
def test_an_arrival_after_its_own_proposal_has_nothing_to_wait_for(
    state: GroupState | None, arrival: Arrival, expected: bool
) -> None:
    assert has_proposed(state, arrival) is expected


def test_a_stranger_cannot_make_a_real_ranks_wait_end_sooner() -> None:
    # The stranger arrived long before the real rank 0; its deadline is its own.
    held = _held((_arrival(1, "stranger"), 0.0), (_arrival(0, "real"), 50.0))
    after, answers = expire_arrivals(held, 55.0, None)
    assert [a.lifetime for a, _ in answers] == ["stranger"]
    assert [a.lifetime for a in after.waiting] == ["real"]
    assert after.next_deadline() == 60.0


def test_other_nodes_ranks_are_said_to_arrive_elsewhere() -> None:
    held = _held((_arrival(0, ep_size=4, local=2), 0.0))
    _, answers = expire_arrivals(held, 10.0, None)
    assert "2 of the 4 ranks run on other nodes" in answers[0][1].message


def test_an_arrival_not_counted_yet_is_taken_and_the_layout_keeps_the_count_known() -> None:
    counted = _held((_arrival(0, ep_size=4, local=2), 0.0))
    assert counted.layout == (4, 2)
    # Rank 1 counts its node's ranks in the exchange its arrival waits on.
    held = arrive(counted, _arrival(1, ep_size=4, local=UNCOUNTED), 1.0, TIMEOUT)
    assert arrived_ranks(held) == (0, 1) and held.layout == (4, 2)
    alone = _held((_arrival(1, ep_size=4, local=UNCOUNTED), 0.0))
    assert alone.layout == (4, UNCOUNTED)
    _, answers = expire_arrivals(alone, 10.0, None)
    message = answers[0][1].message
    assert "rank 0 (never arrived)" in message, message
    assert "ranks of other nodes, if any, arrive at their own sidecars" in message, message
    assert "of the 4 ranks run on other nodes" not in message, message


@pytest.mark.parametrize(
    ("field", "arrival"),
    [
        ("ep_size", _arrival(0, ep_size=0, local=1)),
        ("local_ranks", _arrival(0, local=-1)),
        ("ep_rank", _arrival(4)),
        ("local_ranks", _arrival(0, local=5)),
        ("group", replace(_arrival(0), group="")),
    ],
)
def test_a_bad_arrival_is_refused_naming_the_field_and_changes_nothing(
    field: str, arrival: Arrival
) -> None:
    held = _held((_arrival(0), 0.0))
    with pytest.raises(InvalidArgument, match=field):
        arrive(held, arrival, 1.0, TIMEOUT)
    assert arrived_ranks(held) == (0,)
