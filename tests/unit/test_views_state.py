"""Membership views in the group's state: a departure proposes the next view,
the row keeps it (old rows load without one), the wire and ``groups`` show
it. No I/O, no clock."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from moe_sidecar.core import policy
from moe_sidecar.core.effects import EventKind, GroupEvent, Publish
from moe_sidecar.core.errors import PreconditionFailed
from moe_sidecar.core.group import GroupState, Proposal, Requirement, summarize
from moe_sidecar.core.membership import View, ViewState
from moe_sidecar.core.plan import Capacities
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

DATA = Path(__file__).resolve().parents[1] / "data"
GROUP = "views:fp4/tp1-ep3/pp0"
SMALL = Capacities(256, 100, 200, 2, 16)


def _decided() -> GroupState:
    state: GroupState | None = None
    for rank in range(3):
        p = Proposal(GROUP, 3, rank, 3, f"life-{rank}", 1, Requirement(SMALL, "layer.0"))
        state = policy.propose(state, p, 0.0, 30.0, ceiling=CEILING).state
    assert state is not None
    return state


def _depart(state: GroupState, rank: int) -> tuple[GroupState, list[GroupEvent]]:
    step = policy.depart(state, rank, f"life-{rank}", "its session broke", 10.0, ack_timeout=5.0)
    assert step is not None
    views = [
        e.event
        for e in step.effects
        if isinstance(e, Publish) and e.event.kind is EventKind.VIEW_CHANGED
    ]
    return step.state, views


def test_a_lifetimes_first_view_is_derived_from_its_ranks() -> None:
    view = _decided().current_view()
    assert view == View(1, (0, 1, 2), 1, ViewState.COMMITTED, "lifetime 1 began")
    assert GroupState(GROUP, 3, 3).current_view() is None  # nothing built yet


def test_a_departure_proposes_the_next_view() -> None:
    state, [event] = _depart(_decided(), 2)
    assert event.view is not None
    assert state.current_view() == event.view
    assert event.view == View(2, (0, 1), 1, ViewState.PROPOSED, event.view.cause, 15.0)
    assert "rank 2 (last reported round 1, layer 'layer.0') is gone" in event.view.cause
    assert event.message.startswith("view 2 proposed: members 0, 1 at generation 1")
    again, [second] = _depart(state, 1)
    assert second.view is not None and second.view.number == 3 and second.view.members == (0,)
    assert policy.depart(again, 1, "life-1", "x", 11.0) is None  # gone already: nothing moves


def test_the_row_keeps_the_view_and_old_rows_load_without_one() -> None:
    state, _ = _depart(_decided(), 2)
    loaded = decode_group(encode_group(state))
    assert loaded.current_view() == state.current_view()
    assert loaded.view_lifetime == state.lifetime_index
    old = decode_group((DATA / "group-row-v3.json").read_text())
    assert old.view is None


def test_a_view_of_an_earlier_lifetime_is_not_current() -> None:
    state, _ = _depart(_decided(), 2)
    later = replace(state, lifetime_index=state.lifetime_index + 1)
    assert later.current_view() != state.current_view()


def test_the_wire_and_groups_show_the_view() -> None:
    state, [event] = _depart(_decided(), 2)
    summary = summarize(state)
    assert summary_from_proto(summary_to_proto(summary)).view == summary.view
    decoded = event_from_proto(event_to_proto(event, (3, "")))
    assert decoded is not None and decoded.view == event.view
    text = display.format_groups([summary])
    assert "  view 2 proposed: members 0, 1 at generation 1, due " in text
    [document] = display.groups_as_json([summary])
    assert document["view"]["state"] == "proposed" and document["view"]["members"] == [0, 1]


@pytest.mark.parametrize(
    ("rank", "lifetime", "number", "rounds", "needle"),
    [
        (0, "life-9", 2, 5, "rank 0 of group 'views:fp4/tp1-ep3/pp0' is not of the running"),
        (2, "life-2", 2, 5, "is not of the running lifetime"),  # gone
        (0, "life-0", 1, 5, "acknowledges view 1; the group is at view 2"),
    ],
)
def test_an_acknowledgement_that_counts_for_nothing_is_refused(
    rank: int, lifetime: str, number: int, rounds: int, needle: str
) -> None:
    state, _ = _depart(_decided(), 2)
    with pytest.raises(PreconditionFailed) as info:
        policy.acknowledge_view(state, rank, lifetime, number, rounds, 11.0)
    assert needle in info.value.message


def test_the_members_acknowledgements_commit_the_view() -> None:
    state, _ = _depart(_decided(), 2)
    once = policy.acknowledge_view(state, 0, "life-0", 2, 5, 11.0)
    assert once.effects and not any(isinstance(e, Publish) for e in once.effects)
    both = policy.acknowledge_view(once.state, 1, "life-1", 2, 5, 11.0)
    [event] = [e.event for e in both.effects if isinstance(e, Publish)]
    assert event.view is not None and event.view.state is ViewState.COMMITTED
    assert decode_group(encode_group(both.state)).current_view() == event.view


def test_only_a_proposed_view_of_the_current_lifetime_sets_a_deadline() -> None:
    decided = _decided()
    assert decided.current_view() is not None  # the first view: committed, no deadline
    assert decided.next_deadline() is None
    proposed, _ = _depart(decided, 2)
    assert proposed.next_deadline() == 15.0
    # The same proposed view left over from an earlier lifetime arms nothing.
    stale = replace(proposed, view_lifetime=proposed.lifetime_index - 1)
    assert stale.current_view() != proposed.view
    assert stale.next_deadline() is None


def test_a_view_not_acknowledged_in_time_fails_the_group() -> None:
    state, _ = _depart(_decided(), 2)
    assert state.next_deadline() == 15.0  # the timer is armed for the view
    assert policy.expire(state, 14.0) is None
    step = policy.expire(state, 15.0)
    assert step is not None
    [event] = [e.event for e in step.effects if isinstance(e, Publish)]
    assert event.kind is EventKind.VIEW_CHANGED and event.view == step.state.current_view()
    assert event.view is not None and event.view.state is ViewState.FAILED
    assert "ranks 0, 1 did not acknowledge it in time" in event.view.cause
    assert step.state.next_deadline() is None
    resumed = policy.resume(state, 100.0, 5.0)  # a restarted sidecar: a full timeout again
    assert resumed.next_deadline() == 105.0
