"""The unary requests a rank sends (proposals, commits, arrivals), the
``ListGroups`` page token, and the parse of a request's raw bytes.

Decoding checks presence (a missing message is INVALID_ARGUMENT naming it),
not ranges: the decision core checks every range on its own input.
"""

from __future__ import annotations

import base64
import math
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

from moe_sidecar import flashinfer
from moe_sidecar.core import limits
from moe_sidecar.core.errors import InvalidArgument, UndecodableRequest
from moe_sidecar.core.group import CommitRecord, Proposal, Requirement
from moe_sidecar.core.identity import lifetime_id, owner_id, proof_id
from moe_sidecar.core.policy.arrivals import Arrival
from moe_sidecar.wire.codec.plans import (
    capacities_from_proto,
    capacities_to_proto,
    plan_from_proto,
    plan_to_proto,
)
from moe_workspace.v1 import coordinator_pb2 as pb

__all__ = [
    "arrival_from_proto",
    "arrival_to_proto",
    "commit_from_proto",
    "commit_to_proto",
    "decode_request",
    "page_token_from_proto",
    "page_token_to_proto",
    "proposal_from_proto",
    "proposal_to_proto",
]

_Message = TypeVar("_Message", bound=Message)


def decode_request(message_class: type[_Message], data: bytes) -> _Message:
    """Parses a request's raw bytes as ``message_class``.

    Raises:
        UndecodableRequest: the bytes are not that message (INVALID_ARGUMENT).
    """
    try:
        return message_class.FromString(data)
    except (DecodeError, RecursionError, ValueError) as error:
        name = message_class.DESCRIPTOR.full_name
        raise UndecodableRequest(
            f"request: {len(data)} bytes that are not a {name}: {error}",
            field="request",
            value=len(data),
        ) from None


_PAGE_TOKEN_PREFIX = "g1."


def page_token_to_proto(after: str | None) -> str:
    """The opaque token of the page that starts after group ``after`` ("" for none)."""
    if after is None:
        return ""
    return _PAGE_TOKEN_PREFIX + base64.urlsafe_b64encode(after.encode()).decode().rstrip("=")


def page_token_from_proto(
    request: pb.ListGroupsRequest, default_size: int, max_size: int
) -> tuple[int, str | None, float]:
    """Page size (0: ``default_size``; above ``max_size``: ``max_size``), the
    group name the page starts after, and the idle filter of a ``ListGroupsRequest``.

    Raises:
        InvalidArgument: a negative page size or idle time, or a token this
            sidecar did not make.
    """
    if request.page_size < 0:
        raise InvalidArgument.of("page_size", request.page_size, "must be >= 0")
    idle = request.idle_for_seconds
    if not math.isfinite(idle) or idle < 0:
        raise InvalidArgument.of("idle_for_seconds", idle, "must be a finite number >= 0")
    size = min(request.page_size or default_size, max_size)
    token = request.page_token
    if not token:
        return size, None, idle
    try:
        if not token.startswith(_PAGE_TOKEN_PREFIX):
            raise ValueError("unknown prefix")
        encoded = token[len(_PAGE_TOKEN_PREFIX) :]
        after = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode()
        limits.check_name("page_token", after, allow_empty=False)
    except (ValueError, InvalidArgument):
        raise InvalidArgument.of(
            "page_token", token[:40], "is not a next_page_token of this sidecar"
        ) from None
    return size, after, idle


def proposal_to_proto(p: Proposal) -> pb.ProposeRequest:
    """The ``ProposeRequest`` a rank sends for ``p``."""
    return pb.ProposeRequest(
        group=p.group,
        ep_size=p.ep_size,
        ep_rank=p.ep_rank,
        local_ranks=p.local_ranks,
        lifetime=p.lifetime,
        round=p.round,
        requirement=pb.Requirement(
            capacities=capacities_to_proto(p.requirement.capacities),
            layer=p.requirement.layer,
        ),
        group_proof=p.proof,
        flashinfer_release=p.release,
        owner_digest=p.owner,
    )


def proposal_from_proto(request: pb.ProposeRequest) -> Proposal:
    """The domain proposal of a ``ProposeRequest``; its lifetime and group
    proof tokens become their ids (:func:`moe_sidecar.core.identity.lifetime_id`,
    :func:`~moe_sidecar.core.identity.proof_id`): the sidecar never keeps a token.

    Raises:
        InvalidArgument: the requirement or its capacities are missing, the
            lifetime or proof token is not a usable secret, ``owner_digest``
            is not a SHA-256's hex digits (the owner digest becomes its id,
            :func:`~moe_sidecar.core.identity.owner_id`), or
            ``flashinfer_release`` names no release of the table (empty is
            the default release: a client older than the field).
    """
    if not request.HasField("requirement"):
        raise InvalidArgument.of("requirement", None, "is missing; every proposal states its need")
    r = request.requirement
    if not r.HasField("capacities"):
        raise InvalidArgument.of(
            "requirement.capacities", None, "is missing; every proposal states its need"
        )
    return Proposal(
        group=request.group,
        ep_size=request.ep_size,
        ep_rank=request.ep_rank,
        local_ranks=request.local_ranks,
        lifetime=lifetime_id(request.lifetime),
        round=request.round,
        requirement=Requirement(capacities=capacities_from_proto(r.capacities), layer=r.layer),
        proof=proof_id(request.group_proof),
        release=flashinfer.check_release_name("flashinfer_release", request.flashinfer_release),
        owner=owner_id(request.owner_digest),
    )


def commit_to_proto(group: str, record: CommitRecord) -> pb.CommitRequest:
    """The ``CommitRequest`` a rank sends for ``record``."""
    return pb.CommitRequest(
        group=group,
        ep_rank=record.ep_rank,
        lifetime=record.lifetime,
        round=record.round,
        plan=plan_to_proto(record.plan, None),
        build_seconds=record.build_seconds,
        group_proof=record.proof,
    )


def commit_from_proto(request: pb.CommitRequest) -> tuple[str, CommitRecord]:
    """The group name and domain record of a ``CommitRequest`` (the lifetime
    and group proof tokens become their ids).

    Raises:
        InvalidArgument: the plan (or its capacities) is missing, or the
            lifetime or proof token is not a usable secret.
    """
    if not request.HasField("plan"):
        raise InvalidArgument.of("plan", None, "is missing; commit the plan the rank holds")
    return request.group, CommitRecord(
        ep_rank=request.ep_rank,
        lifetime=lifetime_id(request.lifetime),
        round=request.round,
        plan=plan_from_proto(request.plan),
        build_seconds=request.build_seconds,
        proof=proof_id(request.group_proof),
    )


def arrival_to_proto(a: Arrival) -> pb.ArriveRequest:
    """The ``ArriveRequest`` a rank sends for ``a`` (``a.lifetime`` is its token)."""
    return pb.ArriveRequest(
        group=a.group,
        ep_size=a.ep_size,
        ep_rank=a.ep_rank,
        local_ranks=a.local_ranks,
        lifetime=a.lifetime,
    )


def arrival_from_proto(request: pb.ArriveRequest) -> Arrival:
    """The domain arrival of an ``ArriveRequest``; its lifetime token becomes
    its id (:func:`moe_sidecar.core.identity.lifetime_id`).

    Raises:
        InvalidArgument: the lifetime token is not a usable secret.
    """
    return Arrival(
        group=request.group,
        ep_size=request.ep_size,
        ep_rank=request.ep_rank,
        local_ranks=request.local_ranks,
        lifetime=lifetime_id(request.lifetime),
    )
