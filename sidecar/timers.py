"""The round deadline timers of the sidecar's groups: :class:`RoundTimers`.

At most one timer per group, armed for the group's next deadline (what
:class:`~moe_sidecar.core.effects.Deadline` says); when it fires, the state
holder's callback expires what is due. Stopped timers arm nothing again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

__all__ = ["RoundTimers"]


class RoundTimers:
    """One timer per group on one event loop. Not thread-safe.

    ``clock`` gives the seconds deadlines are stated in; ``fire(group)`` runs
    when a group's timer is due.
    """

    def __init__(self, clock: Callable[[], float], fire: Callable[[str], None]) -> None:
        self._clock = clock
        self._fire = fire
        self._handles: dict[str, asyncio.TimerHandle] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped = False

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Arms timers on ``loop`` from now on."""
        self._loop = loop

    def set(self, group: str, at: float | None) -> None:
        """Arms the group's timer for ``at`` (the clock's seconds), or cancels it (None)."""
        current = self._handles.pop(group, None)
        if current is not None:
            current.cancel()
        if at is None:
            return
        self.retry(group, max(0.0, at - self._clock()))

    def retry(self, group: str, delay: float) -> None:
        """Arms the group's timer ``delay`` seconds from now (unbound or stopped: nothing)."""
        if self._stopped or self._loop is None:
            return
        self._handles[group] = self._loop.call_later(delay, self._due, group)

    def stop(self) -> None:
        """Cancels every timer; none is armed again."""
        self._stopped = True
        for handle in self._handles.values():
            handle.cancel()
        self._handles.clear()

    def _due(self, group: str) -> None:
        self._handles.pop(group, None)
        self._fire(group)
