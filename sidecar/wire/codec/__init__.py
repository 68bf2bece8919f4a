"""The one codec between the wire contract (``moe_workspace.v1``) and the domain.

Both ends of the gRPC connection use it: the sidecar's servicer, the client's
transport, ``moe-sidecar groups`` and ``simulate``. It imports the generated
code and the domain types only (no server state, no metrics, no torch), so a
rank process can use it without pulling in the daemon.

Decoding a request checks presence (a missing message is INVALID_ARGUMENT
naming it), not ranges: the decision core checks every range on its own
input. Decoding a response the client received checks what it acts on.

One codec from the callers' side (import from here), in modules by job:
``plans`` (actions, capacities, plans), ``requests`` (the unary requests, the
page token, the parse of raw bytes), ``decisions`` (a round's answer),
``groups`` (views, group summaries, events) and ``sessions`` (the Session
stream's messages).
"""

from __future__ import annotations

from moe_sidecar.wire.codec.decisions import decision_from_proto, decision_to_proto
from moe_sidecar.wire.codec.groups import (
    event_from_proto,
    event_to_proto,
    summary_from_proto,
    summary_to_proto,
    view_from_proto,
    view_to_proto,
)
from moe_sidecar.wire.codec.plans import (
    action_from_proto,
    action_to_proto,
    capacities_from_proto,
    capacities_to_proto,
    plan_from_proto,
    plan_to_proto,
)
from moe_sidecar.wire.codec.requests import (
    arrival_from_proto,
    arrival_to_proto,
    commit_from_proto,
    commit_to_proto,
    decode_request,
    page_token_from_proto,
    page_token_to_proto,
    proposal_from_proto,
    proposal_to_proto,
)
from moe_sidecar.wire.codec.sessions import (
    session_acknowledge_to_proto,
    session_acknowledged_to_proto,
    session_commit_to_proto,
    session_committed_to_proto,
    session_decision_to_proto,
    session_decision_wire,
    session_error_to_proto,
    session_leave_to_proto,
    session_left_to_proto,
    session_propose_to_proto,
    session_resume_to_proto,
    session_resumed_to_proto,
)

__all__ = [
    "action_from_proto",
    "action_to_proto",
    "arrival_from_proto",
    "arrival_to_proto",
    "capacities_from_proto",
    "capacities_to_proto",
    "commit_from_proto",
    "commit_to_proto",
    "decision_from_proto",
    "decision_to_proto",
    "decode_request",
    "event_from_proto",
    "event_to_proto",
    "page_token_from_proto",
    "page_token_to_proto",
    "plan_from_proto",
    "plan_to_proto",
    "proposal_from_proto",
    "proposal_to_proto",
    "session_acknowledge_to_proto",
    "session_acknowledged_to_proto",
    "session_commit_to_proto",
    "session_committed_to_proto",
    "session_decision_to_proto",
    "session_decision_wire",
    "session_error_to_proto",
    "session_leave_to_proto",
    "session_left_to_proto",
    "session_propose_to_proto",
    "session_resume_to_proto",
    "session_resumed_to_proto",
    "summary_from_proto",
    "summary_to_proto",
    "view_from_proto",
    "view_to_proto",
]
