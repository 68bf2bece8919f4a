"""Attacks on the sidecar's listeners, shutdown and overload answers, each
against a real sidecar: ``python -m moe_sidecar`` where its memory, its exit
or its own event loop matter, a server on real sockets otherwise.

Counts are scaled down from the attacks they stand for (1,000 idle
connections per port instead of 20,000; ``bench/bench_connection_flood.py``
runs the full count) so that each test stays well inside its timeout on two
loaded cores. Loopback addresses only. Run them alone with ``pytest -m attack``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import resource
import signal
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import psutil  # type: ignore[import-untyped]
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from moe_sidecar.server import running_server
from moe_sidecar.servicer import SHUTDOWN_DETAILS
from moe_workspace.v1 import coordinator_pb2 as pb
from moe_workspace.v1 import coordinator_pb2_grpc as pb_grpc
from tests.integration.helpers import (
    coordinator_stub,
    details,
    make_config,
    propose_request,
    rpc_error,
    start_sidecar_process,
    stop_process,
    wait_for_serving_record,
)

pytestmark = [pytest.mark.attack, pytest.mark.timeout(90)]

EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
HTTP2_HELLO = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
"""An HTTP/2 client's connection preface and an empty SETTINGS frame: what an
idle gRPC connection sends before it goes quiet."""
FLOOD = 1000
"""Idle connections per attacked port (the attack used 12,000-20,000)."""
CAP = 32
"""The connection cap of the attacked port in these tests."""
IDLE_S = 3.0
"""The idle timeout of the attacked sidecar in these tests."""
SIDECAR_PER_CONNECTION_BYTES = 20 << 10
"""What a held idle HTTP/2 connection costs the sidecar at most (measured:
13-19 KiB)."""
HUGE = "g" * 100_000


# --- helpers ------------------------------------------------------------------------


def _raise_open_files_limit(needed: int) -> None:
    """Raises this process's soft limit of open files towards the hard one.

    Raises:
        pytest.skip.Exception: the hard limit is below ``needed``.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < needed:
        pytest.skip(f"the hard limit of open files is {hard}; this test needs {needed}")
    if soft != resource.RLIM_INFINITY and soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _closed_by_peer(connection: socket.socket) -> bool:
    """Whether the sidecar closed ``connection`` (whatever it sent first is read)."""
    try:
        while connection.recv(65536):
            pass
    except BlockingIOError:
        return False
    except ConnectionError:
        return True
    return True


def _flood(connect: Callable[[], socket.socket], count: int, hello: bytes) -> list[socket.socket]:
    """``count`` connections that send ``hello`` and then nothing."""
    connections = []
    for _ in range(count):
        connection = connect()
        if hello:
            with contextlib.suppress(ConnectionError):  # closed already: refused
                connection.sendall(hello)
        connection.setblocking(False)
        connections.append(connection)
    return connections


def _wait_closed(connections: list[socket.socket], at_least: int, within: float) -> int:
    """Waits until the sidecar closed ``at_least`` of ``connections``; returns how many."""
    deadline = time.monotonic() + within
    closed = [False] * len(connections)
    while True:
        for i, connection in enumerate(connections):
            closed[i] = closed[i] or _closed_by_peer(connection)
        if sum(closed) >= at_least or time.monotonic() > deadline:
            return sum(closed)
        time.sleep(0.05)  # the poll interval of a wait with a deadline


def _scrape(port: int, timeout: float = 5.0) -> str:
    """The metrics endpoint's page (an HTTP GET on a plain socket).

    Raises:
        AssertionError: the endpoint answered anything but 200.
        OSError: the connection failed or was closed before an answer.
    """
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as connection:
        connection.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        received = b""
        while chunk := connection.recv(65536):
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    return body.decode()


def _sample(text: str, series: str) -> float:
    """The value of ``series`` (name and labels, as exported) in a scrape."""
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{series} not exported")


@contextlib.contextmanager
def _sidecar(tmp_path: Path, *flags: str) -> Iterator[dict[str, Any]]:
    """``python -m moe_sidecar`` on a Unix socket, a loopback TCP port, a
    health port and a metrics port; yields them and its process."""
    socket_path = tmp_path / "s.sock"
    log = tmp_path / "sidecar.log"
    process = start_sidecar_process(
        log,
        *("--listen", f"unix://{socket_path}", "--listen", "127.0.0.1:0"),
        *("--state-dir", str(tmp_path / "state")),
        *("--health-port", "auto", "--metrics-port", "auto"),
        *flags,
    )
    try:
        serving = wait_for_serving_record(process, log)
        tcp_target = serving["listen"][1]
        assert tcp_target.startswith("127.0.0.1:"), serving
        ports = {
            "tcp": int(tcp_target.rpartition(":")[2]),
            "health": serving["health_port"],
            "metrics": serving["metrics_port"],
        }
        yield {**ports, "unix": socket_path, "process": process, "log": log}
    finally:
        stop_process(process)


def _connector(sidecar: dict[str, Any], port: str) -> Callable[[], socket.socket]:
    if port == "unix":

        def unix() -> socket.socket:
            connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            connection.connect(str(sidecar["unix"]))
            return connection

        return unix
    return lambda: socket.create_connection(("127.0.0.1", sidecar[port]), timeout=5)


def _health_check(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5
        )
        return int(reply.status)


# --- idle connections: every listener capped, idle ones closed ----------------------


@pytest.mark.parametrize("port", ["tcp", "unix", "health"])
@pytest.mark.parametrize("hello", [HTTP2_HELLO, b""], ids=["http2", "silent"])
def test_idle_connections_are_capped_per_listener_and_closed_when_idle(
    tmp_path: Path, port: str, hello: bytes
) -> None:
    """1,000 idle connections to one gRPC port: at most the cap is held (the
    rest closed as they arrive), the held ones are closed once idle, the
    sidecar's memory grows by at most the cap's worth, and the port serves
    again afterwards while the other ports served throughout."""
    _raise_open_files_limit(FLOOD + 256)
    with _sidecar(
        tmp_path,
        *("--max-listener-connections", str(CAP), "--max-health-connections", str(CAP)),
        *("--idle-connection-timeout", str(IDLE_S)),
    ) as sidecar:
        process = psutil.Process(sidecar["process"].pid)
        before = process.memory_info().rss
        idle = _flood(_connector(sidecar, port), FLOOD, hello)
        try:
            closed = _wait_closed(idle, FLOOD - CAP, within=10)
            assert closed >= FLOOD - CAP, f"{closed} of {FLOOD} closed; the cap is {CAP}"
            grown = process.memory_info().rss - before
            assert grown < CAP * SIDECAR_PER_CONNECTION_BYTES + (8 << 20), grown
            # The other ports are bounded apart: they serve during the flood.
            other = "health" if port != "health" else "tcp"
            if other == "health":
                assert _health_check(sidecar["health"]) == health_pb2.HealthCheckResponse.SERVING
            else:
                with grpc.insecure_channel(f"127.0.0.1:{sidecar['tcp']}") as channel:
                    pb_grpc.WorkspaceCoordinatorStub(channel).ListGroups(
                        pb.ListGroupsRequest(), timeout=5
                    )
            assert _scrape(sidecar["metrics"])
            closed = _wait_closed(idle, FLOOD, within=IDLE_S + 10)
            assert closed == FLOOD, f"{FLOOD - closed} idle connections still open"
        finally:
            for connection in idle:
                connection.close()
        if port == "health":
            assert _health_check(sidecar["health"]) == health_pb2.HealthCheckResponse.SERVING
        else:
            target = f"unix://{sidecar['unix']}" if port == "unix" else f"127.0.0.1:{sidecar[port]}"
            with grpc.insecure_channel(target) as channel:
                pb_grpc.WorkspaceCoordinatorStub(channel).ListGroups(
                    pb.ListGroupsRequest(), timeout=5
                )
        assert sidecar["process"].poll() is None


async def test_a_session_stream_outlives_the_idle_timeout(tmp_path: Path) -> None:
    """A rank's Session stream is a call in flight: its connection stays open
    past --idle-connection-timeout (an idle socket opened beside it is closed
    meanwhile), and its next message is answered."""
    async with running_server(make_config(tmp_path, idle_connection_timeout=1.0)) as server:
        target = server.addresses.listen[1]
        async with coordinator_stub(target) as stub:
            first = propose_request(0, group="rank/ep1", ep_size=1, local_ranks=1)
            call, outbox = await _session(stub, first)
            assert (await call.read()).WhichOneof("result") == "decision"
            host, _, port = target.rpartition(":")
            beside = _flood(lambda: socket.create_connection((host, int(port))), 1, HTTP2_HELLO)
            try:
                closed = await asyncio.to_thread(_wait_closed, beside, 1, 10.0)
                assert closed == 1, "the idle socket beside the session was not closed"
            finally:
                beside[0].close()
            second = propose_request(0, 2, group="rank/ep1", ep_size=1, local_ranks=1)
            await outbox.put(pb.SessionRequest(id=2, propose=second))
            answer = await asyncio.wait_for(call.read(), 5)
            assert (answer.id, answer.WhichOneof("result")) == (2, "decision"), answer
            await outbox.put(None)


def test_every_listener_bound_is_exported_as_a_limit(tmp_path: Path) -> None:
    """Each listener bound is a flag and a ``moe_sidecar_limit`` series."""
    with _sidecar(
        tmp_path,
        *("--max-listener-connections", "11", "--max-health-connections", "12"),
        *("--max-metrics-connections", "13", "--max-queued-rpcs", "14"),
        *("--idle-connection-timeout", "15", "--metrics-request-timeout", "16"),
        *("--max-merged-groups", "17"),
    ) as sidecar:
        text = _scrape(sidecar["metrics"])
    exported = {
        resource: _sample(text, f'moe_sidecar_limit{{resource="{resource}"}}')
        for resource in (
            "listener_connections",
            "health_connections",
            "metrics_connections",
            "queued_rpcs",
            "idle_connection_seconds",
            "metrics_request_seconds",
            "merged_groups",
        )
    }
    assert list(exported.values()) == [11, 12, 13, 14, 15, 16, 17], exported


# --- metrics: idle sockets cannot keep scrapes out ----------------------------------


def test_metrics_scrapes_are_answered_while_idle_sockets_hold_every_slot(tmp_path: Path) -> None:
    """Idle sockets holding every metrics slot (and reopened as they are
    closed) do not keep scrapes out: each scrape takes the slot of the socket
    idle longest, and every one of 30 is answered."""
    slots = 4
    with _sidecar(tmp_path, "--max-metrics-connections", str(slots)) as sidecar:
        connect = _connector(sidecar, "metrics")
        idle = _flood(connect, 4 * slots, b"")
        answered = 0
        try:
            for _ in range(30):
                idle.extend(_flood(connect, slots, b""))  # the slots full again
                with contextlib.suppress(OSError, AssertionError):
                    _scrape(sidecar["metrics"], timeout=3)
                    answered += 1
            text = _scrape(sidecar["metrics"])
        finally:
            for connection in idle:
                connection.close()
    assert answered == 30, f"{answered} of 30 scrapes answered"
    refused = _sample(text, 'moe_sidecar_limit_refusals_total{resource="metrics_connections"}')
    assert refused >= len(idle) - slots


# --- shutdown: connected Session ranks do not hold it -------------------------------


async def _session(stub: Any, request: pb.ProposeRequest) -> tuple[Any, asyncio.Queue[Any]]:
    """A Session stream that sends ``request`` and then whatever is put on the queue."""
    outbox: asyncio.Queue[Any] = asyncio.Queue()

    async def messages() -> AsyncIterator[pb.SessionRequest]:
        yield pb.SessionRequest(id=1, propose=request)
        while (message := await outbox.get()) is not None:
            yield message

    return stub.Session(messages()), outbox


def test_sigterm_with_connected_session_ranks_exits_well_inside_the_grace_period(
    tmp_path: Path,
) -> None:
    """SIGTERM while Session ranks are connected (two idle after their round,
    one waiting in a round): every stream ends at once (the waiting rank told
    UNAVAILABLE, each stream UNAVAILABLE saying the sidecar shuts down) and
    the sidecar exits 0 in a fraction of its grace period, not at its end."""
    grace = 10.0
    with _sidecar(tmp_path, "--grace-period", str(grace)) as sidecar:

        async def attack() -> tuple[float, list[tuple[str, str]]]:
            async with coordinator_stub(f"127.0.0.1:{sidecar['tcp']}") as stub:
                idle = [
                    await _session(
                        stub,
                        propose_request(0, group=f"idle/{i}", ep_size=1, local_ranks=1),
                    )
                    for i in range(2)
                ]
                for call, _ in idle:
                    assert (await call.read()).WhichOneof("result") == "decision"
                waiting, _ = await _session(
                    stub, propose_request(0, group="waiting/ep2", ep_size=2, local_ranks=2)
                )

                async def waiting_in_round() -> bool:
                    try:
                        group = await stub.GetGroup(pb.GetGroupRequest(group="waiting/ep2"))
                    except grpc.aio.AioRpcError as error:
                        # The session's first message may not have reached the sidecar yet.
                        if error.code() is grpc.StatusCode.NOT_FOUND:
                            return False
                        raise
                    return bool(group.waiting_ranks)

                deadline = time.monotonic() + 10
                while not await waiting_in_round():
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.02)  # the poll interval of a wait with a deadline
                started = time.monotonic()
                sidecar["process"].send_signal(signal.SIGTERM)
                answers = []
                for call in (*(c for c, _ in idle), waiting):
                    messages: list[Any] = []
                    error = await rpc_error(_drain(call, messages))
                    answers.append((error.code().name, details(error)))
                    if call is waiting:
                        assert [m.error.code for m in messages] == ["UNAVAILABLE"], messages
                return started, answers

        started, answers = asyncio.run(attack())
        assert answers == [("UNAVAILABLE", SHUTDOWN_DETAILS)] * 3, answers
        code = sidecar["process"].wait(timeout=grace)
        exited = time.monotonic() - started
        assert code == 0, sidecar["log"].read_text()
        assert exited < grace / 4, f"exited {exited:.2f} s after SIGTERM; the grace is {grace} s"


async def _drain(call: Any, into: list[Any]) -> None:
    """Reads ``call`` to its end, keeping its messages."""
    while (message := await call.read()) is not grpc.aio.EOF:
        into.append(message)


# --- overload: RESOURCE_EXHAUSTED, never CANCELLED ----------------------------------


def test_a_burst_of_4000_new_streams_is_answered_resource_exhausted(tmp_path: Path) -> None:
    """4,000 Watch streams opened at once over 16 connections (the watcher
    limit is 8): every one beyond the limit is RESOURCE_EXHAUSTED naming it,
    none CANCELLED (gRPC's own queue of calls not yet started cancelled 5-17%
    of such a burst)."""
    streams, connections, watchers = 4000, 16, 8
    with _sidecar(tmp_path, "--max-watchers", str(watchers)) as sidecar:

        async def burst() -> tuple[collections.Counter[str], set[str]]:
            channels = [
                # A subchannel each: one connection per channel.
                grpc.aio.insecure_channel(
                    f"127.0.0.1:{sidecar['tcp']}", options=(("grpc.use_local_subchannel_pool", 1),)
                )
                for _ in range(connections)
            ]
            for channel in channels:
                await asyncio.wait_for(channel.channel_ready(), 10)
            stubs = [pb_grpc.WorkspaceCoordinatorStub(channel) for channel in channels]
            calls = [stubs[i % connections].Watch(pb.WatchRequest()) for i in range(streams)]
            reads = [asyncio.ensure_future(call.read()) for call in calls]
            codes: collections.Counter[str] = collections.Counter()
            messages: set[str] = set()
            pending = set(reads)
            deadline = time.monotonic() + 60
            while len(pending) > watchers and time.monotonic() < deadline:
                _, pending = await asyncio.wait(pending, timeout=1)
            for call in calls:
                call.cancel()
            for read in reads:
                if read in pending:
                    codes["open"] += 1
                    continue
                error = read.exception()
                assert isinstance(error, grpc.aio.AioRpcError), read
                codes[error.code().name] += 1
                messages.add(details(error))
            await asyncio.gather(*reads, return_exceptions=True)
            for channel in channels:
                await channel.close()
            return codes, messages

        codes, messages = asyncio.run(burst())
    assert codes == {"RESOURCE_EXHAUSTED": streams - watchers, "open": watchers}, codes
    assert messages == {f"{watchers} Watch streams are open; --max-watchers is {watchers}"}


# --- sessions: a refused first message binds nothing; names quoted short ------------


async def _answers(stub: Any, messages: list[pb.SessionRequest]) -> list[pb.SessionResponse]:
    """The answers of one Session stream carrying ``messages`` (then closed)."""
    return [answer async for answer in stub.Session(iter(messages))]


async def test_a_refused_first_session_message_leaves_the_session_unbound(tmp_path: Path) -> None:
    """A first message that is refused (a rank beyond its group) binds the
    session to nothing: the next one, for another rank and group, is
    answered as a first message would be."""
    async with (
        running_server(make_config(tmp_path)) as server,
        coordinator_stub(server.addresses.listen[0]) as stub,
    ):
        refused = propose_request(5, group="claimed/ep2", ep_size=2, local_ranks=2)
        real = propose_request(0, group="real/ep1", ep_size=1, local_ranks=1)
        answers = await _answers(
            stub,
            [pb.SessionRequest(id=1, propose=refused), pb.SessionRequest(id=2, propose=real)],
        )
        assert answers[0].error.code == "INVALID_ARGUMENT", answers[0]
        assert answers[1].WhichOneof("result") == "decision", answers[1]
        groups = await stub.ListGroups(pb.ListGroupsRequest(), timeout=5)
        assert [g.name for g in groups.groups] == ["real/ep1"]


async def test_errors_quote_huge_names_shortened(tmp_path: Path) -> None:
    """A 100,000-character group name is never echoed whole: every answer
    quoting it (of a session, and of every method taking a group) cuts it
    with an ellipsis or names its length."""
    async with (
        running_server(make_config(tmp_path, enable_admin=True)) as server,
        coordinator_stub(server.addresses.listen[0]) as stub,
    ):
        huge = propose_request(0, group=HUGE, ep_size=1, local_ranks=1)
        real = propose_request(0, group="real/ep1", ep_size=1, local_ranks=1)
        answers = await _answers(
            stub,
            [
                pb.SessionRequest(id=1, propose=huge),
                pb.SessionRequest(id=2, propose=real),
                pb.SessionRequest(id=3, propose=huge),
            ],
        )
        quoted = [answer.error.message for answer in answers if answer.HasField("error")]
        calls = [
            stub.Propose(huge, timeout=5),
            stub.GetGroup(pb.GetGroupRequest(group=HUGE), timeout=5),
            stub.ResetGroup(pb.ResetGroupRequest(group=HUGE), timeout=5),
            stub.RemoveGroup(pb.RemoveGroupRequest(group=HUGE), timeout=5),
            stub.Watch(pb.WatchRequest(group=HUGE)).read(),
        ]
        for call in calls:
            quoted.append(details(await rpc_error(call)))
    assert all(len(message) < 400 for message in quoted), [len(m) for m in quoted]
    assert len(quoted) == 7, quoted
    assert all("100000 characters" in message for message in quoted), quoted
    assert "\u2026 (100000 characters)" in quoted[1], quoted[1]
