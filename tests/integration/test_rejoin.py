"""A replacement rank rejoins against a real sidecar (``python -m
moe_sidecar``) over real gRPC: four ranks' sessions,
one leaves, the three survivors commit view 2; a replacement for that rank
proposes on its own session with the running lifetime's proof, gets the
REBUILD at the stored plan under a new generation, and view 3 (all four,
PROPOSED at that generation) is shown by GetGroup and Watch; all four
acknowledge on their sessions and it commits. The view is stored: the
sidecar killed and started again on its state dir shows it. Without the running proof the newcomer is a
restart's first rank, and the view does not move."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from moe_workspace.v1 import coordinator_pb2 as pb
from tests.integration.helpers import (
    NVFP4,
    coordinator_stub,
    propose_request,
    start_sidecar_process,
    stop_process,
    wait_for_serving_record,
)
from tests.integration.test_exclude_ranks import _Session

pytestmark = pytest.mark.timeout(60)

GROUP = "rejoin/ep4"
WORLD = 4
GONE = 3
SURVIVORS = (0, 1, 2)
PROOF = "the-running-lifetimes-proof"


@contextlib.contextmanager
def _sidecar(tmp_path: Path, *flags: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A ``python -m moe_sidecar`` on a socket in ``tmp_path`` (state kept in
    ``tmp_path/state``); its target and process while it serves; killed after."""
    # One log per start: a start waits for its own serving record.
    log = tmp_path / f"sidecar-{len(list(tmp_path.glob('sidecar-*.log')))}.log"
    socket = tmp_path / "sidecar.sock"
    process = start_sidecar_process(
        log,
        *("--listen", f"unix://{socket}", "--state-dir", str(tmp_path / "state")),
        *("--health-port", "auto", "--metrics-port", "auto", *flags),
    )
    try:
        wait_for_serving_record(process, log)
        yield f"unix://{socket}", process
    finally:
        stop_process(process)


def _proposal(rank: int, lifetime: str, proof: str = PROOF) -> pb.ProposeRequest:
    request = propose_request(
        rank, 1, NVFP4, group=GROUP, ep_size=WORLD, local_ranks=WORLD, lifetime=lifetime
    )
    request.group_proof = proof
    return request


async def _wait_view(stub: Any, number: int, state: int) -> pb.Group:
    """GetGroup until the view is ``number`` in ``state`` (a departure is
    heard when the server sees the stream end)."""
    for _ in range(500):
        group: pb.Group = await stub.GetGroup(pb.GetGroupRequest(group=GROUP), timeout=5)
        if (group.view.number, group.view.state) == (number, state):
            return group
        await asyncio.sleep(0.01)
    raise AssertionError(f"view {number} never reached state {state}: {group.view}")


async def _view_2_committed(stub: Any) -> list[_Session]:
    """Four ranks decide round 1 on their sessions; rank 3's session ends;
    the survivors acknowledge view 2 at 5 rounds."""
    sessions = [_Session(stub) for _ in range(WORLD)]
    decided = await asyncio.gather(
        *(s.send(propose=_proposal(r, f"life-{r}")) for r, s in enumerate(sessions))
    )
    assert all(d.WhichOneof("result") == "decision" for d in decided), decided
    sessions[GONE].close()
    await _wait_view(stub, 2, pb.VIEW_STATE_PROPOSED)
    for rank in SURVIVORS:
        await sessions[rank].send(acknowledge=pb.AcknowledgeView(view=2, rounds=5))
    committed = await _wait_view(stub, 2, pb.VIEW_STATE_COMMITTED)
    assert list(committed.view.members) == list(SURVIVORS)
    return sessions


async def test_a_replacement_joins_view_3_at_a_new_generation_and_it_commits(
    tmp_path: Path,
) -> None:
    with _sidecar(tmp_path) as (target, process):
        async with coordinator_stub(target) as stub:
            sessions = await _view_2_committed(stub)
            before: pb.Group = await stub.GetGroup(pb.GetGroupRequest(group=GROUP), timeout=5)
            events = stub.Watch(pb.WatchRequest(group=GROUP))
            await events.initial_metadata()  # subscribed
            newcomer = _Session(stub)
            joined = await newcomer.send(propose=_proposal(GONE, "life-3-replacement"))
            retried = await newcomer.send(propose=_proposal(GONE, "life-3-replacement"))
            event: pb.GroupEvent = await asyncio.wait_for(events.read(), timeout=5)
            proposed: pb.Group = await stub.GetGroup(pb.GetGroupRequest(group=GROUP), timeout=5)
            for rank in SURVIVORS:
                acked = await sessions[rank].send(acknowledge=pb.AcknowledgeView(view=3, rounds=9))
                assert acked.acknowledged.state == pb.VIEW_STATE_PROPOSED, acked
            last = await newcomer.send(acknowledge=pb.AcknowledgeView(view=3, rounds=0))
            committed = await asyncio.wait_for(events.read(), timeout=5)
            # Killed while every member is connected: closed sessions would
            # move the view on (members leaving) before the kill, or not.
            stop_process(process)
            events.cancel()
            for session in (*sessions, newcomer):
                session.close()
    decision = joined.decision
    generation = before.view.generation + 1
    assert decision.action == pb.ACTION_REBUILD, joined
    assert decision.plan.generation == generation
    assert decision.plan.capacities == before.plan.capacities  # the stored plan
    assert retried.decision == decision  # a retry (its answer lost) gets the same
    view = proposed.view
    assert (view.number, list(view.members), view.generation) == (3, [0, 1, 2, 3], generation)
    assert view.state == pb.VIEW_STATE_PROPOSED and view.HasField("deadline")
    assert "rank 3 rejoined" in view.cause
    assert event.kind == pb.EVENT_KIND_VIEW_CHANGED and event.view == view
    assert proposed.lifetimes == before.lifetimes  # no restart
    assert last.acknowledged.state == pb.VIEW_STATE_COMMITTED, last
    assert committed.kind == pb.EVENT_KIND_VIEW_CHANGED and committed.view == last.acknowledged

    with _sidecar(tmp_path) as (target, _):  # killed above; its row read back
        async with coordinator_stub(target) as stub:
            stored: pb.Group = await stub.GetGroup(pb.GetGroupRequest(group=GROUP), timeout=5)
    assert stored.view == last.acknowledged


async def test_without_the_running_proof_the_newcomer_waits_for_a_restart(
    tmp_path: Path,
) -> None:
    with _sidecar(tmp_path, "--round-timeout", "30") as (target, _):
        async with coordinator_stub(target) as stub:
            sessions = await _view_2_committed(stub)
            stranger = stub.Propose(
                _proposal(GONE, "life-3-restart", proof="another-lifetimes-proof"), timeout=30
            )
            shown = await _wait_for_pending(stub)
            stranger.cancel()
            for session in sessions:
                session.close()
    assert (shown.view.number, list(shown.view.members)) == (2, list(SURVIVORS))
    assert shown.view.state == pb.VIEW_STATE_COMMITTED


async def _wait_for_pending(stub: Any) -> pb.Group:
    """GetGroup until the group shows a restart collecting ranks."""
    for _ in range(500):
        group: pb.Group = await stub.GetGroup(pb.GetGroupRequest(group=GROUP), timeout=5)
        if group.restarting_ranks == 1:
            return group
        await asyncio.sleep(0.01)
    raise AssertionError(f"no restart shown: {group}")
