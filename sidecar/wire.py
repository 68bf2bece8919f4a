"""Conversions between the wire contract and the domain types of the core.

Shared by both ends of the gRPC connection: the sidecar's servicer and the
client's gRPC transport. It imports the generated code and
:mod:`moe_sidecar.policy` only (no server state, no metrics), so a rank process
can use it without pulling in the daemon.
"""

from __future__ import annotations

from moe_sidecar.errors import InvalidArgument
from moe_sidecar.policy import Action, Decision, Plan, Proposal, Requirement
from moe_workspace.v1 import coordinator_pb2 as pb

__all__ = [
    "action_to_proto",
    "decision_from_proto",
    "decision_to_proto",
    "plan_from_proto",
    "plan_to_proto",
    "proposal_from_proto",
    "proposal_to_proto",
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


def proposal_to_proto(p: Proposal) -> pb.ProposeRequest:
    """The ``ProposeRequest`` a rank sends for ``p``."""
    r = p.requirement
    return pb.ProposeRequest(
        group=p.group,
        ep_size=p.ep_size,
        ep_rank=p.ep_rank,
        local_ranks=p.local_ranks,
        lifetime=p.lifetime,
        round=p.round,
        requirement=pb.Requirement(
            workspace_bytes=r.workspace_bytes,
            max_num_tokens=r.max_num_tokens,
            top_k=r.top_k,
            num_experts=r.num_experts,
            layer=r.layer,
            payload_bytes=r.payload_bytes,
        ),
    )


def proposal_from_proto(request: pb.ProposeRequest) -> Proposal:
    """The domain proposal of a ``ProposeRequest``.

    Raises:
        InvalidArgument: the ``requirement`` message is missing.
    """
    if not request.HasField("requirement"):
        raise InvalidArgument.of("requirement", None, "is missing; every proposal states its need")
    r = request.requirement
    return Proposal(
        group=request.group,
        ep_size=request.ep_size,
        ep_rank=request.ep_rank,
        local_ranks=request.local_ranks,
        lifetime=request.lifetime,
        round=request.round,
        requirement=Requirement(
            workspace_bytes=r.workspace_bytes,
            max_num_tokens=r.max_num_tokens,
            top_k=r.top_k,
            num_experts=r.num_experts,
            layer=r.layer,
            payload_bytes=r.payload_bytes,
        ),
    )


def plan_to_proto(plan: Plan) -> pb.Plan:
    """The wire form of a plan."""
    return pb.Plan(
        workspace_bytes=plan.workspace_bytes,
        max_num_tokens=plan.max_num_tokens,
        top_k=plan.top_k,
        num_experts=plan.num_experts,
        generation=plan.generation,
        payload_bytes=plan.payload_bytes,
    )


def plan_from_proto(plan: pb.Plan) -> Plan:
    """The domain form of a wire plan (its shape origin is not on the wire: left empty)."""
    return Plan(
        workspace_bytes=plan.workspace_bytes,
        max_num_tokens=plan.max_num_tokens,
        top_k=plan.top_k,
        num_experts=plan.num_experts,
        generation=plan.generation,
        payload_bytes=plan.payload_bytes,
    )


def decision_to_proto(decision: Decision) -> pb.ProposeResponse:
    """The response every rank of a decided round gets."""
    return pb.ProposeResponse(
        round=decision.round,
        action=_ACTION_TO_PROTO[decision.action],
        plan=plan_to_proto(decision.plan),
        grew=decision.grew,
    )


def decision_from_proto(response: pb.ProposeResponse, layer: str) -> Decision:
    """The decision a ``ProposeResponse`` carries for a round of ``layer``.

    Raises:
        ValueError: the response has no action or no plan.
    """
    action = _ACTION_FROM_PROTO.get(response.action)
    if action is None or not response.HasField("plan"):
        raise ValueError(
            f"malformed ProposeResponse (action={response.action}, "
            f"plan present={response.HasField('plan')})"
        )
    return Decision(
        round=response.round,
        action=action,
        plan=plan_from_proto(response.plan),
        grew=response.grew,
        layer=layer,
    )
