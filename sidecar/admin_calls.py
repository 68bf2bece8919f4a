"""The admin calls of the state holder: :class:`AdminCalls`.

``RemoveGroup``, ``ResetGroup`` and ``ExcludeRanks``, allowed only with
``--enable-admin``, and the record of groups an admin removed here (whose
cluster store copy stays out until a rank of this node proposes for them).
The coordinator (:class:`moe_sidecar.state.Coordinator`) owns the groups and
hands this its containers and collaborators by reference.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from moe_sidecar.core import policy
from moe_sidecar.core.effects import EventKind, GroupEvent
from moe_sidecar.core.errors import AdminDisabled, CoordinatorUnavailable, quote_name
from moe_sidecar.core.group import GroupState
from moe_sidecar.group_reads import GroupReads
from moe_sidecar.step_executor import StepExecutor
from moe_sidecar.store.sqlite import StoreError

__all__ = ["AdminCalls"]


@dataclass(frozen=True, eq=False)
class AdminCalls:
    """The admin calls on the coordinator's groups, through its ``reads``
    (and their clock) and its ``executor`` (and the store, timers and metrics
    it holds).

    ``removed`` and ``recovered`` are the coordinator's own sets, changed in
    place; ``stopped`` says whether the sidecar has closed.
    """

    enabled: bool
    reads: GroupReads
    executor: StepExecutor
    removed: set[str]
    recovered: set[str]
    round_timeout: float
    stopped: Callable[[], bool]

    def remove(self, name: str) -> None:
        """Forgets a group entirely (an admin call), freeing one of ``--max-groups``.

        Raises:
            AdminDisabled: the sidecar runs without ``--enable-admin``.
            InvalidArgument: the name is malformed.
            GroupNotFound: no such group.
            PreconditionFailed: a round or a restart of the group is open.
            CoordinatorUnavailable: the sidecar has stopped or cannot persist.
        """
        self._check_admin("RemoveGroup", name)
        state = self.reads.group(name)
        policy.check_removable(state)
        executor = self.executor
        try:
            executor.store.delete(name)
        except StoreError as error:
            raise CoordinatorUnavailable(
                f"cannot remove group {quote_name(name)}: {error}"
            ) from error
        del executor.groups[name]
        self.recovered.discard(name)
        self.removed.add(name)
        executor.dirty.discard(name)
        executor.timers.set(name, None)
        executor.metrics.groups.set(len(executor.groups))
        executor.publish(
            GroupEvent(
                name, EventKind.GROUP_REMOVED, self.reads.clock(), message="removed by an admin"
            )
        )
        executor.metrics.forget(name)

    def forget_removed(self, name: str) -> None:
        """A rank of this node proposes for a group an admin removed here:
        the group is recorded again (and the cluster store's copy let in).

        Raises:
            CoordinatorUnavailable: the store cannot be written.
        """
        try:
            self.executor.store.forget_removed(name)
        except StoreError as error:
            raise CoordinatorUnavailable(
                f"cannot record group {quote_name(name)} again: {error}"
            ) from error
        self.removed.discard(name)

    def reset(self, name: str) -> GroupState:
        """Forgets a group's stored plan and history (an admin call).

        Raises:
            AdminDisabled: the sidecar runs without ``--enable-admin``.
            InvalidArgument: the name is malformed.
            GroupNotFound: no such group.
            CoordinatorUnavailable: the sidecar has stopped or cannot persist.
        """
        self._check_admin("ResetGroup", name)
        state = self.reads.group(name)
        step = policy.reset(state, self.reads.clock())
        self.executor.execute(step, state)
        return step.state

    def exclude(self, name: str, ranks: tuple[int, ...], reason: str) -> GroupState:
        """Takes ``ranks`` out of the group's membership view (an admin drain;
        see :func:`moe_sidecar.core.policy.exclude`).

        Raises:
            AdminDisabled: the sidecar runs without ``--enable-admin``.
            GroupNotFound: no such group.
            InvalidArgument, PreconditionFailed: as the policy says, changing nothing.
            CoordinatorUnavailable: the sidecar has stopped or cannot persist.
        """
        self._check_admin("ExcludeRanks", name)
        state = self.reads.group(name)
        step = policy.exclude(state, ranks, reason, self.reads.clock(), self.round_timeout)
        self.executor.execute(step, state)
        return step.state

    def _check_admin(self, call: str, name: str) -> None:
        """Refuses an admin call the sidecar does not take now.

        Raises:
            AdminDisabled: the sidecar runs without ``--enable-admin``.
            CoordinatorUnavailable: the sidecar has stopped.
        """
        if not self.enabled:
            raise AdminDisabled(
                f"{call}(group={quote_name(name)}) is an admin call; start the sidecar with "
                "--enable-admin (env MOE_SIDECAR_ENABLE_ADMIN=true) to allow it"
            )
        if self.stopped():
            raise CoordinatorUnavailable("the sidecar has stopped")
