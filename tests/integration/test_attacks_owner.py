"""A stranger's whole-group squat against a real sidecar: every local slot
of a group, its own proof, a huge plan under the workspace ceiling, before
the real ranks (or while they are down). The real ranks' next lifetime
builds its own plan, not the stranger's, because it does not carry the
stranger's owner digest (``moe_sidecar.core.policy.owner``); and the real
ranks' restarts with their own owner key still inherit their stored plan,
across a restart of the sidecar too. Run them alone with ``pytest -m attack``.
"""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from typing import Any

import pytest

from moe_sidecar.server import running_server
from moe_workspace.v1 import coordinator_pb2 as pb
from tests.integration.helpers import (
    NVFP4,
    capacities,
    coordinator_stub,
    make_config,
    owner_digest,
    propose_request,
    token,
    workspace_bytes,
)

pytestmark = [pytest.mark.attack, pytest.mark.timeout(60)]

GROUP = "victim/ep4"
RANKS = 4
PLANTED = pb.Requirement(capacities=capacities(tokens=3_880_000, dispatch=4096), layer="")
"""The stranger's plan: 62.7 GiB per rank at EP 4, under the 64 GiB default ceiling."""
PLANTED_BYTES = workspace_bytes(PLANTED.capacities, RANKS)
OWN_BYTES = workspace_bytes(NVFP4.capacities, RANKS)
STRANGERS_OWNER = hashlib.sha256(b"a key of the stranger's own" + GROUP.encode()).hexdigest()


def _proposal(
    rank: int, lifetime: str, proof: str, owner: str, requirement: pb.Requirement
) -> pb.ProposeRequest:
    request = propose_request(rank, 1, requirement, group=GROUP, ep_size=RANKS, local_ranks=RANKS)
    request.lifetime = token(f"{lifetime}-rank-{rank}")
    request.group_proof = proof
    request.owner_digest = owner
    return request


async def _lifetime(
    stub: Any, lifetime: str, proof: str, owner: str, requirement: pb.Requirement = NVFP4
) -> list[pb.ProposeResponse]:
    """Round 1 of a lifetime proposed by every local rank at once."""
    return list(
        await asyncio.gather(
            *(
                stub.Propose(_proposal(r, lifetime, proof, owner, requirement), timeout=20)
                for r in range(RANKS)
            )
        )
    )


def _real(lifetime: str) -> tuple[str, str, str]:
    """A lifetime of the real ranks: its name, its own proof, their owner digest."""
    return lifetime, f"real-ranks-proof-of-{lifetime}", owner_digest(GROUP)


async def _squat(stub: Any, owner: str) -> None:
    """The stranger completes round 1 for every slot; it builds its own plan."""
    planted = await _lifetime(stub, "stranger", "a-stranger-s-own-proof", owner, PLANTED)
    assert {a.action for a in planted} == {pb.ACTION_BUILD}
    assert {a.plan.workspace_bytes for a in planted} == {PLANTED_BYTES}
    assert PLANTED_BYTES > 62 << 30


@pytest.mark.parametrize("strangers_owner", [STRANGERS_OWNER, ""], ids=["own-key", "no-key"])
async def test_a_whole_group_squat_first_is_not_built_by_the_real_ranks(
    tmp_path: Path, strangers_owner: str
) -> None:
    """Before any real rank: the stranger's plan is stored, and the real
    ranks' round 1 (a restart to the sidecar) begins a new epoch from their
    own layer; their next restarts inherit what they stored."""
    state_dir = tmp_path / "state"
    async with (
        running_server(make_config(tmp_path, state_dir=state_dir)) as server,
        coordinator_stub(server.addresses.listen[0]) as stub,
    ):
        await _squat(stub, strangers_owner)
        squatted = await stub.GetGroup(pb.GetGroupRequest(group=GROUP), timeout=5)
        answers = await _lifetime(stub, *_real("first"))
        assert {a.action for a in answers} == {pb.ACTION_BUILD}
        assert {a.plan.workspace_bytes for a in answers} == {OWN_BYTES}, "built the stranger's plan"
        assert {a.plan.epoch for a in answers} == {squatted.epoch + 1}
        group = await stub.GetGroup(pb.GetGroupRequest(group=GROUP), timeout=5)
        assert group.plan == answers[0].plan and group.lifetimes == 2
        assert [h.plan.workspace_bytes for h in group.history] == [OWN_BYTES]

        # A warm restart with their owner key inherits their stored plan.
        again = await _lifetime(stub, *_real("second"))
        assert {a.plan.SerializeToString() for a in again} == {answers[0].plan.SerializeToString()}
    # And so does one after the sidecar restarted from its stored rows.
    async with (
        running_server(make_config(tmp_path, state_dir=state_dir)) as server,
        coordinator_stub(server.addresses.listen[0]) as stub,
    ):
        third = await _lifetime(stub, *_real("third"))
        assert {a.action for a in third} == {pb.ACTION_BUILD}
        assert {a.plan.SerializeToString() for a in third} == {answers[0].plan.SerializeToString()}


async def test_a_whole_group_squat_of_a_stored_group_is_not_built_by_the_real_ranks(
    tmp_path: Path,
) -> None:
    """While the real ranks are down: the stranger's whole-group restart
    stores its plan; the real ranks' next restart builds their own again."""
    async with (
        running_server(make_config(tmp_path)) as server,
        coordinator_stub(server.addresses.listen[0]) as stub,
    ):
        first = await _lifetime(stub, *_real("first"))
        assert {a.plan.workspace_bytes for a in first} == {OWN_BYTES}
        await _squat(stub, STRANGERS_OWNER)
        back = await _lifetime(stub, *_real("second"))
        assert {a.action for a in back} == {pb.ACTION_BUILD}
        assert {a.plan.workspace_bytes for a in back} == {OWN_BYTES}, "built the stranger's plan"
        group = await stub.GetGroup(pb.GetGroupRequest(group=GROUP), timeout=5)
        assert group.lifetimes == 3 and group.epoch == 2
        assert group.plan == back[0].plan
