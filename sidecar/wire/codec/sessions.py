"""The messages of a rank's Session stream, both ways, and the answer to a
proposal serialized without encoding its decision again."""

from __future__ import annotations

from google.protobuf.message import Message

from moe_sidecar.core.group import CommitRecord, Proposal
from moe_sidecar.core.membership import View
from moe_sidecar.wire.codec.groups import view_to_proto
from moe_sidecar.wire.codec.requests import commit_to_proto, proposal_to_proto
from moe_workspace.v1 import coordinator_pb2 as pb

__all__ = [
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
]


def session_propose_to_proto(message_id: int, p: Proposal) -> pb.SessionRequest:
    """A session message carrying a proposal."""
    return pb.SessionRequest(id=message_id, propose=proposal_to_proto(p))


def session_commit_to_proto(message_id: int, group: str, record: CommitRecord) -> pb.SessionRequest:
    """A session message carrying a commit."""
    return pb.SessionRequest(id=message_id, commit=commit_to_proto(group, record))


def session_decision_to_proto(message_id: int, decision: pb.ProposeResponse) -> pb.SessionResponse:
    """The answer to a session's proposal: its decision (see
    :func:`~moe_sidecar.wire.codec.decisions.decision_to_proto`)."""
    return pb.SessionResponse(id=message_id, decision=decision)


def _varint(value: int) -> bytes:
    """``value`` (>= 0) as a protobuf base-128 varint."""
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _tag(message: type[Message], field: str, wire_type: int) -> bytes:
    return _varint(message.DESCRIPTOR.fields_by_name[field].number << 3 | wire_type)


_SESSION_ID_TAG = _tag(pb.SessionResponse, "id", 0)
_SESSION_DECISION_TAG = _tag(pb.SessionResponse, "decision", 2)


def session_decision_wire(message_id: int, decision: bytes) -> bytes:
    """The serialized answer to a session's proposal, from its decision's
    serialized ``ProposeResponse``: the same bytes as serializing
    :func:`session_decision_to_proto`, without copying or encoding the
    decision again (every rank of a round gets the same one)."""
    head = _SESSION_ID_TAG + _varint(message_id) if message_id else b""
    return head + _SESSION_DECISION_TAG + _varint(len(decision)) + decision


def session_committed_to_proto(message_id: int) -> pb.SessionResponse:
    """The answer to a session's commit."""
    return pb.SessionResponse(id=message_id, committed=pb.CommitResponse())


def session_leave_to_proto(message_id: int) -> pb.SessionRequest:
    """A rank's clean goodbye on its session (its cleanup)."""
    return pb.SessionRequest(id=message_id, leave=pb.LeaveRequest())


def session_left_to_proto(message_id: int) -> pb.SessionResponse:
    """The answer to a session's goodbye (the stream ends next)."""
    return pb.SessionResponse(id=message_id, left=pb.LeaveResponse())


def session_acknowledge_to_proto(message_id: int, view: int, rounds: int) -> pb.SessionRequest:
    """A member's acknowledgement of view ``view`` at ``rounds`` all-to-all rounds."""
    return pb.SessionRequest(
        id=message_id, acknowledge=pb.AcknowledgeView(view=view, rounds=rounds)
    )


def session_acknowledged_to_proto(message_id: int, view: View | None) -> pb.SessionResponse:
    """The answer to an acknowledgement: the view as it stands."""
    response = pb.SessionResponse(id=message_id)
    response.acknowledged.CopyFrom(view_to_proto(view) if view is not None else pb.View())
    return response


def session_resume_to_proto(
    message_id: int, group: str, ep_rank: int, lifetime: str
) -> pb.SessionRequest:
    """The first message of a stream that takes over a broken one: it binds the
    stream to rank ``ep_rank``'s running lifetime (its token) of ``group``."""
    resume = pb.ResumeSession(group=group, ep_rank=ep_rank, lifetime=lifetime)
    return pb.SessionRequest(id=message_id, resume=resume)


def session_resumed_to_proto(message_id: int) -> pb.SessionResponse:
    """The answer to a resume: the stream speaks for the rank's lifetime."""
    return pb.SessionResponse(id=message_id, resumed=pb.ResumeResponse())


def session_error_to_proto(message_id: int, code: str, message: str) -> pb.SessionResponse:
    """A session message's error: the status code's name and the message."""
    return pb.SessionResponse(id=message_id, error=pb.SessionError(code=code, message=message))
