"""Proposes waiting for their round to close: :class:`RoundWaiters`.

One future per waiting call, keyed by group and round, each with the
lifetime it waits for. The state holder wakes them when a step answers the
round (:class:`~moe_sidecar.core.effects.Answer`), wakes one lifetime's call
when its proposal lost its slot (:class:`~moe_sidecar.core.effects.Dismiss`),
and wakes all when the sidecar drains; a call that goes away (cancelled,
past its deadline) leaves no trace.
"""

from __future__ import annotations

import asyncio
from typing import TypeAlias

from moe_sidecar.core.errors import CoordinatorError, CoordinatorUnavailable
from moe_sidecar.core.group import Outcome

__all__ = ["RoundKey", "RoundWaiters"]

RoundKey: TypeAlias = tuple[int, int]
"""(lifetime index, round number): round numbers restart with every lifetime."""
_Wakeup: TypeAlias = "Outcome | CoordinatorUnavailable"
_Waiting: TypeAlias = "tuple[str, asyncio.Future[_Wakeup]]"


class RoundWaiters:
    """The futures of every Propose waiting for its round. Not thread-safe."""

    def __init__(self) -> None:
        self._futures: dict[str, dict[RoundKey, list[_Waiting]]] = {}

    async def wait(
        self, loop: asyncio.AbstractEventLoop, group: str, key: RoundKey, lifetime: str = ""
    ) -> Outcome:
        """Waits until round ``key`` of ``group`` is answered (or, for the
        call of ``lifetime``, until its proposal is dismissed).

        Raises:
            CoordinatorUnavailable: the sidecar drained while the call waited.
        """
        future: asyncio.Future[_Wakeup] = loop.create_future()
        waiting = (lifetime, future)
        self._futures.setdefault(group, {}).setdefault(key, []).append(waiting)
        try:
            woken = await future
        finally:
            # A caller that went away (cancelled, deadline) leaves no trace.
            self._forget(group, key, waiting)
        if isinstance(woken, CoordinatorError):
            raise woken
        return woken

    def _forget(self, group: str, key: RoundKey, waiting: _Waiting) -> None:
        by_round = self._futures.get(group)
        if by_round is None:
            return
        futures = by_round.get(key)
        if futures is not None and waiting in futures:
            futures.remove(waiting)
            if not futures:
                del by_round[key]
                if not by_round:
                    del self._futures[group]

    def wake(self, group: str, key: RoundKey, outcome: Outcome) -> None:
        """Answers every call waiting for round ``key`` of ``group`` with ``outcome``."""
        by_round = self._futures.get(group)
        if by_round is None:
            return
        for _, future in by_round.pop(key, ()):
            if not future.done():
                future.set_result(outcome)
        if not by_round:
            del self._futures[group]

    def wake_lifetime(self, group: str, key: RoundKey, lifetime: str, outcome: Outcome) -> None:
        """Answers only the calls of ``lifetime`` waiting for round ``key`` of ``group``."""
        for waiting_lifetime, future in self._futures.get(group, {}).get(key, ()):
            if waiting_lifetime == lifetime and not future.done():
                future.set_result(outcome)

    def wake_all(self, error: CoordinatorUnavailable) -> None:
        """Wakes every waiting call with ``error`` (the sidecar drains)."""
        for by_round in self._futures.values():
            for futures in by_round.values():
                for _, future in futures:
                    if not future.done():
                        future.set_result(error)
        self._futures.clear()

    def count(self) -> int:
        """How many calls wait now."""
        return sum(len(f) for by_round in self._futures.values() for f in by_round.values())
