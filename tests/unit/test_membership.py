"""Membership views, table-driven: leave, join, acknowledge, expire, mask. No I/O, no clock."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest

from moe_sidecar.core.errors import PreconditionFailed
from moe_sidecar.core.membership import (
    Acknowledgement,
    View,
    ViewState,
    acknowledge,
    expire,
    first_view,
    join,
    leave,
    mask,
)

pytestmark = pytest.mark.timeout(10)

TIMEOUT = 5.0
FIRST = first_view((3, 1, 0, 2), 1, "lifetime 1 began")
"""Four ranks at generation 1, committed."""


def _left(view: View, rank: int, cause: str, now: float) -> View:
    following = leave(view, rank, cause, now, TIMEOUT)
    assert following is not None
    return following


AFTER_DEATH = _left(FIRST, 3, "rank 3's session closed", 10.0)


def test_a_lifetimes_first_view_is_committed_and_holds_every_rank() -> None:
    assert View(1, (0, 1, 2, 3), 1, ViewState.COMMITTED, "lifetime 1 began") == FIRST
    assert mask(FIRST) == 0b1111


def test_a_member_that_leaves_gives_a_proposed_view_of_the_rest() -> None:
    assert (
        View(2, (0, 1, 2), 1, ViewState.PROPOSED, "rank 3's session closed", deadline=15.0)
        == AFTER_DEATH
    )
    assert mask(AFTER_DEATH) == 0b0111
    assert AFTER_DEATH.missing() == (0, 1, 2)


@pytest.mark.parametrize(
    ("view", "rank"),
    [
        (FIRST, 7),  # no member
        (AFTER_DEATH, 3),  # left already
        (replace(FIRST, state=ViewState.FAILED), 0),  # a failed group only stops
    ],
)
def test_nothing_moves_when(view: View, rank: int) -> None:
    assert leave(view, rank, "why", 11.0, TIMEOUT) is None


def test_a_second_death_supersedes_an_open_proposal() -> None:
    acked = acknowledge(AFTER_DEATH, 0, 2, 40, 11.0)
    second = leave(acked, 2, "rank 2's session closed", 12.0, TIMEOUT)
    assert second == View(
        3, (0, 1), 1, ViewState.PROPOSED, "rank 2's session closed", deadline=17.0
    )  # its acknowledgements were for other members


def test_the_last_member_leaving_fails_the_view() -> None:
    view = first_view((0,), 1, "began")
    gone = leave(view, 0, "rank 0 excluded", 1.0, TIMEOUT)
    assert gone is not None and gone.state is ViewState.FAILED and gone.members == ()
    assert "no member is left" in gone.cause


def _acked(view: View, counts: dict[int, int], now: float = 11.0) -> View:
    for rank, rounds in counts.items():
        view = acknowledge(view, rank, view.number, rounds, now)
    return view


@pytest.mark.parametrize(
    ("counts", "state", "cause"),
    [
        ({0: 40, 1: 40}, ViewState.PROPOSED, "rank 3's session closed"),  # rank 2 missing
        ({0: 40, 1: 40, 2: 40}, ViewState.COMMITTED, "rank 3's session closed"),
        (
            {0: 40, 1: 41, 2: 40},
            ViewState.FAILED,
            "quiesced at different all-to-all rounds (rank 0 at 40, rank 1 at 41, rank 2 at 40)",
        ),
    ],
)
def test_a_view_commits_only_at_one_round_count(
    counts: dict[int, int], state: ViewState, cause: str
) -> None:
    view = _acked(AFTER_DEATH, counts)
    assert view.state is state
    assert cause in view.cause
    assert view.deadline == (15.0 if state is ViewState.PROPOSED else None)


def test_a_retried_acknowledgement_changes_nothing() -> None:
    once = _acked(AFTER_DEATH, {0: 40})
    assert acknowledge(once, 0, 2, 40, 12.0) == once
    committed = _acked(AFTER_DEATH, {0: 40, 1: 40, 2: 40})
    assert acknowledge(committed, 1, 2, 40, 30.0) == committed


def test_a_view_not_acknowledged_in_time_fails_naming_the_missing() -> None:
    once = _acked(AFTER_DEATH, {0: 40})
    assert expire(once, 14.9) is None
    failed = expire(once, 15.0)
    assert failed is not None and failed.state is ViewState.FAILED
    assert "ranks 1, 2 did not acknowledge it in time" in failed.cause
    late = acknowledge(once, 1, 2, 40, 15.0)  # an acknowledgement after the deadline
    assert late == failed
    assert expire(FIRST, 1e9) is None  # a committed view has no deadline


REFUSED: list[tuple[Callable[[], object], str]] = [
    (
        lambda: acknowledge(AFTER_DEATH, 0, 1, 40, 11.0),
        "acknowledges view 1; the group is at view 2",
    ),
    (lambda: acknowledge(AFTER_DEATH, 3, 2, 40, 11.0), "rank 3 is no member of view 2"),
    (
        lambda: acknowledge(_acked(AFTER_DEATH, {0: 40}), 0, 2, 41, 11.0),
        "rank 0 acknowledged view 2 at 40 all-to-all rounds; now at 41",
    ),
    (
        lambda: acknowledge(replace(AFTER_DEATH, state=ViewState.FAILED), 0, 2, 40, 11.0),
        "view 2 failed",
    ),
    (lambda: join(FIRST, 2, 2, "replacement", 1.0, TIMEOUT), "rank 2 is a member of view 1"),
    (
        lambda: join(AFTER_DEATH, 3, 1, "replacement", 20.0, TIMEOUT),
        "may join only with a new generation: view 2 holds generation 1, the join names 1",
    ),
    (
        lambda: join(replace(AFTER_DEATH, state=ViewState.FAILED), 3, 2, "r", 20.0, TIMEOUT),
        "the group must restart",
    ),
]


@pytest.mark.parametrize(("call", "message"), REFUSED)
def test_refused(call: Callable[[], object], message: str) -> None:
    with pytest.raises(PreconditionFailed) as info:
        call()
    assert message in info.value.message


def test_a_replacement_joins_only_with_a_new_generation() -> None:
    committed = _acked(AFTER_DEATH, {0: 40, 1: 40, 2: 40})
    joined = join(committed, 3, 2, "a replacement for rank 3 joined", 20.0, TIMEOUT)
    assert joined == View(
        3,
        (0, 1, 2, 3),
        2,
        ViewState.PROPOSED,
        "a replacement for rank 3 joined",
        deadline=25.0,
        joined=(3,),
    )
    assert _acked(joined, {0: 0, 1: 0, 2: 0, 3: 0}).state is ViewState.COMMITTED
    assert _acked(joined, {0: 0, 1: 0, 2: 0, 3: 0}).acks[3] == Acknowledgement(3, 0)


def test_view_numbers_only_grow() -> None:
    views = [FIRST, AFTER_DEATH]
    view = _acked(AFTER_DEATH, {0: 1, 1: 1, 2: 1})
    views.append(view)
    step = leave(view, 1, "rank 1 excluded (drain)", 30.0, TIMEOUT)
    assert step is not None
    views.append(step)
    views.append(join(_acked(step, {0: 2, 2: 2}), 1, 2, "rank 1 back", 31.0, TIMEOUT))
    assert [v.number for v in views] == [1, 2, 2, 3, 4]
    assert [v.generation for v in views] == [1, 1, 1, 1, 2]  # a member added: a new generation
