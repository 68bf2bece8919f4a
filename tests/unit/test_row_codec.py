"""The stored-row codec: exact round trips, every version loads, bad rows say why."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import pytest

from moe_sidecar import flashinfer
from moe_sidecar.core import policy
from moe_sidecar.core.cluster import cluster_plan_of
from moe_sidecar.core.plan import Plan
from moe_sidecar.flashinfer.v0_7_2_post1 import capacities_workspace_bytes, workspace_size_per_rank
from moe_sidecar.store.row_codec import (
    MAX_DOCUMENT_BYTES,
    ROW_VERSION,
    RowError,
    decode_cluster_plan,
    decode_group,
    encode_cluster_plan,
    encode_group,
)
from tests.unit.groups import rich_state

pytestmark = pytest.mark.timeout(10)

DATA = Path(__file__).resolve().parent.parent / "data"
OWNER_ID = hashlib.sha256(b"an owner id").hexdigest()


def test_encoding_round_trips_exactly() -> None:
    state = rich_state()
    assert json.loads(encode_group(state))["version"] == ROW_VERSION
    assert decode_group(encode_group(state)) == state
    reset = policy.reset(state, 200.0).state
    assert decode_group(encode_group(reset)) == reset


def test_a_version_2_row_loads_without_nodes() -> None:
    # Written by the release before nodes were recorded and kept: every later release loads it.
    state = decode_group((DATA / "group-row-v2.json").read_text())
    assert state.plan is not None and state.plan.generation == 2
    assert state.open_round is not None
    assert state.history and all(g.node == "" for g in state.history)


def test_a_version_3_row_of_this_release_loads_with_the_node_of_every_growth() -> None:
    # Written by this release (a plan grown on node-a, merged into node-b, grown
    # there) and kept: every later release must load it.
    state = decode_group((DATA / "group-row-v3.json").read_text())
    assert [(g.plan.generation, g.node) for g in state.history] == [(1, "node-a"), (2, "node-b")]
    assert state.plan == state.history[-1].plan and state.open_round is not None
    assert json.loads(encode_group(state)) == json.loads((DATA / "group-row-v3.json").read_text())


def test_a_cluster_plan_of_this_release_loads_and_round_trips() -> None:
    # What this release writes to etcd, kept: later releases must read it.
    data = (DATA / "cluster-plan-v1.json").read_bytes()
    doc = decode_cluster_plan(data)
    assert doc == cluster_plan_of(decode_group((DATA / "group-row-v3.json").read_text()))
    assert decode_cluster_plan(encode_cluster_plan(doc)) == doc
    reset = cluster_plan_of(policy.reset(rich_state(), 200.0).state)
    assert decode_cluster_plan(encode_cluster_plan(reset)) == reset


def test_a_cluster_plan_carries_its_owner_and_one_written_before_owners_has_none() -> None:
    data = (DATA / "cluster-plan-v1.json").read_bytes()
    assert b'"owner"' not in data  # written before owners travelled
    old = decode_cluster_plan(data)
    assert old.owner == ""
    # No owner writes the bytes it always did, so older nodes read it unchanged.
    assert "owner" not in json.loads(encode_cluster_plan(old))
    owned = replace(old, owner=OWNER_ID)
    assert json.loads(encode_cluster_plan(owned))["owner"] == OWNER_ID
    assert decode_cluster_plan(encode_cluster_plan(owned)) == owned
    # The owner of the group row is the owner of its cluster plan.
    state = replace(rich_state(), owner=OWNER_ID)
    assert decode_cluster_plan(encode_cluster_plan(cluster_plan_of(state))).owner == OWNER_ID


def _cluster(**changes: object) -> bytes:
    document = json.loads((DATA / "cluster-plan-v1.json").read_text())
    for path, value in changes.items():
        target = document
        *parents, leaf = path.split("__")
        for key in parents:
            target = target[int(key)] if isinstance(target, list) else target[key]
        target[leaf] = value
    return json.dumps(document).encode()


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (b"\xff\xfe", "not JSON"),
        (b"[]", "not a JSON object"),
        (b"x" * (MAX_DOCUMENT_BYTES + 1), "at most"),
        (_cluster(kind="other"), "kind 'other'"),
        (_cluster(version=2), "version 2; this release reads version 1 (a newer sidecar"),
        (_cluster(ep_size=0), "'ep_size' holds 0"),
        (_cluster(generation=1), "plan.generation=2"),
        (_cluster(plan__epoch=1), "plan.epoch=1"),
        (_cluster(plan__capacities__top_k=99), "top_k=99"),
        (_cluster(history__0__node=7), "'node' holds 7"),
        (_cluster(history__1__ep_rank=4), "history[1].ep_rank=4"),
        (_cluster(history__0__at=-1.0), "history[0].at=-1.0"),
        (_cluster(name="x" * 300), "group="),
        (_cluster(owner=7), "'owner' holds 7"),
        (_cluster(owner="f" * 63), "owner: 63 characters that are not an owner id"),
        (_cluster(owner=OWNER_ID.upper()), "owner: 64 characters that are not an owner id"),
    ],
)
def test_bad_cluster_plans_are_refused_with_the_reason(data: bytes, needle: str) -> None:
    with pytest.raises(RowError) as info:
        decode_cluster_plan(data)
    assert needle in str(info.value)


def test_a_version_1_row_of_0_1_0_loads_with_a_plan_at_least_as_big() -> None:
    # Written by moe-sidecar 0.1.0 (plans as byte counts): the DeepSeek-V3
    # NVFP4 + bf16 MTP union at EP 2, 128 tokens (7,379,328 B per rank).
    document = json.loads((DATA / "group-row-v1.json").read_text())
    state = decode_group(json.dumps(document))
    assert state.plan is not None
    plan: Plan = state.plan
    capacities = plan.capacities
    assert (capacities.max_tokens, capacities.top_k, capacities.num_experts) == (128, 8, 256)
    assert plan.generation == 2 and state.generation == 2
    workspace = capacities_workspace_bytes(capacities, 2)
    assert workspace >= document["plan"]["workspace_bytes"] == 7_379_328
    assert workspace < document["plan"]["workspace_bytes"] + 2 * 128 + 128
    assert [g.plan.generation for g in state.history] == [1, 2]
    assert [g.layer for g in state.history] == ["model.layers.3.mlp", "model.layers.61.mlp"]
    # Retained outcomes and the open round of the old format are dropped.
    assert state.open_round is None and state.closed == ()
    assert state.last_closed_round == document["last_closed_round"]
    assert [r.committed_generation for r in state.ranks] == [2, 2]
    assert workspace_size_per_rank(2, 128, 3584 + 448 + 64, 14336) < workspace


def _row(**changes: object) -> str:
    document = json.loads(encode_group(rich_state()))
    for path, value in changes.items():
        target = document
        *parents, leaf = path.split("__")
        for key in parents:
            target = target[int(key)] if isinstance(target, list) else target[key]
        target[leaf] = value
    return json.dumps(document)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("not json", "not JSON"),
        ("[1, 2]", "not a JSON object"),
        ('{"name": "g/ep4", "version": 2}', "missing field"),
        ('{"version": 99}', "row version 99"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        (_row(generation=True), "field 'generation' holds True"),
        (_row(generation=-1), "field 'generation' holds -1"),
        (_row(generation=1 << 64), "outside"),
        (_row(plan__generation=0), "plan.generation=0"),
        (_row(plan__capacities__max_tokens=0), "plan.capacities.max_tokens=0"),
        (_row(plan__capacities__top_k=23), "plan.capacities.top_k=23"),
        (
            _row(
                plan__capacities__dispatch_bytes_per_token=1 << 22,
                plan__capacities__max_tokens=1 << 30,
            ),
            "at most 1099511627776",
        ),
        (_row(ep_size=65), "field 'ep_size' holds 65"),
        (_row(local_ranks=9), "field 'local_ranks' holds 9"),
        (_row(closed=[{"kind": "maybe"}]), "unknown outcome kind"),
        (
            _row(
                closed=[
                    {
                        "kind": "refusal",
                        "round": 1,
                        "code": "BOGUS",
                        "message": "",
                        "missing_ranks": [],
                    }
                ]
            ),
            "BOGUS",
        ),
        (_row(ranks=[{"ep_rank": 0}]), "missing field 'lifetime'"),
        (
            _row(history=[{"plan": None, "layer": "", "ep_rank": 0, "round": 1, "at": 0}]),
            "holds null",
        ),
        (_row(ranks__0__last_seen=float("nan")), "last_seen"),
    ],
)
def test_bad_rows_are_refused_with_the_reason(text: str, needle: str) -> None:
    with pytest.raises(RowError) as info:
        decode_group(text)
    assert needle in str(info.value)


def test_a_row_written_before_releases_reads_as_the_default_release() -> None:
    # Rows of sidecars older than the release field: their waiting proposals
    # came from clients that drove the default release; the group's release
    # is not fixed yet (its next decided round fixes it), and sizes as the default.
    state = decode_group((DATA / "group-row-v3.json").read_text())
    assert state.release == ""
    assert state.open_round is not None and state.open_round.proposals
    assert {p.release for p in state.open_round.proposals} == {flashinfer.DEFAULT_RELEASE.name}
    assert state.plan is not None
    assert flashinfer.workspace_size(state.release, state.plan.capacities, state.ep_size) == (
        capacities_workspace_bytes(state.plan.capacities, state.ep_size)
    )


def test_a_row_naming_an_unknown_release_fails_to_load_naming_the_field() -> None:
    document = json.loads(encode_group(rich_state()))
    document["release"] = "9.9.9"
    with pytest.raises(RowError, match=r"field 'release'.*'9\.9\.9'"):
        decode_group(json.dumps(document))


def test_a_row_keeps_the_owner_and_one_written_before_owners_has_none() -> None:
    state = rich_state()
    document = json.loads(encode_group(state))
    assert state.owner and document["owner"] == state.owner
    assert state.open_round is not None
    assert {p["owner"] for p in document["open_round"]["proposals"]} == {state.owner}
    # Rows of sidecars older than owners: no owner, so the next restart begins a new epoch.
    old = decode_group((DATA / "group-row-v3.json").read_text())
    assert old.owner == "" and old.open_round is not None
    assert {p.owner for p in old.open_round.proposals} == {""}
    document["owner"] = "not-a-digest"
    with pytest.raises(RowError, match=r"field 'owner' holds 'not-a-digest'"):
        decode_group(json.dumps(document))
