"""The ranks waiting at their lifetime's first round before they can propose:
:class:`FirstRoundArrivals`.

Each ``Arrive`` call waits here until its rank's first proposal reaches the
sidecar, its own deadline passes (``--round-timeout``), or the sidecar
drains; what is decided is :mod:`moe_sidecar.core.policy.arrivals`'s. A call
that ends before its rank proposed (the process died, or gave up) leaves
its rank named as gone (``GetGroup``'s ranks, which a peer whose broadcast
then fails reads) until a process of that rank proposes. Nothing here is
persisted: a waiting arrival lives as long as its call (bounded by
``--max-concurrent-rpcs``), and at most ``--max-groups`` groups known only
by ranks gone at arrival are remembered (the oldest forgotten first).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import TypeAlias

from moe_sidecar.core.errors import CoordinatorUnavailable
from moe_sidecar.core.group import GroupState, GroupSummary, RankSummary, Refusal, summarize
from moe_sidecar.core.policy.arrivals import (
    Arrival,
    Arrivals,
    arrive,
    arrived_ranks,
    expire_arrivals,
    has_proposed,
    proposed,
    validate_arrival,
    withdraw,
)
from moe_sidecar.metrics import SidecarMetrics
from moe_sidecar.timers import RoundTimers

__all__ = ["FirstRoundArrivals"]

_log = logging.getLogger("moe_sidecar.arrivals")

_Wakeup: TypeAlias = "Refusal | CoordinatorUnavailable | None"
"""None: the rank proposed; a refusal: its deadline passed."""
LEFT_AT_ARRIVAL = (
    "its arrival at the lifetime's first round ended before it proposed (the process "
    "exited, was killed, or gave up while the ranks shared the group's proof)"
)


class FirstRoundArrivals:
    """Every waiting arrival of one sidecar. Not thread-safe: one event loop.

    Args:
        clock: seconds since the epoch, the clock deadlines are stated in.
        round_timeout: seconds an arrival waits (``--round-timeout``).
        group_of: the group's state, if the sidecar knows the group (for
            the last layers the ranks reported and the ranks proposing).
        metrics: the sidecar's metrics (the waiting-ranks gauge counts the
            open round's ranks and the arrived ones).
        max_gone: most groups remembered with no arrival waiting, only ranks
            gone at arrival (``--max-groups``).
    """

    def __init__(
        self,
        clock: Callable[[], float],
        round_timeout: float,
        group_of: Callable[[str], GroupState | None],
        metrics: SidecarMetrics,
        max_gone: int = 128,
    ) -> None:
        self._max_gone = max_gone
        self._clock = clock
        self._round_timeout = round_timeout
        self._group_of = group_of
        self._metrics = metrics
        self._held: dict[str, Arrivals] = {}
        self._futures: dict[tuple[str, str], asyncio.Future[_Wakeup]] = {}
        self._timers = RoundTimers(clock, self._expire)
        self._loop: asyncio.AbstractEventLoop | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Waits and arms timers on ``loop`` from now on."""
        self._loop = loop
        self._timers.bind(loop)

    async def arrive(self, a: Arrival) -> None:
        """Waits until ``a``'s rank proposes (returns), or its deadline passes.

        Raises:
            InvalidArgument: a bad field (nothing changes).
            RoundTimedOut: the deadline passed, naming the ranks not there.
            CoordinatorUnavailable: the sidecar drains.
        """
        assert self._loop is not None, "FirstRoundArrivals.bind() was not called"
        validate_arrival(a)
        if has_proposed(self._group_of(a.group), a):
            return  # its proposal came first: nothing to wait for
        held = arrive(self._held.get(a.group, Arrivals()), a, self._clock(), self._round_timeout)
        key = (a.group, a.lifetime)
        earlier = self._futures.pop(key, None)
        if earlier is not None and not earlier.done():
            earlier.set_result(None)  # a retry of this lifetime's arrival replaces it
        future: asyncio.Future[_Wakeup] = self._loop.create_future()
        self._futures[key] = future
        self._set(a.group, held)
        try:
            woken = await future
        finally:
            if self._futures.get(key) is future:
                del self._futures[key]
                if future.cancelled() or not future.done():
                    # The call went away before its rank proposed (cancelling
                    # the call cancels the future it awaits): the rank is gone.
                    self._set(a.group, withdraw(self._held.get(a.group, Arrivals()), a.lifetime))
        if isinstance(woken, Refusal):
            raise woken.error()
        if isinstance(woken, CoordinatorUnavailable):
            raise woken

    def proposed(self, group: str, lifetime: str, ep_rank: int) -> None:
        """Rank ``ep_rank`` of ``lifetime`` proposed: its arrival, if any, is
        answered, and the rank is no longer counted gone."""
        held = self._held.get(group)
        if held is None:
            return
        held = proposed(held, lifetime, ep_rank)
        future = self._futures.pop((group, lifetime), None)
        if future is not None and not future.done():
            future.set_result(None)
        self._set(group, held)

    def _set(self, group: str, held: Arrivals) -> None:
        self._held.pop(group, None)
        if held:
            self._held[group] = held  # last in the dict's order: the newest
        gone_only = [name for name, h in self._held.items() if not h.waiting]
        for name in gone_only[: max(0, len(gone_only) - self._max_gone)]:
            del self._held[name]
        self._timers.set(group, held.next_deadline())
        self.show_waiting(group)

    def _expire(self, group: str) -> None:
        held = self._held.get(group)
        if held is None:
            return
        held, answers = expire_arrivals(held, self._clock(), self._group_of(group))
        for a, refusal in answers:
            _log.warning(
                "first round timed out",
                extra={"group": group, "rank": a.ep_rank, "detail": refusal.message},
            )
            future = self._futures.pop((group, a.lifetime), None)
            if future is not None and not future.done():
                future.set_result(refusal)
        self._set(group, held)

    def show_waiting(self, group: str) -> None:
        """Sets the group's waiting-ranks gauge: its open round's ranks and its arrived ones."""
        state = self._group_of(group)
        waiting = len(state.open_round.proposals) if state and state.open_round else 0
        self._metrics.group(group).set_waiting(waiting + len(self.arrived_ranks(group)))

    def summary(self, state: GroupState) -> GroupSummary:
        """What operators are shown of ``state``, with its ranks at the first round
        (and those gone there, as ranks that left)."""
        shown = summarize(state)
        arrived = self.arrived_ranks(state.name)
        return replace(
            shown, arrived_ranks=arrived, ranks=shown.ranks + self.left_ranks(state.name)
        )

    def arrived_ranks(self, group: str) -> tuple[int, ...]:
        """The ranks of ``group`` waiting at its first round and not proposing yet."""
        held = self._held.get(group)
        return arrived_ranks(held, self._group_of(group)) if held is not None else ()

    def left_ranks(self, group: str) -> tuple[RankSummary, ...]:
        """The ranks whose arrival ended before they proposed, while others wait."""
        held = self._held.get(group)
        if held is None:
            return ()
        return tuple(
            RankSummary(
                ep_rank=rank,
                lifetime="-",
                last_round=0,
                last_layer="",
                committed_generation=0,
                build_seconds=0.0,
                last_seen=0.0,
                current=True,
                left=LEFT_AT_ARRIVAL,
            )
            for rank in held.left
        )

    def layout(self, group: str) -> GroupState | None:
        """A group known only by its arrivals, as a state with nothing in it
        (None when the arrivals know nothing of it)."""
        held = self._held.get(group)
        if held is None:
            return None
        ep_size, local_ranks = held.layout
        return GroupState(name=group, ep_size=ep_size, local_ranks=local_ranks)

    def names(self) -> list[str]:
        """The groups the arrivals know of."""
        return list(self._held)

    def count(self) -> int:
        """How many arrivals wait now."""
        return sum(len(h.waiting) for h in self._held.values())

    def wake_all(self, error: CoordinatorUnavailable) -> None:
        """Answers every waiting arrival with ``error`` (the sidecar drains)."""
        self._timers.stop()
        for future in self._futures.values():
            if not future.done():
                future.set_result(error)
        self._futures.clear()
        self._held.clear()
