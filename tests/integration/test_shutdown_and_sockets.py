"""Graceful shutdown and the Unix socket's life cycle."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from moe_sidecar.server import SOCKET_MODE, StartupError, running_server
from moe_workspace.v1 import coordinator_pb2 as pb
from moe_workspace.v1 import coordinator_pb2_grpc as pb_grpc
from tests.integration.helpers import (
    coordinator_stub,
    log_records,
    make_config,
    propose_request,
    rpc_error,
    start_sidecar_process,
    stop_process,
    wait_until_serving,
)

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parents[2]


async def test_shutdown_wakes_a_waiting_propose_with_unavailable(tmp_path: Path) -> None:
    config = make_config(tmp_path, grace_period=5.0, round_timeout=60.0)
    async with (
        running_server(config) as server,
        coordinator_stub(server.addresses.listen[0]) as stub,
    ):
        waiting = asyncio.ensure_future(rpc_error(stub.Propose(propose_request(0), timeout=30)))
        watch = stub.Watch(pb.WatchRequest())
        for _ in range(100):
            if server.coordinator.waiting_calls() == 1:
                break
            await asyncio.sleep(0.02)  # the poll interval of a wait with a deadline
        assert server.coordinator.waiting_calls() == 1
        started = time.monotonic()
        await server.stop()
        elapsed = time.monotonic() - started
        error = await asyncio.wait_for(waiting, timeout=5)
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in (error.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as info:  # noqa: PT012
            # It may first deliver the event of the waiting proposal's lifetime.
            for _ in range(3):
                assert await watch.read() is not grpc.aio.EOF
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        # Nothing was left to wait for: the drain did not use the grace period.
        assert elapsed < 2.0
        assert not await asyncio.to_thread((tmp_path / "sidecar.sock").exists)

    # The waiting proposal was kept: its retry rejoins round 1 after a restart.
    async with (
        running_server(config) as server,
        coordinator_stub(server.addresses.listen[0]) as stub,
    ):
        group = await stub.GetGroup(pb.GetGroupRequest(group=propose_request(0).group), timeout=5)
        assert group.open_round == 1 and group.waiting_ranks == 1


async def test_socket_mode_and_stale_socket(tmp_path: Path) -> None:
    path = tmp_path / "run" / "nested" / "sidecar.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path.parent.mkdir(parents=True)
    stale.bind(str(path))
    stale.close()  # bound, never listening: what a killed process leaves behind
    config = make_config(tmp_path, listen=(f"unix://{path}",))
    async with running_server(config) as server:
        assert stat.S_IMODE(path.stat().st_mode) == SOCKET_MODE
        assert stat.S_ISSOCK(path.stat().st_mode)
        # A live socket is not taken over by a second server.
        other = make_config(tmp_path / "b", listen=(f"unix://{path}",))
        with pytest.raises(
            StartupError,
            match=r"address already in use \(another moe-sidecar serves or is starting",
        ):
            async with running_server(other):
                pass
        async with coordinator_stub(server.addresses.listen[0]) as stub:
            await stub.ListGroups(pb.ListGroupsRequest(), timeout=5)


async def test_a_clean_stop_removes_the_socket_and_its_lock_and_a_restart_takes_them(
    tmp_path: Path,
) -> None:
    path = tmp_path / "run" / "sidecar.sock"
    lock = path.with_name("sidecar.sock.lock")
    config = make_config(tmp_path, listen=(f"unix://{path}",))
    for _ in range(2):  # the second start makes both anew
        async with running_server(config):
            assert stat.S_ISSOCK(path.stat().st_mode) and lock.is_file()
            # Held while it serves: a second sidecar on the path is refused.
            with pytest.raises(StartupError, match=r"its lock .* is held"):
                async with running_server(make_config(tmp_path / "b", listen=config.listen)):
                    pass
        assert not path.exists() and not lock.exists()
        assert sorted(p.name for p in path.parent.iterdir()) == []


async def test_a_lock_file_a_killed_sidecar_left_is_taken_by_the_next_start(
    tmp_path: Path,
) -> None:
    path = tmp_path / "sidecar.sock"
    lock = path.with_name("sidecar.sock.lock")
    lock.write_bytes(b"")  # what a SIGKILL leaves: the file, no holder
    async with running_server(make_config(tmp_path, listen=(f"unix://{path}",))):
        assert lock.is_file()
    assert not lock.exists()


async def test_fresh_socket_directory_is_created(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "s.sock"
    async with running_server(make_config(tmp_path, listen=(f"unix://{path}",))):
        assert stat.S_ISSOCK(path.stat().st_mode)


async def test_a_regular_file_is_never_replaced(tmp_path: Path) -> None:
    path = tmp_path / "precious"
    path.write_text("keep me")
    with pytest.raises(StartupError, match="not a socket"):
        async with running_server(make_config(tmp_path, listen=(f"unix://{path}",))):
            pass
    assert path.read_text() == "keep me"


async def test_a_taken_tcp_port_is_refused(tmp_path: Path) -> None:
    async with running_server(make_config(tmp_path)) as server:
        taken = server.addresses.listen[1]
        other = make_config(tmp_path / "b", listen=(taken,))
        with pytest.raises(StartupError, match=r"address already in use .*; give another --listen"):
            async with running_server(other):
                pass


def _serve_in_a_process(tmp_path: Path, *flags: str) -> tuple[subprocess.Popen[bytes], str, Path]:
    """``python -m moe_sidecar`` on a socket in ``tmp_path``, once SERVING: (process, target, log)."""
    target = f"unix://{tmp_path}/s.sock"
    log = tmp_path / "sidecar.log"
    process = start_sidecar_process(
        log,
        "--listen",
        target,
        "--state-dir",
        str(tmp_path / "state"),
        "--health-port",
        "0",
        "--metrics-port",
        "0",
        *flags,
    )
    try:
        wait_until_serving(target, process, log)
    except BaseException:
        stop_process(process)
        raise
    return process, target, log


def _until_waiting_ranks(stub: pb_grpc.WorkspaceCoordinatorStub, group: str, n: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            reply = stub.GetGroup(pb.GetGroupRequest(group=group), timeout=5)
            if reply.waiting_ranks == n:
                return
        except grpc.RpcError as error:
            if not isinstance(error, grpc.Call) or error.code() != grpc.StatusCode.NOT_FOUND:
                raise
        time.sleep(0.02)  # the poll interval of a wait with a deadline
    raise AssertionError(f"group {group!r} never had {n} waiting ranks")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_sigterm_and_sigint_drain_the_cli_server(tmp_path: Path, signum: signal.Signals) -> None:
    process, target, log = _serve_in_a_process(tmp_path, "--round-timeout", "60")
    try:
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.WorkspaceCoordinatorStub(channel)
            waiting = stub.Propose.future(propose_request(0), timeout=30)
            _until_waiting_ranks(stub, propose_request(0).group, 1)
            process.send_signal(signum)
            # Answered at once, not after the round timeout.
            error = waiting.exception(timeout=10)
        process.wait(timeout=15)
    finally:
        stop_process(process)
    assert isinstance(error, grpc.Call)
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "shutting down" in (error.details() or "")
    assert process.returncode == 0, log.read_text()
    messages = [(r["message"], r.get("signal")) for r in log_records(log)]
    assert ("shutdown requested", signum.name) in messages
    assert messages[-1] == ("stopped", None)
    assert not (tmp_path / "s.sock").exists()
    assert not (tmp_path / "s.sock.lock").exists()  # a clean stop leaves nothing beside it


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_second_signal_stops_at_once(tmp_path: Path, signum: signal.Signals) -> None:
    # A grace period far beyond the test's timeout: only the second signal can end it in time.
    process, target, log = _serve_in_a_process(tmp_path, "--grace-period", "600")
    try:
        with grpc.insecure_channel(target) as channel:
            # A stream open on the listener keeps the drain waiting for the grace period.
            hold = health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(service=""), timeout=60
            )
            assert next(hold).status == health_pb2.HealthCheckResponse.SERVING
            process.send_signal(signum)
            # NOT_SERVING: the first signal was handled and the drain began.
            assert next(hold).status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert process.poll() is None
            started = time.monotonic()
            process.send_signal(signum)
            process.wait(timeout=10)
            elapsed = time.monotonic() - started
    finally:
        stop_process(process)
    # Ended by the signal's default action, long before the grace period.
    assert process.returncode == -signum, log.read_text()
    assert elapsed < 5.0
    messages = [r["message"] for r in log_records(log)]
    assert messages.count("shutdown requested") == 1 and "draining" in messages


def test_cli_refuses_a_bad_config(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "moe_sidecar", "--state-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        env={**os.environ, "MOE_SIDECAR_LISTN": "x"},
        timeout=20,
        check=False,
    )
    assert result.returncode == 2
    assert b"MOE_SIDECAR_LISTN" in result.stderr
