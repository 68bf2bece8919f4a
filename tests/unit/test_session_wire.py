"""A round's decision is serialized once and framed per rank as a
SessionResponse: the framing gives the bytes protobuf itself would."""

from __future__ import annotations

import pytest

from moe_sidecar.core.group import Decision
from moe_sidecar.core.plan import Action, Capacities, Plan
from moe_sidecar.wire.codec import (
    decision_to_proto,
    session_decision_to_proto,
    session_decision_wire,
)
from moe_workspace.v1 import coordinator_pb2 as pb

pytestmark = pytest.mark.timeout(30)

DECISION = Decision(7, Action.REUSE, Plan(Capacities(256, 4096, 14336, 8, 256), 0, 3), False, "l")


@pytest.mark.parametrize("message_id", [0, 1, 127, 128, 300, 2**32 + 5, 2**64 - 1])
def test_the_framed_answer_is_the_message_protobuf_serializes(message_id: int) -> None:
    decision = decision_to_proto(DECISION, 8, "")
    framed = session_decision_wire(message_id, decision.SerializeToString())
    assert framed == session_decision_to_proto(message_id, decision).SerializeToString()
    parsed = pb.SessionResponse.FromString(framed)
    assert parsed.id == message_id and parsed.decision == decision
