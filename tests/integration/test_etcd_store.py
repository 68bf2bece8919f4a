"""Two sidecars ("two nodes") on one real etcd: plans cross nodes, survive
outages, crashes and resets, and both nodes end at the join.

Every sidecar is a real ``python -m moe_sidecar`` process with
``--store etcd://...`` and its own state dir and ``--node-name``; etcd is
Debian's (tests/etcd_server.py). Waits are on conditions, with deadlines.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from moe_sidecar.core.plan import Capacities, Plan, join
from moe_sidecar.etcd.replica import group_key
from moe_sidecar.wire.codec import capacities_from_proto, plan_from_proto
from moe_workspace.v1 import coordinator_pb2 as pb
from tests.etcd_server import EtcdServer, EtcdTestClient
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
from tests.integration.helpers import (
    BF16,
    NVFP4,
    capacities,
    details,
    propose_request,
    rpc_error,
    run_round,
    token,
)

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(120)]


async def grow(node: Node, rounds: list[pb.Requirement], lifetime: str) -> list[pb.ProposeResponse]:
    """A new lifetime of both local ranks on ``node`` runs ``rounds``; returns rank 0's answers."""
    answers = []
    async with stub(node) as s:
        for number, requirement in enumerate(rounds, start=1):
            replies = await run_round(
                s, number, requirement, group=GROUP, local_ranks=2, lifetime=lifetime
            )
            assert len({r.SerializeToString() for r in replies}) == 1
            answers.append(replies[0])
    return answers


def requirement(layer: str, **sizes: int) -> pb.Requirement:
    return pb.Requirement(capacities=capacities(**sizes), layer=layer)


def caps_of(req: pb.Requirement) -> Capacities:
    return capacities_from_proto(req.capacities)


async def converged(a: Node, b: Node, etcd: EtcdServer, within: float = 30.0) -> Plan:
    """Waits until both nodes and etcd hold one plan; returns it."""

    async def probe() -> tuple[Plan | None, Plan | None, Plan | None]:
        in_store = await in_etcd(etcd)
        return (
            stored_plan(await group_of(a)),
            stored_plan(await group_of(b)),
            in_store.plan if in_store else None,
        )

    plans = await until(
        probe, lambda p: p[0] is not None and len(set(p)) == 1, "convergence", within
    )
    assert plans[0] is not None
    return plans[0]


# --- the tests ---------------------------------------------------------------------------


async def test_a_plan_grown_on_node_a_is_round_1s_plan_on_node_b(
    tmp_path: Path, etcd_server: EtcdServer
) -> None:
    with nodes(tmp_path, etcd_server, "node-a", "node-b") as (a, b):
        grown = await grow(a, [NVFP4, BF16], "a")
        assert [r.action for r in grown] == [pb.ACTION_BUILD, pb.ACTION_REBUILD]
        plan = plan_from_proto(grown[-1].plan)
        await until(lambda: group_of(b), lambda g: stored_plan(g) == plan, "B hears of A's plan")
        # Round 1 on B builds A's union at once: no growth, no rebuild later.
        first, second = await grow(b, [NVFP4, BF16], "b")
        assert first.action == pb.ACTION_BUILD and plan_from_proto(first.plan) == plan
        assert not first.grew and second.action == pb.ACTION_REUSE
        stored = await in_etcd(etcd_server)
        assert stored is not None and stored.plan == plan
        assert [g.node for g in stored.history] == ["node-a", "node-a"]


async def test_both_growing_at_once_end_at_the_join_on_both_and_in_etcd(
    tmp_path: Path, etcd_server: EtcdServer
) -> None:
    with nodes(tmp_path, etcd_server, "node-a", "node-b") as (a, b):
        needs_a = [
            requirement("l0"),
            requirement("l1", tokens=1024),
            requirement("l2", combine=900),
        ]
        needs_b = [requirement("l0"), requirement("l1", dispatch=700), requirement("l2", top_k=2)]
        answers = await asyncio.gather(grow(a, needs_a, "a"), grow(b, needs_b, "b"))
        # Each node's rounds were decided at once, on its own state.
        assert all(r.action != pb.ACTION_UNSPECIFIED for side in answers for r in side)
        plan = await converged(a, b, etcd_server)
        wanted = caps_of(needs_a[0])
        for need in needs_a + needs_b:
            wanted = join(Plan(wanted, 0, 1), Plan(caps_of(need), 0, 2)).capacities
        assert plan.capacities == wanted  # nothing of either node is lost
        for side in answers:
            assert plan.covers(plan_from_proto(side[-1].plan).capacities)
        # Once they have heard of each other, every later round on either is REUSE.
        for node, name in ((a, "a2"), (b, "b2")):
            again = await grow(node, needs_a + needs_b, name)
            assert [r.action for r in again][1:] == [pb.ACTION_REUSE] * 5
            assert plan_from_proto(again[0].plan) == plan


async def test_rounds_are_decided_while_etcd_is_down_and_converge_after(
    tmp_path: Path, etcd_server: EtcdServer
) -> None:
    with nodes(tmp_path, etcd_server, "node-a", "node-b") as (a, b):
        await grow(a, [NVFP4], "a")
        await converged(a, b, etcd_server)
        await asyncio.to_thread(etcd_server.kill)
        # Both nodes keep deciding, each on its own SQLite; nothing waits for etcd.
        started = time.monotonic()
        grown_a = await grow(a, [NVFP4, requirement("big-tokens", tokens=2048)], "a2")
        grown_b = await grow(b, [NVFP4, requirement("big-dispatch", dispatch=900)], "b2")
        assert time.monotonic() - started < 5.0
        assert grown_a[-1].grew and grown_b[-1].grew
        await until(
            lambda: asyncio.to_thread(a.metric, "moe_sidecar_store_up"),
            lambda v: v == 0,
            "A sees etcd down",
        )
        assert a.metric("moe_sidecar_store_pending_groups") >= 1
        await asyncio.to_thread(etcd_server.start)
        plan = await converged(a, b, etcd_server)
        assert (
            plan.capacities.max_tokens == 2048 and plan.capacities.dispatch_bytes_per_token == 900
        )
        await until(
            lambda: asyncio.to_thread(a.metric, "moe_sidecar_store_pending_groups"),
            lambda v: v == 0,
            "A's outbox drains",
        )


async def test_a_sidecar_killed_during_a_store_write_loses_nothing(
    tmp_path: Path, etcd_server: EtcdServer
) -> None:
    with nodes(tmp_path, etcd_server, "node-a", "node-b") as (a, b):
        await grow(a, [NVFP4], "a")
        await converged(a, b, etcd_server)
        # etcd hangs: A's push of the next growth is in flight when A dies.
        await asyncio.to_thread(etcd_server.pause)
        try:
            grown = await grow(a, [NVFP4, BF16], "a2")
            assert grown[-1].grew
            a.sidecar.stop(kill=True)
        finally:
            await asyncio.to_thread(etcd_server.resume)
        # The decision was answered, so it is in A's SQLite, with its outbox row.
        a.start()
        plan = await converged(a, b, etcd_server)
        assert plan == plan_from_proto(grown[-1].plan)


async def test_a_reset_on_node_a_reaches_node_b_and_is_not_undone(
    tmp_path: Path, etcd_server: EtcdServer
) -> None:
    with nodes(tmp_path, etcd_server, "node-a", "node-b") as (a, b):
        await grow(a, [NVFP4, BF16], "a")
        await converged(a, b, etcd_server)
        b.sidecar.stop()  # B is away during the reset
        async with stub(a) as s:
            await s.ResetGroup(pb.ResetGroupRequest(group=GROUP), timeout=5)
        await until(
            lambda: in_etcd(etcd_server), lambda d: d is not None and d.epoch == 1, "reset in etcd"
        )
        b.start()  # B's own SQLite still holds the epoch-0 plan
        reset = await until(
            lambda: group_of(b), lambda g: g is not None and g.epoch == 1, "B reset"
        )
        assert reset is not None and not reset.HasField("plan")
        # B grows in the new epoch from a small layer: the old plan does not come back.
        first = (await grow(b, [NVFP4], "b"))[0]
        assert first.plan.epoch == 1 and first.grew
        plan = await converged(a, b, etcd_server)
        assert plan.epoch == 1 and plan.capacities == caps_of(NVFP4)
        stored = await in_etcd(etcd_server)
        assert stored is not None and stored.epoch == 1


async def test_a_plan_of_another_shape_merged_after_a_reset_refuses_the_whole_round_at_once(
    tmp_path: Path, etcd_server: EtcdServer
) -> None:
    # A's lifetime built top_k=2, then A was reset; B, hearing of the reset,
    # decides a top_k=4 plan in the new epoch, which merges into A while A's
    # lifetime still runs on what it built. No plan serves both: A's next
    # round is refused for both of its ranks at once, long before the round
    # timeout (20 s) or the calls' own (10 s), and the round is closed.
    other_shape = requirement("l0", top_k=4)
    with nodes(tmp_path, etcd_server, "node-a", "node-b") as (a, b):
        await grow(a, [NVFP4], "a")
        await converged(a, b, etcd_server)
        async with stub(a) as s:
            await s.ResetGroup(pb.ResetGroupRequest(group=GROUP), timeout=5)
        await until(lambda: group_of(b), lambda g: g is not None and g.epoch == 1, "B reset")
        assert (await grow(b, [other_shape], "b"))[0].plan.capacities.top_k == 4
        await until(
            lambda: group_of(a),
            lambda g: stored_plan(g) is not None and g is not None and g.plan.capacities.top_k == 4,
            "A merges B's plan",
        )
        async with stub(a) as s:
            answers = await asyncio.gather(
                *(
                    rpc_error(
                        s.Propose(
                            propose_request(
                                rank,
                                2,
                                other_shape,
                                group=GROUP,
                                ep_size=2,
                                local_ranks=2,
                                lifetime=token(f"a-{rank}"),
                            ),
                            timeout=10,
                        )
                    )
                    for rank in range(2)
                )
            )
        assert [e.code() for e in answers] == [grpc.StatusCode.FAILED_PRECONDITION] * 2
        assert details(answers[0]) == details(answers[1])
        message = details(answers[0])
        assert "top_k=4, num_experts=16" in message and "top_k=2, num_experts=16" in message
        assert "layer 'l0'" in message and "on node 'node-b'" in message
        group = await group_of(a)
        assert group is not None and group.open_round == 0 and group.waiting_ranks == 0
        assert group.last_closed_round == 2 and group.plan.capacities.top_k == 4


async def test_groups_shows_where_a_plan_came_from(tmp_path: Path, etcd_server: EtcdServer) -> None:
    with nodes(tmp_path, etcd_server, "node-a", "node-b") as (a, b):
        await grow(a, [NVFP4, BF16], "a")
        await converged(a, b, etcd_server)
        script = shutil.which("moe-sidecar", path=str(Path(sys.executable).parent))
        assert script is not None
        env = {k: v for k, v in os.environ.items() if not k.startswith("MOE_SIDECAR_")}
        done = await asyncio.to_thread(
            subprocess.run,
            [script, "groups", "--target", b.target],
            capture_output=True,
            text=True,
            timeout=30,
            env=env,
        )
        assert done.returncode == 0, done.stderr
        assert "  plan from: node node-a at 20" in done.stdout
        assert "caused by layer 'mtp' on rank 0 in round 2, on node node-a at" in done.stdout
        as_json = await asyncio.to_thread(
            subprocess.run,
            [script, "groups", "--target", b.target, "--json"],
            capture_output=True,
            text=True,
            timeout=30,
            env=env,
        )
        [group] = json.loads(as_json.stdout)
        assert group["plan"]["origin"]["node"] == "node-a"


async def test_bad_documents_in_etcd_are_skipped_and_counted(
    tmp_path: Path, etcd_server: EtcdServer
) -> None:
    with nodes(tmp_path, etcd_server, "node-a") as (a,):
        async with EtcdTestClient([etcd_server.endpoint]) as client:
            await client.put(group_key(PREFIX, "garbage"), b"{not json")
            good = await in_etcd(etcd_server)
            assert good is None
            await grow(a, [NVFP4], "a")
            stored = await until(lambda: in_etcd(etcd_server), lambda d: d is not None, "pushed")
            assert stored is not None
            # Another "node" writes a document out of range and one of another shape.
            raw = (await client.get(group_key(PREFIX, GROUP))).value  # type: ignore[union-attr]
            document = json.loads(raw)
            document["plan"]["capacities"]["top_k"] = 99
            await client.put(
                group_key(PREFIX, "g/out-of-range"),
                json.dumps({**document, "name": "g/out-of-range"}).encode(),
            )
        await until(
            lambda: asyncio.to_thread(a.metric, "moe_sidecar_store_rejected_documents_total"),
            lambda v: v >= 2,
            "two rejected documents",
        )
        # Still serving, and the bad keys created no group.
        assert await group_of(a, "garbage") is None and await group_of(a, "g/out-of-range") is None
        assert (await grow(a, [NVFP4], "a2"))[0].action == pb.ACTION_BUILD
        assert "skipped a plan document in etcd" in a.log()


async def test_an_etcd_recreated_empty_gets_every_plan_back(
    tmp_path: Path, etcd_server: EtcdServer
) -> None:
    with nodes(tmp_path, etcd_server, "node-a", "node-b") as (a, b):
        await grow(a, [NVFP4, BF16], "a")
        plan = await converged(a, b, etcd_server)
        await asyncio.to_thread(etcd_server.wipe)
        await asyncio.to_thread(etcd_server.start)
        stored = await until(
            lambda: in_etcd(etcd_server), lambda d: d is not None, "plan pushed again", within=40
        )
        assert stored is not None and stored.plan == plan


async def test_a_reset_during_an_outage_wins_over_growth_the_other_node_missed_it_with(
    tmp_path: Path, etcd_server: EtcdServer
) -> None:
    with nodes(tmp_path, etcd_server, "node-a", "node-b") as (a, b):
        await grow(a, [NVFP4], "a")
        await converged(a, b, etcd_server)
        await asyncio.to_thread(etcd_server.kill)
        # While etcd is away: B grows in epoch 0, A resets (epoch 1). Both are pending.
        grown = await grow(b, [NVFP4, requirement("big", tokens=4096)], "b")
        assert grown[-1].grew and grown[-1].plan.epoch == 0
        async with stub(a) as s:
            await s.ResetGroup(pb.ResetGroupRequest(group=GROUP), timeout=5)
        await asyncio.to_thread(etcd_server.start)

        async def epochs() -> tuple[int, int, int]:
            doc = await in_etcd(etcd_server)
            ga, gb = await group_of(a), await group_of(b)
            assert ga is not None and gb is not None
            return ga.epoch, gb.epoch, doc.epoch if doc else -1

        await until(epochs, lambda e: e == (1, 1, 1), "the reset wins everywhere")
        for node in (a, b):
            assert stored_plan(await group_of(node)) is None
        # ... and while both run, a second reset on B reaches A at once.
        async with stub(b) as s:
            await s.ResetGroup(pb.ResetGroupRequest(group=GROUP), timeout=5)
        await until(epochs, lambda e: e == (2, 2, 2), "a reset on B reaches A")
