"""The guard of a Watch stream: when a stream whose write waits is cut off."""

from __future__ import annotations

import asyncio
import time

import pytest

from moe_sidecar.core.effects import EventKind, GroupEvent
from moe_sidecar.core.errors import CoordinatorUnavailable
from moe_sidecar.metrics import SidecarMetrics
from moe_sidecar.watch import Watchers
from moe_sidecar.watch_cutoff import OVERFLOW, WRITE_TIMEOUT, WatchCutoffs

pytestmark = pytest.mark.timeout(30)

PEER = "ipv4:127.0.0.1:40000"


def _event(n: int) -> GroupEvent:
    return GroupEvent(group=f"g{n}/ep1", kind=EventKind.COMMIT, at=0.0)


async def _until(condition: object, within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)  # the poll interval of a wait with a deadline


class _Shutdowns:
    def __init__(self, found: bool = True) -> None:
        self.peers: list[str] = []
        self._found = found

    def __call__(self, peer: str) -> bool:
        self.peers.append(peer)
        return self._found


def _cutoffs(metrics: SidecarMetrics, shut: _Shutdowns, timeout: float) -> WatchCutoffs:
    return WatchCutoffs(metrics, timeout, shut_down=shut)


def _count(metrics: SidecarMetrics, reason: str, connection: str = "shut") -> float:
    labels = {"method": "Watch", "reason": reason, "connection": connection}
    value = metrics.registry.get_sample_value("moe_sidecar_stream_cutoffs_total", labels)
    return value or 0.0


async def test_a_write_pending_past_the_timeout_cuts_the_stream_off() -> None:
    metrics, shut, watchers = SidecarMetrics(), _Shutdowns(), Watchers(8, 4)
    subscription = watchers.subscribe("")
    guard = _cutoffs(metrics, shut, 0.05).guard(subscription, PEER, watchers.unsubscribe)
    watchers.publish(_event(1))
    watchers.publish(_event(2))
    assert (await anext(subscription)).group == "g1/ep1"  # handed out: its write waits
    await _until(lambda: shut.peers == [PEER])
    assert guard.cut_reason == WRITE_TIMEOUT and _count(metrics, WRITE_TIMEOUT) == 1
    assert watchers.count() == 0
    with pytest.raises(CoordinatorUnavailable, match="cut off"):
        await anext(subscription)  # the queued event was dropped


async def test_an_overflow_while_a_write_waits_cuts_at_once_once() -> None:
    metrics, shut, watchers = SidecarMetrics(), _Shutdowns(found=False), Watchers(2, 4)
    subscription = watchers.subscribe("")
    guard = _cutoffs(metrics, shut, 600.0).guard(subscription, "unix:", watchers.unsubscribe)
    watchers.publish(_event(0))
    await anext(subscription)
    for n in range(1, 6):
        watchers.publish(_event(n))
    await _until(lambda: guard.cut_reason is not None)
    assert guard.cut_reason == OVERFLOW and shut.peers == ["unix:"]
    assert _count(metrics, OVERFLOW, "not_found") == 1 and watchers.count() == 0
    guard.close()


async def test_a_stream_that_takes_its_events_is_never_cut_off() -> None:
    metrics, shut, watchers = SidecarMetrics(), _Shutdowns(), Watchers(2, 4)
    subscription = watchers.subscribe("")
    guard = _cutoffs(metrics, shut, 0.05).guard(subscription, PEER, watchers.unsubscribe)
    for n in range(20):
        watchers.publish(_event(n))
        assert (await anext(subscription)).group == f"g{n}/ep1"
        assert guard.write_pending
    waiting = asyncio.ensure_future(anext(subscription))
    await _until(lambda: not guard.write_pending)  # asked again: its timer is stopped
    assert not waiting.done() and shut.peers == [] and guard.cut_reason is None
    waiting.cancel()
    guard.close()
