"""The ranks a started sidecar waits to hear from again: :class:`ReconnectWindow`.

A sidecar that starts on a state directory (a restart: ``kill -9``, SIGTERM,
a new image) reads back groups whose ranks had sessions with the sidecar
that ended. Their clients open their sessions again by themselves (a resume
carrying the lifetime, within about a second of the sidecar listening), so
each rank of a running lifetime that was not gone is *awaited* until a
session speaks for it again (a resume, a proposal or a commit); ``GetGroup``
and ``moe-sidecar groups`` name the awaited ranks. One still awaited when
``--reconnect-window`` has passed since the start died while the sidecar
was away (or runs a client too old to resume): it is declared lost with that
cause, and its peers' watchers act as on any death.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from moe_sidecar.core.group import GroupState

__all__ = ["ReconnectWindow"]


class ReconnectWindow:
    """The awaited ranks of one sidecar's start, and the timer that ends the wait.

    Args:
        window: ``--reconnect-window`` seconds; 0 waits for nobody.
        declare_lost: called with (group, ep_rank, lifetime id, why) for each
            rank still awaited when the window closes.

    Not thread-safe: use it from the sidecar's event loop.
    """

    def __init__(self, window: float, declare_lost: Callable[[str, int, str, str], None]) -> None:
        self.window = window
        self._declare_lost = declare_lost
        self._awaited: dict[str, dict[int, str]] = {}
        """group -> {ep_rank: lifetime id} of the ranks not heard from since the start."""
        self._timer: asyncio.TimerHandle | None = None

    def expect(self, groups: Iterable[GroupState], loop: asyncio.AbstractEventLoop) -> None:
        """Awaits every rank of the running lifetimes of ``groups`` (those read
        back at the start) that is not gone, and arms the window's timer."""
        if self.window <= 0:
            return
        for state in groups:
            ranks = {r.ep_rank: r.lifetime for r in state.current_ranks() if not r.left}
            if ranks:
                self._awaited[state.name] = ranks
        if self._awaited:
            self._timer = loop.call_later(self.window, self._close)

    def heard(self, group: str, ep_rank: int, lifetime: str) -> None:
        """A session speaks for rank ``ep_rank`` of lifetime ``lifetime`` again."""
        ranks = self._awaited.get(group)
        if ranks is not None and ranks.get(ep_rank) == lifetime:
            del ranks[ep_rank]
            if not ranks:
                del self._awaited[group]

    def awaited(self, group: str) -> tuple[int, ...]:
        """The ranks of ``group`` not heard from since the start, in order."""
        return tuple(sorted(self._awaited.get(group, ())))

    def stop(self) -> None:
        """Ends the wait without declaring anyone lost (the sidecar drains). Idempotent."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._awaited.clear()

    def _close(self) -> None:
        self._timer = None
        awaited, self._awaited = self._awaited, {}
        why = (
            f"it did not reconnect within --reconnect-window {self.window:g} s of the "
            "sidecar's start (it died while the sidecar was away, or its client cannot resume)"
        )
        for group, ranks in sorted(awaited.items()):
            for ep_rank, lifetime in sorted(ranks.items()):
                self._declare_lost(group, ep_rank, lifetime, why)
