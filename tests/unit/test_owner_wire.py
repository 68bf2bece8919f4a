"""The owner digest across the wire codec: the sidecar keeps its id, never
the digest a rank sends."""

from __future__ import annotations

import hashlib

import pytest

from moe_sidecar.core.errors import InvalidArgument
from moe_sidecar.core.group import Proposal, Requirement
from moe_sidecar.core.identity import owner_id
from moe_sidecar.core.plan import Capacities
from moe_sidecar.wire.codec import proposal_from_proto, proposal_to_proto

pytestmark = pytest.mark.timeout(10)


def _proposal(owner: str) -> Proposal:
    return Proposal(
        "g/ep2",
        2,
        0,
        2,
        "a-lifetime-token-0123",
        1,
        Requirement(Capacities(256, 100, 200, 2, 16)),
        owner=owner,
    )


def test_the_owner_digest_crosses_the_wire_as_its_id() -> None:
    digest = hashlib.sha256(b"key" + b"g/ep2").hexdigest()
    request = proposal_to_proto(_proposal(digest))
    assert request.owner_digest == digest
    assert proposal_from_proto(request).owner == owner_id(digest)
    assert proposal_from_proto(proposal_to_proto(_proposal(""))).owner == ""


def test_a_bad_owner_digest_is_refused_naming_the_field() -> None:
    request = proposal_to_proto(_proposal("f" * 63))
    with pytest.raises(InvalidArgument, match="owner_digest: 63 characters") as error:
        proposal_from_proto(request)
    assert error.value.field == "owner_digest"
