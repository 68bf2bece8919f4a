"""Views against a real sidecar: an admin drains ranks out of the
membership view (a PROPOSED view without them, a VIEW_CHANGED event);
without --enable-admin it is refused; bad input is named and changes nothing;
the members acknowledge the view on their sessions and it commits."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from moe_sidecar.server import RunningServer, running_server
from moe_workspace.v1 import coordinator_pb2 as pb
from tests.integration.helpers import (
    NVFP4,
    coordinator_stub,
    details,
    make_config,
    propose_request,
    rpc_error,
)

pytestmark = pytest.mark.timeout(60)

GROUP = "exclude/ep3"


async def _decided(running: RunningServer) -> None:
    async with coordinator_stub(running.addresses.listen[0]) as stub:
        await asyncio.gather(
            *(
                stub.Propose(
                    propose_request(r, 1, NVFP4, group=GROUP, ep_size=3, local_ranks=3), timeout=5
                )
                for r in range(3)
            )
        )


@pytest.fixture
async def admin(tmp_path: Path) -> AsyncIterator[RunningServer]:
    async with running_server(make_config(tmp_path, enable_admin=True)) as running:
        await _decided(running)
        yield running


async def test_an_admin_drains_a_rank_out_of_the_view(admin: RunningServer) -> None:
    async with coordinator_stub(admin.addresses.listen[0]) as stub:
        before: pb.Group = await stub.GetGroup(pb.GetGroupRequest(group=GROUP), timeout=5)
        assert (before.view.number, list(before.view.members)) == (1, [0, 1, 2])
        assert before.view.state == pb.VIEW_STATE_COMMITTED
        events = stub.Watch(pb.WatchRequest(group=GROUP))
        await events.initial_metadata()  # subscribed
        group: pb.Group = await stub.ExcludeRanks(
            pb.ExcludeRanksRequest(group=GROUP, ranks=[2], reason="node drain"), timeout=5
        )
        event: pb.GroupEvent = await asyncio.wait_for(events.read(), timeout=5)
        events.cancel()
    view = group.view
    assert (view.number, list(view.members), view.generation) == (2, [0, 1], 1)
    assert view.state == pb.VIEW_STATE_PROPOSED and view.HasField("deadline")
    assert view.cause == "ranks [2] excluded by an admin (drain): node drain"
    assert event.kind == pb.EVENT_KIND_VIEW_CHANGED and event.view == view
    assert [r.left for r in group.ranks] == ["", "", ""]  # a drain is no departure


BAD: list[tuple[dict[str, Any], grpc.StatusCode, str]] = [
    ({"ranks": []}, grpc.StatusCode.INVALID_ARGUMENT, "ranks=[]: name at least one rank"),
    ({"ranks": [3]}, grpc.StatusCode.INVALID_ARGUMENT, "ranks=3: must be a rank below ep_size=3"),
    ({"ranks": [1], "reason": "x" * 5000}, grpc.StatusCode.INVALID_ARGUMENT, "reason="),
    ({"ranks": [1], "group": "nope/ep3"}, grpc.StatusCode.NOT_FOUND, "nope/ep3"),
]


@pytest.mark.parametrize(("fields", "code", "needle"), BAD)
async def test_bad_input_is_named_and_changes_nothing(
    admin: RunningServer, fields: dict[str, Any], code: grpc.StatusCode, needle: str
) -> None:
    request = pb.ExcludeRanksRequest(**{"group": GROUP, **fields})
    async with coordinator_stub(admin.addresses.listen[0]) as stub:
        before = await stub.GetGroup(pb.GetGroupRequest(group=GROUP), timeout=5)
        error = await rpc_error(stub.ExcludeRanks(request, timeout=5))
        after = await stub.GetGroup(pb.GetGroupRequest(group=GROUP), timeout=5)
    assert error.code() == code, details(error)
    assert needle in details(error), details(error)
    assert after.view == before.view


async def test_a_rank_excluded_twice_is_refused_naming_the_members(admin: RunningServer) -> None:
    async with coordinator_stub(admin.addresses.listen[0]) as stub:
        await stub.ExcludeRanks(pb.ExcludeRanksRequest(group=GROUP, ranks=[2]), timeout=5)
        error = await rpc_error(
            stub.ExcludeRanks(pb.ExcludeRanksRequest(group=GROUP, ranks=[2]), timeout=5)
        )
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "ranks [2] are no members of view 2" in details(error)
    assert "(members: [0, 1])" in details(error)


async def test_without_admin_it_is_refused(tmp_path: Path) -> None:
    async with running_server(make_config(tmp_path, enable_admin=False)) as running:
        await _decided(running)
        async with coordinator_stub(running.addresses.listen[0]) as stub:
            error = await rpc_error(
                stub.ExcludeRanks(pb.ExcludeRanksRequest(group=GROUP, ranks=[1]), timeout=5)
            )
            after = await stub.GetGroup(pb.GetGroupRequest(group=GROUP), timeout=5)
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "ExcludeRanks" in details(error) and "--enable-admin" in details(error)
    assert after.view.number == 1


class _Session:
    """One rank's raw Session stream."""

    def __init__(self, stub: Any) -> None:
        self._requests: asyncio.Queue[pb.SessionRequest | None] = asyncio.Queue()
        self._call = stub.Session(self._feed())
        self._id = 0

    async def _feed(self) -> AsyncIterator[pb.SessionRequest]:
        while (request := await self._requests.get()) is not None:
            yield request

    async def send(self, **message: Any) -> pb.SessionResponse:
        self._id += 1
        await self._requests.put(pb.SessionRequest(id=self._id, **message))
        response: pb.SessionResponse = await asyncio.wait_for(self._call.read(), timeout=5)
        return response

    def close(self) -> None:
        self._call.cancel()


async def test_a_view_commits_when_every_member_acknowledges_at_one_count(
    admin: RunningServer,
) -> None:
    group = "acks/ep2"
    async with coordinator_stub(admin.addresses.listen[0]) as stub:
        sessions = [_Session(stub) for _ in range(3)]
        unbound = await sessions[0].send(acknowledge=pb.AcknowledgeView(view=1, rounds=0))
        assert "before the session's first proposal" in unbound.error.message
        proposals = [
            propose_request(r, 1, NVFP4, group=group, ep_size=3, local_ranks=3) for r in range(3)
        ]
        decided = await asyncio.gather(
            *(s.send(propose=p) for s, p in zip(sessions, proposals, strict=True))
        )
        assert all(d.WhichOneof("result") == "decision" for d in decided), decided
        await stub.ExcludeRanks(pb.ExcludeRanksRequest(group=group, ranks=[2]), timeout=5)
        excluded = await sessions[2].send(acknowledge=pb.AcknowledgeView(view=2, rounds=5))
        assert excluded.error.code == "FAILED_PRECONDITION"
        assert "rank 2 is no member of view 2" in excluded.error.message
        first = await sessions[0].send(acknowledge=pb.AcknowledgeView(view=2, rounds=5))
        assert first.acknowledged.state == pb.VIEW_STATE_PROPOSED
        assert list(first.acknowledged.acknowledged) == [0]
        second = await sessions[1].send(acknowledge=pb.AcknowledgeView(view=2, rounds=5))
        assert second.acknowledged.state == pb.VIEW_STATE_COMMITTED
        assert list(second.acknowledged.members) == [0, 1]
        stored = await stub.GetGroup(pb.GetGroupRequest(group=group), timeout=5)
        for session in sessions:
            session.close()
    assert stored.view == second.acknowledged


async def test_a_view_nobody_acknowledges_fails_at_its_deadline(tmp_path: Path) -> None:
    config = make_config(tmp_path, enable_admin=True, round_timeout=0.5)
    async with running_server(config) as running:
        await _decided(running)
        async with coordinator_stub(running.addresses.listen[0]) as stub:
            events = stub.Watch(pb.WatchRequest(group=GROUP))
            await events.initial_metadata()
            await stub.ExcludeRanks(pb.ExcludeRanksRequest(group=GROUP, ranks=[0]), timeout=5)
            proposed = await asyncio.wait_for(events.read(), timeout=5)
            failed = await asyncio.wait_for(events.read(), timeout=10)  # the sidecar's timer
            events.cancel()
            stored = await stub.GetGroup(pb.GetGroupRequest(group=GROUP), timeout=5)
    assert proposed.view.state == pb.VIEW_STATE_PROPOSED
    assert failed.kind == pb.EVENT_KIND_VIEW_CHANGED
    assert failed.view.state == pb.VIEW_STATE_FAILED
    assert "ranks 1, 2 did not acknowledge it in time" in failed.view.cause
    assert stored.view == failed.view
