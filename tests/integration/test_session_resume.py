"""A rank's session across the sidecar's faults, against a real sidecar process.

* ``ResumeSession`` binds a new stream to a rank's running lifetime without a
  proposal: its break is then the rank's death; a resume of another lifetime,
  of a gone rank or of an unknown group binds nothing (its break departs
  nobody);
* a goodbye said while the sidecar is stopped (SIGSTOP) is read as a clean
  leave when it wakes: the client leaves the stream open instead of
  cancelling it (a cancel reads as a death);
* a transport's session comes back by itself after a restart, with nobody
  calling, bound to its rank (its goodbye departs the rank).
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from moe_sidecar.client.transport import GrpcTransport
from moe_sidecar.core.group import Proposal, Requirement
from moe_sidecar.core.plan import Capacities
from moe_workspace.v1 import coordinator_pb2 as pb
from moe_workspace.v1 import coordinator_pb2_grpc as pb_grpc
from tests.multiprocess.harness import Sidecar, free_port

pytestmark = pytest.mark.timeout(120)

_BROKEN = "its session stream closed"
_CLEAN = "it closed its session cleanly"


def _proposal(group: str, rank: int) -> Proposal:
    return Proposal(
        group=group,
        ep_size=2,
        ep_rank=rank,
        local_ranks=2,
        lifetime=f"life-{rank}-lifetime-token",
        round=1,
        requirement=Requirement(Capacities(16, 64, 128, 2, 8), "layer.0"),
    )


class _RawSession:
    """One raw Session stream: messages in, answers out, cancel to break it."""

    def __init__(self, target: str) -> None:
        self._channel = grpc.insecure_channel(target)
        self._requests: queue.SimpleQueue[pb.SessionRequest | None] = queue.SimpleQueue()
        stub = pb_grpc.WorkspaceCoordinatorStub(self._channel)
        self._call = stub.Session(iter(self._requests.get, None))

    def ask(self, request: pb.SessionRequest) -> pb.SessionResponse:
        self._requests.put(request)
        answer: pb.SessionResponse = next(self._call)
        return answer

    def resume(self, group: str, rank: int, lifetime: str) -> pb.SessionResponse:
        resume = pb.ResumeSession(group=group, ep_rank=rank, lifetime=lifetime)
        return self.ask(pb.SessionRequest(id=7, resume=resume))

    def break_off(self) -> None:
        self._call.cancel()
        self._channel.close()


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[Sidecar]:
    running = Sidecar(tmp_path / "sidecar", round_timeout=20.0, metrics_port=free_port()).start()
    try:
        yield running
    finally:
        if running.pid is not None:
            os.kill(running.pid, signal.SIGCONT)  # a failed test leaves none stopped
        running.stop()


def _both_proposed(sidecar: Sidecar, group: str) -> tuple[GrpcTransport, GrpcTransport]:
    """Two transports whose ranks' round 1 of ``group`` closed (sessions bound)."""
    transports = (GrpcTransport(sidecar.target), GrpcTransport(sidecar.target))
    threads = [
        threading.Thread(target=transports[rank].propose, args=(_proposal(group, rank),))
        for rank in (0, 1)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    sidecar.wait_for_group(group, lambda g: len(g.ranks) == 2, timeout=10, what="both ranks")
    return transports


def _sessions_open(sidecar: Sidecar) -> float:
    """The sidecar's ``moe_sidecar_sessions`` gauge."""
    url = f"http://127.0.0.1:{sidecar.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as page:
        for line in page.read().decode().splitlines():
            if line.startswith("moe_sidecar_sessions "):
                return float(line.split()[1])
    raise LookupError("no moe_sidecar_sessions sample")


def _left(sidecar: Sidecar, group: str, rank: int) -> str:
    return str(next(r.left for r in sidecar.get_group(group).ranks if r.ep_rank == rank))


def test_a_resumed_stream_speaks_for_the_rank_and_its_break_is_a_death(
    sidecar: Sidecar,
) -> None:
    group = "resume-binds"
    mine, peer = _both_proposed(sidecar, group)
    mine.close()  # rank 0 says goodbye...
    sidecar.wait_for_group(group, lambda g: bool(g.ranks[0].left), timeout=10, what="rank 0 left")
    sidecar.stop(kill=True)  # ...rank 1's stream breaks with the sidecar
    sidecar.start()
    stranger = _RawSession(sidecar.target)
    wrong = stranger.resume(group, 1, "life-9-lifetime-token")
    assert wrong.error.code == "FAILED_PRECONDITION", wrong
    assert "has no running lifetime" in wrong.error.message, wrong
    unknown = stranger.resume("resume-nobody", 1, "life-1-lifetime-token")
    assert unknown.error.code == "NOT_FOUND", unknown
    gone = stranger.resume(group, 0, "life-0-lifetime-token")
    assert gone.error.code == "FAILED_PRECONDITION" and "is gone" in gone.error.message, gone
    stranger.break_off()
    resumed = _RawSession(sidecar.target)
    answer = resumed.resume(group, 1, "life-1-lifetime-token")
    assert answer.WhichOneof("result") == "resumed", answer
    assert not _left(sidecar, group, 1)  # the stranger's break departed nobody
    resumed.break_off()
    sidecar.wait_for_group(
        group, lambda g: bool(g.ranks[1].left), timeout=10, what="rank 1 gone by its resumed stream"
    )
    assert _BROKEN in _left(sidecar, group, 1)
    peer.close()


def test_a_goodbye_said_while_the_sidecar_is_stopped_is_a_clean_leave(sidecar: Sidecar) -> None:
    group = "resume-stalled-goodbye"
    mine, peer = _both_proposed(sidecar, group)
    assert sidecar.pid is not None
    os.kill(sidecar.pid, signal.SIGSTOP)
    started = time.monotonic()
    mine.close()  # the goodbye waits in the stream: nobody cancels it
    assert time.monotonic() - started < 5
    os.kill(sidecar.pid, signal.SIGCONT)
    sidecar.wait_for_group(group, lambda g: bool(g.ranks[0].left), timeout=10, what="rank 0 left")
    assert _CLEAN in _left(sidecar, group, 0), _left(sidecar, group, 0)
    assert not _left(sidecar, group, 1)
    peer.close()


def test_a_session_comes_back_after_a_restart_with_nobody_calling(sidecar: Sidecar) -> None:
    group = "resume-by-itself"
    mine, peer = _both_proposed(sidecar, group)
    sidecar.stop(kill=True)
    sidecar.start()
    # Nobody calls: both sessions come back by themselves...
    deadline = time.monotonic() + 15
    while _sessions_open(sidecar) != 2:
        assert time.monotonic() < deadline, "the sessions did not come back"
        time.sleep(0.05)  # the poll interval of a wait with a deadline
    # ...bound to their ranks: rank 0's goodbye on its resumed stream is its
    # departure (on a stream bound to nobody it would depart nobody).
    mine.close()
    sidecar.wait_for_group(group, lambda g: bool(g.ranks[0].left), timeout=10, what="rank 0 left")
    assert _CLEAN in _left(sidecar, group, 0)
    assert not _left(sidecar, group, 1)
    peer.close()
