"""Attacks on the sidecar, each against a real sidecar: a server on real
sockets, or ``python -m moe_sidecar`` itself where start-up matters.

One test (or a few) per numbered finding of the issue; each asserts the
status a client now gets and that a refused request changed nothing (the
``ListGroups`` pages before and after are equal). Run them alone with
``pytest -m attack``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import psutil  # type: ignore[import-untyped]
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from moe_sidecar.config import SidecarConfig
from moe_sidecar.core import limits, policy
from moe_sidecar.core.group import GroupState, Proposal, Requirement
from moe_sidecar.core.plan import Capacities
from moe_sidecar.server import RunningServer, running_server
from moe_sidecar.store.row_codec import encode_group
from moe_sidecar.store.sqlite import DATABASE_FILE, StateStore
from moe_sidecar.watch import WATCH_QUEUE_LIMIT
from moe_sidecar.wire.codec import capacities_from_proto
from moe_workspace.v1 import coordinator_pb2 as pb
from moe_workspace.v1 import coordinator_pb2_grpc as pb_grpc
from tests.ceiling import CEILING
from tests.integration.helpers import (
    BF16,
    NVFP4,
    ROOT,
    capacities,
    coordinator_stub,
    details,
    log_records,
    make_config,
    propose_request,
    rpc_error,
    run_round,
    start_sidecar_process,
    stop_process,
    token,
    wait_for_serving_record,
    workspace_bytes,
)
from tests.integration.raw_http2 import RawCall, open_call

pytestmark = [pytest.mark.attack, pytest.mark.timeout(60)]

INVALID = grpc.StatusCode.INVALID_ARGUMENT
FAILED = grpc.StatusCode.FAILED_PRECONDITION
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
SERVICE = "/moe_workspace.v1.WorkspaceCoordinator"
GRPC_MAX_MESSAGE = 4 << 20
"""What a gRPC client receives at most by default."""
VICTIM = "victim/ep2"
SPANNING = "spanning/ep4"
"""Two of its four ranks on this node: commits there may cover the decision."""
HUGE = pb.Requirement(capacities=capacities(tokens=1 << 20, dispatch=1 << 12), layer="")
"""An attacker's layer: a workspace of several GiB (under the workspace ceiling,
so the checks each test is about are what refuse it), and no label to disagree with."""


# --- helpers ------------------------------------------------------------------------


async def _snapshot(stub: Any) -> list[pb.Group]:
    """Every group, through every ListGroups page."""
    groups: list[pb.Group] = []
    page_token = ""
    while True:
        page = await stub.ListGroups(pb.ListGroupsRequest(page_token=page_token), timeout=5)
        groups.extend(page.groups)
        page_token = page.next_page_token
        if not page_token:
            return groups


async def _refused(stub: Any, call: Callable[[], Any], code: grpc.StatusCode, *needles: str) -> str:
    """Makes ``call()``; asserts it fails with ``code``, its message holds every
    needle, and every group is as it was. Returns the message."""
    before = await _snapshot(stub)
    error = await rpc_error(call())
    assert error.code() == code, details(error)
    for needle in needles:
        assert needle in details(error), details(error)
    assert await _snapshot(stub) == before, f"{details(error)!r} changed state"
    return details(error)


async def _group(stub: Any, name: str) -> pb.Group:
    group: pb.Group = await stub.GetGroup(pb.GetGroupRequest(group=name), timeout=5)
    return group


async def _until(condition: Callable[[], Awaitable[bool]], within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not await condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)  # the poll interval of a wait with a deadline


def _commit(group: str, rank: int, rnd: int, plan: pb.Plan, lifetime: str) -> pb.CommitRequest:
    return pb.CommitRequest(
        group=group, ep_rank=rank, lifetime=lifetime, round=rnd, plan=plan, build_seconds=1.0
    )


def _plan(base: pb.Plan, **changes: int) -> pb.Plan:
    plan = pb.Plan()
    plan.CopyFrom(base)
    plan.ClearField("workspace_bytes")
    for key, value in changes.items():
        if key in ("generation", "epoch"):
            setattr(plan, key, value)
        else:
            setattr(plan.capacities, key, value)
    return plan


_MOE_SIDECAR = str(Path(sys.executable).with_name("moe-sidecar"))
"""The installed command, as an operator runs it."""


def _counter(server: RunningServer, name: str, **labels: str) -> float:
    return server.metrics.registry.get_sample_value(name, labels) or 0.0


# --- 1. poisoned commits ---------------------------------------------------------------


async def test_1_poisoned_commits_are_refused_and_change_nothing(tmp_path: Path) -> None:
    """A Commit needs the lifetime's secret and must be the round's decision:
    a forged one is INVALID_ARGUMENT or FAILED_PRECONDITION and stores nothing."""
    async with (
        running_server(make_config(tmp_path)) as server,
        coordinator_stub(server.addresses.listen[0]) as stub,
    ):
        decided = (await run_round(stub, 1, NVFP4, group=VICTIM, local_ranks=2))[0].plan
        spanning = (await run_round(stub, 1, NVFP4, group=SPANNING, local_ranks=2, ep_size=4))[
            0
        ].plan
        shown = (await _group(stub, VICTIM)).ranks[0].lifetime
        assert len(shown) == 12  # what GetGroup publishes: not the token
        larger = _plan(decided, max_tokens=1 << 20, dispatch_bytes_per_token=1 << 12)
        assert 1 << 32 < workspace_bytes(larger.capacities, 2) <= limits.DEFAULT_MAX_WORKSPACE_BYTES
        beyond = _plan(decided, max_tokens=limits.MAX_TOKENS, dispatch_bytes_per_token=1 << 22)
        smaller = _plan(spanning, max_tokens=spanning.capacities.max_tokens // 2)
        attacks = [
            # Without the secret: the published id is no token, a guess is a stranger.
            (VICTIM, shown, 1, larger, INVALID, "a lifetime token of 12 characters"),
            (VICTIM, token("guessed-lifetime"), 1, larger, FAILED, "never proposed"),
            (SPANNING, token("guessed-lifetime"), 1, larger, FAILED, "never proposed"),
            # With the secret: only the decided plan, generation and round.
            (VICTIM, token("life-0"), 1, larger, FAILED, "but the round decided"),
            (VICTIM, token("life-0"), 1, _plan(decided, generation=999), FAILED, "decided"),
            (VICTIM, token("life-0"), 0, decided, INVALID, "round=0"),
            (VICTIM, token("life-0"), 2, decided, FAILED, "commits round 2"),
            (VICTIM, token("life-0"), 1, beyond, INVALID, "(1 TiB)"),
            # (A later epoch is another node's reset, joined by design: policy.commit.)
            (SPANNING, token("life-0"), 1, smaller, FAILED, "may only cover"),
        ]
        for group, lifetime, rnd, plan, code, needle in attacks:
            request = _commit(group, 0, rnd, plan, lifetime)
            await _refused(stub, functools.partial(stub.Commit, request, timeout=5), code, needle)

        # The victims' next round is what they decided, and so is a restart's round 1.
        reuse = await run_round(stub, 2, NVFP4, group=VICTIM, local_ranks=2)
        assert {r.action for r in reuse} == {pb.ACTION_REUSE}
        assert all(r.plan == decided for r in reuse)
        restarted = await run_round(stub, 1, NVFP4, group=VICTIM, local_ranks=2, lifetime="new")
        assert {r.action for r in restarted} == {pb.ACTION_BUILD}
        assert all(r.plan == decided for r in restarted)
        assert [h.plan for h in (await _group(stub, VICTIM)).history] == [decided]
        assert (await _group(stub, SPANNING)).plan == spanning


# --- 2. generation overflow ------------------------------------------------------------


async def test_2_generation_overflow_is_refused_and_the_group_keeps_serving(
    tmp_path: Path,
) -> None:
    """A Commit with generation 2^64-1 is INVALID_ARGUMENT; a group at the end of
    the range refuses its next growth with FAILED_PRECONDITION naming the
    layer, stores nothing, and every group stays listable, also after a restart."""
    config = make_config(tmp_path)
    rank0 = token("life-0")
    async with (
        running_server(config) as server,
        coordinator_stub(server.addresses.listen[0]) as stub,
    ):
        await run_round(stub, 1, NVFP4, group=VICTIM, local_ranks=2)
        decided = (await run_round(stub, 1, NVFP4, group=SPANNING, local_ranks=2, ep_size=4))[
            0
        ].plan
        top = _commit(SPANNING, 0, 1, _plan(decided, generation=(1 << 64) - 1), rank0)
        await _refused(
            stub,
            lambda: stub.Commit(top, timeout=5),
            INVALID,
            "plan.generation=18446744073709551615",
        )
        # Another node's agreed plan may carry its generation, up to the range's end.
        last = _plan(decided, generation=limits.MAX_GENERATION)
        await stub.Commit(_commit(SPANNING, 0, 1, last, rank0), timeout=5)
        at_end = await _group(stub, SPANNING)
        assert at_end.plan.generation == limits.MAX_GENERATION

        async def growth_refused(rnd: int) -> None:
            before = await _snapshot(stub)
            errors = await asyncio.gather(
                *(
                    rpc_error(
                        stub.Propose(
                            propose_request(r, rnd, BF16, group=SPANNING, ep_size=4, local_ranks=2),
                            timeout=5,
                        )
                    )
                    for r in range(2)
                )
            )
            for error in errors:
                assert error.code() == FAILED, details(error)
                assert "layer 'mtp' would grow the plan out of range" in details(error)
                assert f"plan.generation={limits.MAX_GENERATION + 1}" in details(error)
                assert "nothing was stored" in details(error)
            after = await _group(stub, SPANNING)
            assert (after.plan, after.history) == (at_end.plan, at_end.history)
            assert after.last_closed_round == rnd  # the round closed, refused for both ranks
            others = [g for g in await _snapshot(stub) if g.name != SPANNING]
            assert others == [g for g in before if g.name != SPANNING]

        await growth_refused(2)
        assert [g.name for g in await _snapshot(stub)] == [SPANNING, VICTIM]

    async with (
        running_server(config) as server,
        coordinator_stub(server.addresses.listen[0]) as stub,
    ):
        assert [g.name for g in await _snapshot(stub)] == [SPANNING, VICTIM]
        reuse = await run_round(stub, 3, NVFP4, group=SPANNING, local_ranks=2, ep_size=4)
        assert {r.action for r in reuse} == {pb.ACTION_REUSE}
        assert reuse[0].plan.generation == limits.MAX_GENERATION
        await growth_refused(4)


# --- 3. hijack -------------------------------------------------------------------------


async def test_3_one_new_lifetime_cannot_hijack_the_group(tmp_path: Path) -> None:
    """One round-1 Propose of a new lifetime: with another local_ranks it is
    FAILED_PRECONDITION at once; with the right one it waits for a restart
    that never comes (DEADLINE_EXCEEDED). Either way the real ranks' open
    round is decided as usual and nothing of the stranger is stored."""
    async with (
        running_server(make_config(tmp_path, round_timeout=1.5)) as server,
        coordinator_stub(server.addresses.listen[0]) as stub,
    ):
        await run_round(stub, 1, NVFP4, group=VICTIM, local_ranks=2)
        rank0 = asyncio.ensure_future(
            stub.Propose(
                propose_request(0, 2, BF16, group=VICTIM, ep_size=2, local_ranks=2), timeout=10
            )
        )

        async def waiting() -> bool:
            return (await _group(stub, VICTIM)).waiting_ranks == 1

        await _until(waiting)
        alone = propose_request(
            1, 1, HUGE, group=VICTIM, ep_size=2, local_ranks=1, lifetime="hijacker"
        )
        await _refused(stub, lambda: stub.Propose(alone, timeout=5), FAILED, "local_ranks=1")

        stranger = asyncio.ensure_future(
            stub.Propose(
                propose_request(
                    1, 1, HUGE, group=VICTIM, ep_size=2, local_ranks=2, lifetime="hijacker"
                ),
                timeout=10,
            )
        )

        async def restarting() -> bool:
            return (await _group(stub, VICTIM)).restarting_ranks == 1

        await _until(restarting)
        group = await _group(stub, VICTIM)
        assert (group.lifetimes, group.open_round, group.waiting_ranks) == (1, 2, 1)

        rank1 = await stub.Propose(
            propose_request(1, 2, BF16, group=VICTIM, ep_size=2, local_ranks=2), timeout=5
        )
        assert (await rank0) == rank1
        assert rank1.action == pb.ACTION_REBUILD
        assert rank1.plan.capacities == BF16.capacities

        error = await rpc_error(stranger)
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED, details(error)
        assert "a new lifetime begins only when every local rank of the group restarts" in details(
            error
        )
        after = await _group(stub, VICTIM)
        assert (after.lifetimes, after.restarting_ranks, after.open_round) == (1, 0, 0)
        assert after.plan == rank1.plan
        assert [h.plan.capacities for h in after.history] == [NVFP4.capacities, BF16.capacities]


# --- 4. impersonation ------------------------------------------------------------------


async def test_4_impersonating_a_rank_is_refused_and_sets_no_round_size(tmp_path: Path) -> None:
    """A Propose as rank 3 with the id GetGroup shows is INVALID_ARGUMENT; with a
    guessed token it is a stranger (FAILED_PRECONDITION for round 2, a restart
    that times out for round 1); the round's size is the real ranks' need."""
    async with (
        running_server(make_config(tmp_path, round_timeout=1.5)) as server,
        coordinator_stub(server.addresses.listen[0]) as stub,
    ):
        group = "victim/ep4"
        await run_round(stub, 1, NVFP4, group=group, local_ranks=4)
        real = [
            asyncio.ensure_future(
                stub.Propose(
                    propose_request(r, 2, BF16, group=group, ep_size=4, local_ranks=4), timeout=10
                )
            )
            for r in range(3)
        ]

        async def three_waiting() -> bool:
            return (await _group(stub, group)).waiting_ranks == 3

        await _until(three_waiting)
        shown = next(r.lifetime for r in (await _group(stub, group)).ranks if r.ep_rank == 3)

        def as_rank3(rnd: int, lifetime: str) -> pb.ProposeRequest:
            request = propose_request(3, rnd, HUGE, group=group, ep_size=4, local_ranks=4)
            request.lifetime = lifetime
            return request

        await _refused(
            stub,
            lambda: stub.Propose(as_rank3(2, shown), timeout=5),
            INVALID,
            "a lifetime token of 12 characters",
        )
        for guess in (shown * 2, shown.ljust(64, "0"), token("guessed-lifetime")):
            await _refused(
                stub,
                functools.partial(stub.Propose, as_rank3(2, guess), timeout=5),
                FAILED,
                "which this sidecar does not know",
            )
        impostor = asyncio.ensure_future(
            stub.Propose(as_rank3(1, token("impostor-lifetime")), timeout=10)
        )

        async def restarting() -> bool:
            return (await _group(stub, group)).restarting_ranks == 1

        await _until(restarting)
        assert (await _group(stub, group)).waiting_ranks == 3

        rank3 = await stub.Propose(
            propose_request(3, 2, BF16, group=group, ep_size=4, local_ranks=4), timeout=5
        )
        assert await asyncio.gather(*real) == [rank3] * 3
        assert rank3.action == pb.ACTION_REBUILD
        assert rank3.plan.capacities == BF16.capacities
        error = await rpc_error(impostor)
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED, details(error)
        after = await _group(stub, group)
        assert (after.lifetimes, after.plan) == (1, rank3.plan)


# --- 5. unbounded resources ------------------------------------------------------------


def _single(group: str, rnd: int = 1, requirement: pb.Requirement = NVFP4, **kw: Any) -> Any:
    """The proposal of a group's only local rank (its round closes at once)."""
    return propose_request(0, rnd, requirement, group=group, ep_size=1, local_ranks=1, **kw)


async def test_5_junk_groups_stop_at_max_groups(tmp_path: Path) -> None:
    """Groups beyond --max-groups are RESOURCE_EXHAUSTED naming the limit; an
    admin removes an idle group (not a busy one) to make room."""
    async with (
        running_server(make_config(tmp_path, max_groups=20, enable_admin=True)) as server,
        coordinator_stub(server.addresses.listen[0]) as stub,
    ):
        await run_round(stub, 1, NVFP4, group="busy/ep2", local_ranks=2)
        await asyncio.gather(
            *(stub.Propose(_single(f"junk-{i:03d}"), timeout=5) for i in range(19))
        )
        await _refused(
            stub,
            lambda: stub.Propose(_single("junk-019"), timeout=5),
            EXHAUSTED,
            "group='junk-019' would be group 21 of this sidecar; --max-groups is 20",
        )
        malformed = _single("junk-020")
        malformed.requirement.capacities.top_k = 0
        await _refused(stub, lambda: stub.Propose(malformed, timeout=5), INVALID, "top_k=0")
        assert _counter(server, "moe_sidecar_limit_refusals_total", resource="groups") == 1
        assert _counter(server, "moe_sidecar_limit", resource="groups") == 20
        assert _counter(server, "moe_sidecar_groups") == 20

        # The groups it has keep working; an open round keeps its group.
        assert (await stub.Propose(_single("junk-000", 2), timeout=5)).action == pb.ACTION_REUSE
        waiting = asyncio.ensure_future(
            stub.Propose(
                propose_request(0, 2, NVFP4, group="busy/ep2", ep_size=2, local_ranks=2), timeout=10
            )
        )

        async def busy() -> bool:
            return (await _group(stub, "busy/ep2")).waiting_ranks == 1

        await _until(busy)
        remove_busy = pb.RemoveGroupRequest(group="busy/ep2")
        await _refused(stub, lambda: stub.RemoveGroup(remove_busy, timeout=5), FAILED, "in use")
        await stub.RemoveGroup(pb.RemoveGroupRequest(group="junk-001"), timeout=5)
        assert (await stub.Propose(_single("junk-019"), timeout=5)).action == pb.ACTION_BUILD
        waiting.cancel()


async def _grow_full_history(stub: Any, group: str) -> pb.Group:
    """A group grown once per round until its history is full, with the
    longest layer labels: the largest group one rank can make alone."""
    for rnd in range(1, policy.MAX_HISTORY + 1):
        label = f"model.layers.{rnd}.mlp".ljust(limits.MAX_NAME_LENGTH, "~")
        need = pb.Requirement(capacities=capacities(tokens=rnd, num_experts=64), layer=label)
        request = propose_request(0, rnd, need, group=group, ep_size=64, local_ranks=1)
        assert (await stub.Propose(request, timeout=5)).grew
    return await _group(stub, group)


async def _full_history_groups(config: SidecarConfig, total: int) -> tuple[int, int]:
    """Stores groups "full/000"... of a full history each, more than ``total``
    bytes of them: one grown by a sidecar, the rest copies of its row.
    Returns how many, and the size of one."""
    async with (
        running_server(config) as server,
        coordinator_stub(server.addresses.listen[0]) as stub,
    ):
        size = (await _grow_full_history(stub, "full/000")).ByteSize()
    assert size > 64_000
    count = total // size + 8
    with contextlib.closing(sqlite3.connect(config.state_dir / DATABASE_FILE)) as db:
        (row,) = db.execute("SELECT state FROM groups WHERE name = 'full/000'").fetchone()
        clones = [
            (f"full/{i:03d}", row.replace("full/000", f"full/{i:03d}")) for i in range(1, count)
        ]
        db.executemany("INSERT INTO groups (name, state) VALUES (?, ?)", clones)
        db.commit()
    return count, size


async def test_5_list_groups_pages_stay_under_the_message_limit(tmp_path: Path) -> None:
    """Groups whose sum passes gRPC's 4 MiB message limit are listed page by page,
    each page under the limit whatever the page size asked, and ``moe-sidecar
    groups`` pages through all of them."""
    config = make_config(tmp_path, max_groups=100)
    count, _ = await _full_history_groups(config, GRPC_MAX_MESSAGE)
    async with (
        running_server(config) as server,
        coordinator_stub(server.addresses.listen[0]) as stub,
    ):
        for page_size in (0, 1 << 30):  # the default (100), and beyond --max-page-size
            first = await stub.ListGroups(pb.ListGroupsRequest(page_size=page_size), timeout=5)
            assert first.next_page_token
            assert first.ByteSize() < GRPC_MAX_MESSAGE
        listed = await _snapshot(stub)
        assert [g.name for g in listed] == [f"full/{i:03d}" for i in range(count)]
        assert sum(g.ByteSize() for g in listed) > GRPC_MAX_MESSAGE
        cli = await asyncio.to_thread(
            subprocess.run,
            [_MOE_SIDECAR, "groups", "--json", "--target", server.addresses.listen[0]],
            capture_output=True,
            text=True,
            timeout=30,
            cwd=ROOT,
        )
        assert cli.returncode == 0, cli.stderr
        assert len(json.loads(cli.stdout)) == count


def _stall(address: str, method: str, request: Any) -> RawCall:
    """A call whose caller never reads: a window of 0 bytes, a socket never read."""
    return open_call(address, f"{SERVICE}/{method}", request.SerializeToString(), window=0)


async def test_5_answers_nobody_reads_are_bounded(tmp_path: Path) -> None:
    """ListGroups calls whose callers never read (a closed HTTP/2 window) hold at
    most MAX_PENDING_RESPONSE_BYTES of answers: beyond, reads are
    RESOURCE_EXHAUSTED; once those callers go, reads are answered again."""
    config = make_config(tmp_path, max_groups=100)
    count, _ = await _full_history_groups(config, 1 << 20)  # pages of 1 MiB
    async with (
        running_server(config) as server,
        coordinator_stub(server.addresses.listen[0]) as stub,
    ):
        path = server.addresses.listen[0].removeprefix("unix://")
        stalled = [
            await asyncio.to_thread(_stall, path, "ListGroups", pb.ListGroupsRequest())
            for _ in range(30)
        ]
        try:

            async def refused() -> bool:
                return (
                    _counter(server, "moe_sidecar_limit_refusals_total", resource="response_bytes")
                    > 0
                )

            await _until(refused)
            error = await rpc_error(stub.ListGroups(pb.ListGroupsRequest(), timeout=5))
            assert error.code() == EXHAUSTED
            assert "bytes of answers wait for clients that do not read them" in details(error)
            # Proposals and commits do not wait on readers.
            assert (await stub.Propose(_single("other/ep1"), timeout=5)).action == pb.ACTION_BUILD
        finally:
            for connection in stalled:
                connection.close()

        async def answered() -> bool:
            try:
                await stub.ListGroups(pb.ListGroupsRequest(), timeout=5)
            except grpc.aio.AioRpcError:
                return False
            return True

        await _until(answered)
        assert len(await _snapshot(stub)) == count + 1


async def test_5_metric_series_per_group_are_capped(tmp_path: Path) -> None:
    """Beyond --max-group-series, groups are summed under group="_other"."""
    async with (
        running_server(make_config(tmp_path, max_group_series=4)) as server,
        coordinator_stub(server.addresses.listen[0]) as stub,
    ):
        for i in range(12):
            await stub.Propose(_single(f"series-{i:02d}"), timeout=5)
        text = await asyncio.to_thread(_scrape, server.addresses.metrics_port)
    labels = {
        line.split('group="', 1)[1].split('"', 1)[0]
        for line in text.splitlines()
        if 'group="' in line and not line.startswith("#")
    }
    assert labels == {f"series-{i:02d}" for i in range(4)} | {"_other"}
    rounds = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("moe_sidecar_rounds_total{")
    ]
    assert sum(rounds) == 12


def _scrape(port: int | None) -> str:
    """The metrics endpoint's page (an HTTP GET on a plain socket)."""
    assert port is not None
    with socket.create_connection(("127.0.0.1", port), timeout=5) as connection:
        connection.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        received = b""
        while chunk := connection.recv(65536):
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    return body.decode()


async def test_5_health_port_floods_are_bounded_and_probes_still_answer(tmp_path: Path) -> None:
    """Health.Watch and reflection streams on the health port hold at most half
    of --max-health-rpcs (the rest: RESOURCE_EXHAUSTED), so Health.Check
    keeps answering SERVING; the coordinator is not served there."""
    async with (
        running_server(make_config(tmp_path, max_health_rpcs=8)) as server,
        grpc.aio.insecure_channel(f"127.0.0.1:{server.addresses.health_port}") as channel,
    ):
        health = health_pb2_grpc.HealthStub(channel)

        async def first_reply(stream: Any) -> tuple[Any, str]:
            try:
                return (await stream.read()).status, ""
            except grpc.aio.AioRpcError as error:
                return error.code(), details(error)

        # One after another: opened all at once, the refused ones may still be
        # in flight when the next arrive, and the port's bound of 8 calls
        # refuses those first (counted as health_rpcs, not health_streams).
        streams, replies = [], []
        for _ in range(12):
            streams.append(health.Watch(health_pb2.HealthCheckRequest(service="")))
            replies.append(await first_reply(streams[-1]))
        serving = [r for r in replies if r[0] == health_pb2.HealthCheckResponse.SERVING]
        refused = [message for status, message in replies if status == EXHAUSTED]
        assert (len(serving), len(refused)) == (4, 8), replies
        assert all("--max-health-rpcs" in message for message in refused)
        for service in ("", "moe_workspace.v1.WorkspaceCoordinator"):
            for _ in range(3):
                reply = await health.Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=5
                )
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflection = channel.stream_stream(
            "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )(iter([b"\x3a\x00"]))  # list_services: a stream too
        assert (await rpc_error(reflection.read())).code() == EXHAUSTED
        assert _counter(server, "moe_sidecar_limit_refusals_total", resource="health_streams") == 9
        coordinator = pb_grpc.WorkspaceCoordinatorStub(channel)
        elsewhere = await rpc_error(coordinator.ListGroups(pb.ListGroupsRequest(), timeout=5))
        assert elsewhere.code() == grpc.StatusCode.UNIMPLEMENTED
        for stream in streams:
            stream.cancel()
        again = health.Watch(health_pb2.HealthCheckRequest(service=""))
        assert (await again.read()).status == health_pb2.HealthCheckResponse.SERVING
        again.cancel()


async def test_5_watch_streams_are_bounded_by_max_watchers(tmp_path: Path) -> None:
    """A Watch stream beyond --max-watchers is RESOURCE_EXHAUSTED naming the limit."""
    async with (
        running_server(make_config(tmp_path, max_watchers=3)) as server,
        coordinator_stub(server.addresses.listen[0]) as stub,
    ):
        streams = [stub.Watch(pb.WatchRequest()) for _ in range(3)]

        def subscribed(n: int) -> Callable[[], Awaitable[bool]]:
            async def check() -> bool:
                return server.coordinator.watcher_count() == n

            return check

        await _until(subscribed(3))
        error = await rpc_error(stub.Watch(pb.WatchRequest()).read())
        assert error.code() == EXHAUSTED
        assert "3 Watch streams are open; --max-watchers is 3" in details(error)
        streams[0].cancel()
        await _until(subscribed(2))
        streams.append(stub.Watch(pb.WatchRequest()))
        await _until(subscribed(3))
        for stream in streams:
            stream.cancel()


def test_5_idle_metrics_connections_make_no_threads(tmp_path: Path) -> None:
    """200 idle connections to the metrics port of ``python -m moe_sidecar``: no
    thread more, at most --max-metrics-connections held, the rest closed at once."""
    log = tmp_path / "sidecar.log"
    process = start_sidecar_process(
        log,
        *("--listen", f"unix://{tmp_path}/s.sock", "--state-dir", str(tmp_path / "state")),
        *("--health-port", "auto", "--metrics-port", "auto"),
        *("--max-metrics-connections", "4"),
    )
    idle: list[socket.socket] = []
    try:
        metrics = wait_for_serving_record(process, log)["metrics_port"]
        threads = psutil.Process(process.pid).num_threads()
        for _ in range(200):
            connection = socket.create_connection(("127.0.0.1", metrics), timeout=5)
            connection.setblocking(False)
            idle.append(connection)

        def closed(connection: socket.socket) -> bool:
            try:
                return connection.recv(1) == b""
            except BlockingIOError:
                return False

        deadline = time.monotonic() + 10
        while sum(closed(c) for c in idle) < 196:
            assert time.monotonic() < deadline, "connections beyond the limit stay open"
            time.sleep(0.05)  # the poll interval of a wait with a deadline
        assert psutil.Process(process.pid).num_threads() <= threads
        for connection in idle:
            connection.close()
        deadline = time.monotonic() + 10
        while True:  # the held ones are freed as their peers go
            try:
                text = _scrape(metrics)
                break
            except (AssertionError, OSError):
                assert time.monotonic() < deadline
                time.sleep(0.05)  # the poll interval of a wait with a deadline
        refused = 'moe_sidecar_limit_refusals_total{resource="metrics_connections"} '
        assert float(text.split(refused, 1)[1].split()[0]) >= 196
    finally:
        for connection in idle:
            connection.close()
        stop_process(process)


async def test_5_a_watcher_that_never_reads_is_cut_off(tmp_path: Path) -> None:
    """A Watch client that announces the largest HTTP/2 window and never reads
    is cut off once its events back up on the server; a reading watcher is not."""
    async with (
        running_server(make_config(tmp_path)) as server,
        coordinator_stub(server.addresses.listen[0]) as stub,
    ):
        label = "events".ljust(limits.MAX_NAME_LENGTH, "~")
        need = pb.Requirement(capacities=NVFP4.capacities, layer=label)
        await stub.Propose(_single("events/ep1", 1, need), timeout=5)
        path = server.addresses.listen[0].removeprefix("unix://")
        silent = await asyncio.to_thread(
            open_call, path, f"{SERVICE}/Watch", pb.WatchRequest().SerializeToString()
        )
        reader = stub.Watch(pb.WatchRequest(group="events/ep1"))
        received = 0

        async def read_all() -> None:
            nonlocal received
            async for _ in reader:
                received += 1

        reading = asyncio.ensure_future(read_all())
        try:

            async def both() -> bool:
                return server.coordinator.watcher_count() == 2

            await _until(both)
            rounds = 1
            while server.coordinator.watcher_count() == 2:
                rounds += 1
                assert rounds < 50_000, "the silent watcher was never cut off"
                await stub.Propose(_single("events/ep1", rounds, need), timeout=5)
            assert server.coordinator.watcher_count() == 1
            assert rounds > WATCH_QUEUE_LIMIT  # the server queued up to its limit first

            async def all_read() -> bool:
                return received == rounds - 1  # every round after the first

            await _until(all_read)
        finally:
            silent.close()
            reading.cancel()


# The largest group anyone who can reach the coordinator can make: the most
# ranks, each with the longest labels, the full growth history, the retained
# rounds, an open round and a restart each one rank short. Made by the
# decision core itself (no hand-written row), then copied under other names.
_HEAVY = "heavy/".ljust(limits.MAX_NAME_LENGTH, "N")


def _heaviest_group() -> GroupState:
    ep = limits.MAX_EP_SIZE

    def propose(
        state: GroupState | None, rnd: int, lifetimes: list[str], ranks: range
    ) -> GroupState:
        need = Capacities(
            max_tokens=rnd,
            dispatch_bytes_per_token=4096,
            combine_bytes_per_token=4096,
            top_k=limits.MAX_TOP_K,
            num_experts=limits.MAX_NUM_EXPERTS,
            eplb_experts=limits.MAX_NUM_EXPERTS,
        )
        label = f"model.layers.{rnd}.mlp".ljust(limits.MAX_NAME_LENGTH, "~")
        for rank in ranks:
            proposal = Proposal(
                _HEAVY, ep, rank, ep, lifetimes[rank], rnd, Requirement(need, label)
            )
            state = policy.propose(state, proposal, 1.8e9 + rnd, 3600.0, ceiling=CEILING).state
        assert state is not None
        return state

    first = [f"{r:064x}" for r in range(ep)]
    second = [f"{r + ep:064x}" for r in range(ep)]
    state = None
    for rnd in range(1, policy.MAX_HISTORY + 2):  # every round grows the plan
        state = propose(state, rnd, first, range(ep))
    state = propose(state, policy.MAX_HISTORY + 2, first, range(ep - 1))
    state = propose(state, 1, second, range(ep - 1))
    assert len(state.history) == policy.MAX_HISTORY and state.open_round and state.pending
    return state


def _vm_peak_bytes(pid: int) -> int:
    """The process's peak resident set (VmHWM), Linux only."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_5_a_sidecar_full_of_the_largest_groups_restarts_within_the_manifest_limits(
    tmp_path: Path,
) -> None:
    """With the Kubernetes manifest's env, memory limit and state volume, a
    sidecar holding --max-groups of the largest groups starts (database under
    the volume's size), serves every group, refuses one more group with
    RESOURCE_EXHAUSTED, and its peak RSS stays under the memory limit, also
    with 100 callers that ask for 1 MiB pages and never read them."""
    from tests.unit.test_k8s_manifests import _env, _quantity, _sidecar, _sidecar_config, _volumes

    container = _sidecar()
    memory_limit = _quantity(container["resources"]["limits"]["memory"])
    mount = next(
        m for m in container["volumeMounts"] if m["mountPath"] == str(_sidecar_config().state_dir)
    )
    volume = _volumes()[mount["name"]]
    # A hostPath has no size limit: the state then keeps to what we promise
    # the node's disk (the README's 64 MiB), an emptyDir to its sizeLimit.
    volume_limit = (
        _quantity(volume["emptyDir"]["sizeLimit"]) if "emptyDir" in volume else _NODE_DISK_BUDGET
    )
    max_groups = _sidecar_config().max_groups

    row = encode_group(_heaviest_group())
    state_dir = tmp_path / "state"
    StateStore(state_dir).close()
    names = [f"heavy-{i:04d}/".ljust(limits.MAX_NAME_LENGTH, "N") for i in range(max_groups)]
    with contextlib.closing(sqlite3.connect(state_dir / DATABASE_FILE)) as db:
        db.executemany(
            "INSERT INTO groups (name, state) VALUES (?, ?)",
            ((name, row.replace(_HEAVY, name)) for name in names),
        )
        db.commit()
    stored = sum(f.stat().st_size for f in state_dir.iterdir())
    assert stored < volume_limit, f"{stored} bytes of state > the volume's {volume_limit}"

    env = {k: v for k, v in os.environ.items() if not k.startswith("MOE_SIDECAR_")}
    env.update(_env(container))
    env.update(
        MOE_SIDECAR_LISTEN=f"unix://{tmp_path}/s.sock",
        MOE_SIDECAR_HEALTH_PORT="auto",
        MOE_SIDECAR_METRICS_PORT="auto",
        MOE_SIDECAR_STATE_DIR=str(state_dir),
    )
    log = tmp_path / "sidecar.log"
    stalled: list[RawCall] = []
    with log.open("wb") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "moe_sidecar"], cwd=ROOT, env=env, stderr=stderr
        )
    try:
        wait_for_serving_record(process, log)
        started = _vm_peak_bytes(process.pid)
        with grpc.insecure_channel(f"unix://{tmp_path}/s.sock") as channel:
            stub = pb_grpc.WorkspaceCoordinatorStub(channel)
            listed, page_token = [], ""
            while True:
                page = stub.ListGroups(pb.ListGroupsRequest(page_token=page_token), timeout=10)
                listed += [g.name for g in page.groups]
                if not (page_token := page.next_page_token):
                    break
            assert listed == names
            with pytest.raises(grpc.RpcError) as info:
                stub.Propose(_single("one-more"), timeout=5)
            assert info.value.code() == EXHAUSTED
            # And callers that ask for pages and never read them: bounded too.
            for _ in range(100):
                stalled.append(_stall(f"{tmp_path}/s.sock", "ListGroups", pb.ListGroupsRequest()))
            deadline = time.monotonic() + 20
            while True:
                try:
                    stub.ListGroups(pb.ListGroupsRequest(), timeout=5)
                except grpc.RpcError as error:
                    if error.code() == EXHAUSTED:
                        break
                assert time.monotonic() < deadline, "answers nobody reads were not bounded"
                time.sleep(0.05)  # the poll interval of a wait with a deadline
        peak = _vm_peak_bytes(process.pid)
    finally:
        for connection in stalled:
            connection.close()
        stop_process(process)
    limit_mib = memory_limit / 2**20
    print(  # shown with -s: the figures behind the limits
        f"{max_groups} largest groups: {stored / 2**20:.1f} MiB of state (volume "
        f"{volume_limit / 2**20:.0f} MiB); peak RSS {peak / 2**20:.0f} MiB, "
        f"{started / 2**20:.0f} MiB at SERVING (limit {limit_mib:.0f} MiB)"
    )
    assert peak < memory_limit, (
        f"{max_groups} groups: peak RSS {peak / 2**20:.0f} MiB (at SERVING "
        f"{started / 2**20:.0f} MiB) >= the manifest's {limit_mib:.0f} MiB"
    )


# --- 6. wrong statuses, unusable state, plaintext beyond loopback -----------------------

_METHODS = pb.DESCRIPTOR.services_by_name["WorkspaceCoordinator"].methods
_UNDECODABLE = {
    "a truncated field": b"\x0a\x10abc",
    "a varint of 11 bytes": b"\x08" + b"\xff" * 11,
    "field number 0": b"\x00",
    "an end-group without a start": b"\x0c",
    "groups nested 300 deep": b"\x0b" * 300 + b"\x0c" * 300,
    "garbage": b"\xff\xff\xff\xff not a protobuf",
}


def _not_utf8(method: str) -> bytes:
    """The method's first string field holding bytes that are not UTF-8."""
    field = 2 if method == "ListGroups" else 1  # page_token, else group
    text = bytes([field << 3 | 2, 2]) + b"\xff\xfe"
    if method == "Session":  # propose (field 2) holding that group
        return bytes([2 << 3 | 2, len(text)]) + text
    return text


async def test_6_undecodable_bytes_are_invalid_argument_on_every_method(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Raw undecodable bytes on every method are INVALID_ARGUMENT (not grpc's
    UNKNOWN), change nothing, are counted by method, and logged once per peer."""
    async with running_server(make_config(tmp_path, enable_admin=True)) as server:
        tcp = server.addresses.listen[1]
        async with coordinator_stub(tcp) as stub:
            await run_round(stub, 1, NVFP4, group=VICTIM, local_ranks=2)
            before = await _snapshot(stub)
        peers = 2
        for _ in range(peers):  # two connections: two peers
            options = (("grpc.use_local_subchannel_pool", 1),)
            async with grpc.aio.insecure_channel(tcp, options=options) as channel:
                for method in _METHODS:
                    path = f"{SERVICE}/{method.name}"
                    for payload in (*_UNDECODABLE.values(), _not_utf8(method.name)):
                        if method.client_streaming:
                            # A session answers each message; a bad one ends
                            # in an error message, not the stream.
                            code, message = await _session_error(channel, path, payload)
                            assert code == INVALID.name, (method.name, payload, message)
                            assert f"bytes that are not a {method.input_type.full_name}" in message
                            continue
                        if method.server_streaming:
                            stream = channel.unary_stream(path, bytes, bytes)(payload, timeout=5)
                            error = await rpc_error(stream.read())
                        else:
                            error = await rpc_error(
                                channel.unary_unary(path, bytes, bytes)(payload, timeout=5)
                            )
                        assert error.code() == INVALID, (method.name, payload, details(error))
                        assert f"bytes that are not a {method.input_type.full_name}" in details(
                            error
                        )
        async with coordinator_stub(tcp) as stub:
            assert await _snapshot(stub) == before
        per_method = peers * (len(_UNDECODABLE) + 1)
        for method in _METHODS:
            counted = _counter(server, "moe_sidecar_undecodable_requests_total", method=method.name)
            assert counted == per_method, method.name
        assert _counter(server, "moe_sidecar_errors_total", code="INVALID_ARGUMENT") == (
            per_method * len(_METHODS)
        )
        assert _counter(server, "moe_sidecar_errors_total", code="UNKNOWN") == 0
    logged = [r for r in caplog.records if r.getMessage() == "undecodable request"]
    assert len(logged) == peers
    assert len({r.__dict__["peer"] for r in logged}) == peers


async def _session_error(channel: grpc.aio.Channel, path: str, payload: bytes) -> tuple[str, str]:
    """The error a Session stream answers ``payload`` with: (code name, message)."""
    call = channel.stream_stream(path, bytes, bytes)(timeout=5)
    await call.write(payload)
    data = await call.read()
    assert isinstance(data, bytes), data
    answer = pb.SessionResponse.FromString(data)
    await call.done_writing()
    assert answer.WhichOneof("result") == "error", answer
    assert await call.read() == grpc.aio.EOF
    return answer.error.code, answer.error.message


_NODE_DISK_BUDGET = 64 << 20
"""Bytes of the node's disk a sidecar's state may take at --max-groups."""


def _small_group(name: str) -> GroupState:
    """A two-rank group after two rounds, made by the decision core."""
    state = None
    for rnd, need in ((1, NVFP4), (2, BF16)):
        for rank in range(2):
            requirement = Requirement(capacities_from_proto(need.capacities), need.layer)
            proposal = Proposal(name, 2, rank, 2, f"{rank:064x}", rnd, requirement)
            state = policy.propose(state, proposal, 1.8e9 + rnd, 60.0, ceiling=CEILING).state
    assert state is not None
    return state


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


def _edit(change: Callable[[dict[str, Any]], object]) -> Callable[[str], str]:
    def edit(text: str) -> str:
        document = json.loads(text)
        change(document)
        return json.dumps(document)

    return edit


_BAD_ROWS: dict[str, Callable[[str], str]] = {
    "generation beyond the range": _edit(lambda d: d.__setitem__("generation", 1 << 64)),
    "a plan beyond 1 TiB": _edit(
        lambda d: d["plan"]["capacities"].__setitem__("max_tokens", 1 << 40)
    ),
    "a time no timestamp holds": _edit(lambda d: d["ranks"][0].__setitem__("last_seen", 1e300)),
    "a year past 9999": _edit(lambda d: d["history"][0].__setitem__("at", 1e12)),
    "an integer beyond any double": _edit(
        lambda d: d["ranks"][1].__setitem__("last_seen", 10**400)
    ),
    "a lone surrogate in a label": _edit(
        lambda d: d["ranks"][0].__setitem__("last_layer", "\ud800")
    ),
    "a negative build time": _edit(lambda d: d["ranks"][1].__setitem__("build_seconds", -5.0)),
    "JSON nested 100,000 deep": lambda text: '{"version": 2, "name": ' + _deep(100_000) + "}",
    "a field nested 100,000 deep": lambda text: text.replace(
        '"history":[', '"history":[' + _deep(100_000) + ",", 1
    ),
}


def _state_dir_with(tmp_path: Path, rows: dict[str, str]) -> Path:
    state_dir = tmp_path / "state"
    StateStore(state_dir).close()
    with contextlib.closing(sqlite3.connect(state_dir / DATABASE_FILE)) as db:
        db.executemany("INSERT INTO groups (name, state) VALUES (?, ?)", rows.items())
        db.commit()
    return state_dir


def _start_until_exit(
    tmp_path: Path,
    *flags: str,
    prefix: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    listen: tuple[str, ...] = ("--listen", "unix://{tmp_path}/s.sock"),
) -> tuple[int, str]:
    """Runs ``python -m moe_sidecar`` until it exits; returns its exit status and stderr.

    The health port it is given stays bound by this test (not listening) for
    the whole run, so no other process can take it meanwhile, and a sidecar
    that got as far as opening its health port would fail with "cannot
    listen" (and gRPC's own line) instead of the one-line error the tests
    expect: the health port can never have answered a probe.
    """
    with socket.socket() as held_health_port:
        held_health_port.bind(("127.0.0.1", 0))
        command = [
            *prefix,
            sys.executable,
            "-m",
            "moe_sidecar",
            *(flag.format(tmp_path=tmp_path) for flag in listen),
            *("--health-port", str(held_health_port.getsockname()[1]), "--metrics-port", "0"),
            *("--state-dir", str(tmp_path / "state")),
            *flags,
        ]
        base = {k: v for k, v in os.environ.items() if not k.startswith("MOE_SIDECAR_")}
        done = subprocess.run(
            command,
            cwd=ROOT,
            env={**base, **(env or {})},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=30,
        )
    return done.returncode, done.stderr.decode()


def _one_line_error(stderr: str) -> dict[str, Any]:
    assert "Traceback" not in stderr, stderr
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    record: dict[str, Any] = json.loads(lines[0])
    assert record["message"] == "cannot start", record
    return record


@pytest.mark.parametrize("damage", list(_BAD_ROWS))
def test_6_a_bad_stored_row_stops_the_start_naming_file_and_group(
    tmp_path: Path, damage: str
) -> None:
    """Out-of-range or deeply nested rows: ``python -m moe_sidecar`` exits 1 with
    one log line naming the database and the group, no traceback, never SERVING."""
    good = encode_group(_small_group("good"))
    bad = _BAD_ROWS[damage](encode_group(_small_group("bad")))
    state_dir = _state_dir_with(tmp_path, {"good": good, "bad": bad})
    code, stderr = _start_until_exit(tmp_path)
    assert code == 1
    error = _one_line_error(stderr)["error"]
    assert f"'{state_dir / DATABASE_FILE}': group 'bad' is corrupt" in error


def _obeying_file_modes() -> tuple[str, ...]:
    """A command prefix under which a process obeys file modes: as root,
    setpriv with no capabilities (so no CAP_DAC_OVERRIDE)."""
    if os.geteuid() != 0:
        return ()
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("root without setpriv: file modes do not apply")
    return (setpriv, "--bounding-set", "-all", "--inh-caps", "-all", "--")


@pytest.mark.parametrize("read_only", ["database file", "state dir"])
def test_6_an_unwritable_state_stops_the_start(tmp_path: Path, read_only: str) -> None:
    """A database the sidecar cannot write: exit 1 before SERVING, naming the file."""
    prefix = _obeying_file_modes()
    state_dir = _state_dir_with(tmp_path, {"good": encode_group(_small_group("good"))})
    database = state_dir / DATABASE_FILE
    target = database if read_only == "database file" else state_dir
    target.chmod(0o444 if read_only == "database file" else 0o555)
    try:
        code, stderr = _start_until_exit(tmp_path, prefix=prefix)
    finally:
        target.chmod(0o644 if read_only == "database file" else 0o755)
    assert code == 1
    error = _one_line_error(stderr)["error"]
    # The message names what to change: the file, or the directory and its flag.
    assert str(target) in error
    if read_only == "state dir":
        assert "--state-dir" in error


@pytest.mark.parametrize("listen", ["0.0.0.0:0", "[::]:0", "192.0.2.1:50051"])
@pytest.mark.parametrize("source", ["flag", "env"])
def test_6_tcp_beyond_loopback_without_tls_is_refused_at_start(
    tmp_path: Path, listen: str, source: str
) -> None:
    """Plaintext TCP beyond loopback: exit status 2, naming the address and the
    flags that allow it."""
    if source == "flag":
        code, stderr = _start_until_exit(tmp_path, listen=("--listen", listen))
    else:
        env = {"MOE_SIDECAR_LISTEN": listen}
        code, stderr = _start_until_exit(tmp_path, env=env, listen=())
    assert code == 2
    assert "Traceback" not in stderr and len(stderr.splitlines()) == 1, stderr
    named = "--listen " if source == "flag" else "MOE_SIDECAR_LISTEN="
    assert f"{named}{listen!r}: TCP beyond loopback needs TLS (--tls-cert and --tls-key" in stderr
    assert "--insecure" in stderr


def test_6_insecure_allows_plaintext_beyond_loopback(tmp_path: Path) -> None:
    log = tmp_path / "sidecar.log"
    process = start_sidecar_process(
        log,
        *("--listen", "0.0.0.0:0", "--insecure", "--state-dir", str(tmp_path / "state")),
        *("--health-port", "auto", "--metrics-port", "0"),
    )
    try:
        (listening,) = wait_for_serving_record(process, log)["listen"]
        host, _, port = listening.rpartition(":")
        assert host == "0.0.0.0", listening
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.WorkspaceCoordinatorStub(channel)
            assert not stub.ListGroups(pb.ListGroupsRequest(), timeout=5).groups
    finally:
        stop_process(process)
    assert all(r["level"] != "ERROR" for r in log_records(log))


def _certificates(directory: Path) -> dict[str, bytes]:
    """A throwaway CA and a server (127.0.0.1) and client certificate it signed."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("no openssl to make certificates")

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=directory, check=True, capture_output=True)

    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    run(
        "req",
        "-x509",
        *ec,
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "1",
        "-subj",
        "/CN=test-ca",
    )
    for name, extensions in (
        ("server", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n"),
        ("client", "extendedKeyUsage=clientAuth\n"),
    ):
        (directory / f"{name}.ext").write_text(extensions)
        run("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        run(
            "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext",
        )  # fmt: skip
    return {p.name: p.read_bytes() for p in directory.iterdir() if p.suffix in (".pem", ".key")}


async def _list_over(target: str, credentials: grpc.ChannelCredentials | None) -> grpc.StatusCode:
    channel = (
        grpc.aio.secure_channel(target, credentials)
        if credentials is not None
        else grpc.aio.insecure_channel(target)
    )
    async with channel:
        stub = pb_grpc.WorkspaceCoordinatorStub(channel)
        try:
            await stub.ListGroups(pb.ListGroupsRequest(), timeout=3)
        except grpc.aio.AioRpcError as error:
            return error.code()
        return grpc.StatusCode.OK


async def test_6_tls_beyond_loopback(tmp_path: Path) -> None:
    """With --tls-cert/--tls-key a TLS client works and a plaintext one fails;
    with --tls-client-ca a client without a certificate fails too."""
    certs_dir = tmp_path / "certs"
    certs_dir.mkdir()
    certs = _certificates(certs_dir)
    ca_only = grpc.ssl_channel_credentials(root_certificates=certs["ca.pem"])
    with_cert = grpc.ssl_channel_credentials(
        root_certificates=certs["ca.pem"],
        private_key=certs["client.key"],
        certificate_chain=certs["client.pem"],
    )
    unix = f"unix://{tmp_path}/sidecar.sock"
    for client_ca in (None, certs_dir / "ca.pem"):
        config = make_config(
            tmp_path,
            listen=(unix, "0.0.0.0:0"),
            tls_cert=certs_dir / "server.pem",
            tls_key=certs_dir / "server.key",
            tls_client_ca=client_ca,
        )
        async with running_server(config) as server:
            target = "127.0.0.1:" + server.addresses.listen[1].rpartition(":")[2]
            assert await _list_over(target, None) == grpc.StatusCode.UNAVAILABLE
            assert await _list_over(target, ca_only) == (
                grpc.StatusCode.OK if client_ca is None else grpc.StatusCode.UNAVAILABLE
            )
            assert await _list_over(target, with_cert) == grpc.StatusCode.OK
            assert await _list_over(unix, None) == grpc.StatusCode.OK  # guarded by its file mode
            if client_ca is not None:
                flags = ["--target", target, "--tls-ca", str(certs_dir / "ca.pem")]
                client = [
                    "--tls-cert",
                    str(certs_dir / "client.pem"),
                    "--tls-key",
                    str(certs_dir / "client.key"),
                ]
                for extra, status in (([], 1), (client, 0)):
                    cli = await asyncio.to_thread(
                        subprocess.run,
                        [_MOE_SIDECAR, "groups", *flags, *extra],
                        capture_output=True,
                        text=True,
                        timeout=30,
                    )
                    assert cli.returncode == status, cli.stderr


# --- the fuzzer, smaller -----------------------------------------------------------------


@pytest.mark.timeout(180)
def test_fuzz_1500_requests_no_internal_error_and_no_refusal_changes_state(tmp_path: Path) -> None:
    """bench/fuzz_sidecar.py with 1,500 requests (the committed run has 10,000)."""
    from bench.fuzz_sidecar import format_report, run

    report = run(1500, seed=11, directory=tmp_path)
    text = "\n".join(format_report(report, "test_attacks.py: run(1500, seed=11)"))
    assert report.requests >= 1500, text
    assert report.restarts >= 1, text
    assert not report.violations, text
    # Every kind of request was answered, refused and accepted alike.
    answered = {method for method, _ in report.counts}
    assert answered == {m.name for m in _METHODS}, text
    assert {code for _, code in report.counts} >= {"OK", "INVALID_ARGUMENT", "FAILED_PRECONDITION"}
