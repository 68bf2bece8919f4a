"""The state holder with a real store and an injected clock (no gRPC)."""

from __future__ import annotations

import asyncio
import hashlib
import sqlite3
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path

import pytest

from moe_sidecar.core.cluster import ClusterPlan
from moe_sidecar.core.effects import EventKind
from moe_sidecar.core.errors import CoordinatorUnavailable, RoundTimedOut
from moe_sidecar.core.group import Growth, Proposal, Requirement
from moe_sidecar.core.plan import Action, Capacities, Plan
from moe_sidecar.state import Coordinator
from moe_sidecar.store.sqlite import DATABASE_FILE, StateStore

pytestmark = pytest.mark.timeout(10)

REQ = Requirement(Capacities(256, 100, 200, 2, 16), "l0")
OWNER = hashlib.sha256(b"the ranks' owner").hexdigest()


class ManualClock:
    """A clock that moves only when told."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def proposal(rank: int, rnd: int = 1, group: str = "g/ep2") -> Proposal:
    return Proposal(group, 2, rank, 2, f"life-{rank}", rnd, REQ)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
async def coordinator(tmp_path: Path, clock: ManualClock) -> AsyncIterator[Coordinator]:
    holder = Coordinator(StateStore(tmp_path), round_timeout=30.0, clock=clock, watch_queue_limit=3)
    holder.start()
    yield holder
    holder.close()


async def _until(condition: Callable[[], bool], what: str, limit: float = 5.0) -> None:
    """Returns once ``condition()`` holds; fails after ``limit`` seconds."""
    deadline = time.monotonic() + limit
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {limit}s: {what}")
        await asyncio.sleep(0.005)  # the poll interval of a wait with a deadline


async def _until_waiting(coordinator: Coordinator, n: int) -> None:
    await _until(lambda: coordinator.waiting_calls() == n, f"{n} waiting calls")


async def test_round_closes_for_every_waiter(coordinator: Coordinator) -> None:
    first = asyncio.ensure_future(coordinator.propose(proposal(0)))
    await _until_waiting(coordinator, 1)
    second = await coordinator.propose(proposal(1))
    assert await first == second
    assert second.action is Action.BUILD
    assert coordinator.waiting_calls() == 0


async def test_deadline_follows_the_injected_clock(
    coordinator: Coordinator, clock: ManualClock
) -> None:
    waiting = asyncio.ensure_future(coordinator.propose(proposal(0)))
    await _until_waiting(coordinator, 1)
    clock.now += 29.9
    assert coordinator.expire_due() == 0
    clock.now += 0.1
    assert coordinator.expire_due() == 1
    with pytest.raises(RoundTimedOut, match=r"timed out after 30\.0s"):
        await waiting
    assert coordinator.group("g/ep2").last_closed_round == 1


async def test_a_cancelled_caller_leaves_nothing(coordinator: Coordinator) -> None:
    waiting = asyncio.ensure_future(coordinator.propose(proposal(0)))
    await _until_waiting(coordinator, 1)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert coordinator.waiting_calls() == 0
    # Its proposal stays in the round; the other rank closes it.
    decision = await coordinator.propose(proposal(1))
    assert decision.round == 1


async def test_close_wakes_waiters_and_refuses_new_proposals(
    tmp_path: Path, clock: ManualClock
) -> None:
    holder = Coordinator(StateStore(tmp_path), round_timeout=30.0, clock=clock)
    holder.start()
    waiting = asyncio.ensure_future(holder.propose(proposal(0)))
    await _until_waiting(holder, 1)
    holder.close()
    with pytest.raises(CoordinatorUnavailable, match="shutting down"):
        await waiting
    with pytest.raises(CoordinatorUnavailable):
        await holder.propose(proposal(1))
    # The waiting proposal was flushed at close: a new holder still has the open round.
    again = Coordinator(StateStore(tmp_path), round_timeout=30.0, clock=clock)
    try:
        rnd = again.group("g/ep2").open_round
        assert rnd is not None and [p.ep_rank for p in rnd.proposals] == [0]
    finally:
        again.close()


async def test_time_the_sidecar_was_down_does_not_count_against_a_kept_round(
    tmp_path: Path, clock: ManualClock
) -> None:
    holder = Coordinator(StateStore(tmp_path), round_timeout=30.0, clock=clock)
    holder.start()
    waiting = asyncio.ensure_future(holder.propose(proposal(0)))
    await _until_waiting(holder, 1)
    holder.close()
    with pytest.raises(CoordinatorUnavailable):
        await waiting
    # Down for longer than the round timeout: the kept round is not failed.
    clock.now += 100.0
    again = Coordinator(StateStore(tmp_path), round_timeout=30.0, clock=clock)
    again.start()
    try:
        assert again.expire_due() == 0
        rnd = again.group("g/ep2").open_round
        assert rnd is not None and rnd.deadline == clock.now + 30.0
        # Rank 0's retry rejoins; rank 1 closes the round.
        retried = asyncio.ensure_future(again.propose(proposal(0)))
        await _until_waiting(again, 1)
        decision = await again.propose(proposal(1))
        assert await retried == decision and decision.action is Action.BUILD
        # A round kept across a restart still times out a full timeout later.
        kept = asyncio.ensure_future(again.propose(proposal(0, rnd=2)))
        await _until_waiting(again, 1)
        again.close()
        with pytest.raises(CoordinatorUnavailable):
            await kept
    finally:
        again.close()
    clock.now += 10.0
    third = Coordinator(StateStore(tmp_path), round_timeout=30.0, clock=clock)
    third.start()
    try:
        clock.now += 30.0
        assert third.expire_due() == 1
        outcome = third.group("g/ep2").outcome_of(2)
        assert outcome is not None and "rank 1 (last reported round 1" in getattr(
            outcome, "message", ""
        )
    finally:
        third.close()


async def test_a_slow_watcher_is_cut_off_without_blocking(coordinator: Coordinator) -> None:
    slow = coordinator.watch("")
    fast = coordinator.watch("")
    received: list[EventKind] = []

    async def read_fast() -> None:
        async for event in fast:
            received.append(event.kind)

    reader = asyncio.ensure_future(read_fast())
    for n, group in enumerate(("a/ep1", "b/ep1", "c/ep1"), start=1):
        await coordinator.propose(Proposal(group, 1, 0, 1, "x", 1, REQ))
        # The fast watcher reads each round's two events before the next round.
        read = 2 * n
        await _until(lambda: len(received) == read, f"{read} events read")  # noqa: B023
    # Six events; the slow watcher's limit is three.
    with pytest.raises(CoordinatorUnavailable, match="fell more than 3 events behind"):
        await slow.__anext__()
    assert coordinator.watcher_count() == 1
    assert received == [EventKind.LIFETIME_STARTED, EventKind.ROUND_DECIDED] * 3
    coordinator.unwatch(fast)
    fast.end()
    await asyncio.wait_for(reader, 1)


async def test_a_round_is_answered_only_once_its_decision_is_stored(
    tmp_path: Path, coordinator: Coordinator
) -> None:
    waiting = asyncio.ensure_future(coordinator.propose(proposal(0)))
    await _until_waiting(coordinator, 1)
    # Another process breaks the database under the sidecar.
    with sqlite3.connect(tmp_path / DATABASE_FILE) as db:
        db.execute("ALTER TABLE groups RENAME TO moved_away")
    with pytest.raises(CoordinatorUnavailable, match="nothing was decided"):
        await coordinator.propose(proposal(1))
    # Nobody was told a decision that is not on disk; the round stays open.
    # (Not a wait for something to happen: one turn of the loop, the turn a
    # waiter answered by mistake would need to finish, before checking it did not.)
    await asyncio.sleep(0)
    assert not waiting.done()
    assert coordinator.group("g/ep2").open_round is not None
    with sqlite3.connect(tmp_path / DATABASE_FILE) as db:
        db.execute("ALTER TABLE moved_away RENAME TO groups")
    # The closing rank's retry (the client retries UNAVAILABLE) decides it.
    decision = await coordinator.propose(proposal(1))
    assert await waiting == decision
    with sqlite3.connect(tmp_path / DATABASE_FILE) as db:
        (row,) = db.execute("SELECT state FROM groups").fetchall()
    assert '"last_closed_round":1' in row[0]


# --- with a cluster store ------------------------------------------------------------


class RecordingReplica:
    """A replica that records what it is asked to push (the etcd one is tested on etcd)."""

    def __init__(self) -> None:
        self.woken: list[str] = []

    async def start(self, host: object) -> None:
        pass

    def replicate(self, name: str) -> None:
        self.woken.append(name)

    async def close(self, flush_seconds: float) -> None:
        pass


async def test_a_growth_is_pending_in_the_same_write_and_the_replica_is_woken(
    tmp_path: Path, clock: ManualClock
) -> None:
    replica = RecordingReplica()
    store = StateStore(tmp_path)
    holder = Coordinator(store, round_timeout=30.0, clock=clock, replica=replica, node="node-a")
    holder.start()
    try:
        first = asyncio.ensure_future(holder.propose(proposal(0)))
        await _until_waiting(holder, 1)
        assert replica.woken == [] and store.pending() == []
        await holder.propose(proposal(1))
        await first
        assert replica.woken == ["g/ep2"]
        [(name, seq)] = holder.pending_replication()
        assert name == "g/ep2" and holder.group(name).history[-1].node == "node-a"
        # A REUSE round has nothing for the cluster.
        await asyncio.gather(holder.propose(proposal(0, 2)), holder.propose(proposal(1, 2)))
        assert replica.woken == ["g/ep2"]
        assert holder.replicated(name, seq) and holder.pending_replication() == []
    finally:
        holder.close()


async def test_a_merge_is_persisted_and_watched(tmp_path: Path, clock: ManualClock) -> None:
    replica = RecordingReplica()
    holder = Coordinator(
        StateStore(tmp_path), round_timeout=30.0, clock=clock, replica=replica, node="node-b"
    )
    holder.start()
    try:
        subscription = holder.watch("")
        remote = ClusterPlan(
            "g/ep2",
            2,
            plan=Plan(REQ.capacities, 0, 3),
            generation=3,
            history=(Growth(Plan(REQ.capacities, 0, 3), "l0", 1, 1, 999.0, "node-a"),),
            owner=OWNER,
        )
        assert holder.merge(remote)
        assert holder.cluster_plan("g/ep2") == remote
        assert not holder.merge(remote)  # idempotent
        assert replica.woken == [] and holder.pending_replication() == []
        event = await anext(subscription)
        assert event.kind is EventKind.PLAN_MERGED and event.node == "node-a"
        # The merged plan is round 1's plan here.
        # (for ranks that carry its owner: the owner came with it)
        owned = [replace(proposal(rank), owner=OWNER) for rank in range(2)]
        decisions = await asyncio.gather(*(holder.propose(p) for p in owned))
        assert {d.plan for d in decisions} == {remote.plan} and not decisions[0].grew
    finally:
        holder.close()
    reopened = StateStore(tmp_path)
    try:
        assert reopened.load()["g/ep2"].plan == remote.plan
    finally:
        reopened.close()
