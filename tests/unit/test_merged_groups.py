"""Groups merged from the cluster store have a bound of their own: the state
holder with a real store (no gRPC, no etcd; the etcd side is
tests/integration/test_attacks_etcd.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from moe_sidecar.core.cluster import ClusterPlan
from moe_sidecar.core.errors import ResourceExhausted
from moe_sidecar.core.group import Proposal, Requirement
from moe_sidecar.core.plan import Capacities, Plan
from moe_sidecar.state import Coordinator
from moe_sidecar.store.sqlite import StateStore

pytestmark = pytest.mark.timeout(10)

REQ = Requirement(Capacities(256, 100, 200, 2, 16), "l0")
OWNER = hashlib.sha256(b"the ranks' owner").hexdigest()
"""The owner of the merged plans and of the local ranks (so they inherit them)."""


def remote(name: str) -> ClusterPlan:
    return ClusterPlan(name, 1, plan=Plan(REQ.capacities, 0, 1), generation=1, owner=OWNER)


def proposal(group: str) -> Proposal:
    return Proposal(group, 1, 0, 1, "lifetime-of-rank-0", 1, REQ, owner=OWNER)


async def test_merged_groups_and_local_groups_are_bounded_apart(tmp_path: Path) -> None:
    holder = Coordinator(
        StateStore(tmp_path), round_timeout=30.0, max_groups=2, max_merged_groups=3
    )
    holder.start()
    try:
        assert all(holder.merge(remote(f"m{i}")) for i in range(3))
        assert not holder.merge(remote("m3"))  # beyond --max-merged-groups
        assert holder.group_names() == ["m0", "m1", "m2"]
        # The merged groups leave every slot of --max-groups to local ranks.
        await holder.propose(proposal("local-a"))
        # A local rank using a merged group moves it into the local budget ...
        decision = await holder.propose(proposal("m0"))
        assert decision.plan == remote("m0").plan and not decision.grew
        # ... which is now full, for new groups and for merged ones alike.
        for name in ("local-b", "m1"):
            with pytest.raises(ResourceExhausted, match="--max-groups is 2"):
                await holder.propose(proposal(name))
        # A merged slot freed by that move takes the next merge.
        assert holder.merge(remote("m3"))
        refusals = holder.metrics.registry.get_sample_value(
            "moe_sidecar_limit_refusals_total", {"resource": "merged_groups"}
        )
        assert refusals == 1
    finally:
        holder.close()


async def test_a_bound_of_zero_merges_only_groups_already_here(tmp_path: Path) -> None:
    holder = Coordinator(StateStore(tmp_path), round_timeout=30.0, max_merged_groups=0)
    holder.start()
    try:
        assert not holder.merge(remote("m0"))
        await holder.propose(proposal("here"))
        grown = ClusterPlan("here", 1, plan=Plan(REQ.capacities, 0, 5), generation=5)
        assert holder.merge(grown)
    finally:
        holder.close()
