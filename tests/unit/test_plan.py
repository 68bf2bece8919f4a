"""The plan lattice: one join for every union. Table-driven, no I/O."""

from __future__ import annotations

import functools
import itertools
from dataclasses import replace

import pytest

from moe_sidecar.core.plan import (
    Action,
    Capacities,
    EpochPlan,
    Plan,
    ShapeMismatch,
    decide_action,
    dominates,
    grow,
    join,
    join_capacities,
    join_epoch_plans,
)

pytestmark = pytest.mark.timeout(10)


def caps(tokens: int = 16, dispatch: int = 100, combine: int = 200, eplb: int = 0) -> Capacities:
    return Capacities(
        max_tokens=tokens,
        dispatch_bytes_per_token=dispatch,
        combine_bytes_per_token=combine,
        top_k=2,
        num_experts=16,
        eplb_experts=eplb,
    )


def plan(c: Capacities, generation: int = 1, epoch: int = 0) -> Plan:
    return Plan(capacities=c, epoch=epoch, generation=generation)


@pytest.mark.parametrize(
    ("a", "b", "joined"),
    [
        (caps(), caps(), caps()),
        (caps(tokens=32), caps(dispatch=400), caps(tokens=32, dispatch=400)),
        (caps(combine=1), caps(dispatch=1), caps()),
        (caps(eplb=8), caps(), caps(eplb=8)),
    ],
)
def test_join_capacities_is_the_maximum_of_every_size(
    a: Capacities, b: Capacities, joined: Capacities
) -> None:
    assert join_capacities(a, b) == joined == join_capacities(b, a)
    assert joined.covers(a) and joined.covers(b)


@pytest.mark.parametrize("field", ["top_k", "num_experts"])
def test_shapes_must_be_equal(field: str) -> None:
    other = replace(caps(), **{field: 4 if field == "top_k" else 32})
    with pytest.raises(ShapeMismatch, match=f"{field}=") as info:
        join_capacities(caps(), other)
    assert info.value.left == caps() and info.value.right == other
    assert not caps().covers(other) and not other.covers(caps())


# --- join of decided plans ------------------------------------------------------------

SMALL = plan(caps())
WIDE = plan(caps(dispatch=400), generation=2)
LONG = plan(caps(tokens=64), generation=2)


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        (SMALL, SMALL, SMALL),
        (SMALL, WIDE, WIDE),
        (WIDE, LONG, plan(caps(tokens=64, dispatch=400), generation=3)),
        # Same capacities, newer generation: the newer plan.
        (SMALL, replace(SMALL, generation=5), replace(SMALL, generation=5)),
        # Bigger capacities at an older generation: neither dominates.
        (plan(caps(dispatch=400), 1), plan(caps(), 4), plan(caps(dispatch=400), 5)),
        # A higher epoch wins whole, even with smaller capacities.
        (WIDE, plan(caps(), 9, epoch=1), plan(caps(), 9, epoch=1)),
    ],
)
def test_join(a: Plan, b: Plan, expected: Plan) -> None:
    assert join(a, b) == expected
    assert join(b, a) == expected


def test_join_returns_a_dominating_input_itself() -> None:
    assert join(SMALL, WIDE) is WIDE
    assert dominates(WIDE, SMALL) and not dominates(SMALL, WIDE)


def test_join_refuses_different_shapes_in_one_epoch_only() -> None:
    other = plan(replace(caps(), top_k=4))
    with pytest.raises(ShapeMismatch):
        join(SMALL, other)
    newer = replace(other, epoch=1)
    assert join(SMALL, newer) is newer


GRID = [
    plan(caps(tokens=t, dispatch=d), generation=g)
    for t, d, g in itertools.product((16, 32), (100, 400), (1, 2))
]


@pytest.mark.parametrize(("a", "b"), list(itertools.product(GRID, GRID)))
def test_join_is_commutative_idempotent_and_an_upper_bound(a: Plan, b: Plan) -> None:
    joined = join(a, b)
    assert joined == join(b, a)
    assert join(joined, joined) == joined
    assert joined.capacities.covers(a.capacities) and joined.capacities.covers(b.capacities)
    assert joined.generation >= max(a.generation, b.generation)


PLACES = [
    EpochPlan(epoch, p if p is None else replace(p, epoch=epoch), counter)
    for epoch, p, counter in itertools.product((0, 1), (None, GRID[0], GRID[3]), (2, 5))
]


@pytest.mark.parametrize(("a", "b"), list(itertools.product(PLACES, PLACES)))
def test_the_epoch_lattice_is_commutative_idempotent_and_keeps_every_counter(
    a: EpochPlan, b: EpochPlan
) -> None:
    joined = join_epoch_plans(a, b)
    assert joined == join_epoch_plans(b, a)
    assert join_epoch_plans(joined, joined) == joined
    assert joined.epoch == max(a.epoch, b.epoch)
    assert joined.generation >= max(a.generation, b.generation)
    if joined.plan is not None:
        assert joined.generation >= joined.plan.generation
    for side in (a, b):
        if side.epoch == joined.epoch and side.plan is not None:
            assert joined.plan is not None and joined.plan.covers(side.plan.capacities)


def test_the_higher_epoch_wins_whole_even_over_a_larger_plan() -> None:
    big = EpochPlan(0, plan(caps(tokens=4096), generation=4), 4)
    reset = EpochPlan(1, None, 3)
    assert join_epoch_plans(big, reset) == EpochPlan(1, None, 4)
    assert join_epoch_plans(EpochPlan.of(GRID[0]), EpochPlan(0, None, 0)).plan is GRID[0]


def test_every_merge_order_converges() -> None:
    # Nodes may hear of each other's plans in any order; once every plan has
    # been merged everywhere, one more exchange leaves every node equal.
    results = {functools.reduce(join, order) for order in itertools.permutations(GRID[:5])}
    assert len({r.capacities for r in results}) == 1
    settled = functools.reduce(join, results)
    assert all(join(r, settled) == settled for r in results)


# --- growth and actions ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("current", "need", "expected"),
    [
        (None, caps(), plan(caps(), generation=8)),
        (SMALL, caps(dispatch=50), SMALL),
        (SMALL, caps(dispatch=400), plan(caps(dispatch=400), generation=8)),
        (WIDE, caps(tokens=64), plan(caps(tokens=64, dispatch=400), generation=8)),
    ],
)
def test_grow(current: Plan | None, need: Capacities, expected: Plan) -> None:
    grown = grow(current, need, epoch=0, last_generation=7)
    assert grown == expected
    if current is not None and current.covers(need):
        assert grown is current


def test_grow_refuses_another_shape() -> None:
    with pytest.raises(ShapeMismatch):
        grow(SMALL, replace(caps(), num_experts=32), epoch=0, last_generation=1)


@pytest.mark.parametrize(
    ("built", "decided", "action"),
    [
        (None, SMALL, Action.BUILD),
        (SMALL, SMALL, Action.REUSE),
        (WIDE, SMALL, Action.REUSE),
        (SMALL, WIDE, Action.REBUILD),
        (WIDE, LONG, Action.REBUILD),
    ],
)
def test_decide_action(built: Plan | None, decided: Plan, action: Action) -> None:
    assert decide_action(built, decided) is action
