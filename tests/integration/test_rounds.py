"""Rounds against a real server: closing, timing out, retries, callers that leave."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from moe_sidecar.server import RunningServer, running_server
from moe_workspace.v1 import coordinator_pb2 as pb
from tests.integration.helpers import (
    BF16,
    GROUP,
    capacities,
    coordinator_stub,
    details,
    make_config,
    propose_request,
    rpc_error,
    workspace_bytes,
)

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("transport", ["unix", "tcp"])
async def test_eight_concurrent_ranks_get_one_decision(tmp_path: Path, transport: str) -> None:
    async with running_server(make_config(tmp_path)) as server:
        unix, tcp = server.addresses.listen
        assert unix.startswith("unix://") and not tcp.endswith(":0")
        async with coordinator_stub(unix if transport == "unix" else tcp) as stub:
            # Each rank needs a little more of one size; the plan is their join.
            requests = [
                propose_request(
                    rank,
                    requirement=pb.Requirement(
                        capacities=capacities(tokens=128 + rank, dispatch=100 + 10 * (7 - rank)),
                        layer="l0",
                    ),
                )
                for rank in range(8)
            ]
            responses = await asyncio.gather(*(stub.Propose(r, timeout=10) for r in requests))
            assert all(r == responses[0] for r in responses)
            assert responses[0].action == pb.ACTION_BUILD
            assert responses[0].plan.capacities == capacities(tokens=135, dispatch=170)
            assert responses[0].plan.workspace_bytes == workspace_bytes(
                capacities(tokens=135, dispatch=170)
            )
            assert responses[0].plan.generation == 1 and responses[0].grew

            # Round 2 at a bigger layer: everyone rebuilds, generation 2.
            responses = await asyncio.gather(
                *(stub.Propose(propose_request(rank, 2, BF16), timeout=10) for rank in range(8))
            )
            assert {r.action for r in responses} == {pb.ACTION_REBUILD}
            assert {r.plan.generation for r in responses} == {2}
            assert {r.plan.workspace_bytes for r in responses} == {
                workspace_bytes(capacities(tokens=256, dispatch=400))
            }

            group = await stub.GetGroup(pb.GetGroupRequest(group=GROUP), timeout=5)
            assert group.last_closed_round == 2 and group.open_round == 0
            assert [(h.plan.generation, h.layer) for h in group.history] == [(1, "l0"), (2, "mtp")]
        assert server.coordinator.waiting_calls() == 0


async def test_round_times_out_naming_the_missing_ranks(tmp_path: Path) -> None:
    async with (
        running_server(make_config(tmp_path, round_timeout=0.5)) as server,
        coordinator_stub(server.addresses.listen[0]) as stub,
    ):
        await asyncio.gather(
            *(stub.Propose(propose_request(rank), timeout=10) for rank in range(8))
        )
        # Round 2: ranks 6 and 7 never come.
        started = asyncio.get_running_loop().time()
        errors = await asyncio.gather(
            *(
                rpc_error(stub.Propose(propose_request(rank, 2, BF16), timeout=10))
                for rank in range(6)
            )
        )
        elapsed = asyncio.get_running_loop().time() - started
        assert 0.4 < elapsed < 5.0
        assert {e.code() for e in errors} == {grpc.StatusCode.DEADLINE_EXCEEDED}
        assert len({e.details() for e in errors}) == 1
        message = details(errors[0])
        assert "rank 6 (last reported round 1, layer 'l0')" in message
        assert "rank 7 (last reported round 1, layer 'l0')" in message
        assert "2 of 8 local ranks missing" in message

        # A late rank is told the same; the group moves on to round 3.
        late = await rpc_error(stub.Propose(propose_request(6, 2, BF16), timeout=10))
        assert late.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert late.details() == message
        group = await stub.GetGroup(pb.GetGroupRequest(group=GROUP), timeout=5)
        assert group.last_closed_round == 2 and group.open_round == 0
        assert server.coordinator.waiting_calls() == 0


async def test_retry_of_a_closed_round_gets_the_same_decision(tmp_path: Path) -> None:
    async with (
        running_server(make_config(tmp_path)) as server,
        coordinator_stub(server.addresses.listen[1]) as stub,
    ):
        first = await asyncio.gather(
            *(
                stub.Propose(propose_request(r, local_ranks=2, ep_size=2), timeout=5)
                for r in range(2)
            )
        )
        again = await stub.Propose(propose_request(1, local_ranks=2, ep_size=2), timeout=5)
        assert again == first[1]


async def test_heterogeneous_layer_is_refused_naming_both_layers(tmp_path: Path) -> None:
    async with (
        running_server(make_config(tmp_path)) as server,
        coordinator_stub(server.addresses.listen[0]) as stub,
    ):
        await asyncio.gather(
            *(
                stub.Propose(propose_request(r, ep_size=2, local_ranks=2), timeout=5)
                for r in range(2)
            )
        )
        odd = pb.Requirement(capacities=capacities(top_k=4), layer="mtp")
        errors = await asyncio.gather(
            *(
                rpc_error(
                    stub.Propose(propose_request(r, 2, odd, ep_size=2, local_ranks=2), timeout=5)
                )
                for r in range(2)
            )
        )
        assert {e.code() for e in errors} == {grpc.StatusCode.FAILED_PRECONDITION}
        message = details(errors[0])
        assert "'mtp'" in message and "'l0'" in message and "top_k=4" in message


def _proposed(server: RunningServer, group: str) -> set[int]:
    """The ranks that proposed ``group``'s open round."""
    rnd = server.coordinator.group(group).open_round
    return {p.ep_rank for p in rnd.proposals} if rnd is not None else set()


async def test_a_caller_that_goes_away_leaves_nothing_waiting(tmp_path: Path) -> None:
    async with (
        running_server(make_config(tmp_path)) as server,
        coordinator_stub(server.addresses.listen[0]) as stub,
    ):
        # Rank 0's client gives up after 0.3 s: its deadline ends the call.
        error = await rpc_error(stub.Propose(propose_request(0), timeout=0.3))
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # Another one is cancelled by its caller, once it waits in the round.
        call = stub.Propose(propose_request(1), timeout=10)
        for _ in range(250):
            if _proposed(server, GROUP) == {0, 1}:
                break
            await asyncio.sleep(0.02)  # the poll interval of a wait with a deadline
        assert _proposed(server, GROUP) == {0, 1}
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        for _ in range(100):
            if server.coordinator.waiting_calls() == 0:
                break
            await asyncio.sleep(0.02)  # the poll interval of a wait with a deadline
        assert server.coordinator.waiting_calls() == 0
        # Their proposals stay in the round: the others still close it, and
        # the retries of ranks 0 and 1 are answered with that decision.
        responses = await asyncio.gather(
            *(stub.Propose(propose_request(rank), timeout=10) for rank in range(8))
        )
        assert {r.action for r in responses} == {pb.ACTION_BUILD}
