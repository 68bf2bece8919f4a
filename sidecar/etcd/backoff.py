"""The one retry pause of the cluster store's loops: doubling, capped, cut short by a stop.

Every loop that retries etcd (the watch stream's reconnects, the replica's
watch loop and its push loop) waits through a :class:`Backoff`, so they all
back off alike: ``first`` seconds after the first failure, twice that after
the next, at most ``ceiling``; a success starts over from ``first``.
"""

from __future__ import annotations

import asyncio
import contextlib
import math

__all__ = ["Backoff"]


class Backoff:
    """Delays between retries: ``first`` doubling up to ``ceiling`` seconds."""

    def __init__(self, first: float, ceiling: float) -> None:
        """
        Raises:
            ValueError: ``first`` is not positive, or ``ceiling`` is below it.
        """
        if not (math.isfinite(first) and first > 0):
            raise ValueError(f"first={first!r}: must be a positive number of seconds")
        if not (math.isfinite(ceiling) and ceiling >= first):
            raise ValueError(f"ceiling={ceiling!r}: must be at least first={first!r}")
        self.first = first
        self.ceiling = ceiling
        self._next = first

    def reset(self) -> None:
        """A retry succeeded: the next failure waits ``first`` again."""
        self._next = self.first

    def next_delay(self) -> float:
        """The delay to wait now; the one after it doubles (up to ``ceiling``)."""
        delay = self._next
        self._next = min(delay * 2, self.ceiling)
        return delay

    async def pause(self, stop: asyncio.Event) -> None:
        """Waits :meth:`next_delay` seconds, or less if ``stop`` is set meanwhile."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.next_delay()):
                await stop.wait()
