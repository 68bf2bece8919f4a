"""A group's replicated part and its join: what nodes share through a cluster store. Pure.

A :class:`ClusterPlan` is the part of a :class:`~moe_sidecar.core.group.GroupState`
that outlives a node: the group's layout (``ep_size``), its epoch, its stored
plan, its generation counter, its growth history, each growth naming the
node that made it, and the owner of the stored plan (the id
:func:`moe_sidecar.core.identity.owner_id` makes, never the digest a rank
sends), so that a restart on any node is checked against the owner
(:mod:`moe_sidecar.core.policy.owner`). Round state (lifetimes, ranks, open
rounds, retained outcomes, what a lifetime built) stays on the node that
runs the ranks.

Cluster plans form a lattice on top of :func:`moe_sidecar.core.plan.join_epoch_plans`, so
stores that exchange them converge whatever the order, and nothing merges by
any other rule (:func:`join_cluster_plans`):

* the higher epoch wins whole: its plan, its history and its owner (a reset
  is never undone by a node that missed it; a lifetime that did not inherit
  the stored plan began a new epoch with its own owner);
* in one epoch the plans join with :func:`moe_sidecar.core.plan.join` (no plan is
  the bottom) and the histories are united; a joined plan that neither side
  held is recorded as a growth made by the joining node; the owner is the
  larger id of the two (:func:`join_owners`: no owner is the bottom, so a
  node older than owners that wrote the document back loses nothing; two
  owners in one epoch come only of two nodes' races, and the restart on the
  side whose owner lost begins a new epoch, one rebuild);
* the generation counter is the larger of the two (generations are never
  reused by a node that has heard of the other's).

The join is commutative and idempotent, and its result covers both inputs
(:func:`covers`), which is what the compare-and-swap retry of a store relies
on. Its epoch, owner and plan capacities are associative too; the
generations are not, when a join mints one.
"""

from __future__ import annotations

import math
from dataclasses import astuple, dataclass
from typing import Final

from moe_sidecar.core import limits
from moe_sidecar.core.errors import InvalidArgument, quote_name
from moe_sidecar.core.group import GroupState, Growth
from moe_sidecar.core.identity import OWNER_DIGEST_LENGTH
from moe_sidecar.core.plan import EpochPlan, Plan, dominates, join_epoch_plans

__all__ = [
    "JOINED_LAYER",
    "MAX_HISTORY",
    "MAX_TIMESTAMP",
    "ClusterPlan",
    "LayoutMismatch",
    "check_cluster_plan",
    "check_cluster_plan_ceiling",
    "cluster_plan_of",
    "covers",
    "join_cluster_plans",
    "join_owners",
    "plan_origin",
]

MAX_HISTORY: Final = 256
"""Growth events kept per group (oldest dropped first), on a node and in a store."""
MAX_TIMESTAMP: Final = 253_402_300_800.0
"""The end of year 9999 in seconds since the epoch: a later growth time is corrupt."""
JOINED_LAYER: Final = "(joined across nodes)"
"""The layer label of a growth that joined two nodes' plans."""


@dataclass(frozen=True)
class ClusterPlan:
    """What every node's sidecar shares of one group."""

    name: str
    ep_size: int
    epoch: int = 0
    plan: Plan | None = None
    """The group's plan in ``epoch`` (None: nothing grown since the last reset)."""
    generation: int = 0
    """The last generation any node that contributed issued."""
    history: tuple[Growth, ...] = ()
    """The growths of ``epoch``, oldest first, each with its node."""
    owner: str = ""
    """The owner id (:attr:`moe_sidecar.core.group.GroupState.owner`) of the
    lifetime that stored the plan (empty: none, or a document written before
    owners travelled)."""

    @property
    def held(self) -> EpochPlan:
        """Where the group stands in the plans' lattice."""
        return EpochPlan(self.epoch, self.plan, self.generation)


class LayoutMismatch(ValueError):
    """Two cluster plans of one group name disagree on ``ep_size`` (or name)."""


def cluster_plan_of(state: GroupState) -> ClusterPlan:
    """The replicated part of a node's group state."""
    return ClusterPlan(
        name=state.name,
        ep_size=state.ep_size,
        epoch=state.epoch,
        plan=state.plan,
        generation=state.generation,
        history=state.history,
        owner=state.owner,
    )


def _history_key(g: Growth) -> tuple[object, ...]:
    return (
        g.at,
        g.plan.epoch,
        g.plan.generation,
        g.node,
        g.layer,
        g.ep_rank,
        g.round,
        # Every capacity, in declaration order: a new field needs no change here.
        *astuple(g.plan.capacities),
    )


def _unite(epoch: int, *histories: tuple[Growth, ...]) -> tuple[Growth, ...]:
    """Every growth of ``epoch`` in the histories, once each, in one total
    order (time first), the newest :data:`MAX_HISTORY` kept."""
    entries = {g for history in histories for g in history if g.plan.epoch == epoch}
    return tuple(sorted(entries, key=_history_key))[-MAX_HISTORY:]


def join_owners(a: str, b: str) -> str:
    """The owner of two cluster plans of one epoch: the larger id (a total
    order, so commutative, associative and idempotent; "" is the least)."""
    return max(a, b)


def join_cluster_plans(a: ClusterPlan, b: ClusterPlan, *, node: str, now: float) -> ClusterPlan:
    """The cluster plan that holds both ``a`` and ``b`` (see the module docstring).

    ``node`` and ``now`` name the growth recorded when the join makes a plan
    that neither input held.

    Raises:
        LayoutMismatch: ``a`` and ``b`` name different groups or ``ep_size``.
        ShapeMismatch: same epoch, plans of different ``top_k``/``num_experts``.
    """
    if a.name != b.name or a.ep_size != b.ep_size:
        raise LayoutMismatch(
            f"group {quote_name(a.name)} with ep_size={a.ep_size} cannot join group "
            f"{quote_name(b.name)} with ep_size={b.ep_size}; the group name must change with "
            "the parallel layout"
        )
    held = join_epoch_plans(a.held, b.held)
    if a.epoch != b.epoch:
        winner = a if a.epoch > b.epoch else b
        history = _unite(winner.epoch, winner.history)
        return ClusterPlan(
            a.name, a.ep_size, held.epoch, held.plan, held.generation, history, winner.owner
        )
    history = _unite(a.epoch, a.history, b.history)
    plan = held.plan
    if plan is not None and plan != a.plan and plan != b.plan:
        joined = Growth(plan=plan, layer=JOINED_LAYER, ep_rank=0, round=0, at=now, node=node)
        history = _unite(a.epoch, history, (joined,))
    owner = join_owners(a.owner, b.owner)
    return ClusterPlan(a.name, a.ep_size, held.epoch, plan, held.generation, history, owner)


def covers(a: ClusterPlan, b: ClusterPlan) -> bool:
    """Whether ``a`` already holds everything of ``b``: joining ``b`` into it
    would change nothing."""
    if a.name != b.name or a.ep_size != b.ep_size or a.generation < b.generation:
        return False
    if a.epoch != b.epoch:
        return a.epoch > b.epoch
    if b.plan is not None and (a.plan is None or not dominates(a.plan, b.plan)):
        return False
    if join_owners(a.owner, b.owner) != a.owner:
        return False
    mine = set(a.history)
    return all(g in mine for g in b.history if g.plan.epoch == b.epoch)


def plan_origin(history: tuple[Growth, ...], plan: Plan | None) -> Growth | None:
    """The newest growth that made ``plan``: which node decided it, and when."""
    if plan is None:
        return None
    return next((g for g in reversed(history) if g.plan == plan), None)


def check_cluster_plan(doc: ClusterPlan) -> None:
    """Checks every field of a cluster plan, as if it had arrived in a request:
    it comes from another node, so it is untrusted input.

    Raises:
        InvalidArgument: naming the first bad field and its value.
    """
    limits.check_name("group", doc.name, allow_empty=False)
    limits.check_count("ep_size", doc.ep_size, 1, limits.MAX_EP_SIZE, limits.EP_SIZE_REASON)
    limits.check_count("epoch", doc.epoch, 0, limits.MAX_GENERATION)
    limits.check_count("generation", doc.generation, 0, limits.MAX_GENERATION)
    _check_owner(doc.owner)
    if doc.plan is not None:
        limits.check_plan("plan", doc.plan, doc.ep_size)
        if doc.plan.epoch != doc.epoch:
            raise InvalidArgument.of(
                "plan.epoch", doc.plan.epoch, f"the group's epoch is {doc.epoch}"
            )
        if doc.plan.generation > doc.generation:
            raise InvalidArgument.of(
                "plan.generation", doc.plan.generation, f"above the counter {doc.generation}"
            )
    if len(doc.history) > MAX_HISTORY:
        raise InvalidArgument.of("history", len(doc.history), f"at most {MAX_HISTORY} entries")
    for i, g in enumerate(doc.history):
        where = f"history[{i}]"
        limits.check_plan(f"{where}.plan", g.plan, doc.ep_size)
        if g.plan.epoch != doc.epoch:
            raise InvalidArgument.of(
                f"{where}.plan.epoch", g.plan.epoch, f"the group's epoch is {doc.epoch}"
            )
        limits.check_name(f"{where}.layer", g.layer, allow_empty=True)
        limits.check_name(f"{where}.node", g.node, allow_empty=True)
        limits.check_count(f"{where}.ep_rank", g.ep_rank, 0, doc.ep_size - 1)
        limits.check_count(f"{where}.round", g.round, 0, limits.MAX_ROUND)
        _check_time(f"{where}.at", g.at)


def check_cluster_plan_ceiling(
    doc: ClusterPlan, ceiling: limits.WorkspaceCeiling, release: str
) -> None:
    """Checks that the plan of a cluster document (and every plan of its
    history) derives at most ``ceiling`` workspace bytes per rank in
    ``release``'s arithmetic (the local group's: documents carry no release)
    (:func:`~moe_sidecar.core.limits.check_workspace_ceiling`); run after
    :func:`check_cluster_plan`.

    Raises:
        InvalidArgument: naming the plan, its bytes and the ceiling.
    """
    if doc.plan is not None:
        limits.check_workspace_ceiling("plan", doc.plan.capacities, doc.ep_size, ceiling, release)
    for i, g in enumerate(doc.history):
        limits.check_workspace_ceiling(
            f"history[{i}].plan", g.plan.capacities, doc.ep_size, ceiling, release
        )


def _check_owner(value: str) -> None:
    """An owner id is empty or the 64 lowercase hex digits of a SHA-256
    (:func:`~moe_sidecar.core.identity.owner_id`); the message shows its
    length, never the value (an id is not a secret, but a forged field
    may be anything)."""
    if not isinstance(value, str) or (
        value and (len(value) != OWNER_DIGEST_LENGTH or value.strip("0123456789abcdef"))
    ):
        length = len(value) if isinstance(value, str) else None
        raise InvalidArgument(
            f"owner: {length} characters that are not an owner id; it must be empty or the "
            f"{OWNER_DIGEST_LENGTH} lowercase hex digits of a SHA-256",
            field="owner",
            value=length,
        )


def _check_time(field: str, value: float) -> None:
    if not (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and 0.0 <= value <= MAX_TIMESTAMP
    ):
        raise InvalidArgument.of(
            field, value, f"must be seconds since the epoch in [0, {MAX_TIMESTAMP:g}]"
        )
