"""The bounds of the long streams, against a real sidecar (a server on real
sockets): how many Session streams may be open (``--max-sessions``), how
much a stream that writes and never reads may send (``--stream-receive-bytes``),
that the ranks beside it are answered, and that a Watch stream whose peer
never reads (a real HTTP/2 peer announcing a zero flow-control window,
:mod:`tests.integration.raw_http2`) is cut off (``--stream-write-timeout``,
its queue's bound) while the watchers beside it go on.
"""

from __future__ import annotations

import asyncio
import time
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
    run_round,
)
from tests.integration.raw_http2 import RawCall, grpc_message, open_call

pytestmark = pytest.mark.timeout(60)

GROUP = "sessions/ep8"


def _sessions(server: RunningServer) -> float:
    return server.metrics.registry.get_sample_value("moe_sidecar_sessions") or 0.0


def _refused(server: RunningServer) -> float:
    value = server.metrics.registry.get_sample_value(
        "moe_sidecar_limit_refusals_total", {"resource": "sessions"}
    )
    return value or 0.0


class _Session:
    """One rank's Session stream that proposes round 1 and waits."""

    def __init__(self, stub: Any, rank: int) -> None:
        self._requests: asyncio.Queue[pb.SessionRequest | None] = asyncio.Queue()
        self.call = stub.Session(self._messages())
        request = propose_request(rank, group=GROUP, ep_size=8, local_ranks=8)
        self._requests.put_nowait(pb.SessionRequest(id=1, propose=request))

    async def _messages(self) -> AsyncIterator[pb.SessionRequest]:
        while (message := await self._requests.get()) is not None:
            yield message


async def _until(condition: Any, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)  # the poll interval of a wait with a deadline


async def test_sessions_beyond_the_bound_are_refused_naming_the_flag(tmp_path: Path) -> None:
    """With ``--max-sessions 4``, four ranks' sessions wait in their round;
    a fifth stream is RESOURCE_EXHAUSTED at once, naming the flag, counted;
    once one of the four ends, a new one is served again."""
    async with (
        running_server(make_config(tmp_path, max_sessions=4)) as server,
        coordinator_stub(server.addresses.listen[0]) as stub,
    ):
        sessions = [_Session(stub, rank) for rank in range(4)]
        await _until(lambda: _sessions(server) == 4)
        extra = _Session(stub, 4)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await extra.call.read()
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "4 Session streams are open; --max-sessions is 4" in details(refused.value)
        assert _refused(server) == 1 and _sessions(server) == 4

        sessions[0].call.cancel()
        await _until(lambda: _sessions(server) == 3)
        again = _Session(stub, 0)
        await _until(lambda: _sessions(server) == 4)
        for session in (*sessions[1:], again):
            session.call.cancel()
        await _until(lambda: _sessions(server) == 0)


def _cutoffs(server: RunningServer, reason: str, connection: str = "shut") -> float:
    value = server.metrics.registry.get_sample_value(
        "moe_sidecar_stream_cutoffs_total",
        {"method": "Watch", "reason": reason, "connection": connection},
    )
    return value or 0.0


def _zero_window_watch(address: str | tuple[str, int]) -> RawCall:
    """A Watch of every group from a peer that never reads (a zero window)."""
    watcher = open_call(
        address,
        "/moe_workspace.v1.WorkspaceCoordinator/Watch",
        pb.WatchRequest(group="").SerializeToString(),
        window=0,
    )
    watcher.keep_acknowledging()
    return watcher


def _tcp(server: RunningServer) -> tuple[str, int]:
    host, port = server.addresses.listen[1].rsplit(":", 1)
    return host, int(port)


async def test_a_watch_stream_that_never_reads_is_cut_off(tmp_path: Path) -> None:
    """A zero-window Watch of every group falls more than its queue's limit
    behind while rounds go on, its handler stuck in its first write: the
    sidecar shuts its connection down (gRPC cannot end the call otherwise),
    counts it as an overflow and frees its queue. The peer sees its
    connection end (no trailers: the call had no way to send them)."""
    config = make_config(tmp_path, max_groups=1024, stream_write_timeout=600.0)
    async with (
        running_server(config) as server,
        coordinator_stub(server.addresses.listen[0]) as stub,
    ):
        watcher = _zero_window_watch(_tcp(server))
        try:
            await _until(lambda: server.coordinator.watcher_count() == 1)
            for n in range(1000):  # 2 or 3 events a round: past the 1,024 a queue holds
                if watcher.closed.is_set():
                    break
                await run_round(stub, 1, NVFP4, group=f"g{n}/ep1", local_ranks=1)
            await _until(watcher.closed.is_set, within=5.0)
            assert _cutoffs(server, "overflow") == 1
            assert server.coordinator.watcher_count() == 0
            assert not watcher.trailers and watcher.data_received == 0
        finally:
            watcher.close()


async def test_a_watch_write_pending_past_the_timeout_is_cut_off(tmp_path: Path) -> None:
    """With ``--stream-write-timeout 0.5``, a zero-window watcher's first
    event waits for it half a second: its connection is shut down, counted
    as a write timeout, while a watcher that reads, beside it, gets every
    event of the round and of the rounds after."""
    async with (
        running_server(make_config(tmp_path, stream_write_timeout=0.5)) as server,
        coordinator_stub(server.addresses.listen[0]) as stub,
    ):
        reader = stub.Watch(pb.WatchRequest(group=""))
        await reader.initial_metadata()
        watcher = _zero_window_watch(_tcp(server))
        try:
            await _until(lambda: server.coordinator.watcher_count() == 2)
            await run_round(stub, 1, NVFP4, group="slow/ep1", local_ranks=1)
            await _until(watcher.closed.is_set, within=5.0)
            assert _cutoffs(server, "write_timeout") == 1
            assert server.coordinator.watcher_count() == 1
            limit = server.metrics.registry.get_sample_value(
                "moe_sidecar_limit", {"resource": "stream_write_seconds"}
            )
            assert limit == 0.5
            await run_round(stub, 1, NVFP4, group="after/ep1", local_ranks=1)
            seen: list[str] = []
            while "after/ep1" not in seen:
                event = await asyncio.wait_for(reader.read(), timeout=5)
                seen.append(event.group)
            assert "slow/ep1" in seen
        finally:
            watcher.close()
            reader.cancel()


async def test_a_unix_socket_watcher_that_never_reads_is_dropped_not_cut(
    tmp_path: Path,
) -> None:
    """A zero-window watcher on the Unix socket cannot be told apart from
    the other connections of its listener (moe_sidecar.peer_socket): its
    write timing out drops its subscription (its queue freed, its
    --max-watchers place given back), counted as ``connection="not_found"``;
    its call stays open until the peer goes."""
    async with (
        running_server(make_config(tmp_path, stream_write_timeout=0.5)) as server,
        coordinator_stub(server.addresses.listen[0]) as stub,
    ):
        path = server.addresses.listen[0].removeprefix("unix://")
        watcher = _zero_window_watch(path)
        try:
            await _until(lambda: server.coordinator.watcher_count() == 1)
            await run_round(stub, 1, NVFP4, group="unix/ep1", local_ranks=1)
            await _until(lambda: _cutoffs(server, "write_timeout", "not_found") == 1)
            assert server.coordinator.watcher_count() == 0
            assert not watcher.closed.is_set()
        finally:
            watcher.close()


async def test_a_session_that_writes_and_never_reads_holds_at_most_its_window(
    tmp_path: Path,
) -> None:
    """A zero-window Session stream proposes, then keeps sending all the
    sidecar's windows allow: with ``--stream-receive-bytes 16384`` the
    sidecar lets it send at most about twice that, not the megabytes gRPC's BDP
    probing granted (bench/bench_unread_sessions.py: 4,258,830 B per stream
    before, 64,020 with the default window)."""
    from bench.bench_unread_sessions import METHOD, feed_unread

    async with running_server(make_config(tmp_path, stream_receive_bytes=16384)) as server:
        host, port = server.addresses.listen[1].rsplit(":", 1)
        call = open_call((host, int(port)), METHOD, None, window=0)
        request = propose_request(0, group="unread/ep1", ep_size=1, local_ranks=1)
        first = pb.SessionRequest(id=1, propose=request).SerializeToString()
        call.send_data(grpc_message(first))
        chunk = grpc_message(b"\x00" * 1000)
        sent = 0
        # The sidecar must stop granting room: feed it for 2 s, or until it
        # granted more than the bound (the failure).
        end = time.monotonic() + 2.0
        try:
            while time.monotonic() < end and sent <= 4 * 16384:
                sent += await asyncio.to_thread(feed_unread, call, chunk)
        finally:
            call.close()
        # One window, and the one gRPC opens again as it reads the first message.
        assert 0 < sent <= 2 * 16384 + len(chunk), sent


async def test_the_rank_beside_a_session_that_never_reads_is_answered(tmp_path: Path) -> None:
    """Rank 1 proposes on a zero-window Session stream (its answer can never
    go out); rank 0's proposal closes the round and rank 0 is answered, and
    so are later calls: the stuck stream holds up only itself."""
    async with (
        running_server(make_config(tmp_path)) as server,
        coordinator_stub(server.addresses.listen[0]) as stub,
    ):
        group = "beside/ep2"
        host, port = server.addresses.listen[1].rsplit(":", 1)
        call = open_call(
            (host, int(port)), "/moe_workspace.v1.WorkspaceCoordinator/Session", None, window=0
        )
        request = propose_request(1, group=group, ep_size=2, local_ranks=2)
        call.send_data(grpc_message(pb.SessionRequest(id=1, propose=request).SerializeToString()))
        call.keep_acknowledging()
        try:

            async def one_waiting() -> bool:
                try:
                    got = await stub.GetGroup(pb.GetGroupRequest(group=group), timeout=5)
                except grpc.aio.AioRpcError:
                    return False  # not proposed yet
                return bool(got.waiting_ranks == 1)

            deadline = time.monotonic() + 10
            while not await one_waiting():
                assert time.monotonic() < deadline, "rank 1's proposal never arrived"
                await asyncio.sleep(0.02)  # the poll interval of a wait with a deadline
            answer = await stub.Propose(
                propose_request(0, group=group, ep_size=2, local_ranks=2), timeout=10
            )
            assert answer.action == pb.ACTION_BUILD
            other = await run_round(stub, 1, NVFP4, group="other/ep2", local_ranks=2)
            assert {a.action for a in other} == {pb.ACTION_BUILD}
            assert call.data_received == 0
        finally:
            call.close()
