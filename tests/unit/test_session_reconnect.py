"""A rank's session back on a new stream: the core's check
(:func:`moe_sidecar.core.policy.reconnect`) and the start's awaited ranks
(:class:`moe_sidecar.reconnect_window.ReconnectWindow`), table-driven."""

from __future__ import annotations

import asyncio

import pytest

from moe_sidecar.core import policy
from moe_sidecar.core.errors import PreconditionFailed
from moe_sidecar.core.group import GroupState, Proposal, Requirement
from moe_sidecar.core.plan import Capacities
from moe_sidecar.reconnect_window import ReconnectWindow
from tests.ceiling import CEILING

pytestmark = pytest.mark.timeout(10)

GROUP = "reconnect:fp4/tp1-ep3/pp0"
SMALL = Capacities(256, 100, 200, 2, 16)


def _decided() -> GroupState:
    state: GroupState | None = None
    for rank in range(3):
        p = Proposal(GROUP, 3, rank, 3, f"life-{rank}", 1, Requirement(SMALL, "layer.0"))
        state = policy.propose(state, p, 0.0, 30.0, ceiling=CEILING).state
    assert state is not None
    return state


def _gone(state: GroupState, rank: int) -> GroupState:
    step = policy.depart(state, rank, f"life-{rank}", "its session broke", 10.0)
    assert step is not None
    return step.state


def test_the_running_lifetime_of_a_rank_not_gone_may_resume() -> None:
    state = _decided()
    policy.reconnect(state, 1, "life-1")  # raises nothing: the stream may bind


@pytest.mark.parametrize(
    ("rank", "lifetime", "words"),
    [
        (1, "life-9", "has no running lifetime"),  # another lifetime
        (1, "life-0", "has no running lifetime"),  # another rank's
        (5, "life-5", "has no running lifetime"),  # no such rank
        (2, "life-2", "is gone (its session broke)"),  # its session broke before
    ],
)
def test_anything_else_binds_nothing(rank: int, lifetime: str, words: str) -> None:
    state = _gone(_decided(), 2)
    with pytest.raises(PreconditionFailed, match=r"^session: rank ") as caught:
        policy.reconnect(state, rank, lifetime)
    assert words in caught.value.message, caught.value.message


def test_the_window_awaits_the_ranks_read_back_and_declares_the_rest_lost() -> None:
    state = _gone(_decided(), 2)  # rank 2 left before the restart: not awaited
    lost: list[tuple[str, int, str, str]] = []

    async def run() -> tuple[tuple[int, ...], tuple[int, ...]]:
        window = ReconnectWindow(0.05, lambda *args: lost.append(args))
        window.expect([state], asyncio.get_running_loop())
        before = window.awaited(GROUP)
        window.heard(GROUP, 0, "life-0")
        window.heard(GROUP, 1, "life-9")  # another lifetime: still awaited
        after = window.awaited(GROUP)
        await asyncio.sleep(0.2)  # past the window: its timer has fired
        return before, after

    before, after = asyncio.run(run())
    assert (before, after) == ((0, 1), (1,))
    [(group, rank, lifetime, why)] = lost
    assert (group, rank, lifetime) == (GROUP, 1, "life-1")
    assert why.startswith("it did not reconnect within --reconnect-window 0.05 s"), why


def test_a_window_of_zero_awaits_nobody() -> None:
    async def run() -> tuple[int, ...]:
        window = ReconnectWindow(0.0, lambda *args: pytest.fail(f"declared lost: {args}"))
        window.expect([_decided()], asyncio.get_running_loop())
        return window.awaited(GROUP)

    assert asyncio.run(run()) == ()
