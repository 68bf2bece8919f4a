"""The group's owner across nodes, on a real etcd: a plan the real ranks stored
on node A is inherited on node B only by ranks that carry its owner.

Node A's real ranks grow a plan; node B starts after it is in etcd (so B
reads the group back from etcd, its owner with it). A stranger that squats
one group on B, with its own proof and owner digest, does not inherit A's
plan: it begins a new epoch, which reaches etcd with the stranger's owner.
The real ranks' first lifetime on B, with their owner digest, builds A's
plan at once. Every sidecar is a real ``python -m moe_sidecar`` process; etcd
is Debian's (tests/etcd_server.py). Waits are on conditions, with deadlines.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
from collections.abc import Callable
from pathlib import Path

import pytest

from moe_sidecar.core.cluster import ClusterPlan
from moe_sidecar.core.identity import owner_id
from moe_sidecar.core.plan import Plan
from moe_sidecar.wire.codec import plan_from_proto
from moe_workspace.v1 import coordinator_pb2 as pb
from tests.etcd_server import EtcdServer
from tests.integration.etcd_nodes import Node, group_of, in_etcd, stored_plan, stub, until
from tests.integration.helpers import BF16, NVFP4, owner_digest, propose_request

pytestmark = [pytest.mark.etcd, pytest.mark.attack, pytest.mark.timeout(180)]

SQUATTED = "victim/ep2-squatted"
"""The group a stranger squats on node B."""
OWNED = "victim/ep2-owned"
"""The group the real ranks start on node B."""


def strangers_digest(group: str) -> str:
    """The owner digest of a stranger, of a key of its own."""
    return hashlib.sha256(b"a key of the stranger's own" + group.encode()).hexdigest()


async def lifetime(
    node: Node, group: str, digest: str, rounds: list[pb.Requirement]
) -> list[pb.ProposeResponse]:
    """A new lifetime of both local ranks of ``group`` on ``node``, one proof
    and owner ``digest`` for both, runs ``rounds``; returns rank 0's answers."""
    proof = secrets.token_hex(16)
    name = secrets.token_hex(4)
    answers = []
    async with stub(node) as s:
        for number, requirement in enumerate(rounds, start=1):
            requests = []
            for rank in range(2):
                request = propose_request(
                    rank,
                    number,
                    requirement,
                    group=group,
                    ep_size=2,
                    local_ranks=2,
                    lifetime=f"{name}-rank-{rank}-lifetime",
                )
                request.group_proof = proof
                request.owner_digest = digest
                requests.append(request)
            replies = await asyncio.gather(*(s.Propose(r, timeout=20) for r in requests))
            assert len({r.SerializeToString() for r in replies}) == 1
            answers.append(replies[0])
    return answers


async def in_etcd_when(
    etcd: EtcdServer, group: str, what: str, ok: Callable[[ClusterPlan], bool]
) -> ClusterPlan:
    """etcd's document of ``group`` once ``ok(doc)`` holds."""
    doc = await until(lambda: in_etcd(etcd, group), lambda d: d is not None and ok(d), what)
    assert doc is not None
    return doc


def holding(plan: Plan, owner: str) -> Callable[[ClusterPlan], bool]:
    """Whether a document holds ``plan`` and ``owner``."""
    return lambda doc: doc.plan == plan and doc.owner == owner


async def node_holds(node: Node, group: str, plan: Plan, what: str) -> None:
    """Waits until ``node`` stores ``plan`` for ``group``."""
    await until(lambda: group_of(node, group), lambda found: stored_plan(found) == plan, what)


async def test_a_stranger_on_node_b_does_not_inherit_node_as_plan_and_the_owner_does(
    tmp_path: Path, etcd_server: EtcdServer
) -> None:
    node_a = Node(tmp_path, "node-a", etcd_server).start()
    node_b = Node(tmp_path, "node-b", etcd_server)
    try:
        plans = {}
        for group in (SQUATTED, OWNED):
            grown = await lifetime(node_a, group, owner_digest(group), [NVFP4, BF16])
            assert [r.action for r in grown] == [pb.ACTION_BUILD, pb.ACTION_REBUILD]
            plans[group] = plan_from_proto(grown[-1].plan)
            owner = owner_id(owner_digest(group))
            doc = await in_etcd_when(
                etcd_server, group, "A's plan and owner in etcd", holding(plans[group], owner)
            )
            assert doc.owner != owner_digest(group)  # the id, never the digest
        # B starts now: it reads both groups back from etcd, owners with them.
        node_b.start()
        for group in (SQUATTED, OWNED):
            await node_holds(node_b, group, plans[group], "B reads A's plan back from etcd")

        # A stranger squats one group on B: its own plan in a new epoch, not A's.
        (squat,) = await lifetime(node_b, SQUATTED, strangers_digest(SQUATTED), [NVFP4])
        planted = plan_from_proto(squat.plan)
        assert planted != plans[SQUATTED] and planted.epoch == plans[SQUATTED].epoch + 1
        assert squat.action == pb.ACTION_BUILD and squat.grew
        stranger = owner_id(strangers_digest(SQUATTED))
        doc = await in_etcd_when(
            etcd_server,
            SQUATTED,
            "the stranger's epoch in etcd",
            lambda d: d.epoch == planted.epoch and d.owner == stranger,
        )
        assert doc.plan == planted
        # Node A hears of it, and its real ranks' next lifetime does not build it.
        await node_holds(node_a, SQUATTED, planted, "A hears of the stranger's epoch")
        (back,) = await lifetime(node_a, SQUATTED, owner_digest(SQUATTED), [BF16])
        assert plan_from_proto(back.plan).epoch == planted.epoch + 1

        # The real ranks on B carry the owner: A's plan at once, no growth.
        first, second = await lifetime(node_b, OWNED, owner_digest(OWNED), [NVFP4, BF16])
        assert first.action == pb.ACTION_BUILD and not first.grew
        assert plan_from_proto(first.plan) == plans[OWNED]
        assert second.action == pb.ACTION_REUSE
        doc = await in_etcd_when(
            etcd_server, OWNED, "the owner's document", lambda d: d.plan == plans[OWNED]
        )
        assert doc.owner == owner_id(owner_digest(OWNED)) and doc.epoch == plans[OWNED].epoch
    finally:
        node_b.sidecar.stop()
        node_a.sidecar.stop()
