"""What one rank holds of its EP group's all-to-all: the object built, the
plan it was built at, the ``moe_ep`` object over it, and the dispatch rows
its layers asked for; building a plan and releasing what it supersedes.

The manager (:mod:`moe_sidecar.client.manager`) decides when; this holds.
"""

from __future__ import annotations

import time
from typing import Any

from moe_sidecar.client.backends import AlltoAll, AlltoAllBackend, BuildSpec
from moe_sidecar.client.dispatch_layouts import DispatchLayouts
from moe_sidecar.client.group_collectives import GroupCollectives
from moe_sidecar.core.plan import Action, Plan

__all__ = ["HeldWorkspace"]


class HeldWorkspace:
    """One rank's all-to-all, built through ``backend``, and its counts.

    Args:
        backend: builds, sizes and releases the all-to-all.
        ep_size: ranks of the EP group.
        ep_rank: this rank in it.
        enable_rank_mask: build kernels that take an active-rank mask (the
            ``mask`` peer-loss policy: survivors go on without a dead rank).
    """

    def __init__(
        self,
        backend: AlltoAllBackend,
        ep_size: int,
        ep_rank: int,
        *,
        enable_rank_mask: bool = False,
    ) -> None:
        self.backend = backend
        self.ep_size = ep_size
        self.ep_rank = ep_rank
        self.enable_rank_mask = enable_rank_mask
        self.handle: AlltoAll | None = None
        """The all-to-all built (None: nothing)."""
        self.plan: Plan | None = None
        """The plan ``handle`` was built at."""
        self.workspace_bytes = 0
        """Per-rank bytes of ``plan`` by the backend's size function (0: nothing built)."""
        self.layouts = DispatchLayouts()
        """What ``communication()``'s ``params`` describes."""
        self._communication: Any = None
        self.builds = 0
        self.rebuilds = 0
        self.releases = 0
        self.first_build_seconds: float | None = None

    def build(
        self, plan: Plan, action: Action, low_precision_combine: bool, on_group: GroupCollectives
    ) -> float:
        """Builds ``plan``, passes the EP barrier and releases the superseded
        workspace; returns the build's seconds.

        Raises:
            BackendError: the backend could not build.
            RankLost: a peer died in the barrier.
        """
        workspace = self.backend.workspace_bytes(plan.capacities, self.ep_size)
        spec = BuildSpec(
            ep_size=self.ep_size,
            ep_rank=self.ep_rank,
            capacities=plan.capacities,
            workspace_size_per_rank=workspace,
            use_low_precision_combine=low_precision_combine,
            enable_rank_mask=self.enable_rank_mask,
        )
        started = time.perf_counter()
        handle = self.backend.build(spec)
        build_seconds = time.perf_counter() - started
        if self.first_build_seconds is None:
            self.first_build_seconds = build_seconds
        on_group.barrier_after_build(self.backend, handle)
        superseded = self.handle
        self._drop_communication()
        self.handle, self.plan, self.workspace_bytes = handle, plan, workspace
        if superseded is not None:
            self.backend.release(superseded)
            self.releases += 1
        if action is Action.BUILD:
            self.builds += 1
        else:
            self.rebuilds += 1
        return build_seconds

    def communication(self, low_precision_combine: bool) -> Any:
        """The ``moe_ep`` object over ``handle``, made on first use after each
        build (no allocation, no collective); None when nothing is built.

        Raises:
            BackendError: the backend cannot make the object.
        """
        if self.handle is None or self.plan is None:
            return None
        if self._communication is None:
            spec = self.layouts.communication_spec(
                self.plan, self.ep_size, self.ep_rank, low_precision_combine
            )
            self._communication = self.backend.communication(self.handle, spec)
        return self._communication

    def release(self) -> None:
        """Frees what is held (nothing built afterwards)."""
        handle = self.handle
        self._drop_communication()
        self.handle, self.plan, self.workspace_bytes = None, None, 0
        if handle is not None:
            self.backend.release(handle)
            self.releases += 1

    def _drop_communication(self) -> None:
        communication, self._communication = self._communication, None
        # A moe_ep backend's object is the handle itself: the release destroys it.
        if communication is not None and communication is not self.handle:
            communication.destroy()
