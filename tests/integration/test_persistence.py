"""State survives a stop and a start, and a ``kill -9`` of a server process."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
from pathlib import Path

import pytest

from moe_sidecar.server import running_server
from moe_sidecar.store.sqlite import DATABASE_FILE, StoreError
from moe_workspace.v1 import coordinator_pb2 as pb
from tests.integration.helpers import (
    BF16,
    NVFP4,
    coordinator_stub,
    grow_and_commit,
    make_config,
    propose_request,
    run_round,
    start_sidecar_process,
    stop_process,
    wait_until_serving,
    workspace_bytes,
)

pytestmark = pytest.mark.timeout(60)

GROUP = "model/ep2"


async def _grow_and_commit(target: str) -> tuple[pb.Group, list[pb.ProposeResponse]]:
    async with coordinator_stub(target) as stub:
        second = await grow_and_commit(stub, GROUP, build_seconds=0.25)
        group = await stub.GetGroup(pb.GetGroupRequest(group=GROUP), timeout=5)
        return group, second


async def _check_restored(
    target: str, before: pb.Group, answered: list[pb.ProposeResponse]
) -> None:
    async with coordinator_stub(target) as stub:
        after = await stub.GetGroup(pb.GetGroupRequest(group=GROUP), timeout=5)
        assert after.plan == before.plan
        assert (
            after.plan.workspace_bytes == workspace_bytes(BF16.capacities, 2)
            and after.plan.generation == 2
        )
        assert list(after.history) == list(before.history)
        assert [(h.plan.generation, h.layer) for h in after.history] == [(1, "l0"), (2, "mtp")]
        rank0 = next(r for r in after.ranks if r.ep_rank == 0)
        assert rank0.committed_generation == 2 and rank0.last_build_seconds == 0.25
        # A rank that missed the answer of round 2 retries and gets it exactly.
        retry = await stub.Propose(
            propose_request(1, 2, BF16, group=GROUP, ep_size=2, local_ranks=2, lifetime="life-1"),
            timeout=5,
        )
        assert retry == answered[1]
        # A restarted inference server starts from the stored union: one build.
        restarted = await run_round(stub, 1, NVFP4, group=GROUP, local_ranks=2, lifetime="b")
        assert {r.action for r in restarted} == {pb.ACTION_BUILD}
        assert {r.plan.workspace_bytes for r in restarted} == {workspace_bytes(BF16.capacities, 2)}
        assert {r.plan.generation for r in restarted} == {2}


async def test_state_survives_stop_and_start(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    async with running_server(config) as server:
        before, answered = await _grow_and_commit(server.addresses.listen[0])
    async with running_server(config) as server:
        await _check_restored(server.addresses.listen[1], before, answered)


def _start_sidecar_process(
    tmp_path: Path, socket_target: str, state_dir: Path
) -> subprocess.Popen[bytes]:
    """``python -m moe_sidecar`` in a subprocess, returned once it reports SERVING."""
    log = tmp_path / "sidecar.stderr"
    process = start_sidecar_process(
        log,
        "--listen",
        socket_target,
        "--state-dir",
        str(state_dir),
        "--health-port",
        "0",
        "--metrics-port",
        "0",
        "--round-timeout",
        "10",
    )
    try:
        wait_until_serving(socket_target, process, log)
    except BaseException:
        stop_process(process)
        raise
    return process


def _kill_9(process: subprocess.Popen[bytes]) -> int:
    os.kill(process.pid, signal.SIGKILL)
    return process.wait(timeout=10)


async def test_state_survives_kill_9_of_the_server_process(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    socket_path = tmp_path / "sidecar.sock"
    socket_target = f"unix://{socket_path}"
    process = await asyncio.to_thread(
        _start_sidecar_process, tmp_path, socket_target, config.state_dir
    )
    try:
        before, answered = await _grow_and_commit(socket_target)
    finally:
        returncode = await asyncio.to_thread(_kill_9, process)
    assert returncode == -signal.SIGKILL
    # The dead process left its socket file behind; the new server replaces it.
    assert await asyncio.to_thread(socket_path.exists)
    async with running_server(config) as server:
        await _check_restored(server.addresses.listen[0], before, answered)


async def test_a_second_server_on_the_same_state_dir_is_refused(tmp_path: Path) -> None:
    async with running_server(make_config(tmp_path)):
        other = make_config(tmp_path, listen=(f"unix://{tmp_path}/other.sock",))
        with pytest.raises(StoreError, match="in use by another moe-sidecar"):
            async with running_server(other):
                pass


def _overwrite_with_garbage(database: Path) -> None:
    database.write_bytes(b"this is not sqlite" * 100)
    for suffix in ("-wal", "-shm"):
        Path(f"{database}{suffix}").unlink(missing_ok=True)


async def test_corrupt_state_is_a_clear_error_at_start(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    async with running_server(config) as server:
        await _grow_and_commit(server.addresses.listen[0])
    with sqlite3.connect(config.state_dir / DATABASE_FILE) as db:
        db.execute("UPDATE groups SET state = '{\"name\": 1}'")
    with pytest.raises(StoreError, match=r"group 'model/ep2' is corrupt"):
        async with running_server(config):
            pass
    await asyncio.to_thread(_overwrite_with_garbage, config.state_dir / DATABASE_FILE)
    with pytest.raises(StoreError, match="not a usable SQLite database"):
        async with running_server(config):
            pass
