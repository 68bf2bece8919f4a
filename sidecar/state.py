"""The one state holder of the sidecar: :class:`Coordinator`.

It owns every mutable thing the sidecar has: the groups (moved only by the
pure functions of :mod:`moe_sidecar.core.policy`) and the store they persist
to, and it holds one collaborator per other job: the futures of Proposes
waiting for their round (:class:`~moe_sidecar.waiters.RoundWaiters`), the round
deadline timers (:class:`~moe_sidecar.timers.RoundTimers`), the Watch streams
(:class:`~moe_sidecar.watch.Watchers`), the metrics and logs that describe
the groups (:class:`~moe_sidecar.observer.EventObserver`), the execution of
a step's effects (:class:`~moe_sidecar.step_executor.StepExecutor`: persist
first, then answers, events and timers), the reads of the groups
(:class:`~moe_sidecar.group_reads.GroupReads`) and the admin calls
(:class:`~moe_sidecar.admin_calls.AdminCalls`). Everything runs on one
asyncio event loop, so no locks. Each call applies one policy step and hands
it to the executor; plans decided on other nodes come back through
:meth:`Coordinator.merge`, one more step of the core.

A step that changes what a restart needs (a round that builds, grows or is
refused, an aborted round, a commit, a reset, a timeout, a merge) persists;
a round decided REUSE writes its short record, and at start the records are
applied to the rows they follow (:mod:`moe_sidecar.stored_groups`), so every
answer a rank received is given again after a crash. Rows written by a
release that recorded nothing of its REUSE rounds may lag them: such a group
is handed to the core as ``recovered`` until a round of it is decided
(:mod:`moe_sidecar.core.policy.recovery`).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TypeAlias

from moe_sidecar import flashinfer
from moe_sidecar.admin_calls import AdminCalls
from moe_sidecar.arrivals import FirstRoundArrivals
from moe_sidecar.core import limits, policy
from moe_sidecar.core.cluster import ClusterPlan
from moe_sidecar.core.effects import Wait
from moe_sidecar.core.errors import CoordinatorUnavailable, ResourceExhausted, quote_name
from moe_sidecar.core.group import (
    CommitRecord,
    Decision,
    GroupState,
    GroupSummary,
    Outcome,
    Proposal,
    Refusal,
)
from moe_sidecar.core.policy.arrivals import Arrival
from moe_sidecar.group_reads import GroupReads
from moe_sidecar.metrics import SidecarMetrics
from moe_sidecar.observer import EventObserver
from moe_sidecar.reconnect_window import ReconnectWindow
from moe_sidecar.step_executor import StepExecutor
from moe_sidecar.store.replica import Replica
from moe_sidecar.store.sqlite import StateStore, StoreError
from moe_sidecar.stored_groups import stored_groups
from moe_sidecar.timers import RoundTimers
from moe_sidecar.waiters import RoundWaiters
from moe_sidecar.watch import WATCH_QUEUE_LIMIT, Subscription, Watchers

__all__ = ["DEFAULT_RECONNECT_WINDOW_S", "Clock", "Coordinator"]

PAUSE_TICK_S = 0.25
"""How often the state holder looks at the monotonic clock to notice that it
stood still (SIGSTOP, a throttled cgroup, a long pause)."""
PAUSE_NOTICED_S = 2.0
"""A tick this much later than due is a pause of the sidecar: its length
does not count against the ranks' deadlines."""
DEFAULT_RECONNECT_WINDOW_S = 30.0
"""``--reconnect-window``: how long a started sidecar waits for the ranks it
read back to speak again before it declares them lost."""

Clock: TypeAlias = Callable[[], float]
"""Seconds since the epoch (stored in history and shown as timestamps)."""

_log = logging.getLogger("moe_sidecar.state")


def _merged_only(state: GroupState) -> bool:
    """A group made here from the cluster store that no local rank has proposed for."""
    return not state.ranks and not state.busy()


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
        max_groups: int = 128,
        max_merged_groups: int = 128,
        max_watchers: int = 64,
        replica: Replica | None = None,
        node: str = "",
        max_workspace_bytes: int = limits.DEFAULT_MAX_WORKSPACE_BYTES,
        reconnect_window: float = DEFAULT_RECONNECT_WINDOW_S,
    ) -> None:
        self._store = store
        self._max_groups = max_groups
        self._max_merged_groups = max_merged_groups
        """Groups made here from the cluster store alone; not part of ``max_groups``."""
        self.node = node
        """This node's name, recorded on every growth decided here."""
        self._round_timeout = round_timeout
        self._ceiling = limits.WorkspaceCeiling(max_workspace_bytes, flashinfer.workspace_size)
        """``--max-workspace-bytes``, measured in each group's FlashInfer release."""
        self.metrics = metrics if metrics is not None else SidecarMetrics()
        self._clock = clock
        self._groups: dict[str, GroupState] = stored_groups(store)
        self._removed: set[str] = store.removed()
        """Groups an admin removed here: the cluster store's copy stays out."""
        self._dirty: set[str] = set()
        self._recovered: set[str] = set(self._groups)
        """Groups read from their rows with no round decided since: a row may lag
        its REUSE rounds (see :mod:`moe_sidecar.core.policy.recovery`)."""
        self._waiters = RoundWaiters()
        self._timers = RoundTimers(clock, self._on_timer)
        self._watchers = Watchers(watch_queue_limit, max_watchers)
        self._observer = EventObserver(self.metrics, self.sizing_of)
        self._phase = _Phase.OPEN
        self._loop: asyncio.AbstractEventLoop | None = None
        self.arrivals = FirstRoundArrivals(
            clock, round_timeout, self._groups.get, self.metrics, max_groups
        )
        """Ranks at their lifetime's first round that cannot propose yet."""
        self._reads, self._executor, self._admin = self._parts(replica, admin_enabled)
        self._reconnects = ReconnectWindow(reconnect_window, self._declare_lost)
        self._pause_tick: asyncio.TimerHandle | None = None
        """The ranks read back at the start that no session has spoken for since."""
        for state in self._groups.values():
            self._observer.update_gauges(state)
        self.metrics.groups.set(len(self._groups))

    def _parts(
        self, replica: Replica | None, admin_enabled: bool
    ) -> tuple[GroupReads, StepExecutor, AdminCalls]:
        """The reads, the step executor and the admin calls on this coordinator's parts."""
        reads = GroupReads(self._groups, self.arrivals, self._clock)
        executor = StepExecutor(
            self._groups,
            self._dirty,
            self._store,
            replica,
            self.metrics,
            self._observer,
            self.arrivals,
            self._waiters,
            self._timers,
            self._watchers,
        )
        admin = AdminCalls(
            admin_enabled,
            reads,
            executor,
            self._removed,
            self._recovered,
            self._round_timeout,
            lambda: self._phase is _Phase.CLOSED,
        )
        return reads, executor, admin

    # --- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        """Binds to the running loop and arms the deadlines of stored open rounds.

        Raises:
            RuntimeError: no event loop is running.
        """
        self._loop = asyncio.get_running_loop()
        self._timers.bind(self._loop)
        self.arrivals.bind(self._loop)
        self._reconnects.expect(self._groups.values(), self._loop)
        self._tick(time.monotonic())
        now = self._clock()
        for name, state in list(self._groups.items()):
            # The time this sidecar was down does not count against the ranks.
            if state.busy():
                state = self._groups[name] = policy.resume(state, now, self._round_timeout)
                self._dirty.add(name)
            self._timers.set(name, state.next_deadline())

    def _tick(self, due: float) -> None:
        """Notices a pause of the sidecar (this tick ran late): the pause
        does not count against the ranks. A plain timer, not a task: it runs
        in the same turn of the loop as the deadlines that came due during
        the pause, and before them (it was due first), so none of them fails
        a round for the sidecar's own stillness."""
        now = time.monotonic()
        late = now - due
        if late > PAUSE_NOTICED_S and self._phase is _Phase.OPEN:
            self._paused(late)
        assert self._loop is not None
        self._pause_tick = self._loop.call_later(PAUSE_TICK_S, self._tick, now + PAUSE_TICK_S)

    def _paused(self, seconds: float) -> None:
        """Moves every deadline ``seconds`` later (see :func:`moe_sidecar.core.policy.paused`)."""
        _log.warning("the sidecar stood still", extra={"seconds": round(seconds, 3)})
        for name, state in list(self._groups.items()):
            if state.next_deadline() is None:
                continue
            self._groups[name] = policy.paused(state, seconds)
            self._dirty.add(name)
            self._timers.set(name, self._groups[name].next_deadline())

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
        self._timers.stop()
        self._reconnects.stop()
        if self._pause_tick is not None:
            self._pause_tick.cancel()
        self._waiters.wake_all(
            CoordinatorUnavailable(
                "the sidecar is shutting down; retry the proposal once it is back (the round "
                "is kept)"
            )
        )
        self._watchers.end_all(CoordinatorUnavailable("the sidecar is shutting down"))
        self.arrivals.wake_all(CoordinatorUnavailable("the sidecar is shutting down"))

    def close(self) -> None:
        """Drains, writes every unsaved group, and closes the store. Idempotent."""
        if self._phase is _Phase.CLOSED:
            return
        self.drain()
        try:
            self._store.save_many(self._groups[name] for name in sorted(self._dirty))
            self._dirty.clear()
        except StoreError:
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
            PermissionDenied: its group proof does not match the group's
                ranks' (or a rank with their proof took its slot back).
            RoundTimedOut: the round missed ranks past its deadline.
            RoundAborted: a rank restarted mid-round, or this rank's lifetime ended.
            ResourceExhausted: a new group beyond ``--max-groups``.
            CoordinatorUnavailable: the sidecar is shutting down or cannot
                persist the decision.
        """
        if self._phase is not _Phase.OPEN:
            raise CoordinatorUnavailable("the sidecar is shutting down; retry once it is back")
        if not proposal.release:
            # An unstated release is the default one, spelled as stored rows
            # and the wire spell it, so the group compares one name.
            proposal = replace(proposal, release=flashinfer.DEFAULT_RELEASE.name)
        before = self._groups.get(proposal.group)
        if before is None or _merged_only(before):
            self._check_group_budget(proposal)
        step = policy.propose(
            before,
            proposal,
            self._clock(),
            self._round_timeout,
            node=self.node,
            ceiling=self._ceiling,
            recovered=proposal.group in self._recovered,
        )
        if before is None and proposal.group in self._removed:
            self._admin.forget_removed(proposal.group)
        self._executor.execute(step, before)
        self.arrivals.proposed(proposal.group, proposal.lifetime, proposal.ep_rank)
        reply = step.reply
        if isinstance(reply, Decision) and (
            before is None or reply.round > before.last_closed_round
        ):
            # Every local rank proposed this round: none is behind the state any more.
            self._recovered.discard(proposal.group)
        if isinstance(reply, Wait):
            assert self._loop is not None, "Coordinator.start() was not called"
            key = (reply.lifetime_index, reply.round)
            waited = self._waiters.wait(self._loop, proposal.group, key, proposal.lifetime)
            return _answer(await waited)
        assert reply is not None
        return _answer(reply)

    async def arrive(self, arrival: Arrival) -> None:
        """Waits while a rank at its lifetime's first round shares the group's
        proof, until it proposes (see :class:`~moe_sidecar.arrivals.FirstRoundArrivals`).

        Raises:
            InvalidArgument: a malformed field (nothing changes).
            RoundTimedOut: ``--round-timeout`` passed, naming the ranks not there.
            CoordinatorUnavailable: the sidecar is shutting down.
        """
        if self._phase is not _Phase.OPEN:
            raise CoordinatorUnavailable("the sidecar is shutting down; retry once it is back")
        await self.arrivals.arrive(arrival)

    def waiting_calls(self) -> int:
        """How many Propose calls wait for their round now."""
        return self._waiters.count()

    # --- deadlines ------------------------------------------------------------------

    def _on_timer(self, group: str) -> None:
        try:
            state = self._groups.get(group)
            if state is not None and self._phase is _Phase.OPEN:
                self._expire(state, self._clock())
        except CoordinatorUnavailable:
            # Retry in a second; the waiters keep waiting meanwhile.
            if self._phase is _Phase.OPEN:
                self._timers.retry(group, 1.0)
        except Exception:
            # A timer callback has no caller to tell; log it and keep serving.
            _log.exception("round deadline handling failed", extra={"group": group})

    def expire_due(self) -> int:
        """Fails every open round whose deadline has passed on the clock.

        The timers call this per group; it is public for callers that move
        an injected clock. Returns how many rounds expired.

        Raises:
            CoordinatorUnavailable: a timed-out round could not be persisted
                (its waiters keep waiting).
        """
        now = self._clock()
        expired = 0
        for state in list(self._groups.values()):
            deadline = state.next_deadline()
            while deadline is not None and deadline <= now:
                expired += self._expire(self._groups[state.name], now)
                deadline = self._groups[state.name].next_deadline()
        return expired

    def _expire(self, state: GroupState, now: float) -> int:
        step = policy.expire(state, now)
        if step is None:
            # The clock moved less than the timer thought: look again at the deadline.
            self._timers.set(state.name, state.next_deadline())
            return 0
        self._executor.execute(step, state)
        return 1

    # --- commits, reads, admin ------------------------------------------------------

    def depart(
        self, group: str, ep_rank: int, lifetime: str, why: str, *, lost: bool = True
    ) -> None:
        """A rank's session ended: it is gone (see :func:`moe_sidecar.core.policy.depart`);
        ``lost`` when the session broke rather than closed cleanly.

        Ignored while the sidecar drains (its own shutdown ends the sessions)
        and for groups or lifetimes it does not know. Never raises: a session's
        end has no caller to tell; a failure to persist is logged.
        """
        if self._phase is not _Phase.OPEN:
            return
        state = self._groups.get(group)
        if state is None:
            return
        step = policy.depart(
            state, ep_rank, lifetime, why, self._clock(), lost=lost, ack_timeout=self._round_timeout
        )
        if step is None:
            return
        try:
            self._executor.execute(step, state)
        except CoordinatorUnavailable:
            _log.exception("could not record a rank's departure", extra={"group": group})

    def reconnect(self, group: str, ep_rank: int, lifetime: str) -> None:
        """A rank's session came back on a new stream (see
        :func:`moe_sidecar.core.policy.reconnect`): the stream may speak for
        the rank's running lifetime. Changes nothing.

        Raises:
            InvalidArgument: the group name is malformed.
            GroupNotFound: no such group.
            PreconditionFailed: the lifetime is not the rank's running one, or
                the rank is gone.
            CoordinatorUnavailable: the sidecar is shutting down.
        """
        if self._phase is not _Phase.OPEN:
            raise CoordinatorUnavailable("the sidecar is shutting down; retry once it is back")
        policy.reconnect(self.group(group), ep_rank, lifetime)
        self.session_bound(group, ep_rank, lifetime)

    def session_bound(self, group: str, ep_rank: int, lifetime: str) -> None:
        """A session speaks for rank ``ep_rank`` of lifetime ``lifetime`` (its
        first answered message, or a resume): the rank is not awaited any more."""
        self._reconnects.heard(group, ep_rank, lifetime)

    def summary(self, state: GroupState) -> GroupSummary:
        """What operators are shown of ``state``: its ranks at the first round
        (:meth:`FirstRoundArrivals.summary`) and those not back since the
        sidecar's start (see :class:`~moe_sidecar.reconnect_window.ReconnectWindow`)."""
        shown = self.arrivals.summary(state)
        return replace(shown, awaited_ranks=self._reconnects.awaited(state.name))

    def _declare_lost(self, group: str, ep_rank: int, lifetime: str, why: str) -> None:
        """The reconnect window closed with the rank still awaited: a death."""
        _log.warning(
            "rank declared lost: not back after the sidecar's start",
            extra={"group": group, "ep_rank": ep_rank},
        )
        self.depart(group, ep_rank, lifetime, why, lost=True)

    def commit(self, group: str, record: CommitRecord) -> GroupState:
        """Records the plan a rank holds after building and the barrier.

        Raises:
            InvalidArgument: a malformed group name or field.
            GroupNotFound: no such group.
            PreconditionFailed: the rank, lifetime, round or plan does not fit
                the group's decision.
            PermissionDenied: its group proof is not the lifetime's.
            CoordinatorUnavailable: the sidecar has stopped or cannot persist.
        """
        if self._phase is _Phase.CLOSED:
            raise CoordinatorUnavailable("the sidecar has stopped")
        state = self.group(group)
        step = policy.commit(state, record, self._clock(), node=self.node, ceiling=self._ceiling)
        self._executor.execute(step, state)
        if isinstance(step.reply, Refusal):
            raise step.reply.error()
        return step.state

    def group(self, name: str) -> GroupState:
        """One group's state (see :meth:`GroupReads.group`).

        Raises:
            InvalidArgument: the name is malformed.
            GroupNotFound: no such group.
        """
        return self._reads.group(name)

    def shown_group(self, name: str) -> GroupState:
        """One group's state as ``GetGroup`` shows it (see :meth:`GroupReads.shown_group`).

        Raises:
            InvalidArgument: the name is malformed.
            GroupNotFound: no such group, and no arrival of it.
        """
        return self._reads.shown_group(name)

    def sizing_of(self, name: str) -> tuple[int, str] | None:
        """The EP size and FlashInfer release of group ``name`` (None: no such group)."""
        return self._reads.sizing_of(name)

    def groups(self) -> list[GroupState]:
        """Every group, by name."""
        return self._reads.all_groups()

    def groups_page(
        self, after: str | None, size: int, idle_for: float = 0.0
    ) -> tuple[list[GroupState], str | None]:
        """A page of groups and the name to continue after (see :meth:`GroupReads.groups_page`)."""
        return self._reads.groups_page(after, size, idle_for)

    def remove(self, name: str) -> None:
        """Forgets a group entirely (an admin call; see :meth:`AdminCalls.remove`).

        Raises:
            AdminDisabled: the sidecar runs without ``--enable-admin``.
            InvalidArgument: the name is malformed.
            GroupNotFound: no such group.
            PreconditionFailed: a round or a restart of the group is open.
            CoordinatorUnavailable: the sidecar has stopped or cannot persist.
        """
        self._admin.remove(name)

    def reset(self, name: str) -> GroupState:
        """Forgets a group's stored plan and history (an admin call).

        Raises:
            AdminDisabled: the sidecar runs without ``--enable-admin``.
            InvalidArgument: the name is malformed.
            GroupNotFound: no such group.
            CoordinatorUnavailable: the sidecar has stopped or cannot persist.
        """
        return self._admin.reset(name)

    def acknowledge_view(
        self, name: str, ep_rank: int, lifetime: str, number: int, rounds: int
    ) -> GroupState:
        """A member acknowledged a view (see :func:`moe_sidecar.core.policy.acknowledge_view`).

        Raises:
            GroupNotFound: no such group.
            PreconditionFailed: as the policy says, changing nothing.
            CoordinatorUnavailable: the sidecar has stopped or cannot persist.
        """
        state = self.group(name)
        step = policy.acknowledge_view(state, ep_rank, lifetime, number, rounds, self._clock())
        self._executor.execute(step, state)
        return step.state

    def exclude(self, name: str, ranks: tuple[int, ...], reason: str) -> GroupState:
        """Takes ``ranks`` out of the group's membership view (an admin drain;
        see :meth:`AdminCalls.exclude`).

        Raises:
            AdminDisabled: the sidecar runs without ``--enable-admin``.
            GroupNotFound: no such group.
            InvalidArgument, PreconditionFailed: as the policy says, changing nothing.
            CoordinatorUnavailable: the sidecar has stopped or cannot persist.
        """
        return self._admin.exclude(name, ranks, reason)

    # --- the cluster store ----------------------------------------------------------

    def now(self) -> float:
        """The clock's seconds (what growths are stamped with)."""
        return self._clock()

    def cluster_plan(self, name: str) -> ClusterPlan | None:
        """The replicated part of group ``name`` (None: no such group)."""
        return self._reads.cluster_plan(name)

    def group_names(self) -> list[str]:
        """Every group's name, sorted."""
        return self._reads.group_names()

    def merge(self, remote: ClusterPlan) -> bool:
        """Merges a group's plan from the cluster store (another node's decision).

        Returns whether the group changed here. A group this node has never
        seen is created when the remote document holds anything.

        Raises:
            InvalidArgument: a field of ``remote`` is out of range, or its plan
                is above the per-rank workspace ceiling.
            PreconditionFailed: ``remote`` cannot join the group (another
                ``ep_size``, or another ``top_k``/``num_experts`` in one epoch).
            CoordinatorUnavailable: the sidecar has stopped or cannot persist.
        """
        if self._phase is _Phase.CLOSED:
            raise CoordinatorUnavailable("the sidecar has stopped")
        before = self._groups.get(remote.name)
        if before is None and remote.name in self._removed:
            return False  # removed here; back only when a rank of this node proposes for it
        merged = len(self._groups) - self._local_group_count()
        if before is None and merged >= self._max_merged_groups:
            self.metrics.refused("merged_groups")
            _log.warning(
                "cluster plan not merged: --max-merged-groups reached; merged once a rank "
                "of this node proposes for it",
                extra={"group": remote.name, "max_merged_groups": self._max_merged_groups},
            )
            return False
        step = policy.merge(before, remote, self._clock(), node=self.node, ceiling=self._ceiling)
        if before is None and not step.persists:
            return False
        self._executor.execute(step, before)
        return step.persists

    def _check_group_budget(self, proposal: Proposal) -> None:
        """A rank of this node proposes for a group none of them used yet.

        Raises:
            InvalidArgument: the proposal is malformed (checked first).
            ResourceExhausted: ``max_groups`` groups have local ranks already.
        """
        local = self._local_group_count()
        if local >= self._max_groups:
            policy.validate_proposal(
                proposal, ceiling=self._ceiling
            )  # a malformed request is INVALID_ARGUMENT first
            self.metrics.refused("groups")
            raise ResourceExhausted(
                f"group={quote_name(proposal.group)} would be group {local + 1} of this "
                f"sidecar; --max-groups is {self._max_groups}: remove idle groups (moe-sidecar "
                "groups --idle-for SECONDS, then moe-sidecar remove GROUP) or raise the limit"
            )

    def _local_group_count(self) -> int:
        """Groups a rank of this node has proposed for (what ``max_groups`` bounds)."""
        return sum(1 for state in self._groups.values() if not _merged_only(state))

    def pending_replication(self) -> list[tuple[str, int]]:
        """Groups the cluster store has not got yet, each with its outbox ``seq``.

        Raises:
            StoreError: the local database cannot be read.
        """
        return self._store.pending()

    def replicated(self, name: str, seq: int) -> bool:
        """The cluster store has group ``name`` as of outbox ``seq``: forget it
        unless it was saved again since. Returns whether it was forgotten.

        Raises:
            StoreError: the local database cannot be written.
        """
        return self._store.clear_pending(name, seq)

    def mark_pending(self, names: list[str]) -> None:
        """Records that the cluster store must get these groups again.

        Raises:
            StoreError: the local database cannot be written.
        """
        self._store.mark_pending(names)

    def watch(self, group: str) -> Subscription:
        """Subscribes to the events of ``group`` (``""``: every group).

        Call :meth:`unwatch` when the stream ends.

        Raises:
            InvalidArgument: the name is malformed.
            GroupNotFound: no such group, and no arrival of it.
            ResourceExhausted: ``--max-watchers`` streams are open.
            CoordinatorUnavailable: the sidecar is shutting down.
        """
        if group:
            # A group known only by ranks at their first round (Arrive) may be
            # watched: their peer-loss watchers subscribe before the first
            # proposal, so no death of the lifetime can be missed.
            self.shown_group(group)
        if self._phase is not _Phase.OPEN:
            raise CoordinatorUnavailable("the sidecar is shutting down")
        try:
            subscription = self._watchers.subscribe(group)
        except ResourceExhausted:
            self.metrics.refused("watchers")
            raise
        self.metrics.watchers.set(self._watchers.count())
        return subscription

    def watcher_count(self) -> int:
        """How many Watch streams are subscribed now."""
        return self._watchers.count()

    def unwatch(self, subscription: Subscription) -> None:
        """Drops a subscription. Idempotent."""
        self._watchers.unsubscribe(subscription)
        self.metrics.watchers.set(self._watchers.count())
