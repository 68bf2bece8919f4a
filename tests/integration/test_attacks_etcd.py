"""Attacks through the cluster store, each against real sidecars on a real etcd.

Whoever can write under the etcd prefix can write anything there. Each test
plays one such writer (or a node flooding the cluster with groups) and
asserts what the sidecar now does: it keeps reading etcd (``store_up``
back at 1), sets the bad document aside (counted in
``moe_sidecar_store_rejected_documents``, logged), replaces it with a valid
one by compare-and-swap, and keeps its own ranks' budget. Every loop is
bounded, every address loopback.
"""

from __future__ import annotations

import asyncio
import functools
import secrets
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from moe_sidecar.core.cluster import ClusterPlan
from moe_sidecar.core.group import Growth
from moe_sidecar.core.limits import MAX_GENERATION
from moe_sidecar.core.plan import Capacities, Plan
from moe_sidecar.etcd.client import EtcdRequestError
from moe_sidecar.etcd.document import MAC_PREFIX, DocumentRules, seal_document
from moe_sidecar.etcd.errors import EtcdTimeout
from moe_sidecar.etcd.replica import group_key
from moe_sidecar.store.row_codec import decode_cluster_plan, encode_cluster_plan
from moe_sidecar.wire.codec import plan_from_proto
from moe_workspace.v1 import coordinator_pb2 as pb
from tests.etcd_server import EtcdServer, EtcdTestClient, StartEtcd
from tests.integration.etcd_nodes import (
    GROUP,
    PREFIX,
    Node,
    group_of,
    in_etcd,
    nodes,
    stored_plan,
    stub,
    until,
)
from tests.integration.helpers import BF16, NVFP4, run_round

pytestmark = [pytest.mark.etcd, pytest.mark.attack, pytest.mark.timeout(240)]

RECEIVE_LIMIT = 64 << 20
"""The etcd client's gRPC receive limit: what one page of a read must stay under."""
REJECTED = "moe_sidecar_store_rejected_documents_total"
STORE_UP = "moe_sidecar_store_up"


def full_document(name: str, ep_size: int = 2) -> ClusterPlan:
    """A valid document as large as a real one gets: 256 growths, longest names."""
    shape = (4096, 14336, 8, 256)
    history = tuple(
        Growth(
            Plan(Capacities(256 + i, *shape), 0, i + 1), "L" * 256, 0, i + 1, 1.7e9 + i, "n" * 253
        )
        for i in range(256)
    )
    return ClusterPlan(name, ep_size, 0, Plan(Capacities(511, *shape), 0, 256), 256, history)


async def put_all(etcd: EtcdServer, values: dict[bytes, bytes], *, at_once: int = 8) -> None:
    """Writes every value, ``at_once`` writes in flight."""
    items = list(values.items())
    async with EtcdTestClient([etcd.endpoint], timeout=30) as client:
        for start in range(0, len(items), at_once):
            batch = items[start : start + at_once]
            await asyncio.gather(*(client.put(key, value) for key, value in batch))


async def grow(node: Node, rounds: list[pb.Requirement], lifetime: str) -> list[pb.ProposeResponse]:
    """A new lifetime of both local ranks of GROUP on ``node``; rank 0's answers."""
    answers = []
    async with stub(node) as s:
        for number, requirement in enumerate(rounds, start=1):
            replies = await run_round(
                s, number, requirement, group=GROUP, local_ranks=2, lifetime=lifetime
            )
            answers.append(replies[0])
    return answers


async def raw_in_etcd(etcd: EtcdServer, group: str = GROUP) -> bytes | None:
    async with EtcdTestClient([etcd.endpoint]) as client:
        got = await client.get(group_key(PREFIX, group))
    return None if got is None else got.value


# --- a big prefix ---------------------------------------------------------------------


async def test_valid_documents_beyond_one_response_are_read_page_by_page(
    tmp_path: Path, etcd_server: EtcdServer
) -> None:
    documents = {
        group_key(PREFIX, f"big-{i:03d}/ep2"): encode_cluster_plan(
            full_document(f"big-{i:03d}/ep2")
        )
        for i in range(400)
    }
    assert sum(map(len, documents.values())) > RECEIVE_LIMIT
    await put_all(etcd_server, documents)
    with nodes(tmp_path, etcd_server, "node-a") as (a,):
        # The prefix is read, so the node merges (up to --max-merged-groups) and watches.
        await until(lambda: a.metric_now(STORE_UP), lambda v: v == 1, "etcd readable", 90)
        await until(
            lambda: a.metric_now("moe_sidecar_store_merges_total"),
            lambda v: v >= 128,
            "documents merged",
            90,
        )
        assert await a.metric_now(REJECTED) == 0
        found = await group_of(a, "big-000/ep2")
        assert found is not None and found.plan.generation == 256
        # Its own groups still reach etcd.
        await grow(a, [NVFP4], "a")
        await until(lambda: in_etcd(etcd_server), lambda d: d is not None, "pushed")


async def test_junk_keys_beyond_one_response_are_set_aside_and_the_rest_merged(
    tmp_path: Path, etcd_server: EtcdServer
) -> None:
    junk = {
        group_key(PREFIX, f"junk-{i:03d}"): secrets.token_bytes(16) * 87_500  # 1.4 MB each
        for i in range(200)
    }
    assert sum(map(len, junk.values())) > RECEIVE_LIMIT
    await put_all(etcd_server, junk)
    real = ClusterPlan("real/ep2", 2, 0, Plan(Capacities(512, 4096, 14336, 8, 256), 0, 1), 1)
    await put_all(etcd_server, {group_key(PREFIX, "real/ep2"): encode_cluster_plan(real)})
    with nodes(tmp_path, etcd_server, "node-a") as (a,):
        await until(lambda: a.metric_now(STORE_UP), lambda v: v == 1, "etcd readable", 90)
        merged = await until(
            lambda: group_of(a, "real/ep2"), lambda g: g is not None, "the real group merged", 90
        )
        assert stored_plan(merged) == real.plan
        assert await a.metric_now(REJECTED) >= 200
        assert "skipped a plan document in etcd" in a.log() and "too_big" in a.log()


async def test_a_value_over_a_groups_key_too_large_to_receive_is_replaced(
    tmp_path: Path, etcd_factory: StartEtcd
) -> None:
    # etcd takes a value this large only when told to; the node's watch and
    # reads cannot receive it (64 MiB), and must not stop on it.
    etcd = etcd_factory(extra_args=("--max-request-bytes=70000000",))
    with nodes(tmp_path, etcd, "node-a") as (a,):
        grown = await grow(a, [NVFP4, BF16], "a")
        final = plan_from_proto(grown[-1].plan)
        await until(lambda: in_etcd(etcd), lambda d: d is not None and d.plan == final, "pushed")
        await put_all(etcd, {group_key(PREFIX, GROUP): b"x" * (65 << 20)}, at_once=1)

        async def receivable() -> ClusterPlan | None:
            try:
                return await in_etcd(etcd)
            # This test's client cannot receive it either: refused as too
            # large, or (on a loaded machine) still receiving at its deadline.
            except (EtcdRequestError, EtcdTimeout):
                return None

        await until(
            receivable,
            lambda d: d is not None and d.plan == final,
            "the value replaced with the node's plan",
            60,
        )
        assert await a.metric_now(REJECTED) >= 1
        assert await a.metric_now(STORE_UP) == 1
        # And the node still hears of other nodes' writes.
        other = ClusterPlan("other/ep2", 2, 0, Plan(Capacities(512, 4096, 14336, 8, 256), 0, 1), 1)
        await put_all(etcd, {group_key(PREFIX, "other/ep2"): encode_cluster_plan(other)})
        await until(lambda: group_of(a, "other/ep2"), lambda g: g is not None, "merged")


# --- junk groups from another node -------------------------------------------------------


async def test_junk_groups_on_one_node_do_not_spend_another_nodes_budget(
    tmp_path: Path, etcd_server: EtcdServer
) -> None:
    with nodes(tmp_path, etcd_server, "node-a", "node-b", args=("--max-groups", "16")) as (a, b):
        async with stub(a) as s:
            for i in range(16):
                await run_round(s, 1, NVFP4, group=f"junk-{i:02d}", local_ranks=1)
        await until(
            lambda: b.metric_now("moe_sidecar_store_merges_total"),
            lambda v: v >= 16,
            "B merged A's groups",
        )
        # A real new group on B: B's own ranks still have all of --max-groups.
        first = await grow(b, [NVFP4], "b")
        assert first[0].action == pb.ACTION_BUILD
        # And A, whose ranks made the 16, is full.
        async with stub(a) as s:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await run_round(s, 1, NVFP4, group="junk-16", local_ranks=1)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_groups_merged_from_the_cluster_stop_at_their_own_bound(
    tmp_path: Path, etcd_server: EtcdServer
) -> None:
    with (
        nodes(tmp_path, etcd_server, "node-a") as (a,),
        nodes(tmp_path, etcd_server, "node-b", args=("--max-merged-groups", "4")) as (b,),
    ):
        async with stub(a) as s:
            for i in range(10):
                await run_round(s, 1, NVFP4, group=f"many-{i:02d}", local_ranks=1)
        await until(
            lambda: b.metric_now('moe_sidecar_limit_refusals_total{resource="merged_groups"}'),
            lambda v: v >= 6,
            "B refused merges beyond its bound",
        )
        async with stub(b) as s:
            listed = await s.ListGroups(pb.ListGroupsRequest(), timeout=5)
        assert len(listed.groups) == 4
        # A local rank of B may still use a group it did not merge.
        async with stub(b) as s:
            answers = await run_round(s, 1, NVFP4, group="many-09", local_ranks=1)
        assert answers[0].action == pb.ACTION_BUILD


# --- documents that decode but lie ---------------------------------------------------------


@pytest.mark.parametrize("field", ["generation", "epoch"])
async def test_a_document_far_past_the_groups_is_set_aside_and_replaced(
    tmp_path: Path, etcd_server: EtcdServer, field: str
) -> None:
    with nodes(tmp_path, etcd_server, "node-a") as (a,):
        await grow(a, [NVFP4], "a")
        stored = await until(lambda: in_etcd(etcd_server), lambda d: d is not None, "pushed")
        assert stored is not None and stored.plan is not None
        forged = replace(stored, generation=MAX_GENERATION)
        if field == "epoch":
            forged = replace(
                forged,
                epoch=MAX_GENERATION,
                plan=replace(stored.plan, epoch=MAX_GENERATION),
                history=(),
            )
        await put_all(etcd_server, {group_key(PREFIX, GROUP): encode_cluster_plan(forged)})
        await until(lambda: a.metric_now(REJECTED), lambda v: v >= 1, "the forgery set aside")
        # The node's next write replaces it: etcd holds a plausible document again.
        await until(
            lambda: in_etcd(etcd_server),
            lambda d: d is not None and d.generation < 100 and d.epoch < 100,
            "etcd's document replaced",
        )
        # The group keeps growing, and an admin can still reset it.
        grown = await grow(a, [NVFP4, BF16], "a2")
        assert grown[-1].grew and grown[-1].plan.generation < 100
        async with stub(a) as s:
            await s.ResetGroup(pb.ResetGroupRequest(group=GROUP), timeout=5)
        assert "implausible" in a.log()


async def test_a_garbage_document_over_a_groups_key_is_replaced_by_the_next_write(
    tmp_path: Path, etcd_server: EtcdServer
) -> None:
    with nodes(tmp_path, etcd_server, "node-a") as (a,):
        grown = await grow(a, [NVFP4, BF16], "a")
        final = plan_from_proto(grown[-1].plan)
        await until(
            lambda: in_etcd(etcd_server), lambda d: d is not None and d.plan == final, "pushed"
        )
        await put_all(etcd_server, {group_key(PREFIX, GROUP): b"{not json"})
        await until(
            lambda: raw_in_etcd(etcd_server),
            lambda v: (
                v is not None and v.startswith(b'{"') and decode_cluster_plan(v).plan == final
            ),
            "the garbage replaced with the node's plan",
        )
        assert stored_plan(await group_of(a)) == final
        assert await a.metric_now(REJECTED) >= 1


async def test_a_document_beyond_the_size_limit_is_set_aside_unread(
    tmp_path: Path, etcd_server: EtcdServer
) -> None:
    big = encode_cluster_plan(full_document("big/ep2"))
    with nodes(
        tmp_path, etcd_server, "node-a", args=("--store-max-document-bytes", str(len(big) - 1))
    ) as (a,):
        await put_all(etcd_server, {group_key(PREFIX, "big/ep2"): big})
        await until(lambda: a.metric_now(REJECTED), lambda v: v >= 1, "the document set aside")
        assert await group_of(a, "big/ep2") is None
        assert "too_big" in a.log()


# --- authenticated documents ---------------------------------------------------------------


async def test_with_a_cluster_key_only_signed_documents_are_merged(
    tmp_path: Path, etcd_server: EtcdServer
) -> None:
    key = secrets.token_hex(32).encode()
    key_file = tmp_path / "store.key"
    key_file.write_bytes(key + b"\n")
    with nodes(
        tmp_path, etcd_server, "node-a", "node-b", args=("--store-key-file", str(key_file))
    ) as (a, b):
        grown = await grow(a, [NVFP4, BF16], "a")
        final = plan_from_proto(grown[-1].plan)
        await until(lambda: group_of(b), lambda g: stored_plan(g) == final, "B merged A's plan")
        raw = await raw_in_etcd(etcd_server)
        assert raw is not None and raw.startswith(MAC_PREFIX)
        # A writer without the key: a bare document, and one signed with another key.
        huge = ClusterPlan(
            "forged/ep2", 2, 0, Plan(Capacities(1 << 20, 1 << 16, 1 << 16, 8, 256), 0, 1), 1
        )
        other = DocumentRules(key=b"not the cluster's key at all")
        forged_key = group_key(PREFIX, "forged2/ep2")
        await put_all(
            etcd_server,
            {
                group_key(PREFIX, "forged/ep2"): encode_cluster_plan(huge),
                forged_key: seal_document(other, forged_key, replace(huge, name="forged2/ep2")),
                group_key(PREFIX, GROUP): encode_cluster_plan(replace(huge, name=GROUP)),
            },
        )
        for node in (a, b):
            rejected = functools.partial(node.metric_now, REJECTED)
            await until(rejected, lambda v: v >= 3, f"{node.name} refused the three")
            assert await group_of(node, "forged/ep2") is None
            assert await group_of(node, "forged2/ep2") is None
            assert stored_plan(await group_of(node)) == final
        log = a.log() + b.log()
        assert "unauthenticated" in log and "bad_mac" in log
        # The group's key holds a signed, valid document again.
        await until(
            lambda: raw_in_etcd(etcd_server),
            lambda v: v is not None and v.startswith(MAC_PREFIX),
            "the bare document replaced",
        )


async def test_oversized_documents_are_read_one_at_a_time(
    tmp_path: Path, etcd_server: EtcdServer
) -> None:
    """100 junk documents of 1.4 MB (each over ``--store-max-document-bytes``)
    under the prefix: a starting sidecar sets every one aside and its peak
    RSS stays within 32 MiB of one started on an empty prefix in the same
    run (read 32 values to a page, it peaked at 277.7 MiB against 48.6 MiB;
    bench/bench_etcd_oversized.py measures both with 200)."""
    from bench.bench_etcd_oversized import fill_prefix, sidecar_peak_rss_mib

    await fill_prefix(etcd_server.endpoint, "/oversized", 100, 1_400_000)
    base = await asyncio.to_thread(
        sidecar_peak_rss_mib, tmp_path / "empty", f"etcd://{etcd_server.endpoint}/empty", 0
    )
    full = await asyncio.to_thread(
        sidecar_peak_rss_mib, tmp_path / "full", f"etcd://{etcd_server.endpoint}/oversized", 100
    )
    assert full - base < 32, f"peak RSS {full:.1f} MiB, {base:.1f} MiB on an empty prefix"
