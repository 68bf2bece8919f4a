"""A plan decided on another node (through the cluster store) merges in. Pure.

The plan arrives as a :class:`~moe_sidecar.core.cluster.ClusterPlan` and is
merged with the cluster plans' join; steps that change a group's epoch or plan
ask their executor to replicate it (:class:`~moe_sidecar.core.effects.Replicate`).
"""

from __future__ import annotations

from dataclasses import replace

from moe_sidecar.core import limits
from moe_sidecar.core.cluster import (
    ClusterPlan,
    LayoutMismatch,
    check_cluster_plan,
    check_cluster_plan_ceiling,
    cluster_plan_of,
    covers,
    join_cluster_plans,
    plan_origin,
)
from moe_sidecar.core.effects import (
    Effect,
    EventKind,
    GroupEvent,
    Persist,
    Publish,
    Replicate,
    Step,
)
from moe_sidecar.core.errors import InvalidArgument, PreconditionFailed, quote_name
from moe_sidecar.core.group import GroupState
from moe_sidecar.core.plan import ShapeMismatch
from moe_sidecar.core.policy.events import group_event

__all__ = ["merge"]


def merge(
    state: GroupState | None,
    remote: ClusterPlan,
    now: float,
    *,
    node: str = "",
    ceiling: limits.WorkspaceCeiling,
) -> Step:
    """Merges a group's plan decided elsewhere (another node, the cluster store).

    ``state`` is None for a group this node has never seen. The group's
    epoch, plan, generation counter, history and owner become the join of its own
    and ``remote`` (:func:`~moe_sidecar.core.cluster.join_cluster_plans`): a later
    epoch replaces the plan (a reset reaches this node), in one epoch the
    plans join, nothing ever shrinks. Rounds, lifetimes and what a lifetime
    built are this node's own and do not change: an open round decides from
    the merged plan when it closes.

    The step persists and publishes a PLAN_MERGED event when the group
    changed, and asks to replicate when the group holds something ``remote``
    lacks (so a store that sent an older document gets the join back). A
    merge that changes nothing has no effects.

    ``node`` names this node on a growth the join makes.

    Raises:
        InvalidArgument: a field of ``remote`` is out of range (it is
            untrusted input), or its plan is above the per-rank workspace
            ``ceiling``.
        PreconditionFailed: ``remote`` has another ``ep_size``, a plan of
            another ``top_k``/``num_experts`` in the same epoch, or one whose
            join with the group's would leave the ranges.
    """
    check_cluster_plan(remote)
    check_cluster_plan_ceiling(remote, ceiling, state.release if state is not None else "")
    if state is None:
        state = GroupState(name=remote.name, ep_size=remote.ep_size, local_ranks=remote.ep_size)
    local = cluster_plan_of(state)
    joined = _joined(local, remote, node, now)
    merged = replace(
        state,
        epoch=joined.epoch,
        plan=joined.plan,
        # The join's counter is at least the group's own: cluster_plan_of copies it.
        generation=joined.generation,
        history=joined.history,
        # So a restart here is checked against the owner of the plan it would inherit.
        owner=joined.owner,
    )
    effects: list[Effect] = []
    if cluster_plan_of(merged) != local:
        effects += [Persist(), Publish(_merged_event(state, joined, now))]
    if not covers(remote, joined):
        effects.append(Replicate())
    return Step(merged, effects=tuple(effects))


def _joined(local: ClusterPlan, remote: ClusterPlan, node: str, now: float) -> ClusterPlan:
    """The join of the group's cluster plan with ``remote``, checked in range.

    Raises:
        PreconditionFailed: another ``ep_size``, another shape in one epoch,
            or a join out of range.
    """
    try:
        joined = join_cluster_plans(local, remote, node=node, now=now)
    except LayoutMismatch as error:
        raise PreconditionFailed(f"cannot merge group {quote_name(remote.name)}: {error}") from None
    except ShapeMismatch as error:
        raise PreconditionFailed(
            f"cannot merge group {quote_name(remote.name)}: the plan from another node has "
            f"{error}; FlashInfer's all-to-all needs one top_k and num_experts for every layer"
        ) from None
    try:
        # Two plans in range can join out of range (one node's tokens, another's bytes).
        check_cluster_plan(joined)
    except InvalidArgument as error:
        raise PreconditionFailed(
            f"cannot merge group {quote_name(remote.name)}: the join with the plan from another "
            f"node would be out of range ({error.message}); nothing was merged"
        ) from None
    return joined


def _merged_event(state: GroupState, joined: ClusterPlan, now: float) -> GroupEvent:
    """The PLAN_MERGED event of a merge that changed ``state`` into ``joined``."""
    origin = plan_origin(joined.history, joined.plan)
    what = (
        f"epoch {joined.epoch} begins (reset on another node)"
        if joined.epoch > state.epoch
        else "plan merged"
    )
    generation = f"generation {joined.plan.generation}" if joined.plan is not None else "no plan"
    source = f", from node {origin.node!r}" if origin and origin.node else ""
    return group_event(
        state,
        EventKind.PLAN_MERGED,
        now,
        plan=joined.plan,
        message=f"{what}: epoch {joined.epoch}, {generation}{source}",
        node=origin.node if origin is not None else "",
    )
