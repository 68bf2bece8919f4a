"""The read side of the state holder's groups: :class:`GroupReads`.

What ``GetGroup``, ``ListGroups``, the metrics and the cluster replica read
of the groups, and nothing that changes them: the coordinator
(:class:`moe_sidecar.state.Coordinator`) owns the groups and hands this its
containers by reference, so every read sees its latest step.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

from moe_sidecar.arrivals import FirstRoundArrivals
from moe_sidecar.core import policy
from moe_sidecar.core.cluster import ClusterPlan, cluster_plan_of
from moe_sidecar.core.errors import GroupNotFound
from moe_sidecar.core.group import GroupState

__all__ = ["GroupReads"]


@dataclass(frozen=True, eq=False)
class GroupReads:
    """Reads of ``groups`` (the coordinator's own, by name), with the groups
    that only ``arrivals`` know of where a caller shows them; ``clock`` gives
    seconds since the epoch."""

    groups: dict[str, GroupState]
    arrivals: FirstRoundArrivals
    clock: Callable[[], float]

    def group(self, name: str) -> GroupState:
        """One group's state.

        Raises:
            InvalidArgument: the name is malformed.
            GroupNotFound: no such group.
        """
        policy.validate_group_name(name)
        state = self.groups.get(name)
        if state is None:
            raise GroupNotFound.named(name)
        return state

    def shown_group(self, name: str) -> GroupState:
        """One group's state as ``GetGroup`` shows it: a group known only by
        ranks at their first round is shown with nothing but its layout.

        Raises:
            InvalidArgument: the name is malformed.
            GroupNotFound: no such group, and no arrival of it.
        """
        policy.validate_group_name(name)
        state = self.groups.get(name) or self.arrivals.layout(name)
        if state is None:
            raise GroupNotFound.named(name)
        return state

    def sizing_of(self, name: str) -> tuple[int, str] | None:
        """The EP size and FlashInfer release of group ``name``, what its
        workspace bytes are derived by (None: no such group)."""
        state = self.groups.get(name)
        return (state.ep_size, state.release) if state is not None else None

    def all_groups(self) -> list[GroupState]:
        """Every group, by name."""
        return [self.groups[name] for name in sorted(self.groups)]

    def groups_page(
        self, after: str | None, size: int, idle_for: float = 0.0
    ) -> tuple[list[GroupState], str | None]:
        """Up to ``size`` groups named after ``after`` (in name order), and the
        name to continue after (None: this was the last page).

        ``idle_for`` > 0 keeps only groups with no open round or restart and
        no activity for at least that many seconds.
        """
        now = self.clock()
        names = sorted({*self.groups, *self.arrivals.names()})
        start = 0 if after is None else bisect.bisect_right(names, after)
        page: list[GroupState] = []
        for index in range(start, len(names)):
            state = self.groups.get(names[index]) or self.arrivals.layout(names[index])
            if state is None:
                continue
            arriving = names[index] not in self.groups  # ranks wait in it: never idle
            if idle_for > 0 and (
                arriving or state.busy() or now - state.last_activity() < idle_for
            ):
                continue
            if len(page) == size:
                return page, page[-1].name
            page.append(state)
        return page, None

    def cluster_plan(self, name: str) -> ClusterPlan | None:
        """The replicated part of group ``name`` (None: no such group)."""
        state = self.groups.get(name)
        return cluster_plan_of(state) if state is not None else None

    def group_names(self) -> list[str]:
        """Every group's name, sorted."""
        return sorted(self.groups)
