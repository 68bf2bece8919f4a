"""Carrying out one step of the core: :class:`StepExecutor`.

Each call of the state holder (:class:`moe_sidecar.state.Coordinator`)
applies one policy step; this executes its effects
(:mod:`moe_sidecar.core.effects`) in order:
:class:`~moe_sidecar.core.effects.Persist` first (when the write fails,
nothing of the step happens and the caller gets UNAVAILABLE), then answers,
events and timers. It never compares states to find out what happened: the
step says it.

A round decided REUSE changes only the retained outcomes and the ranks' last
rounds: it writes its short record
(:class:`~moe_sidecar.core.effects.RecordReuse`) before anyone hears of it.
A proposal that only joins a round answers nobody: its state is marked dirty
and rides along with the next write of its group (or the flush at close).
With a cluster store, a step that carries
:class:`~moe_sidecar.core.effects.Replicate` records the group as pending in
the same SQLite transaction as its write, then wakes the replica.

The executor holds the coordinator's parts by reference (its groups, its
unsaved names, its store and collaborators); the coordinator stays their one
owner.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from moe_sidecar.arrivals import FirstRoundArrivals
from moe_sidecar.core.effects import Answer, Deadline, Dismiss, GroupEvent, Publish, Replicate, Step
from moe_sidecar.core.errors import CoordinatorUnavailable, quote_name
from moe_sidecar.core.group import GroupState
from moe_sidecar.metrics import SidecarMetrics
from moe_sidecar.observer import EventObserver
from moe_sidecar.store.replica import Replica
from moe_sidecar.store.sqlite import ReuseRecord, StateStore, StoreError
from moe_sidecar.timers import RoundTimers
from moe_sidecar.waiters import RoundWaiters
from moe_sidecar.watch import Watchers

__all__ = ["StepExecutor"]

# The state holder's logger: operators filter the step's failures by it.
_log = logging.getLogger("moe_sidecar.state")


@dataclass(frozen=True, eq=False)
class StepExecutor:
    """Runs a step's effects against the coordinator's groups and collaborators.

    ``groups`` and ``dirty`` are the coordinator's own containers, changed in
    place: the groups by name, and the names whose state changed unsaved.
    """

    groups: dict[str, GroupState]
    dirty: set[str]
    store: StateStore
    replica: Replica | None
    metrics: SidecarMetrics
    observer: EventObserver
    arrivals: FirstRoundArrivals
    waiters: RoundWaiters
    timers: RoundTimers
    watchers: Watchers

    def execute(self, step: Step, before: GroupState | None) -> None:
        """Carries out ``step``: persist first, then every other effect in order.

        Raises:
            CoordinatorUnavailable: the step had to persist and could not;
                nothing of it happened.
        """
        name = step.state.name
        self._persist(step, before)
        self.groups[name] = step.state
        if before is None:
            self.metrics.groups.set(len(self.groups))
        self.observer.update_gauges(step.state, before)
        if self.arrivals.arrived_ranks(name):
            self.arrivals.show_waiting(name)
        for effect in step.effects:
            if isinstance(effect, Answer):
                self.waiters.wake(name, (effect.lifetime_index, effect.round), effect.outcome)
            elif isinstance(effect, Dismiss):
                key = (effect.lifetime_index, effect.round)
                self.waiters.wake_lifetime(name, key, effect.lifetime, effect.outcome)
            elif isinstance(effect, Publish):
                self.publish(effect.event)
            elif isinstance(effect, Deadline):
                self.timers.set(name, effect.at)
            elif isinstance(effect, Replicate) and self.replica is not None:
                self.replica.replicate(name)

    def publish(self, event: GroupEvent) -> None:
        """Counts, logs and fans out one event."""
        self.observer.observe(event)
        self.watchers.publish(event)

    def _persist(self, step: Step, before: GroupState | None) -> None:
        """Writes the step's state when it persists (recording it pending for
        the cluster store when it replicates), or marks it dirty.

        Raises:
            CoordinatorUnavailable: the write failed.
        """
        name = step.state.name
        replicate = self.replica is not None and step.replicates
        reuse = step.reuse_record
        if reuse is not None and not step.persists:
            try:
                self.store.record_reuse(
                    ReuseRecord(name, reuse.lifetime_index, reuse.round, reuse.layer)
                )
            except StoreError as error:
                _log.error("cannot record a round", extra={"group": name, "error": str(error)})
                raise CoordinatorUnavailable(
                    f"cannot record round {reuse.round} of group {quote_name(name)}: {error}; "
                    "nothing was decided"
                ) from error
        if step.persists or replicate:
            try:
                if step.persists:
                    self.store.save(step.state, pending=replicate)
                else:
                    self.store.mark_pending((name,))
            except StoreError as error:
                _log.error("cannot persist group", extra={"group": name, "error": str(error)})
                raise CoordinatorUnavailable(
                    f"cannot persist group {quote_name(name)}: {error}; nothing was decided"
                ) from error
        if step.persists:
            self.dirty.discard(name)
        elif step.state is not before:
            self.dirty.add(name)
