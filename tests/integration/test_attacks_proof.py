"""Who may propose: the group's proof and the workspace ceiling, each attack
against a real sidecar (a server on real sockets).

A stranger is any process that can reach the coordinator's socket but is not
one of the group's ranks: it can read ``GetGroup`` and ``Watch`` and choose
its own lifetime, but it does not hold the secret the group's ranks shared
over their CPU group (the proof). Each test asserts the status the stranger
now gets, that the real ranks' round is decided from their own proposals,
and that the refusal shows in the group (``refused_proposals``, what
``moe-sidecar groups`` prints) and in the metrics. Run them alone with
``pytest -m attack``.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from moe_sidecar.core import limits
from moe_sidecar.core.cluster import ClusterPlan
from moe_sidecar.core.plan import Plan
from moe_sidecar.etcd.replica import group_key
from moe_sidecar.server import RunningServer, running_server
from moe_sidecar.store.row_codec import encode_cluster_plan
from moe_sidecar.wire.codec import capacities_from_proto, summary_from_proto
from moe_sidecar.wire.display import format_groups
from moe_workspace.v1 import coordinator_pb2 as pb
from tests.etcd_server import EtcdServer, EtcdTestClient, free_port
from tests.integration.helpers import (
    NVFP4,
    capacities,
    coordinator_stub,
    details,
    make_config,
    owner_digest,
    propose_request,
    rpc_error,
    token,
    workspace_bytes,
)
from tests.multiprocess.harness import Sidecar

pytestmark = [pytest.mark.attack, pytest.mark.timeout(60)]

DENIED = grpc.StatusCode.PERMISSION_DENIED
GROUP = "victim/ep4"
RANKS = 4
REAL = "real-ranks-group-proof-0001"
"""The proof the group's ranks share (what rank 0 drew)."""
RESTARTED = "real-ranks-group-proof-0002"
"""The proof of the ranks' next lifetime (drawn anew at its first initialize())."""
STRANGER = "a-stranger-s-own-proof-0003"
PLANTED = pb.Requirement(capacities=capacities(tokens=1 << 20, dispatch=1 << 12), layer="")
"""What the stranger proposes: 16 GiB per rank at EP 4, under the workspace
ceiling (so only the proof stands in its way), and no layer to disagree with."""
ATTACK = pb.Requirement(capacities=capacities(tokens=12_500_000, dispatch=4800), layer="")
"""The reported attack's layer: 12.5 M tokens, about 1,004 GiB per rank at EP 4."""


def _proposal(
    rank: int,
    lifetime: str,
    proof: str,
    requirement: pb.Requirement = NVFP4,
    *,
    rnd: int = 1,
    local_ranks: int = RANKS,
) -> pb.ProposeRequest:
    request = propose_request(
        rank, rnd, requirement, group=GROUP, ep_size=RANKS, local_ranks=local_ranks
    )
    request.lifetime = token(lifetime)
    request.group_proof = proof
    # The real ranks' lifetimes carry their owner digest; a stranger has none.
    request.owner_digest = owner_digest(GROUP) if proof in (REAL, RESTARTED) else ""
    return request


async def _group(stub: Any) -> pb.Group:
    group: pb.Group = await stub.GetGroup(pb.GetGroupRequest(group=GROUP), timeout=5)
    return group


async def _counts(stub: Any) -> tuple[int, int]:
    """(waiting, restarting) ranks of the group; (0, 0) before its first proposal arrives."""
    try:
        group = await _group(stub)
    except grpc.aio.AioRpcError as error:
        if error.code() != grpc.StatusCode.NOT_FOUND:
            raise
        return 0, 0
    return group.waiting_ranks, group.restarting_ranks


async def _waiting(stub: Any, count: int) -> bool:
    return (await _counts(stub))[0] == count


async def _until(condition: Callable[[], Awaitable[bool]], within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not await condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)  # the poll interval of a wait with a deadline


def _propose_all(
    stub: Any, ranks: range | list[int], lifetime: str, proof: str
) -> list[asyncio.Task[pb.ProposeResponse]]:
    return [
        asyncio.ensure_future(stub.Propose(_proposal(r, f"{lifetime}-{r}", proof), timeout=20))
        for r in ranks
    ]


def _refusals(server: RunningServer) -> float:
    return server.metrics.registry.get_sample_value("moe_sidecar_proof_refusals_total") or 0.0


def _assert_denied(error: grpc.aio.AioRpcError, rank: int) -> None:
    assert error.code() == DENIED, details(error)
    text = details(error)
    assert f"group {GROUP!r} rank {rank}" in text and "the group proof does not match" in text


async def _assert_shown(stub: Any, server: RunningServer, refused: int) -> None:
    """The refusals show in GetGroup, in what ``moe-sidecar groups`` prints,
    and in the metrics."""
    group = await _group(stub)
    assert group.refused_proposals == refused
    shown = format_groups([summary_from_proto(group)])
    assert f"refused proposals: {refused} (their group proof did not match" in shown
    assert _refusals(server) == refused


async def test_a_stranger_cannot_complete_a_restart(tmp_path: Path) -> None:
    """While ranks 0-2 restart, a stranger polling GetGroup until
    ``restarting_ranks == 3`` proposes round 1 as rank 3 with a lifetime of
    its own: it is refused at once (PERMISSION_DENIED), nothing it proposed
    is stored, and the real rank 3 completes the restart."""
    async with (
        running_server(make_config(tmp_path)) as server,
        coordinator_stub(server.addresses.listen[0]) as stub,
    ):
        first = await asyncio.gather(*_propose_all(stub, range(RANKS), "first", REAL))
        stored = first[0].plan
        restarting = _propose_all(stub, range(3), "second", RESTARTED)

        async def three_restarting() -> bool:
            return (await _counts(stub))[1] == 3

        await _until(three_restarting)
        stranger = _proposal(3, "stranger", STRANGER, PLANTED)
        _assert_denied(await rpc_error(stub.Propose(stranger, timeout=10)), 3)
        # Without a proof at all (a client older than proofs) it is no better off.
        anonymous = _proposal(3, "stranger-2", "", PLANTED)
        _assert_denied(await rpc_error(stub.Propose(anonymous, timeout=10)), 3)
        assert (await _group(stub)).restarting_ranks == 3

        last = await stub.Propose(_proposal(3, "second-3", RESTARTED), timeout=10)
        answers = [*(await asyncio.gather(*restarting)), last]
        assert {a.action for a in answers} == {pb.ACTION_BUILD}
        assert all(a.plan == stored for a in answers), "the restart built the stranger's plan"
        group = await _group(stub)
        assert group.lifetimes == 2 and group.plan == stored
        assert [h.plan for h in group.history] == [stored]
        await _assert_shown(stub, server, 2)


async def test_a_stranger_cannot_take_a_rank_that_has_not_arrived(tmp_path: Path) -> None:
    """In a group's first lifetime: a stranger proposing for the one rank
    that has not arrived is refused at once; one that came before most of
    the real ranks holds the slot only until the real rank comes, which takes
    it back (the stranger's waiting call is answered PERMISSION_DENIED)."""
    async with (
        running_server(make_config(tmp_path)) as server,
        coordinator_stub(server.addresses.listen[0]) as stub,
    ):
        waiting = _propose_all(stub, range(3), "late", REAL)

        await _until(lambda: _waiting(stub, 3))
        stranger = _proposal(3, "stranger", STRANGER, PLANTED)
        _assert_denied(await rpc_error(stub.Propose(stranger, timeout=10)), 3)
        last = await stub.Propose(_proposal(3, "late-3", REAL), timeout=10)
        answers = [*(await asyncio.gather(*waiting)), last]
        assert {a.action for a in answers} == {pb.ACTION_BUILD}
        assert {a.plan.workspace_bytes for a in answers} == {workspace_bytes(NVFP4.capacities, 4)}

    (tmp_path / "early").mkdir()
    async with (
        running_server(make_config(tmp_path / "early")) as server,
        coordinator_stub(server.addresses.listen[0]) as stub,
    ):
        # The stranger comes second: rank 0 holds one slot, the stranger one.
        rank0 = _propose_all(stub, [0], "early", REAL)

        await _until(lambda: _waiting(stub, 1))
        early = asyncio.ensure_future(
            stub.Propose(_proposal(3, "stranger", STRANGER, PLANTED), timeout=20)
        )

        await _until(lambda: _waiting(stub, 2))
        rest = _propose_all(stub, [1, 2], "early", REAL)
        await _until(lambda: _waiting(stub, 4))
        assert not early.done(), "two proofs in one round: it must not close"
        last = await stub.Propose(_proposal(3, "early-3", REAL), timeout=10)
        _assert_denied(await rpc_error(early), 3)
        answers = [*(await asyncio.gather(*rank0, *rest)), last]
        assert {a.action for a in answers} == {pb.ACTION_BUILD}
        assert {a.plan.workspace_bytes for a in answers} == {workspace_bytes(NVFP4.capacities, 4)}
        group = await _group(stub)
        assert len(group.ranks) == RANKS and all(r.current for r in group.ranks)
        await _assert_shown(stub, server, 1)


async def test_a_stranger_leaving_does_not_fail_the_real_ranks_round(tmp_path: Path) -> None:
    """A stranger waits beside rank 0 on a Session stream, then closes it:
    its proposal is withdrawn, rank 0's round is not aborted, and the real
    ranks complete it (the stranger's going is no rank's departure)."""
    async with (
        running_server(make_config(tmp_path)) as server,
        coordinator_stub(server.addresses.listen[0]) as stub,
    ):
        rank0 = _propose_all(stub, [0], "real", REAL)
        await _until(lambda: _waiting(stub, 1))
        requests: asyncio.Queue[pb.SessionRequest | None] = asyncio.Queue()

        async def messages() -> Any:
            while (message := await requests.get()) is not None:
                yield message

        session = stub.Session(messages())
        proposal = _proposal(3, "stranger", STRANGER, PLANTED)
        await requests.put(pb.SessionRequest(id=1, propose=proposal))
        await _until(lambda: _waiting(stub, 2))
        session.cancel()
        await _until(lambda: _waiting(stub, 1))
        rest = await asyncio.gather(*_propose_all(stub, [1, 2, 3], "real", REAL))
        answers = [*(await asyncio.gather(*rank0)), *rest]
        assert {a.action for a in answers} == {pb.ACTION_BUILD}
        assert {a.plan.workspace_bytes for a in answers} == {workspace_bytes(NVFP4.capacities, 4)}
        assert not any(r.left for r in (await _group(stub)).ranks)
        del server


async def test_a_commit_without_the_proof_is_refused(tmp_path: Path) -> None:
    """A commit with the rank's own lifetime (say, leaked) but another proof
    is PERMISSION_DENIED and changes nothing but the refusal count."""
    async with (
        running_server(make_config(tmp_path)) as server,
        coordinator_stub(server.addresses.listen[0]) as stub,
    ):
        decided = (await asyncio.gather(*_propose_all(stub, range(RANKS), "life", REAL)))[0]
        plan = pb.Plan()
        plan.CopyFrom(decided.plan)
        plan.ClearField("workspace_bytes")
        commit = pb.CommitRequest(
            group=GROUP,
            ep_rank=0,
            lifetime=token("life-0"),
            round=1,
            plan=plan,
            build_seconds=1.0,
            group_proof=STRANGER,
        )
        _assert_denied(await rpc_error(stub.Commit(commit, timeout=5)), 0)
        assert [r.committed_generation for r in (await _group(stub)).ranks] == [0] * RANKS
        commit.group_proof = REAL
        await stub.Commit(commit, timeout=5)
        assert (await _group(stub)).ranks[0].committed_generation == decided.plan.generation
        await _assert_shown(stub, server, 1)


async def test_a_squatted_group_is_taken_back_without_the_squatters_plan(
    tmp_path: Path,
) -> None:
    """A stranger takes a group name first with ``local_ranks=1`` and grows a
    plan of its own; the real ranks (4 on this node, one proof) take the
    group back: a new epoch, built from their own layer, not the squatter's.
    The squatter cannot take it again with fewer local ranks."""
    async with (
        running_server(make_config(tmp_path)) as server,
        coordinator_stub(server.addresses.listen[0]) as stub,
    ):
        squat = _proposal(0, "squatter", STRANGER, PLANTED, local_ranks=1)
        planted = await stub.Propose(squat, timeout=10)
        assert planted.action == pb.ACTION_BUILD

        answers = await asyncio.gather(*_propose_all(stub, range(RANKS), "real", REAL))
        assert {a.action for a in answers} == {pb.ACTION_BUILD}
        own = workspace_bytes(NVFP4.capacities, 4)
        assert {a.plan.workspace_bytes for a in answers} == {own}
        assert {a.plan.epoch for a in answers} == {planted.plan.epoch + 1}
        group = await _group(stub)
        assert group.local_ranks == RANKS and group.plan == answers[0].plan
        assert [h.plan.workspace_bytes for h in group.history] == [own]

        again = _proposal(0, "squatter-2", STRANGER, PLANTED, local_ranks=1)
        error = await rpc_error(stub.Propose(again, timeout=10))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, details(error)
        assert "fewer local ranks may not end the group's lifetime" in details(error)
        old = _proposal(0, "squatter", STRANGER, PLANTED, rnd=2, local_ranks=1)
        error = await rpc_error(stub.Propose(old, timeout=10))
        assert error.code() == grpc.StatusCode.ABORTED, details(error)
        assert "which ended when other ranks of the group restarted" in details(error)
        assert (await _group(stub)).plan == answers[0].plan
        del server


async def test_the_workspace_ceiling_refuses_proposals_commits_and_stored_plans(
    tmp_path: Path,
) -> None:
    """The reported attack's 12.5 M tokens (about 1,004 GiB per rank) is
    refused by the default 64 GiB ceiling, naming it; a lower ceiling
    refuses a commit above it, and a round whose stored plan (grown under a
    higher ceiling) is above it is refused instead of told to build it."""
    ceiling = 1 << 30
    assert workspace_bytes(ATTACK.capacities, 4) > limits.DEFAULT_MAX_WORKSPACE_BYTES == 64 << 30
    assert workspace_bytes(PLANTED.capacities, 4) > ceiling
    state_dir = tmp_path / "state"
    async with (
        running_server(make_config(tmp_path, state_dir=state_dir)) as server,
        coordinator_stub(server.addresses.listen[0]) as stub,
    ):
        error = await rpc_error(stub.Propose(_proposal(0, "one", REAL, ATTACK), timeout=10))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, details(error)
        assert "workspace ceiling of 68719476736 bytes (64.0 GiB" in details(error)
        assert "--max-workspace-bytes" in details(error)
        grown = await asyncio.gather(
            *(
                stub.Propose(_proposal(r, f"big-{r}", REAL, PLANTED), timeout=10)
                for r in range(RANKS)
            )
        )
        assert grown[0].plan.workspace_bytes > ceiling

    low = make_config(tmp_path, state_dir=state_dir, max_workspace_bytes=ceiling)
    async with (
        running_server(low) as server,
        coordinator_stub(server.addresses.listen[0]) as stub,
    ):
        plan = pb.Plan()
        plan.CopyFrom(grown[0].plan)
        plan.ClearField("workspace_bytes")
        commit = pb.CommitRequest(
            group=GROUP,
            ep_rank=0,
            lifetime=token("big-0"),
            round=1,
            plan=plan,
            build_seconds=1.0,
            group_proof=REAL,
        )
        error = await rpc_error(stub.Commit(commit, timeout=5))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, details(error)
        assert f"workspace ceiling of {ceiling} bytes" in details(error)
        restart = [
            stub.Propose(_proposal(r, f"small-{r}", RESTARTED), timeout=10) for r in range(RANKS)
        ]
        for outcome in await asyncio.gather(*(rpc_error(call) for call in restart)):
            assert outcome.code() == grpc.StatusCode.FAILED_PRECONDITION, details(outcome)
            assert "needs the stored plan" in details(outcome)
            assert f"workspace ceiling of {ceiling} bytes" in details(outcome)
        limit = server.metrics.registry.get_sample_value(
            "moe_sidecar_limit", {"resource": "workspace_bytes"}
        )
        assert limit == ceiling


def _metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.etcd
async def test_an_etcd_document_above_the_ceiling_is_set_aside(
    tmp_path: Path, etcd_server: EtcdServer
) -> None:
    """Another "node" writes the reported attack's plan (about 1,004 GiB per
    rank, inside every field's range) for a group into etcd: the sidecar
    does not merge it (no group appears, so no new lifetime would build it)
    and counts it as a rejected document."""
    prefix = "/ceiling/"
    planted = Plan(capacities=capacities_from_proto(ATTACK.capacities), epoch=0, generation=1)
    doc = ClusterPlan(name=GROUP, ep_size=RANKS, epoch=0, plan=planted, generation=1, history=())
    async with EtcdTestClient([etcd_server.endpoint]) as client:
        await client.put(group_key(prefix, GROUP), encode_cluster_plan(doc))
    port = free_port()
    url = f"etcd://{etcd_server.endpoint}{prefix.rstrip('/')}"
    sidecar = Sidecar(tmp_path / "node", args=("--store", url), metrics_port=port).start()
    try:

        async def rejected() -> bool:
            name = "moe_sidecar_store_rejected_documents_total"
            return await asyncio.to_thread(_metric, port, name) >= 1

        await _until(rejected, within=30)
        async with coordinator_stub(sidecar.target) as stub:
            error = await rpc_error(_group(stub))
            assert error.code() == grpc.StatusCode.NOT_FOUND, details(error)
        assert "workspace ceiling" in sidecar.log.read_text(errors="replace")
    finally:
        sidecar.stop()


async def test_a_round_and_a_restart_held_by_two_proofs_time_out_naming_the_cause(
    tmp_path: Path,
) -> None:
    """Ranks 0-1 with the real proof and a stranger's 2-3 with its own fill
    every slot of round 1: it never closes, and its timeout names the two
    proofs and their ranks (not "0 of 4 local ranks missing"). The same for
    a restart of a running group."""
    async with (
        running_server(make_config(tmp_path, round_timeout=1.0)) as server,
        coordinator_stub(server.addresses.listen[0]) as stub,
    ):
        held = [
            *_propose_all(stub, [0, 1], "real", REAL),
            *_propose_all(stub, [2, 3], "s", STRANGER),
        ]
        for error in await asyncio.gather(*(rpc_error(call) for call in held)):
            assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED, details(error)
            text = details(error)
            assert "it held proposals of 2 group proofs" in text, text
            assert "holds ranks [0, 1]" in text and "holds ranks [2, 3]" in text, text
            assert "local ranks missing" not in text, text

        await asyncio.gather(*_propose_all(stub, range(RANKS), "run", REAL))
        restart = [
            *_propose_all(stub, [0, 1], "next", RESTARTED),
            *_propose_all(stub, [2, 3], "s2", STRANGER),
        ]
        for error in await asyncio.gather(*(rpc_error(call) for call in restart)):
            assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED, details(error)
            text = details(error)
            assert "the restart of group" in text and "4 of 4 local ranks" in text, text
            assert "it held proposals of 2 group proofs" in text, text
        del server


async def test_a_flood_of_refused_proposals_writes_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """200 proposals with a rank's lifetime and a stranger's proof into a
    running group are each refused and counted, but logged once (one line
    per group per minute)."""
    async with (
        running_server(make_config(tmp_path)) as server,
        coordinator_stub(server.addresses.listen[0]) as stub,
    ):
        await asyncio.gather(*_propose_all(stub, range(RANKS), "real", REAL))
        with caplog.at_level("WARNING", logger="moe_sidecar.state"):
            for n in range(200):
                # A rank's (leaked) lifetime with another proof: refused at once.
                flood = _proposal(n % RANKS, f"real-{n % RANKS}", STRANGER, rnd=2)
                _assert_denied(await rpc_error(stub.Propose(flood, timeout=10)), n % RANKS)
        lines = [r for r in caplog.records if r.getMessage() == "proof refused"]
        assert len(lines) == 1, len(lines)
        assert _refusals(server) == 200
