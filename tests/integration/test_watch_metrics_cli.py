"""What operators see: Watch events, the metrics endpoint, ``moe-sidecar groups``."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client import REGISTRY, generate_latest

from moe_sidecar import cli
from moe_sidecar.server import RunningServer, StartupError, running_server, start_server
from moe_sidecar.wire.display import format_bytes
from moe_workspace.v1 import coordinator_pb2 as pb
from tests.integration.helpers import (
    BF16,
    NVFP4,
    coordinator_stub,
    details,
    grow_and_commit,
    make_config,
    propose_request,
    rpc_error,
    workspace_bytes,
)

pytestmark = pytest.mark.timeout(30)

GROUP = "model/ep2"
NVFP4_AT_EP2 = workspace_bytes(NVFP4.capacities, 2)
BF16_AT_EP2 = workspace_bytes(BF16.capacities, 2)


def _request(rank: int, rnd: int, requirement: pb.Requirement, **kw: Any) -> pb.ProposeRequest:
    return propose_request(rank, rnd, requirement, group=GROUP, ep_size=2, local_ranks=2, **kw)


async def _until_watching(server: RunningServer, n: int) -> None:
    for _ in range(250):
        if server.coordinator.watcher_count() == n:
            return
        await asyncio.sleep(0.02)  # the poll interval of a wait with a deadline
    raise AssertionError(f"{n} watch streams never subscribed")


async def _drive(server: RunningServer) -> None:
    """Round 1 (build), round 2 (rebuild), a commit, a NOT_FOUND, a timeout."""
    async with coordinator_stub(server.addresses.listen[0]) as stub:
        await grow_and_commit(stub, GROUP, build_seconds=0.5)
        await rpc_error(stub.GetGroup(pb.GetGroupRequest(group="nope"), timeout=5))
        error = await rpc_error(stub.Propose(_request(0, 3, BF16), timeout=5))
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED


async def test_watch_streams_group_events(tmp_path: Path) -> None:
    async with (
        running_server(make_config(tmp_path, round_timeout=0.3)) as server,
        coordinator_stub(server.addresses.listen[1]) as stub,
    ):
        missing = await rpc_error(stub.Watch(pb.WatchRequest(group="nope")).read())
        assert missing.code() == grpc.StatusCode.NOT_FOUND
        everything = stub.Watch(pb.WatchRequest())
        await _until_watching(server, 1)
        await _drive(server)
        events = [await asyncio.wait_for(everything.read(), 5) for _ in range(5)]
        assert [e.kind for e in events] == [
            pb.EVENT_KIND_LIFETIME_STARTED,
            pb.EVENT_KIND_ROUND_DECIDED,
            pb.EVENT_KIND_ROUND_DECIDED,
            pb.EVENT_KIND_COMMIT,
            pb.EVENT_KIND_RANK_TIMEOUT,
        ]
        decided = [e for e in events if e.kind == pb.EVENT_KIND_ROUND_DECIDED]
        assert [(e.round, e.action, e.plan.generation, e.layer) for e in decided] == [
            (1, pb.ACTION_BUILD, 1, "l0"),
            (2, pb.ACTION_REBUILD, 2, "mtp"),
        ]
        commit = next(e for e in events if e.kind == pb.EVENT_KIND_COMMIT)
        assert commit.ep_rank == 0 and commit.plan.generation == 2
        timeout = next(e for e in events if e.kind == pb.EVENT_KIND_RANK_TIMEOUT)
        assert timeout.round == 3 and list(timeout.missing_ranks) == [1]
        assert "rank 1 (last reported round 2, layer 'mtp')" in timeout.message
        assert all(e.group == GROUP and e.time.seconds > 0 for e in events)

        # A watcher of one group sees that group only.
        only = stub.Watch(pb.WatchRequest(group=GROUP))
        await _until_watching(server, 2)
        await stub.Propose(
            propose_request(0, group="other/ep1", ep_size=1, local_ranks=1), timeout=5
        )
        await asyncio.gather(*(stub.Propose(_request(r, 4, BF16), timeout=5) for r in range(2)))
        event = await asyncio.wait_for(only.read(), 5)
        assert event.group == GROUP and event.round == 4
        everything.cancel()
        only.cancel()


async def test_watch_streams_refused_aborted_and_reset_events(tmp_path: Path) -> None:
    config = make_config(tmp_path, enable_admin=True)
    async with (
        running_server(config) as server,
        coordinator_stub(server.addresses.listen[0]) as stub,
    ):
        watch = stub.Watch(pb.WatchRequest())  # the group does not exist yet
        await _until_watching(server, 1)
        await asyncio.gather(*(stub.Propose(_request(r, 1, NVFP4), timeout=5) for r in range(2)))
        # Round 2: a layer with another top_k is refused for both ranks.
        odd = pb.Requirement(capacities=NVFP4.capacities, layer="odd")
        odd.capacities.top_k = 4
        refused = await asyncio.gather(
            *(rpc_error(stub.Propose(_request(r, 2, odd), timeout=5)) for r in range(2))
        )
        assert {e.code() for e in refused} == {grpc.StatusCode.FAILED_PRECONDITION}
        # Round 3: rank 0 waits; rank 1 restarts (a new lifetime), which waits
        # for the rest of the restart and abandons nothing yet.
        waiting = asyncio.ensure_future(rpc_error(stub.Propose(_request(0, 3, BF16), timeout=5)))
        await _until_waiting_calls(server, 1)
        restarted = asyncio.ensure_future(
            stub.Propose(_request(1, 1, NVFP4, lifetime="restarted-1"), timeout=5)
        )
        await _until_waiting_calls(server, 2)
        assert not waiting.done()
        # Rank 0 restarts too: the old lifetime ends (round 3 ABORTED) and
        # round 1 of the new lifetime is decided.
        await stub.Propose(_request(0, 1, NVFP4, lifetime="restarted-0"), timeout=5)
        aborted = await asyncio.wait_for(waiting, 5)
        assert aborted.code() == grpc.StatusCode.ABORTED
        await restarted
        await stub.ResetGroup(pb.ResetGroupRequest(group=GROUP), timeout=5)
        events = [await asyncio.wait_for(watch.read(), 5) for _ in range(7)]
        watch.cancel()
    assert [e.kind for e in events] == [
        pb.EVENT_KIND_LIFETIME_STARTED,
        pb.EVENT_KIND_ROUND_DECIDED,
        pb.EVENT_KIND_ROUND_REFUSED,
        pb.EVENT_KIND_ROUND_ABORTED,
        pb.EVENT_KIND_LIFETIME_STARTED,
        pb.EVENT_KIND_ROUND_DECIDED,
        pb.EVENT_KIND_RESET,
    ]
    refusal, abort, reset = events[2], events[3], events[6]
    assert (refusal.round, refusal.layer) == (2, "odd")
    assert "top_k=4" in refusal.message and "'l0'" in refusal.message
    assert (abort.round, abort.ep_rank) == (3, -1)
    assert "the group restarted" in abort.message and abort.message in details(aborted)
    assert "stored plan forgotten" in reset.message
    assert all(e.group == GROUP and e.time.seconds > 0 for e in events)


async def _until_waiting_calls(server: RunningServer, n: int) -> None:
    for _ in range(250):
        if server.coordinator.waiting_calls() == n:
            return
        await asyncio.sleep(0.02)  # the poll interval of a wait with a deadline
    raise AssertionError(f"never {n} waiting Propose calls")


async def test_metrics_endpoint(tmp_path: Path) -> None:
    async with running_server(make_config(tmp_path, round_timeout=0.3)) as server:
        await _drive(server)
        url = f"http://127.0.0.1:{server.addresses.metrics_port}/metrics"
        text = await asyncio.to_thread(
            lambda: urllib.request.urlopen(url, timeout=5).read().decode()
        )
    samples = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert samples[f'moe_sidecar_rounds_total{{action="build",group="{GROUP}"}}'] == 1
    assert samples[f'moe_sidecar_rounds_total{{action="rebuild",group="{GROUP}"}}'] == 1
    assert samples[f'moe_sidecar_rounds_total{{action="timed_out",group="{GROUP}"}}'] == 1
    assert samples[f'moe_sidecar_rebuilds_total{{group="{GROUP}"}}'] == 1
    assert samples[f'moe_sidecar_workspace_bytes{{group="{GROUP}"}}'] == BF16_AT_EP2
    assert samples[f'moe_sidecar_waiting_ranks{{group="{GROUP}"}}'] == 0
    assert samples["moe_sidecar_groups"] == 1
    assert samples['moe_sidecar_errors_total{code="NOT_FOUND"}'] == 1
    assert samples['moe_sidecar_errors_total{code="DEADLINE_EXCEEDED"}'] == 1
    # Every closed round: two decided, one timed out.
    assert samples["moe_sidecar_round_latency_seconds_count"] == 3


async def test_metrics_endpoint_stops_with_the_server(tmp_path: Path) -> None:
    async with running_server(make_config(tmp_path)) as server:
        url = f"http://127.0.0.1:{server.addresses.metrics_port}/metrics"
        await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())
    with pytest.raises(OSError):
        await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=2).read())


async def test_metrics_endpoint_exports_only_the_sidecars_series(tmp_path: Path) -> None:
    # This process's global registry has process_* and python_* series; the
    # endpoint must not show them.
    assert "python_info" in generate_latest(REGISTRY).decode()
    async with running_server(make_config(tmp_path, round_timeout=0.3)) as server:
        await _drive(server)
        url = f"http://127.0.0.1:{server.addresses.metrics_port}/metrics"
        text = await asyncio.to_thread(
            lambda: urllib.request.urlopen(url, timeout=5).read().decode()
        )
    names = {
        line.split()[2] if line.startswith("#") else re.split(r"[{ ]", line, maxsplit=1)[0]
        for line in text.splitlines()
        if line
    }
    assert "moe_sidecar_rounds_total" in names
    assert {name for name in names if not name.startswith("moe_sidecar_")} == set()


async def test_groups_command_text_and_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with running_server(make_config(tmp_path, round_timeout=0.3)) as server:
        await _drive(server)
        target = server.addresses.listen[0]
        assert await asyncio.to_thread(cli.main, ["groups", "--target", target]) == 0
        text = capsys.readouterr().out
        assert await asyncio.to_thread(cli.main, ["groups", "--target", target, "--json"]) == 0
        document = json.loads(capsys.readouterr().out)
    assert f"group {GROUP}" in text
    big, small = format_bytes(BF16_AT_EP2), format_bytes(NVFP4_AT_EP2)
    assert f"plan: {big} per rank ({BF16_AT_EP2} B), max_tokens=256, dispatch=400 B/token" in text
    assert "epoch 0, generation 2" in text
    assert f"generation 1: {small} ({NVFP4_AT_EP2} B), max_tokens=256, caused by layer 'l0'" in text
    assert f"generation 2: {big} ({BF16_AT_EP2} B), max_tokens=256, caused by layer 'mtp'" in text
    rank_lines = [line.split() for line in text.splitlines() if line.startswith("       ")]
    assert [row[:6] for row in rank_lines] == [
        ["0", "yes", "3", "mtp", "2", "0.500"],
        ["1", "yes", "2", "mtp", "0", "0.000"],
    ]
    [group] = document
    assert group["name"] == GROUP and group["generation"] == 2
    assert group["plan"]["workspace_bytes"] == BF16_AT_EP2 and group["plan"]["workspace"] == big
    assert group["plan"]["capacities"]["dispatch_bytes_per_token"] == 400
    assert [(h["generation"], h["layer"]) for h in group["history"]] == [(1, "l0"), (2, "mtp")]
    assert [(r["ep_rank"], r["last_round"], r["committed_generation"]) for r in group["ranks"]] == [
        (0, 3, 2),
        (1, 2, 0),
    ]


def test_groups_command_reports_an_unreachable_sidecar(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.main(["groups", "--target", f"unix://{tmp_path}/none.sock", "--timeout", "0.5"])
    assert code == 1
    assert "UNAVAILABLE" in capsys.readouterr().err


async def _one_group(server: RunningServer, name: str) -> None:
    async with coordinator_stub(server.addresses.listen[0]) as stub:
        await stub.Propose(propose_request(0, group=name, ep_size=1, local_ranks=1), timeout=5)


async def _groups_listed(capsys: pytest.CaptureFixture[str], *flags: str) -> list[str]:
    """The names ``moe-sidecar groups --json FLAGS`` prints."""
    assert await asyncio.to_thread(cli.main, ["groups", "--json", *flags]) == 0
    return [group["name"] for group in json.loads(capsys.readouterr().out)]


async def test_groups_target_comes_from_the_flag_then_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    env_config = make_config(tmp_path / "env", listen=(f"unix://{tmp_path}/env.sock",))
    flag_config = make_config(tmp_path / "flag", listen=(f"unix://{tmp_path}/flag.sock",))
    async with running_server(env_config) as by_env, running_server(flag_config) as by_flag:
        await _one_group(by_env, "named-by/env")
        await _one_group(by_flag, "named-by/flag")
        monkeypatch.setenv("MOE_SIDECAR_TARGET", by_env.addresses.listen[0])
        assert await _groups_listed(capsys) == ["named-by/env"]
        target = by_flag.addresses.listen[0]
        assert await _groups_listed(capsys, "--target", target) == ["named-by/flag"]


@pytest.mark.parametrize("environment", ["unset", "empty"])
async def test_groups_target_defaults_to_port_50051_on_loopback(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    environment: str,
) -> None:
    try:
        server = await start_server(make_config(tmp_path, listen=("127.0.0.1:50051",)))
    except StartupError:
        pytest.skip("127.0.0.1:50051, the default target, is taken on this machine")
    try:
        await _one_group(server, "named-by/default")
        if environment == "unset":
            monkeypatch.delenv("MOE_SIDECAR_TARGET", raising=False)
        else:
            monkeypatch.setenv("MOE_SIDECAR_TARGET", "")
        assert await _groups_listed(capsys) == ["named-by/default"]
    finally:
        await server.stop()
