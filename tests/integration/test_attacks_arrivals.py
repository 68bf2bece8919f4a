"""A stranger's arrivals at a group's first round, against a real sidecar.

An ``Arrive`` carries no proof (the ranks send it before they hold one),
so anyone who reaches the socket can send one. It must not complete, refuse
or shorten the real ranks' round, nor change the group; a bad one is
INVALID_ARGUMENT naming the field and changes nothing.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest

from moe_sidecar.server import running_server
from moe_workspace.v1 import coordinator_pb2 as pb
from tests.integration.helpers import (
    NVFP4,
    coordinator_stub,
    details,
    make_config,
    propose_request,
    rpc_error,
    token,
)

pytestmark = [pytest.mark.attack, pytest.mark.timeout(60)]

GROUP = "victim/ep2"
PROOF = "real-ranks-group-proof-0001"


def _arrival(rank: int, lifetime: str, **fields: Any) -> Any:
    values: dict[str, Any] = {"group": GROUP, "ep_size": 2, "ep_rank": rank, "local_ranks": 2}
    values.update(fields)
    return pb.ArriveRequest(lifetime=token(lifetime), **values)


def _proposal(rank: int) -> Any:
    request = propose_request(rank, 1, NVFP4, group=GROUP, ep_size=2, local_ranks=2)
    request.lifetime = token(f"real-{rank}")
    request.group_proof = PROOF
    return request


async def test_a_strangers_arrivals_neither_complete_nor_hold_up_the_real_round(
    tmp_path: Path,
) -> None:
    async with (
        running_server(make_config(tmp_path, round_timeout=2.0)) as server,
        coordinator_stub(server.addresses.listen[0]) as stub,
    ):
        # A stranger arrives for both ranks before the real ranks come.
        strangers = [
            asyncio.ensure_future(stub.Arrive(_arrival(r, f"stranger-{r}"), timeout=20))
            for r in range(2)
        ]
        group = await _until_shown(stub, [0, 1])
        assert group.last_closed_round == 0 and not group.HasField("plan")
        # Arrivals of every rank complete nothing: the real ranks' round is decided
        # from their own proposals, at once.
        real = await asyncio.gather(*(stub.Propose(_proposal(r), timeout=10) for r in range(2)))
        assert {a.action for a in real} == {pb.ACTION_BUILD}
        # The stranger's calls end at their own deadline, changing nothing.
        for call in strangers:
            error = await rpc_error(call)
            assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED, details(error)
            assert "the first round of group 'victim/ep2' timed out" in details(error)
        group = await stub.GetGroup(pb.GetGroupRequest(group=GROUP), timeout=5)
        assert group.last_closed_round == 1 and list(group.arrived_ranks) == []
        assert group.plan == real[0].plan


async def test_an_arrival_that_reaches_the_sidecar_after_its_proposal_ends_at_once(
    tmp_path: Path,
) -> None:
    # The arrival and the proposal travel on different calls: when the proposal
    # comes first, the arrival has nothing to wait for. Held, it would wait out
    # the round timeout and, once its rank's process exits, show the rank gone.
    async with (
        running_server(make_config(tmp_path, round_timeout=30.0)) as server,
        coordinator_stub(server.addresses.listen[0]) as stub,
    ):
        first = asyncio.ensure_future(stub.Propose(_proposal(0), timeout=20))
        await _until_waiting(stub, 1)
        await stub.Arrive(_arrival(0, "real-0"), timeout=5)
        await stub.Propose(_proposal(1), timeout=10)
        await first
        await stub.Arrive(_arrival(1, "real-1"), timeout=5)
        group = await stub.GetGroup(pb.GetGroupRequest(group=GROUP), timeout=5)
        assert list(group.arrived_ranks) == [] and [r.left for r in group.ranks] == ["", ""]
        assert group.waiting_ranks == 0


async def _until_waiting(stub: Any, count: int) -> None:
    deadline = asyncio.get_running_loop().time() + 10
    while True:
        try:
            group = await stub.GetGroup(pb.GetGroupRequest(group=GROUP), timeout=5)
            if group.waiting_ranks == count:
                return
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.NOT_FOUND:
                raise
        assert asyncio.get_running_loop().time() < deadline, f"{count} waiting ranks not shown"
        await asyncio.sleep(0.01)  # the poll interval of a wait with a deadline


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"ep_rank": 2}, "ep_rank"),
        ({"ep_size": 0}, "ep_size"),
        ({"local_ranks": 3}, "local_ranks"),
        ({"group": ""}, "group"),
    ],
)
async def test_a_bad_arrival_is_refused_naming_the_field(
    tmp_path: Path, fields: dict[str, Any], named: str
) -> None:
    async with (
        running_server(make_config(tmp_path)) as server,
        coordinator_stub(server.addresses.listen[0]) as stub,
    ):
        error = await rpc_error(stub.Arrive(_arrival(0, "bad", **fields), timeout=5))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, details(error)
        assert named in details(error)
        short = await rpc_error(stub.Arrive(pb.ArriveRequest(group=GROUP, ep_size=2), timeout=5))
        assert short.code() == grpc.StatusCode.INVALID_ARGUMENT and "lifetime" in details(short)
        listed = await stub.ListGroups(pb.ListGroupsRequest(), timeout=5)
        assert list(listed.groups) == []  # nothing was recorded


async def _until_shown(stub: Any, ranks: list[int]) -> Any:
    deadline = asyncio.get_running_loop().time() + 10
    while True:
        try:
            group = await stub.GetGroup(pb.GetGroupRequest(group=GROUP), timeout=5)
            if list(group.arrived_ranks) == ranks:
                return group
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.NOT_FOUND:
                raise
        assert asyncio.get_running_loop().time() < deadline, f"ranks {ranks} not shown"
        await asyncio.sleep(0.01)  # the poll interval of a wait with a deadline


async def test_a_group_known_only_by_arrivals_cannot_be_reset_or_removed(tmp_path: Path) -> None:
    # An admin acting on what `groups` shows must not make a group of a stranger's arrival.
    async with (
        running_server(make_config(tmp_path, enable_admin=True)) as server,
        coordinator_stub(server.addresses.listen[0]) as stub,
    ):
        arrival = asyncio.ensure_future(stub.Arrive(_arrival(0, "stranger"), timeout=20))
        await _until_shown(stub, [0])
        for call in (
            stub.ResetGroup(pb.ResetGroupRequest(group=GROUP), timeout=5),
            stub.RemoveGroup(pb.RemoveGroupRequest(group=GROUP), timeout=5),
        ):
            error = await rpc_error(call)
            assert error.code() == grpc.StatusCode.NOT_FOUND, details(error)
        idle = await stub.ListGroups(pb.ListGroupsRequest(idle_for_seconds=1), timeout=5)
        assert list(idle.groups) == []  # ranks wait in it: it is not idle
        arrival.cancel()
        real = await asyncio.gather(*(stub.Propose(_proposal(r), timeout=10) for r in range(2)))
        assert {a.action for a in real} == {pb.ACTION_BUILD}
        assert real[0].plan.epoch == 0  # no reset happened
