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

from moe_sidecar.server import SOCKET_MODE, StartupError, running_server
from moe_workspace.v1 import coordinator_pb2 as pb
from tests.integration.helpers import coordinator_stub, make_config, propose_request, rpc_error

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
            await asyncio.sleep(0.02)
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
        with pytest.raises(StartupError, match="already serves"):
            async with running_server(other):
                pass
        async with coordinator_stub(server.addresses.listen[0]) as stub:
            await stub.ListGroups(pb.ListGroupsRequest(), timeout=5)


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
        with pytest.raises(StartupError, match="cannot listen"):
            async with running_server(other):
                pass


def test_sigterm_drains_the_cli_server(tmp_path: Path) -> None:
    sock = tmp_path / "s.sock"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "moe_sidecar",
            "--listen",
            f"unix://{sock}",
            "--state-dir",
            str(tmp_path / "state"),
            "--health-port",
            "0",
            "--metrics-port",
            "0",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={k: v for k, v in os.environ.items() if not k.startswith("MOE_SIDECAR_")},
    )
    try:
        deadline = time.monotonic() + 20
        while not sock.exists() and time.monotonic() < deadline:
            assert process.poll() is None
            time.sleep(0.05)
        time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=15)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, stderr.decode()
    assert b'"message":"shutdown requested","signal":"SIGTERM"' in stderr
    assert b'"message":"stopped"' in stderr
    assert not sock.exists()


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
