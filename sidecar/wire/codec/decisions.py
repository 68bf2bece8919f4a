"""A round's decision: the ``ProposeResponse`` every rank of the round gets."""

from __future__ import annotations

from moe_sidecar.core.errors import InvalidArgument
from moe_sidecar.core.group import Decision
from moe_sidecar.wire.codec.plans import (
    action_from_proto,
    action_to_proto,
    plan_from_proto,
    plan_to_proto,
)
from moe_workspace.v1 import coordinator_pb2 as pb

__all__ = ["decision_from_proto", "decision_to_proto"]


def decision_to_proto(decision: Decision, ep_size: int, release: str) -> pb.ProposeResponse:
    """The response every rank of a decided round gets (its plan's bytes in
    the ranks' FlashInfer ``release``)."""
    return pb.ProposeResponse(
        round=decision.round,
        action=action_to_proto(decision.action),
        plan=plan_to_proto(decision.plan, ep_size, release),
        grew=decision.grew,
    )


def decision_from_proto(response: pb.ProposeResponse, layer: str) -> Decision:
    """The decision a ``ProposeResponse`` carries for a round of ``layer``.

    Raises:
        ValueError: the response has no action, no plan or no capacities.
    """
    action = action_from_proto(response.action)
    if action is None or not response.HasField("plan"):
        raise ValueError(
            f"malformed ProposeResponse (action={response.action}, "
            f"plan present={response.HasField('plan')})"
        )
    try:
        plan = plan_from_proto(response.plan)
    except InvalidArgument as error:
        raise ValueError(f"malformed ProposeResponse: {error.message}") from None
    return Decision(round=response.round, action=action, plan=plan, grew=response.grew, layer=layer)
