"""The one state holder of the sidecar: :class:`Coordinator`.

It owns every mutable thing the sidecar has: the groups (driven only through
the pure functions of :mod:`moe_sidecar.policy`), the store they persist to, the
futures of Proposes waiting for their round, the round deadline timers, the
Watch subscribers, and the metrics that describe them. Everything runs on one
asyncio event loop, so no locks: each method applies a policy step, persists
it, and only then wakes whoever the step answered.

What is persisted when: a step that answers anyone (a closed round, an
aborted round, a commit, a reset, a timeout) is written before the answer
leaves. A proposal that only joins a round answers nobody, so its state is
marked dirty and rides along with the next write of its group (or the flush
at close); losing it to a crash loses nothing a rank was told, and the rank's
retry rebuilds it.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeAlias

from moe_sidecar import policy
from moe_sidecar.errors import (
    AdminDisabled,
    CoordinatorError,
    CoordinatorUnavailable,
    GroupNotFound,
)
from moe_sidecar.metrics import SidecarMetrics
from moe_sidecar.policy import (
    Action,
    Answered,
    CommitRecord,
    Decision,
    GroupState,
    Outcome,
    Plan,
    Proposal,
    Refusal,
    Waiting,
)
from moe_sidecar.store import StateStore

__all__ = [
    "WATCH_QUEUE_LIMIT",
    "Clock",
    "Coordinator",
    "EventKind",
    "GroupEvent",
    "Subscription",
]

Clock: TypeAlias = Callable[[], float]
"""Seconds since the epoch (stored in history and shown as timestamps)."""

WATCH_QUEUE_LIMIT = 1024
"""Undelivered events a Watch stream may hold before it is cut off."""

_log = logging.getLogger("moe_sidecar.state")

_RoundKey: TypeAlias = tuple[int, int]
"""(lifetime index, round number): round numbers restart with every lifetime."""
_Wakeup: TypeAlias = "Outcome | CoordinatorUnavailable"


class EventKind(enum.Enum):
    """What happened to a group (the wire's ``EventKind``)."""

    ROUND_DECIDED = "round_decided"
    ROUND_REFUSED = "round_refused"
    RANK_TIMEOUT = "rank_timeout"
    COMMIT = "commit"
    RESET = "reset"
    LIFETIME_STARTED = "lifetime_started"
    ROUND_ABORTED = "round_aborted"


@dataclass(frozen=True)
class GroupEvent:
    """One event of a group, as Watch streams deliver it."""

    group: str
    kind: EventKind
    at: float
    round: int = 0
    action: Action | None = None
    plan: Plan | None = None
    ep_rank: int = -1
    """The rank concerned, or -1 when the event concerns the group."""
    layer: str = ""
    message: str = ""
    missing_ranks: tuple[int, ...] = ()


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

    def wants(self, event: GroupEvent) -> bool:
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
            return False
        self._queue.append(event)
        self._wake.set()
        return True

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
        while True:
            if self._ended is not None:
                raise self._ended
            if self._queue:
                return self._queue.popleft()
            if self._finished:
                raise StopAsyncIteration
            self._wake.clear()
            await self._wake.wait()


def _answer(outcome: Outcome) -> Decision:
    if isinstance(outcome, Refusal):
        raise outcome.error()
    return outcome


class _Phase(enum.Enum):
    OPEN = "open"
    DRAINING = "draining"
    CLOSED = "closed"


class Coordinator:
    """Every group of one sidecar, their persistence, waiters, timers and watchers.

    Construct it, then call :meth:`start` on the event loop that will serve
    it; :meth:`close` at the end. Not thread-safe: call it from that loop.

    Raises:
        StoreError: (on construction) the stored state cannot be loaded.
    """

    def __init__(
        self,
        store: StateStore,
        *,
        round_timeout: float,
        admin_enabled: bool = False,
        metrics: SidecarMetrics | None = None,
        clock: Clock = time.time,
        watch_queue_limit: int = WATCH_QUEUE_LIMIT,
    ) -> None:
        self._store = store
        self._round_timeout = round_timeout
        self._admin_enabled = admin_enabled
        self.metrics = metrics if metrics is not None else SidecarMetrics()
        self._clock = clock
        self._watch_queue_limit = watch_queue_limit
        self._groups: dict[str, GroupState] = store.load()
        self._dirty: set[str] = set()
        self._waiters: dict[str, dict[_RoundKey, list[asyncio.Future[_Wakeup]]]] = {}
        self._timers: dict[str, tuple[float, asyncio.TimerHandle]] = {}
        self._subscribers: list[Subscription] = []
        self._phase = _Phase.OPEN
        self._loop: asyncio.AbstractEventLoop | None = None
        for state in self._groups.values():
            self._update_gauges(state)
        self.metrics.groups.set(len(self._groups))

    # --- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        """Binds to the running loop and arms the deadlines of stored open rounds.

        Raises:
            RuntimeError: no event loop is running.
        """
        self._loop = asyncio.get_running_loop()
        for state in self._groups.values():
            self._sync_timer(state)

    @property
    def serving(self) -> bool:
        """False once draining began."""
        return self._phase is _Phase.OPEN

    def drain(self) -> None:
        """Stops taking proposals and wakes every waiting Propose and Watch.

        Waiting Proposes get :class:`CoordinatorUnavailable` (a retry against
        the restarted sidecar rejoins the round, which stays stored). Commits
        and reads still work until :meth:`close`. Idempotent.
        """
        if self._phase is not _Phase.OPEN:
            return
        self._phase = _Phase.DRAINING
        for _, handle in self._timers.values():
            handle.cancel()
        self._timers.clear()
        for by_round in self._waiters.values():
            for futures in by_round.values():
                for future in futures:
                    if not future.done():
                        future.set_result(
                            CoordinatorUnavailable(
                                "the sidecar is shutting down; retry the proposal once it is "
                                "back (the round is kept)"
                            )
                        )
        self._waiters.clear()
        for subscription in self._subscribers:
            subscription.end(CoordinatorUnavailable("the sidecar is shutting down"))
        self._subscribers.clear()

    def close(self) -> None:
        """Drains, writes every unsaved group, and closes the store. Idempotent."""
        if self._phase is _Phase.CLOSED:
            return
        self.drain()
        try:
            self._store.save_many(self._groups[name] for name in sorted(self._dirty))
            self._dirty.clear()
        except sqlite3.Error:
            _log.exception("could not save waiting proposals at shutdown")
        finally:
            self._phase = _Phase.CLOSED
            self._store.close()

    # --- proposals ------------------------------------------------------------------

    async def propose(self, proposal: Proposal) -> Decision:
        """Applies one rank's proposal and waits until its round closes.

        Returns at once for a retry of a closed round or the proposal that
        closes its round; otherwise waits for the last local rank, the
        round's deadline, or the sidecar's shutdown.

        Raises:
            InvalidArgument: a malformed field (nothing changes).
            PreconditionFailed: the proposal contradicts the group, or its
                round was refused (heterogeneous layers, disagreeing ranks).
            RoundTimedOut: the round missed ranks past its deadline.
            RoundAborted: a rank restarted mid-round, or this rank's lifetime ended.
            CoordinatorUnavailable: the sidecar is shutting down or cannot
                persist the decision.
        """
        if self._phase is not _Phase.OPEN:
            raise CoordinatorUnavailable("the sidecar is shutting down; retry once it is back")
        old = self._groups.get(proposal.group)
        now = self._clock()
        new, result = policy.propose(old, proposal, now, self._round_timeout)
        if isinstance(result, Answered):
            return _answer(result.outcome)
        if isinstance(result, Waiting):
            if new is not old:
                self._apply(new, persist=result.aborted is not None or result.new_lifetime)
            self._lifetime_changes(old, new, proposal, result.aborted, result.new_lifetime, now)
            outcome = await self._wait(new.name, (new.lifetime_index, result.round))
            return _answer(outcome)
        self._apply(new, persist=True)
        self._lifetime_changes(old, new, proposal, result.aborted, result.new_lifetime, now)
        self._round_closed(old, new, proposal, result.outcome, now)
        return _answer(result.outcome)

    async def _wait(self, group: str, key: _RoundKey) -> Outcome:
        assert self._loop is not None, "Coordinator.start() was not called"
        future: asyncio.Future[_Wakeup] = self._loop.create_future()
        self._waiters.setdefault(group, {}).setdefault(key, []).append(future)
        try:
            woken = await future
        finally:
            # A caller that went away (cancelled, deadline) leaves no trace.
            self._forget_waiter(group, key, future)
        if isinstance(woken, CoordinatorError):
            raise woken
        return woken

    def _forget_waiter(self, group: str, key: _RoundKey, future: asyncio.Future[_Wakeup]) -> None:
        by_round = self._waiters.get(group)
        if by_round is None:
            return
        futures = by_round.get(key)
        if futures is not None and future in futures:
            futures.remove(future)
            if not futures:
                del by_round[key]
                if not by_round:
                    del self._waiters[group]

    def _wake(self, group: str, key: _RoundKey, outcome: Outcome) -> None:
        by_round = self._waiters.get(group)
        if by_round is None:
            return
        for future in by_round.pop(key, ()):
            if not future.done():
                future.set_result(outcome)
        if not by_round:
            del self._waiters[group]

    def waiting_calls(self) -> int:
        """How many Propose calls wait for their round now."""
        return sum(len(f) for by_round in self._waiters.values() for f in by_round.values())

    def _lifetime_changes(
        self,
        old: GroupState | None,
        new: GroupState,
        proposal: Proposal,
        aborted: Refusal | None,
        new_lifetime: bool,
        now: float,
    ) -> None:
        if aborted is not None and old is not None:
            self._round_failed(
                (old.lifetime_index, aborted.round),
                aborted,
                GroupEvent(
                    new.name,
                    EventKind.ROUND_ABORTED,
                    now,
                    round=aborted.round,
                    ep_rank=proposal.ep_rank,
                    message=aborted.message,
                ),
                rank=proposal.ep_rank,
                layer=proposal.requirement.layer,
            )
        if new_lifetime:
            _log.info(
                "lifetime started",
                extra={
                    "group": new.name,
                    "lifetime_index": new.lifetime_index,
                    "rank": proposal.ep_rank,
                    "lifetime": proposal.lifetime,
                    "stored_plan": None if new.plan is None else new.plan.workspace_bytes,
                },
            )
            self._emit(
                GroupEvent(
                    new.name,
                    EventKind.LIFETIME_STARTED,
                    now,
                    round=proposal.round,
                    plan=new.plan,
                    ep_rank=proposal.ep_rank,
                    message=f"lifetime {new.lifetime_index} started by rank "
                    f"{proposal.ep_rank} ({proposal.lifetime!r})",
                )
            )

    def _round_closed(
        self,
        old: GroupState | None,
        new: GroupState,
        proposal: Proposal,
        outcome: Outcome,
        now: float,
    ) -> None:
        # The round's earlier proposals, when it was open before this one came.
        opened = old.open_round if old is not None else None
        if opened is not None and (
            old is None
            or old.lifetime_index != new.lifetime_index
            or opened.number != outcome.round
        ):
            opened = None
        ranks = sorted(
            {p.ep_rank for p in (opened.proposals if opened else ())} | {proposal.ep_rank}
        )
        key = (new.lifetime_index, outcome.round)
        self.metrics.round_latency.observe(now - opened.opened_at if opened else 0.0)
        layer = proposal.requirement.layer
        if isinstance(outcome, Decision):
            self._wake(new.name, key, outcome)
            self.metrics.group(new.name).round_closed(outcome.action.value)
            if outcome.action is Action.REBUILD:
                self.metrics.group(new.name).rebuilds.inc()
            _log.info(
                "round decided",
                extra={
                    "group": new.name,
                    "round": outcome.round,
                    "ranks": ranks,
                    "layer": outcome.layer,
                    "action": outcome.action.value,
                    "workspace_bytes": outcome.plan.workspace_bytes,
                    "max_num_tokens": outcome.plan.max_num_tokens,
                    "generation": outcome.plan.generation,
                    "grew": outcome.grew,
                },
            )
            self._emit(
                GroupEvent(
                    new.name,
                    EventKind.ROUND_DECIDED,
                    now,
                    round=outcome.round,
                    action=outcome.action,
                    plan=outcome.plan,
                    layer=outcome.layer,
                )
            )
        else:
            self._round_failed(
                key,
                outcome,
                GroupEvent(
                    new.name,
                    EventKind.ROUND_REFUSED,
                    now,
                    round=outcome.round,
                    ep_rank=proposal.ep_rank,
                    layer=layer,
                    message=outcome.message,
                ),
                ranks=ranks,
                rank=proposal.ep_rank,
                layer=layer,
            )

    def _round_failed(
        self, key: _RoundKey, refusal: Refusal, event: GroupEvent, **fields: object
    ) -> None:
        """Wakes the waiters of a refused, timed-out or aborted round with its
        error, and counts, logs and publishes it."""
        self._wake(event.group, key, refusal)
        outcome = {
            EventKind.ROUND_ABORTED: "aborted",
            EventKind.ROUND_REFUSED: "refused",
            EventKind.RANK_TIMEOUT: "timed_out",
        }[event.kind]
        self.metrics.group(event.group).round_closed(outcome)
        _log.warning(
            f"round {outcome.replace('_', ' ')}",
            extra={
                "group": event.group,
                "round": refusal.round,
                **fields,
                "reason": refusal.message,
            },
        )
        self._emit(event)

    # --- deadlines ------------------------------------------------------------------

    def _sync_timer(self, state: GroupState) -> None:
        current = self._timers.get(state.name)
        rnd = state.open_round
        if rnd is None or self._phase is not _Phase.OPEN or self._loop is None:
            if current is not None:
                current[1].cancel()
                del self._timers[state.name]
            return
        if current is not None:
            if current[0] == rnd.deadline:
                return
            current[1].cancel()
        delay = max(0.0, rnd.deadline - self._clock())
        handle = self._loop.call_later(delay, self._on_timer, state.name)
        self._timers[state.name] = (rnd.deadline, handle)

    def _on_timer(self, group: str) -> None:
        self._timers.pop(group, None)
        try:
            state = self._groups.get(group)
            if state is not None and self._phase is _Phase.OPEN:
                self._expire(state, self._clock())
        except Exception:
            # A timer callback has no caller to tell; log it and keep serving.
            _log.exception("round deadline handling failed", extra={"group": group})

    def expire_due(self) -> int:
        """Fails every open round whose deadline has passed on the clock.

        The timers call this per group; it is public for callers that move
        an injected clock. Returns how many rounds expired.

        Raises:
            CoordinatorUnavailable: a timed-out round could not be persisted
                (its waiters keep waiting; a timer retries in a second).
        """
        now = self._clock()
        expired = 0
        for state in list(self._groups.values()):
            if state.open_round is not None and state.open_round.deadline <= now:
                expired += self._expire(state, now)
        return expired

    def _expire(self, state: GroupState, now: float) -> int:
        new, refusal = policy.expire(state, now)
        if refusal is None:
            self._sync_timer(state)
            return 0
        try:
            self._apply(new, persist=True)
        except CoordinatorUnavailable:
            # Retry in a second; the waiters keep waiting meanwhile.
            if self._loop is not None:
                self._timers[state.name] = (
                    -1.0,
                    self._loop.call_later(1.0, self._on_timer, state.name),
                )
            raise
        self._round_failed(
            (new.lifetime_index, refusal.round),
            refusal,
            GroupEvent(
                new.name,
                EventKind.RANK_TIMEOUT,
                now,
                round=refusal.round,
                message=refusal.message,
                missing_ranks=refusal.missing_ranks,
            ),
            missing_ranks=list(refusal.missing_ranks),
        )
        return 1

    # --- commits, reads, admin ------------------------------------------------------

    def commit(self, group: str, record: CommitRecord) -> GroupState:
        """Records the plan a rank holds after building and the barrier.

        Raises:
            InvalidArgument: a malformed group name or field.
            GroupNotFound: no such group.
            PreconditionFailed: the rank, lifetime or round does not fit the group.
            CoordinatorUnavailable: the sidecar has stopped or cannot persist.
        """
        if self._phase is _Phase.CLOSED:
            raise CoordinatorUnavailable("the sidecar has stopped")
        state = self.group(group)
        now = self._clock()
        new = policy.commit(state, record, now)
        self._apply(new, persist=True)
        _log.info(
            "commit",
            extra={
                "group": group,
                "round": record.round,
                "rank": record.ep_rank,
                "generation": record.plan.generation,
                "workspace_bytes": record.plan.workspace_bytes,
                "build_seconds": record.build_seconds,
            },
        )
        self._emit(
            GroupEvent(
                group,
                EventKind.COMMIT,
                now,
                round=record.round,
                plan=record.plan,
                ep_rank=record.ep_rank,
                message=f"rank {record.ep_rank} holds generation {record.plan.generation} "
                f"(built in {record.build_seconds:.3f}s)",
            )
        )
        return new

    def group(self, name: str) -> GroupState:
        """One group's state.

        Raises:
            InvalidArgument: the name is malformed.
            GroupNotFound: no such group.
        """
        policy.validate_group_name(name)
        state = self._groups.get(name)
        if state is None:
            raise GroupNotFound.named(name)
        return state

    def groups(self) -> list[GroupState]:
        """Every group, by name."""
        return [self._groups[name] for name in sorted(self._groups)]

    def reset(self, name: str) -> GroupState:
        """Forgets a group's stored plan and history (an admin call).

        Raises:
            AdminDisabled: the sidecar runs without ``--enable-admin``.
            InvalidArgument: the name is malformed.
            GroupNotFound: no such group.
            CoordinatorUnavailable: the sidecar has stopped or cannot persist.
        """
        if not self._admin_enabled:
            raise AdminDisabled(
                f"ResetGroup(group={name!r}) is an admin call; start the sidecar with "
                "--enable-admin (env MOE_SIDECAR_ENABLE_ADMIN=true) to allow it"
            )
        if self._phase is _Phase.CLOSED:
            raise CoordinatorUnavailable("the sidecar has stopped")
        state = self.group(name)
        new = policy.reset(state)
        self._apply(new, persist=True)
        _log.warning("group reset", extra={"group": name, "generation": new.generation})
        self._emit(
            GroupEvent(
                name,
                EventKind.RESET,
                self._clock(),
                message=f"stored plan forgotten (generation stays {new.generation})",
            )
        )
        return new

    def watch(self, group: str) -> Subscription:
        """Subscribes to the events of ``group`` (``""``: every group).

        Call :meth:`unwatch` when the stream ends.

        Raises:
            InvalidArgument: the name is malformed.
            GroupNotFound: no such group.
            CoordinatorUnavailable: the sidecar is shutting down.
        """
        if group:
            self.group(group)
        if self._phase is not _Phase.OPEN:
            raise CoordinatorUnavailable("the sidecar is shutting down")
        subscription = Subscription(group, self._watch_queue_limit)
        self._subscribers.append(subscription)
        return subscription

    def watcher_count(self) -> int:
        """How many Watch streams are subscribed now."""
        return len(self._subscribers)

    def unwatch(self, subscription: Subscription) -> None:
        """Drops a subscription. Idempotent."""
        if subscription in self._subscribers:
            self._subscribers.remove(subscription)

    def _emit(self, event: GroupEvent) -> None:
        if not self._subscribers:
            return
        for subscription in list(self._subscribers):
            if subscription.wants(event) and not subscription.offer(event):
                self._subscribers.remove(subscription)

    # --- the single place state changes -------------------------------------------

    def _apply(self, new: GroupState, *, persist: bool) -> None:
        if persist:
            try:
                self._store.save(new)
            except sqlite3.Error as error:
                _log.error("cannot persist group", extra={"group": new.name, "error": str(error)})
                raise CoordinatorUnavailable(
                    f"cannot persist group {new.name!r}: {error}; nothing was decided"
                ) from error
            self._dirty.discard(new.name)
        else:
            self._dirty.add(new.name)
        known = new.name in self._groups
        self._groups[new.name] = new
        if not known:
            self.metrics.groups.set(len(self._groups))
        self._update_gauges(new)
        self._sync_timer(new)

    def _update_gauges(self, state: GroupState) -> None:
        series = self.metrics.group(state.name)
        series.workspace_bytes.set(state.plan.workspace_bytes if state.plan is not None else 0)
        series.waiting_ranks.set(
            len(state.open_round.proposals) if state.open_round is not None else 0
        )
