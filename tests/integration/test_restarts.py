"""Restarts that fail nobody: each case against a real ``python -m moe_sidecar``.

The ranks are real clients (:class:`~moe_sidecar.client.transport.GrpcTransport`
over their Session streams, each call on its own thread, as a rank's
synchronous code calls it); the sidecar is its own process, stopped with
SIGTERM or ``kill -9`` and started again on the same state directory and
socket.

* SIGTERM while a rank waits in an open round, back later than
  ``--round-timeout``: the rank's retry and its peer complete the round;
  nobody gets DEADLINE_EXCEEDED, no present rank is named missing.
* The same after ``kill -9``, when a Commit had saved the open round.
* ``kill -9`` after rounds decided REUSE (each recorded before it was
  answered): the restarted sidecar has them, the ranks' next round is
  decided REUSE for both, and the plan and the commits stay as recorded.
* ``kill -9`` right after a REUSE round was answered, before one rank read
  its answer: that rank's retry gets the same REUSE at once, not a round
  that waits for a peer that has moved on (one round, one answer).
* The client's retry window: a sidecar stopped for 25 s is reached within
  about a second of its return, inside the documented 30 s.
* One zero-window Health/Watch stream (a real HTTP/2 peer that never opens
  its window) does not hang SIGTERM: the waiting ranks are answered at once
  and the process exits within the grace period.
* Two sidecars started at the same instant on one socket path: never both
  run, and the survivor keeps serving on its socket.
"""

from __future__ import annotations

import concurrent.futures
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from moe_sidecar.client.errors import CoordinatorError
from moe_sidecar.client.transport import DEFAULT_UNAVAILABLE_RETRY_S, GrpcTransport
from moe_sidecar.core.group import CommitRecord, Decision, Proposal, Requirement
from moe_sidecar.core.identity import new_lifetime_secret
from moe_sidecar.core.plan import Action, Capacities
from moe_workspace.v1 import coordinator_pb2 as pb
from moe_workspace.v1 import coordinator_pb2_grpc as pb_grpc
from tests.integration.helpers import (
    ROOT,
    log_records,
    propose_request,
    start_sidecar_process,
    stop_process,
    wait_until_serving,
)
from tests.integration.raw_http2 import open_call
from tests.multiprocess.harness import free_port

pytestmark = pytest.mark.timeout(120)

CAPACITIES = Capacities(16, 200, 400, 2, 8)


class SidecarProcess:
    """``python -m moe_sidecar`` on one socket and state directory, restartable."""

    def __init__(self, directory: Path, *flags: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.socket = directory / "s.sock"
        self.target = f"unix://{self.socket}"
        self.log = directory / "sidecar.log"
        self.flags = (
            "--listen",
            self.target,
            "--state-dir",
            str(directory / "state"),
            # No fixed ports (another sidecar on this machine may hold 50052);
            # a test that needs the health port gives it in ``flags`` (the last wins).
            "--health-port",
            "0",
            "--metrics-port",
            "0",
            *flags,
        )
        self.process: subprocess.Popen[bytes] | None = None

    def launch(self) -> subprocess.Popen[bytes]:
        """Starts the process; does not wait for it."""
        self.process = start_sidecar_process(self.log, *self.flags)
        return self.process

    def start(self) -> SidecarProcess:
        process = self.launch()
        wait_until_serving(self.target, process, self.log)
        return self

    def stop(self, signum: signal.Signals = signal.SIGTERM) -> None:
        assert self.process is not None
        self.process.send_signal(signum)
        self.process.wait(timeout=30)

    def group(self, name: str) -> pb.Group:
        with grpc.insecure_channel(self.target) as channel:
            stub = pb_grpc.WorkspaceCoordinatorStub(channel)
            return stub.GetGroup(pb.GetGroupRequest(group=name), timeout=5)

    def wait_for(self, name: str, *, open_round: int, waiting: int, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                g = self.group(name)
                if g.open_round == open_round and g.waiting_ranks == waiting:
                    return
            except grpc.RpcError:
                pass  # not there yet (NOT_FOUND) or not reachable yet
            time.sleep(0.02)  # the poll interval of a wait with a deadline
        raise AssertionError(f"group {name!r}: never {waiting} ranks waiting in round {open_round}")

    def close(self) -> None:
        if self.process is not None:
            stop_process(self.process)


@pytest.fixture
def sidecars() -> Iterator[list[SidecarProcess]]:
    """Every SidecarProcess a test registers is killed at its end."""
    made: list[SidecarProcess] = []
    yield made
    for sidecar in made:
        sidecar.close()


class Rank:
    """One rank: a GrpcTransport with its own lifetime; calls run on a thread."""

    def __init__(self, target: str, group: str, rank: int, ranks: int) -> None:
        self.transport = GrpcTransport(target, propose_timeout=60.0)
        self.group, self.rank, self.ranks = group, rank, ranks
        self.lifetime = new_lifetime_secret()
        self._pool = concurrent.futures.ThreadPoolExecutor(1)

    def propose(self, rnd: int) -> concurrent.futures.Future[Decision]:
        proposal = Proposal(
            self.group,
            self.ranks,
            self.rank,
            self.ranks,
            self.lifetime,
            rnd,
            Requirement(CAPACITIES, f"layer.{rnd}"),
        )
        return self._pool.submit(self.transport.propose, proposal)

    def commit(self, decision: Decision) -> None:
        record = CommitRecord(self.rank, self.lifetime, decision.round, decision.plan, 0.01)
        self.transport.commit(self.group, record)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.transport.close()


def _decided(futures: list[concurrent.futures.Future[Decision]], timeout: float) -> list[Decision]:
    """Every rank's decision; a typed error fails the test with its message."""
    decisions = []
    for rank, future in enumerate(futures):
        try:
            decisions.append(future.result(timeout=timeout))
        except CoordinatorError as error:
            raise AssertionError(f"rank {rank}: {type(error).__name__}: {error}") from error
    return decisions


def _assert_nobody_timed_out(sidecar: SidecarProcess) -> None:
    records = log_records(sidecar.log)
    assert not [r for r in records if r["message"] == "round timed out"], sidecar.log.read_text()
    assert not [r for r in records if r.get("missing_ranks")], sidecar.log.read_text()


ROUND_TIMEOUT = 4.0
DOWN_S = ROUND_TIMEOUT + 2.0
"""Longer than the round timeout: the kept round must not count it."""


def test_sigterm_in_an_open_round_back_after_the_round_timeout_fails_nobody(
    tmp_path: Path, sidecars: list[SidecarProcess]
) -> None:
    sidecar = SidecarProcess(tmp_path, "--round-timeout", str(ROUND_TIMEOUT))
    sidecars.append(sidecar.start())
    group = "restart-term:fp4/tp1-ep2/pp0"
    ranks = [Rank(sidecar.target, group, r, 2) for r in range(2)]
    try:
        waiting = ranks[0].propose(1)
        sidecar.wait_for(group, open_round=1, waiting=1)
        stopped_at = time.monotonic()
        sidecar.stop(signal.SIGTERM)
        # Its peer proposes while the sidecar is down: both retry UNAVAILABLE.
        peer = ranks[1].propose(1)
        time.sleep(max(0.0, stopped_at + DOWN_S - time.monotonic()))
        sidecar.start()
        decisions = _decided([waiting, peer], timeout=30)
    finally:
        for rank in ranks:
            rank.close()
    assert [(d.round, d.action) for d in decisions] == [(1, Action.BUILD)] * 2
    assert ranks[0].transport.rpc_count > 1  # it was answered by its retry
    _assert_nobody_timed_out(sidecar)


def test_kill_9_after_a_commit_saved_the_open_round_fails_nobody(
    tmp_path: Path, sidecars: list[SidecarProcess]
) -> None:
    sidecar = SidecarProcess(tmp_path, "--round-timeout", str(ROUND_TIMEOUT))
    sidecars.append(sidecar.start())
    group = "restart-kill:fp4/tp1-ep2/pp0"
    ranks = [Rank(sidecar.target, group, r, 2) for r in range(2)]
    try:
        first = _decided([rank.propose(1) for rank in ranks], timeout=30)
        ranks[0].commit(first[0])
        waiting = ranks[0].propose(2)
        sidecar.wait_for(group, open_round=2, waiting=1)
        # This commit persists the group, and with it the open round 2.
        ranks[1].commit(first[1])
        killed_at = time.monotonic()
        sidecar.stop(signal.SIGKILL)
        peer = ranks[1].propose(2)
        time.sleep(max(0.0, killed_at + DOWN_S - time.monotonic()))
        sidecar.start()
        # The stored round 2 comes back with a fresh deadline; rank 0's retry
        # rejoins it and rank 1's closes it.
        decisions = _decided([waiting, peer], timeout=30)
    finally:
        for rank in ranks:
            rank.close()
    assert [(d.round, d.action) for d in decisions] == [(2, Action.REUSE)] * 2
    _assert_nobody_timed_out(sidecar)


def test_kill_9_after_reuse_rounds_the_restarted_sidecar_has_them(
    tmp_path: Path, sidecars: list[SidecarProcess]
) -> None:
    sidecar = SidecarProcess(tmp_path, "--round-timeout", str(ROUND_TIMEOUT))
    sidecars.append(sidecar.start())
    group = "restart-reuse:fp4/tp1-ep2/pp0"
    ranks = [Rank(sidecar.target, group, r, 2) for r in range(2)]
    try:
        first = _decided([rank.propose(1) for rank in ranks], timeout=30)
        for rank, decision in zip(ranks, first, strict=True):
            rank.commit(decision)
        for rnd in (2, 3, 4):
            reused = _decided([rank.propose(rnd) for rank in ranks], timeout=30)
            assert [(d.round, d.action) for d in reused] == [(rnd, Action.REUSE)] * 2
        before_kill = sidecar.group(group)
        sidecar.stop(signal.SIGKILL)  # rounds 2-4 wrote their records, not the row
        sidecar.start()
        assert sidecar.group(group).last_closed_round == 4
        decisions = _decided([rank.propose(5) for rank in ranks], timeout=30)
        after = sidecar.group(group)
    finally:
        for rank in ranks:
            rank.close()
    assert [(d.round, d.action) for d in decisions] == [(5, Action.REUSE)] * 2
    assert after.plan == before_kill.plan
    assert list(after.history) == list(before_kill.history)
    assert after.last_closed_round == 5
    assert [r.committed_generation for r in after.ranks] == [first[0].plan.generation] * 2
    _assert_nobody_timed_out(sidecar)


def test_kill_9_right_after_a_reuse_answer_a_retry_gets_the_same_answer(
    tmp_path: Path, sidecars: list[SidecarProcess]
) -> None:
    sidecar = SidecarProcess(tmp_path, "--round-timeout", str(ROUND_TIMEOUT))
    sidecars.append(sidecar.start())
    group = "restart-answer:fp4/tp1-ep2/pp0"
    ranks = [Rank(sidecar.target, group, r, 2) for r in range(2)]
    try:
        first = _decided([rank.propose(1) for rank in ranks], timeout=30)
        for rank, decision in zip(ranks, first, strict=True):
            rank.commit(decision)
        waiting = ranks[0].propose(2)
        sidecar.wait_for(group, open_round=2, waiting=1)
        (answered,) = _decided([ranks[1].propose(2)], timeout=30)
        sidecar.stop(signal.SIGKILL)  # right after rank 1 read its answer
        assert answered.round == 2 and answered.action is Action.REUSE
        waiting.cancel()
        ranks[0].close()
        # Rank 0 missed its answer: the same lifetime retries round 2 on a
        # new client, while rank 1 has moved on and never proposes round 2 again.
        retry = Rank(sidecar.target, group, 0, 2)
        retry.lifetime = ranks[0].lifetime
        ranks[0] = retry
        sidecar.start()
        started = time.monotonic()
        (again,) = _decided([retry.propose(2)], timeout=30)
        took = time.monotonic() - started
        decisions = _decided([rank.propose(3) for rank in ranks], timeout=30)
    finally:
        for rank in ranks:
            rank.close()
    assert again == answered
    assert took < ROUND_TIMEOUT, took  # answered from the record, not after a wait
    assert [(d.round, d.action) for d in decisions] == [(3, Action.REUSE)] * 2
    _assert_nobody_timed_out(sidecar)


def _first_connect(path: Path, timeout: float) -> float:
    """CLOCK_MONOTONIC time at which ``path`` first accepts a connection."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(str(path))
                return time.monotonic()
            except OSError:
                pass
        time.sleep(0.005)
    raise AssertionError(f"{path} never accepted a connection")


OUTAGE_S = 25.0
"""How long the sidecar is away in the retry-window test (the window is 30 s)."""


def test_a_client_waits_out_a_25_s_outage_and_reaches_the_sidecar_within_a_second(
    tmp_path: Path, sidecars: list[SidecarProcess]
) -> None:
    assert DEFAULT_UNAVAILABLE_RETRY_S == 30.0
    readme = (ROOT / "docs" / "user-guide.md").read_text()
    assert "retry UNAVAILABLE with exponential\nbackoff for 30 s" in readme
    sidecar = SidecarProcess(tmp_path, "--round-timeout", "20")
    launched = time.monotonic()
    sidecars.append(sidecar.start())
    startup = time.monotonic() - launched
    group = "restart-window:fp4/tp1-ep1/pp0"
    rank = Rank(sidecar.target, group, 0, 1)  # the default window
    try:
        assert rank.propose(1).result(timeout=30).action is Action.BUILD
        sidecar.stop(signal.SIGTERM)
        asked_at = time.monotonic()
        answer = rank.propose(2)
        answered_at: list[float] = []
        answer.add_done_callback(lambda _: answered_at.append(time.monotonic()))
        # Launched so that it is back about OUTAGE_S after the first failed attempt.
        time.sleep(max(0.0, asked_at + OUTAGE_S - startup - time.monotonic()))
        sidecar.launch()
        back_at = _first_connect(sidecar.socket, timeout=30)
        decision = answer.result(timeout=15)
    finally:
        rank.close()
    outage = back_at - asked_at
    gap = answered_at[0] - back_at
    print(f"sidecar away {outage:.2f}s; the waiting client reached it {gap:.3f}s after its return")
    assert decision.round == 2 and decision.action is Action.REUSE
    assert OUTAGE_S - 2 < outage < DEFAULT_UNAVAILABLE_RETRY_S - 1, outage
    # The channel reconnects at most a second (+20% jitter) apart.
    assert gap < 2.0, gap


GRACE_S = 3.0
WAITING_RANKS = 7


def test_a_zero_window_health_watch_does_not_hang_sigterm(
    tmp_path: Path, sidecars: list[SidecarProcess]
) -> None:
    port = free_port()
    sidecar = SidecarProcess(
        tmp_path,
        "--health-port",
        str(port),
        "--grace-period",
        str(GRACE_S),
        "--round-timeout",
        "60",
    )
    sidecars.append(sidecar.start())
    # A real HTTP/2 peer that never opens its window: the server can send the
    # response headers but never a message. It answers SETTINGS and PINGs.
    watcher = open_call(
        ("127.0.0.1", port),
        "/grpc.health.v1.Health/Watch",
        health_pb2.HealthCheckRequest(service="").SerializeToString(),
        window=0,
    )
    watcher.keep_acknowledging()
    try:
        # The Watch is being served: its headers came, its first message cannot.
        assert watcher.headers_received.wait(timeout=10)
        with grpc.insecure_channel(sidecar.target) as channel:
            stub = pb_grpc.WorkspaceCoordinatorStub(channel)
            waiting = [
                stub.Propose.future(propose_request(rank, local_ranks=8), timeout=60)
                for rank in range(WAITING_RANKS)
            ]
            sidecar.wait_for(propose_request(0).group, open_round=1, waiting=WAITING_RANKS)
            assert watcher.data_received == 0 and not watcher.closed.is_set()
            assert sidecar.process is not None
            signalled_at = time.monotonic()
            sidecar.process.send_signal(signal.SIGTERM)
            answered = []
            for future in waiting:
                error = future.exception(timeout=GRACE_S + 5)
                answered.append(time.monotonic() - signalled_at)
                assert isinstance(error, grpc.Call) and error.code() == grpc.StatusCode.UNAVAILABLE
                assert "shutting down" in (error.details() or "")
            sidecar.process.wait(timeout=GRACE_S + 10)
            stopped = time.monotonic() - signalled_at
    finally:
        watcher.close()
    print(f"waiting ranks answered after {max(answered):.3f}s; stopped after {stopped:.3f}s")
    assert max(answered) < 1.5, answered
    assert sidecar.process.returncode == 0, sidecar.log.read_text()
    # Nothing on the listener was in flight; the process ends well within the grace.
    assert stopped < GRACE_S + 1.0, stopped
    assert watcher.closed.wait(timeout=5)


TRIALS = 20


@pytest.mark.timeout(400)
@pytest.mark.parametrize("shared_health_port", [False, True], ids=["own-ports", "shared-health"])
def test_two_sidecars_started_at_once_on_one_socket_never_both_run(
    tmp_path: Path, shared_health_port: bool
) -> None:
    sock = tmp_path / "s.sock"
    target = f"unix://{sock}"
    outcomes: list[tuple[int, str]] = []
    for trial in range(TRIALS):
        shared = free_port()
        health = [str(shared if shared_health_port else free_port()) for _ in range(2)]
        logs = [tmp_path / f"t{trial}-{i}.log" for i in range(2)]
        processes = [
            start_sidecar_process(
                logs[i],
                "--listen",
                target,
                "--state-dir",
                str(tmp_path / f"state-{trial}-{i}"),
                "--health-port",
                health[i],
                "--metrics-port",
                "0",
            )
            for i in range(2)
        ]
        try:
            deadline = time.monotonic() + 60
            while all(p.poll() is None for p in processes):
                assert time.monotonic() < deadline, f"trial {trial}: both still running"
                time.sleep(0.02)  # the poll interval of a wait with a deadline
            loser = next(i for i, p in enumerate(processes) if p.poll() is not None)
            winner = 1 - loser
            wait_until_serving(target, processes[winner], logs[winner])
            # Its health port serves too (the one both asked for, when shared).
            with grpc.insecure_channel(f"127.0.0.1:{health[winner]}") as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=5
                )
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            # The loser's exit left the winner's socket in place and serving.
            assert sock.exists(), f"trial {trial}: the socket is gone"
            assert processes[winner].poll() is None, f"trial {trial}: the winner died"
            assert processes[loser].returncode == 1, logs[loser].read_text()
            error = next(r for r in log_records(logs[loser]) if r["message"] == "cannot start")
            outcomes.append((winner, error["error"]))
            processes[winner].send_signal(signal.SIGTERM)
            processes[winner].wait(timeout=30)
        finally:
            for process in processes:
                stop_process(process)
    reasons = {reason.split(" on ")[0] for _, reason in outcomes}
    print(f"{TRIALS} trials; winners {[w for w, _ in outcomes]}; loser errors {reasons}")
    assert all("another moe-sidecar serves or is starting" in r for _, r in outcomes), outcomes
