"""The peer-loss pieces without processes: the policy variable, the RANK_LEFT
event a departure publishes (``lost``, ``survivors``), its wire form, and
which events a rank's watcher acts on. No I/O, no clock."""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest

from moe_sidecar.client.engines.vllm.plugin import check_environment
from moe_sidecar.client.errors import InvalidArgument
from moe_sidecar.client.peer_loss import PeerLossPolicy, PeerLossWatcher, policy_from_environment
from moe_sidecar.config import add_serve_arguments, config_from_flags
from moe_sidecar.core import policy
from moe_sidecar.core.effects import EventKind, GroupEvent, Publish
from moe_sidecar.core.group import GroupState, Proposal, Requirement
from moe_sidecar.core.identity import lifetime_id, short_id
from moe_sidecar.core.plan import Capacities
from moe_sidecar.wire.codec import event_from_proto, event_to_proto
from tests.ceiling import CEILING

pytestmark = pytest.mark.timeout(10)

GROUP = "peer-loss:fp4/tp1-ep3/pp0"
SMALL = Capacities(256, 100, 200, 2, 16)
TOKENS = tuple(f"lifetime-token-of-rank-{r}" for r in range(3))
"""Each rank's lifetime secret (the sidecar's core sees their ids)."""
IDS = tuple(lifetime_id(t) for t in TOKENS)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("", PeerLossPolicy.EXIT),
        ("exit", PeerLossPolicy.EXIT),
        (" Raise ", PeerLossPolicy.RAISE),
        ("WAIT", PeerLossPolicy.WAIT),
        ("mask", PeerLossPolicy.MASK),
    ],
)
def test_the_policy_variable(value: str, expected: PeerLossPolicy) -> None:
    assert policy_from_environment({"MOE_SIDECAR_ON_PEER_LOSS": value}) is expected


@pytest.mark.parametrize("value", ["sometimes", "1", "exit,raise"])
def test_a_bad_policy_is_named(value: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        policy_from_environment({"MOE_SIDECAR_ON_PEER_LOSS": value})
    assert "MOE_SIDECAR_ON_PEER_LOSS" in info.value.message
    assert repr(value) in info.value.message
    assert "exit, raise, wait" in info.value.message
    with pytest.raises(InvalidArgument, match="MOE_SIDECAR_ON_PEER_LOSS"):
        check_environment({"MOE_SIDECAR_ON_PEER_LOSS": value})  # the vLLM plugin's start check


def test_the_sidecar_ignores_the_clients_variable() -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    config_from_flags(parser.parse_args([]), {"MOE_SIDECAR_ON_PEER_LOSS": "raise"})


def _decided() -> GroupState:
    """Round 1 decided for three ranks."""
    state: GroupState | None = None
    for rank in range(3):
        proposal = Proposal(GROUP, 3, rank, 3, IDS[rank], 1, Requirement(SMALL, "layer.0"))
        state = policy.propose(state, proposal, 0.0, 30.0, ceiling=CEILING).state
    assert state is not None
    return state


def _rank_left(state: GroupState, rank: int, *, lost: bool) -> tuple[GroupState, GroupEvent]:
    step = policy.depart(state, rank, IDS[rank], "why", 1.0, lost=lost)
    assert step is not None
    [event] = [
        e.event
        for e in step.effects
        if isinstance(e, Publish) and e.event.kind is EventKind.RANK_LEFT
    ]
    return step.state, event


@pytest.mark.parametrize("lost", [True, False])
def test_a_departure_says_whether_it_was_a_death_and_who_is_left(lost: bool) -> None:
    state, event = _rank_left(_decided(), 2, lost=lost)
    assert event.lost is lost
    assert event.ep_rank == 2
    assert event.survivors == (short_id(IDS[0]), short_id(IDS[1]))
    _, second = _rank_left(state, 1, lost=True)
    assert second.survivors == (short_id(IDS[0]),)  # a rank gone before is no survivor
    assert event_from_proto(event_to_proto(event, (3, ""))) == replace(
        event, ranks=(), latency=None
    )


def _watcher(rank: int) -> PeerLossWatcher:
    return PeerLossWatcher("unix:///nowhere", GROUP, rank, TOKENS[rank], lambda loss: None)


DEATH = GroupEvent(
    GROUP,
    EventKind.RANK_LEFT,
    1.0,
    ep_rank=2,
    lost=True,
    survivors=(short_id(IDS[0]), short_id(IDS[1])),
)


@pytest.mark.parametrize(
    ("event", "acts"),
    [
        (DEATH, True),
        (replace(DEATH, lost=False), False),  # a clean close (cleanup) is no death
        (replace(DEATH, kind=EventKind.ROUND_ABORTED), False),
        (replace(DEATH, group="another"), False),
        (replace(DEATH, survivors=(short_id(IDS[1]),)), False),  # not this rank's lifetime
        (replace(DEATH, ep_rank=0), False),  # about this rank itself
    ],
)
def test_which_events_a_watcher_acts_on(event: GroupEvent, acts: bool) -> None:
    assert _watcher(0).concerns_me(event) is acts


def test_the_policies_are_the_ones_the_tools_name() -> None:
    # simulate's --on-peer-loss lists the tuple without importing the client's gRPC side.
    from moe_sidecar.core.defaults import PEER_LOSS_POLICIES

    assert tuple(p.value for p in PeerLossPolicy) == PEER_LOSS_POLICIES
    assert PEER_LOSS_POLICIES[0] == PeerLossPolicy.EXIT.value  # the default
