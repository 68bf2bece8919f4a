"""A sidecar that stood still (stopped, throttled, a long pause) fails no
round for it: the pause does not count against the ranks' deadlines.

The state holder on a real event loop, with the real clock; the pause is the
loop itself blocked (as SIGSTOP leaves it), past the round's timeout.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from moe_sidecar.core import policy
from moe_sidecar.core.group import GroupState, Proposal, Requirement
from moe_sidecar.core.plan import Action, Capacities
from moe_sidecar.state import PAUSE_NOTICED_S, Coordinator
from moe_sidecar.store.sqlite import StateStore
from tests.ceiling import CEILING

pytestmark = pytest.mark.timeout(30)

REQ = Requirement(Capacities(256, 100, 200, 2, 16), "layer.0")
ROUND_TIMEOUT_S = 1.0


def _proposal(rank: int) -> Proposal:
    return Proposal("pause/ep2", 2, rank, 2, f"life-{rank}", 1, REQ)


def test_a_pause_longer_than_the_round_timeout_fails_no_round(tmp_path: Path) -> None:
    async def run() -> tuple[Action, Action]:
        holder = Coordinator(StateStore(tmp_path), round_timeout=ROUND_TIMEOUT_S)
        holder.start()
        try:
            first = asyncio.ensure_future(holder.propose(_proposal(0)))
            await asyncio.sleep(0)  # rank 0's proposal opens the round and waits
            assert holder.waiting_calls() == 1
            # The loop stands still (as under SIGSTOP), past the round's timeout.
            time.sleep(PAUSE_NOTICED_S + ROUND_TIMEOUT_S + 0.5)  # noqa: ASYNC251
            # A timer's turn, after the round's deadline came due during the pause.
            await asyncio.sleep(0.05)
            second = await holder.propose(_proposal(1))
            return (await first).action, second.action
        finally:
            holder.close()

    assert asyncio.run(run()) == (Action.BUILD, Action.BUILD)


def test_paused_moves_every_deadline_by_the_pause() -> None:
    state: GroupState | None = None
    state = policy.propose(state, _proposal(0), 100.0, 30.0, ceiling=CEILING).state
    assert state is not None and state.next_deadline() == 130.0
    assert policy.paused(state, 12.5).next_deadline() == 142.5
    idle = GroupState("pause/ep2", 2, 2)
    assert policy.paused(idle, 12.5) == idle
