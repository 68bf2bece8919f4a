"""Capacity plans and their one join. Pure: no grpc, asyncio, torch, clock or I/O.

A workspace is described by its **capacities** (:class:`Capacities`): the
most tokens a rank dispatches per call, the dispatch and combine bytes per
token, ``top_k``, ``num_experts`` and the experts reserved for EPLB
statistics. A :class:`Plan` is capacities plus an ``epoch`` (moved only by
an admin reset) and a ``generation`` (moved only by growth). Workspace bytes
are not part of a plan: they are derived from its capacities by a backend's
size function, which the core takes as an argument
(:class:`moe_sidecar.core.limits.WorkspaceCeiling`); each FlashInfer release's
is in :mod:`moe_sidecar.flashinfer`.

Plans form a lattice, and every union in the project goes through it:

* :func:`join_capacities` is the component-wise maximum of the sizes; the
  shape (``top_k``, ``num_experts``) must be equal, else
  :class:`ShapeMismatch` (FlashInfer builds one all-to-all for one shape);
* :func:`join` joins two decided plans: the higher epoch wins whole; in one
  epoch a plan that dominates the other (capacities and generation) is the
  answer, else the joined capacities under a generation above both, so a
  generation never names two capacity vectors that one node handed out;
* :func:`join_epoch_plans` joins where two groups stand (:class:`EpochPlan`:
  epoch, plan, generation counter): the higher epoch wins whole, in one
  epoch the plans :func:`join` (no plan is the bottom), the counter is the
  largest either side issued. A round's commit across nodes, the cluster
  plans' join (merges from other nodes, the etcd store's compare-and-swap)
  all stand on it;
* :func:`grow` is a round's decision: the plan itself when it covers the
  round's need, else the join of its capacities with the need under the next
  generation;
* :func:`decide_action` turns what a lifetime built and the decided plan
  into BUILD, REUSE or REBUILD.

The sidecar's rounds, the client's agreement across nodes and embedded mode,
the stores' merges and the restore of a stored plan all use these functions;
nothing else takes a maximum of capacities.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields, replace
from typing import Final

__all__ = [
    "SHAPE_FIELDS",
    "SIZE_FIELDS",
    "Action",
    "Capacities",
    "EpochPlan",
    "Plan",
    "ShapeMismatch",
    "decide_action",
    "dominates",
    "grow",
    "join",
    "join_capacities",
    "join_epoch_plans",
]


class Action(enum.Enum):
    """What every rank of a round does with the decided plan."""

    BUILD = "build"
    """Nothing is built in this lifetime yet: build at the plan."""
    REUSE = "reuse"
    """What is built covers the plan: keep it."""
    REBUILD = "rebuild"
    """The plan exceeds what is built: build anew at the plan, then free the old."""


@dataclass(frozen=True)
class Capacities:
    """What an all-to-all workspace holds, per rank (or what one layer needs).

    Every field is a non-negative integer; :mod:`moe_sidecar.core.limits` holds
    their ranges. ``top_k`` and ``num_experts`` are the workspace's shape:
    they never grow, they must match.
    """

    max_tokens: int
    """Most tokens one rank dispatches in one call (FlashInfer's max_num_tokens)."""
    dispatch_bytes_per_token: int
    """Sum of every dispatch payload's bytes per token (activations, scales,
    the int32 expert ids and float32 weights of the top-k routing, extras)."""
    combine_bytes_per_token: int
    """Bytes per token of the combine payload."""
    top_k: int
    num_experts: int
    eplb_experts: int = 0
    """Experts whose load statistics the workspace gathers for EPLB (0: none)."""

    @property
    def shape(self) -> tuple[int, int]:
        """``(top_k, num_experts)``: what must be equal for two capacities to join."""
        return (self.top_k, self.num_experts)

    def covers(self, other: Capacities) -> bool:
        """Whether a workspace of these capacities serves ``other``: the same
        shape and at least as much of every size."""
        return self.shape == other.shape and all(
            getattr(self, name) >= getattr(other, name) for name in SIZE_FIELDS
        )


SHAPE_FIELDS: Final = ("top_k", "num_experts")
"""Fields of :class:`Capacities` that must be equal to join."""
SIZE_FIELDS: Final = tuple(f.name for f in fields(Capacities) if f.name not in SHAPE_FIELDS)
"""Fields of :class:`Capacities` joined by taking the maximum."""


class ShapeMismatch(ValueError):
    """Two capacities of different ``top_k``/``num_experts`` cannot join.

    Callers turn it into a refusal that names the layers and ranks involved.
    """

    def __init__(self, left: Capacities, right: Capacities) -> None:
        super().__init__(
            f"top_k={left.top_k}, num_experts={left.num_experts} cannot join "
            f"top_k={right.top_k}, num_experts={right.num_experts}"
        )
        self.left = left
        self.right = right


def join_capacities(a: Capacities, b: Capacities) -> Capacities:
    """The least capacities covering both: the maximum of every size.

    Raises:
        ShapeMismatch: ``a`` and ``b`` differ in ``top_k`` or ``num_experts``.
    """
    if a == b:
        # The common case (every rank at the same layer) makes no copy.
        return a
    if a.shape != b.shape:
        raise ShapeMismatch(a, b)
    return replace(a, **{name: max(getattr(a, name), getattr(b, name)) for name in SIZE_FIELDS})


@dataclass(frozen=True)
class Plan:
    """A decided workspace: capacities, the epoch they belong to, their generation."""

    capacities: Capacities
    epoch: int
    """Moved only by an admin reset; a higher epoch replaces a lower one whole."""
    generation: int
    """Moved only by growth (or by a join that no input dominates)."""

    def covers(self, need: Capacities) -> bool:
        """Whether a workspace built at this plan serves ``need``."""
        return self.capacities.covers(need)


def dominates(a: Plan, b: Plan) -> bool:
    """Whether ``a`` is at least ``b``: the same epoch, capacities covering
    ``b``'s and a generation no lower."""
    return a.epoch == b.epoch and a.capacities.covers(b.capacities) and a.generation >= b.generation


def join(a: Plan, b: Plan) -> Plan:
    """The plan both ``a`` and ``b`` lead to (commutative and idempotent).

    The higher epoch wins whole (a reset is never undone by a node that
    missed it). In one epoch, a plan dominating the other is returned as it
    is; otherwise the joined capacities get a generation above both, so the
    result is never mistaken for either input.

    Raises:
        ShapeMismatch: same epoch, different ``top_k``/``num_experts``.
    """
    if a.epoch != b.epoch:
        return a if a.epoch > b.epoch else b
    if dominates(a, b):
        return a
    if dominates(b, a):
        return b
    return Plan(
        capacities=join_capacities(a.capacities, b.capacities),
        epoch=a.epoch,
        generation=max(a.generation, b.generation) + 1,
    )


@dataclass(frozen=True)
class EpochPlan:
    """Where a group stands in the lattice: its epoch, the plan of that epoch
    and the last generation it issued."""

    epoch: int
    plan: Plan | None
    """None: nothing grown since the epoch began (the bottom of the epoch)."""
    generation: int
    """Never below ``plan.generation``: generations are never reused."""

    @classmethod
    def of(cls, plan: Plan) -> EpochPlan:
        """Where a lone decided plan stands: its own epoch and generation."""
        return cls(plan.epoch, plan, plan.generation)


def join_epoch_plans(a: EpochPlan, b: EpochPlan) -> EpochPlan:
    """The least place above both ``a`` and ``b`` (commutative and idempotent).

    The higher epoch wins whole (a reset is never undone by a node that
    missed it); in one epoch the plans join (:func:`join`; no plan is the
    bottom). The generation counter is the largest of both counters and the
    joined plan's: a generation one side issued is never issued again.

    Raises:
        ShapeMismatch: same epoch, plans of different ``top_k``/``num_experts``.
    """
    generation = max(a.generation, b.generation)
    if a.epoch != b.epoch:
        winner = a if a.epoch > b.epoch else b
        return replace(winner, generation=generation)
    if a.plan is None or b.plan is None:
        plan = a.plan if b.plan is None else b.plan
    else:
        plan = join(a.plan, b.plan)
    if plan is not None:
        generation = max(generation, plan.generation)
    return EpochPlan(a.epoch, plan, generation)


def grow(plan: Plan | None, need: Capacities, *, epoch: int, last_generation: int) -> Plan:
    """The plan a round decides: ``plan`` when it covers ``need``, else the join
    of its capacities with ``need`` under generation ``last_generation + 1``.

    Args:
        plan: what the group holds now (None: nothing in this epoch).
        need: the joined capacities of the round's proposals.
        epoch: the group's epoch (a new plan's epoch).
        last_generation: the last generation the group issued; generations
            are never reused, not even across epochs.

    Raises:
        ShapeMismatch: ``need`` has another ``top_k``/``num_experts`` than ``plan``.
    """
    if plan is not None and plan.covers(need):
        return plan
    capacities = need if plan is None else join_capacities(plan.capacities, need)
    return Plan(capacities=capacities, epoch=epoch, generation=last_generation + 1)


def decide_action(built: Plan | None, plan: Plan) -> Action:
    """What a lifetime holding ``built`` does to serve ``plan``.

    BUILD when nothing is built, REUSE when ``built`` covers ``plan``,
    REBUILD otherwise. The sidecar decides with it, and the client's
    agreement step derives the same action with it from the agreed plan.
    """
    if built is None:
        return Action.BUILD
    if built.capacities.covers(plan.capacities):
        return Action.REUSE
    return Action.REBUILD
