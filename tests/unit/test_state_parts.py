"""The state holder's collaborators on a real event loop: timers, waiters,
watchers and the event observer."""

from __future__ import annotations

import asyncio
import logging

import pytest

from moe_sidecar import flashinfer
from moe_sidecar.core.effects import EventKind, GroupEvent
from moe_sidecar.core.errors import CoordinatorUnavailable, ResourceExhausted
from moe_sidecar.core.group import Decision
from moe_sidecar.core.plan import Action, Capacities, Plan
from moe_sidecar.metrics import SidecarMetrics
from moe_sidecar.observer import EventObserver
from moe_sidecar.timers import RoundTimers
from moe_sidecar.waiters import RoundWaiters
from moe_sidecar.watch import Watchers

pytestmark = pytest.mark.timeout(10)

PLAN = Plan(Capacities(256, 100, 200, 2, 16, eplb_experts=8), epoch=0, generation=1)


async def test_a_due_timer_fires_once_and_a_stopped_one_never_again() -> None:
    fired: list[str] = []
    due = asyncio.Event()

    def fire(group: str) -> None:
        fired.append(group)
        due.set()

    timers = RoundTimers(lambda: 0.0, fire)
    timers.set("unbound", 0.0)  # not bound to a loop yet: nothing is armed
    timers.bind(asyncio.get_running_loop())
    timers.set("g", 0.0)
    timers.set("cancelled", 0.0)
    timers.set("cancelled", None)
    await asyncio.wait_for(due.wait(), 5)
    timers.stop()
    timers.set("g", 0.0)
    timers.retry("g", 0.0)
    await asyncio.sleep(0)  # one turn of the loop: an armed zero-delay timer would run
    await asyncio.sleep(0)
    assert fired == ["g"]


async def test_waiters_get_their_round_and_a_drain_wakes_the_rest() -> None:
    waiters = RoundWaiters()
    loop = asyncio.get_running_loop()
    decision = Decision(round=1, action=Action.BUILD, plan=PLAN, grew=True, layer="l0")
    first = asyncio.create_task(waiters.wait(loop, "g", (1, 1)))
    second = asyncio.create_task(waiters.wait(loop, "g", (1, 2)))
    await asyncio.sleep(0)  # both tasks run up to their wait
    assert waiters.count() == 2
    waiters.wake("g", (1, 1), decision)
    assert await first == decision
    waiters.wake_all(CoordinatorUnavailable("draining"))
    with pytest.raises(CoordinatorUnavailable, match="draining"):
        await second
    assert waiters.count() == 0


async def test_watchers_are_bounded_filtered_and_ended() -> None:
    watchers = Watchers(queue_limit=4, max_watchers=2)
    mine = watchers.subscribe("g")
    every = watchers.subscribe("")
    with pytest.raises(ResourceExhausted, match="--max-watchers is 2"):
        watchers.subscribe("h")
    watchers.publish(GroupEvent("other", EventKind.RESET, 1.0))
    watchers.publish(GroupEvent("g", EventKind.RESET, 2.0))
    assert (await anext(mine)).at == 2.0
    assert (await anext(every)).group == "other"
    watchers.end_all(CoordinatorUnavailable("stopping"))
    assert watchers.count() == 0
    with pytest.raises(CoordinatorUnavailable, match="stopping"):
        await anext(mine)


@pytest.mark.parametrize("release", [r.name for r in flashinfer.RELEASES])
def test_the_observer_counts_and_logs_each_kind(
    caplog: pytest.LogCaptureFixture, release: str
) -> None:
    metrics = SidecarMetrics()
    observer = EventObserver(metrics, lambda group: (2, release))
    caplog.set_level(logging.INFO, logger="moe_sidecar.state")
    decided = GroupEvent(
        "g", EventKind.ROUND_DECIDED, 1.0, round=1, action=Action.REBUILD, plan=PLAN, latency=0.5
    )
    observer.observe(decided)
    observer.observe(GroupEvent("g", EventKind.RANK_TIMEOUT, 2.0, round=2, missing_ranks=(1,)))
    observer.observe(GroupEvent("g", EventKind.GROUP_REMOVED, 3.0, message="removed"))
    assert [r.getMessage() for r in caplog.records] == [
        "round decided",
        "round timed out",
        "group removed",
    ]
    logged = caplog.records[0].__dict__
    # In the group's own release's arithmetic.
    assert logged["workspace_bytes"] == flashinfer.workspace_size(release, PLAN.capacities, 2)
    assert logged["eplb_experts"] == 8 and logged["max_tokens"] == 256
    assert caplog.records[1].__dict__["missing_ranks"] == [1]
    sample = metrics.registry.get_sample_value
    assert sample("moe_sidecar_rebuilds_total", {"group": "g"}) == 1
    assert sample("moe_sidecar_rounds_total", {"group": "g", "action": "rebuild"}) == 1
    assert sample("moe_sidecar_rounds_total", {"group": "g", "action": "timed_out"}) == 1


def test_a_reuse_round_is_logged_at_debug_a_build_at_info(
    caplog: pytest.LogCaptureFixture,
) -> None:
    metrics = SidecarMetrics()
    observer = EventObserver(metrics, lambda group: (2, ""))
    caplog.set_level(logging.INFO, logger="moe_sidecar.state")
    for number, action in ((1, Action.BUILD), (2, Action.REUSE)):
        observer.observe(
            GroupEvent("g", EventKind.ROUND_DECIDED, 1.0, round=number, action=action, plan=PLAN)
        )
    assert [(r.levelname, r.__dict__["action"]) for r in caplog.records] == [("INFO", "build")]
    caplog.clear()
    caplog.set_level(logging.DEBUG, logger="moe_sidecar.state")
    observer.observe(
        GroupEvent("g", EventKind.ROUND_DECIDED, 1.0, round=3, action=Action.REUSE, plan=PLAN)
    )
    assert [(r.levelname, r.__dict__["round"]) for r in caplog.records] == [("DEBUG", 3)]
    sample = metrics.registry.get_sample_value
    assert sample("moe_sidecar_rounds_total", {"group": "g", "action": "reuse"}) == 2


def test_a_rank_that_said_goodbye_left_normally_one_whose_session_broke_was_lost(
    caplog: pytest.LogCaptureFixture,
) -> None:
    metrics = SidecarMetrics()
    observer = EventObserver(metrics, lambda group: (2, ""))
    caplog.set_level(logging.INFO, logger="moe_sidecar.state")
    for rank, lost in ((0, False), (1, True)):
        observer.observe(
            GroupEvent("g", EventKind.RANK_LEFT, 1.0, ep_rank=rank, message="closed", lost=lost)
        )
    assert [(r.levelname, r.getMessage(), r.__dict__["rank"]) for r in caplog.records] == [
        ("INFO", "rank left the group normally", 0),
        ("WARNING", "rank lost: its session broke without a goodbye", 1),
    ]
    assert metrics.ranks_lost._value.get() == 1
