"""Watch streams: a bounded queue of group events per subscriber, and the
sidecar's set of them (:class:`Watchers`).

A subscriber that falls behind by more than its limit is cut off (told to
reconnect and resynchronise), so a slow watcher can neither block rounds nor
grow the sidecar's memory. A stream whose peer does not read at all leaves
its handler stuck in a write that gRPC cannot end; a
:class:`DeliveryObserver` (:mod:`moe_sidecar.watch_cutoff`) hears when an
event is handed out to be written, when the next is asked for (the write
is done), and when the queue overflowed, and cuts such a stream off.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Protocol

from moe_sidecar.core.effects import GroupEvent
from moe_sidecar.core.errors import CoordinatorError, CoordinatorUnavailable, ResourceExhausted

__all__ = ["WATCH_QUEUE_LIMIT", "DeliveryObserver", "Subscription", "Watchers"]

WATCH_QUEUE_LIMIT = 1024
"""Undelivered events a Watch stream may hold before it is cut off."""


class DeliveryObserver(Protocol):
    """What a stream's guard hears of its subscription's deliveries."""

    def handed_out(self) -> None:
        """An event was handed to the stream, to be written to its peer."""

    def asked_again(self) -> None:
        """The stream asks for its next event: the last one's write is done."""

    def overflowed(self) -> None:
        """The subscriber fell behind by more than its limit and was cut off."""


class Subscription:
    """One Watch stream: a bounded queue of events, iterated asynchronously.

    A subscriber that falls :data:`WATCH_QUEUE_LIMIT` events behind is cut
    off (its queue is dropped and iteration raises
    :class:`CoordinatorUnavailable`, telling it to reconnect and resync),
    so a slow watcher can neither block rounds nor grow memory.
    """

    def __init__(self, group: str, limit: int) -> None:
        self.group = group
        """The watched group, or ``""`` for every group."""
        self._limit = limit
        self._queue: collections.deque[GroupEvent] = collections.deque()
        self._wake = asyncio.Event()
        self._ended: CoordinatorError | None = None
        self._finished = False
        self._observer: DeliveryObserver | None = None

    def observe(self, observer: DeliveryObserver) -> None:
        """Tells ``observer`` of this stream's deliveries from now on."""
        self._observer = observer

    def wants(self, event: GroupEvent) -> bool:
        """Whether ``event`` is of the watched group."""
        return not self.group or self.group == event.group

    def offer(self, event: GroupEvent) -> bool:
        """Queues ``event``; False when the subscriber overflowed and is cut off."""
        if self._finished or self._ended is not None:
            return False
        if len(self._queue) >= self._limit:
            self._queue.clear()
            self.end(
                CoordinatorUnavailable(
                    f"watch stream fell more than {self._limit} events behind and was cut "
                    "off; reconnect and resynchronise with ListGroups/GetGroup"
                )
            )
            if self._observer is not None:
                self._observer.overflowed()
            return False
        self._queue.append(event)
        self._wake.set()
        return True

    def drop(self, error: CoordinatorError) -> None:
        """Ends the stream with ``error`` at once, its queued events dropped
        (their memory freed: the stream was cut off)."""
        self._queue.clear()
        self.end(error)

    def end(self, error: CoordinatorError | None = None) -> None:
        """Ends the stream once queued events are read: with ``error``, or cleanly."""
        if error is None:
            self._finished = True
        elif self._ended is None:
            self._ended = error
        self._wake.set()

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> GroupEvent:
        """The next event.

        Raises:
            CoordinatorUnavailable: the subscriber was cut off or the sidecar stops.
            StopAsyncIteration: the stream ended cleanly.
        """
        if self._observer is not None:
            self._observer.asked_again()
        while True:
            if self._ended is not None:
                raise self._ended
            if self._queue:
                if self._observer is not None:
                    self._observer.handed_out()
                return self._queue.popleft()
            if self._finished:
                raise StopAsyncIteration
            self._wake.clear()
            await self._wake.wait()


class Watchers:
    """Every open Watch stream of the sidecar, at most ``max_watchers``.

    Each subscriber's queue holds at most ``queue_limit`` events. Not
    thread-safe: use it from the sidecar's event loop.
    """

    def __init__(self, queue_limit: int, max_watchers: int) -> None:
        self._queue_limit = queue_limit
        self._max_watchers = max_watchers
        self._subscriptions: list[Subscription] = []

    def subscribe(self, group: str) -> Subscription:
        """A new stream of the events of ``group`` (``""``: every group).

        Raises:
            ResourceExhausted: ``max_watchers`` streams are open.
        """
        if len(self._subscriptions) >= self._max_watchers:
            raise ResourceExhausted(
                f"{len(self._subscriptions)} Watch streams are open; --max-watchers is "
                f"{self._max_watchers}"
            )
        subscription = Subscription(group, self._queue_limit)
        self._subscriptions.append(subscription)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        """Drops a subscription. Idempotent."""
        if subscription in self._subscriptions:
            self._subscriptions.remove(subscription)

    def publish(self, event: GroupEvent) -> None:
        """Offers ``event`` to every stream that wants it; one that overflows is dropped."""
        for subscription in list(self._subscriptions):
            if subscription.wants(event) and not subscription.offer(event):
                self.unsubscribe(subscription)

    def end_all(self, error: CoordinatorError) -> None:
        """Ends every stream with ``error`` and forgets them."""
        for subscription in self._subscriptions:
            subscription.end(error)
        self._subscriptions.clear()

    def count(self) -> int:
        """How many streams are subscribed now."""
        return len(self._subscriptions)
