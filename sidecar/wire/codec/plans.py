"""Actions, capacities and plans: the values every other part of the codec carries."""

from __future__ import annotations

from moe_sidecar import flashinfer
from moe_sidecar.core.capacity_fields import CAPACITY_FIELDS
from moe_sidecar.core.errors import InvalidArgument
from moe_sidecar.core.plan import Action, Capacities, Plan
from moe_workspace.v1 import coordinator_pb2 as pb

__all__ = [
    "action_from_proto",
    "action_to_proto",
    "capacities_from_proto",
    "capacities_to_proto",
    "plan_from_proto",
    "plan_to_proto",
]

_ACTION_TO_PROTO = {
    Action.BUILD: pb.ACTION_BUILD,
    Action.REUSE: pb.ACTION_REUSE,
    Action.REBUILD: pb.ACTION_REBUILD,
}
_ACTION_FROM_PROTO = {wire: action for action, wire in _ACTION_TO_PROTO.items()}


def action_to_proto(action: Action | None) -> pb.Action.ValueType:
    """The wire action (``ACTION_UNSPECIFIED`` for None)."""
    return pb.ACTION_UNSPECIFIED if action is None else _ACTION_TO_PROTO[action]


def action_from_proto(action: pb.Action.ValueType) -> Action | None:
    """The domain action, or None for ``ACTION_UNSPECIFIED`` or an unknown value."""
    return _ACTION_FROM_PROTO.get(action)


def capacities_to_proto(c: Capacities) -> pb.Capacities:
    """The wire form of capacities: every field of the capacity table."""
    return pb.Capacities(**{field.name: getattr(c, field.name) for field in CAPACITY_FIELDS})


def capacities_from_proto(c: pb.Capacities) -> Capacities:
    """The domain form of wire capacities (ranges unchecked): every field of
    the capacity table (proto3 reads a field an older peer did not send as 0)."""
    return Capacities(**{field.name: getattr(c, field.name) for field in CAPACITY_FIELDS})


def plan_to_proto(plan: Plan, ep_size: int | None, release: str = "") -> pb.Plan:
    """The wire form of a plan; ``workspace_bytes`` derived at ``ep_size``
    (None: 0) in FlashInfer ``release``'s arithmetic (empty: the default
    release's; a commit carries no bytes)."""
    return pb.Plan(
        capacities=capacities_to_proto(plan.capacities),
        epoch=plan.epoch,
        generation=plan.generation,
        workspace_bytes=(
            flashinfer.workspace_size(release, plan.capacities, ep_size) if ep_size else 0
        ),
    )


def plan_from_proto(plan: pb.Plan, field: str = "plan") -> Plan:
    """The domain form of a wire plan (its derived ``workspace_bytes`` is ignored).

    Raises:
        InvalidArgument: the plan has no capacities (naming ``field``).
    """
    if not plan.HasField("capacities"):
        raise InvalidArgument.of(f"{field}.capacities", None, "is missing")
    return Plan(
        capacities=capacities_from_proto(plan.capacities),
        epoch=plan.epoch,
        generation=plan.generation,
    )
