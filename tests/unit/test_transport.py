"""The gRPC transport against a real sidecar: retries, deadlines, fork, pickling."""

from __future__ import annotations

import os
import pickle
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from moe_sidecar.client.errors import (
    CoordinatorUnavailable,
    InternalError,
    InvalidArgument,
    PreconditionFailed,
    RoundTimedOut,
    SessionStatus,
    SidecarNotAnswering,
    rpc_status,
)
from moe_sidecar.client.transport import EmbeddedTransport, GrpcTransport, transport_for
from moe_sidecar.core.group import CommitRecord, Proposal, Requirement
from moe_sidecar.core.plan import Action, Capacities
from tests.multiprocess.harness import Sidecar, running_sidecar

pytestmark = pytest.mark.timeout(60)


def proposal(
    group: str,
    *,
    local_ranks: int = 1,
    ep_size: int = 1,
    round: int = 1,
    lifetime: str = "life-1-lifetime-token",
    num_experts: int = 8,
) -> Proposal:
    return Proposal(
        group=group,
        ep_size=ep_size,
        ep_rank=0,
        local_ranks=local_ranks,
        lifetime=lifetime,
        round=round,
        requirement=Requirement(Capacities(16, 64, 128, 2, num_experts), "layer.0"),
    )


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecar]:
    with running_sidecar(tmp_path_factory.mktemp("transport"), round_timeout=20.0) as running:
        yield running


def test_propose_and_commit(sidecar: Sidecar) -> None:
    transport = GrpcTransport(sidecar.target)
    decision = transport.propose(proposal("t-basic"))
    assert decision.action is Action.BUILD
    assert decision.plan.capacities == Capacities(16, 64, 128, 2, 8)
    # Idempotent: a retried proposal of a closed round gets the same decision.
    assert transport.propose(proposal("t-basic")) == decision
    transport.commit("t-basic", CommitRecord(0, "life-1-lifetime-token", 1, decision.plan, 0.01))
    assert transport.rpc_count == 3
    assert sidecar.get_group("t-basic").ranks[0].committed_generation == 1
    transport.close()


@pytest.mark.parametrize("session", [True, False], ids=["session", "unary"])
def test_typed_error_keeps_status(sidecar: Sidecar, session: bool) -> None:
    transport = GrpcTransport(sidecar.target, session=session)
    with pytest.raises(InvalidArgument, match="num_experts") as caught:
        transport.propose(proposal("t-bad", ep_size=2, local_ranks=1, num_experts=1))
    status = rpc_status(caught.value)
    assert status is not None and status.code is grpc.StatusCode.INVALID_ARGUMENT
    cause = SessionStatus if session else grpc.RpcError
    assert isinstance(caught.value.__cause__, cause)
    assert transport.rpc_count == 1  # not retried
    transport.close()


def test_unavailable_is_retried_until_the_sidecar_starts(tmp_path: Path) -> None:
    late = Sidecar(tmp_path / "late", round_timeout=20.0)
    starter = threading.Timer(1.0, late.start)
    starter.start()
    try:
        transport = GrpcTransport(late.target, unavailable_retry=30.0)
        decision = transport.propose(proposal("t-late"))
        assert decision.action is Action.BUILD
        assert transport.rpc_count > 1
        transport.close()
    finally:
        starter.join()
        late.stop()


def test_unavailable_gives_up_with_a_typed_error(tmp_path: Path) -> None:
    transport = GrpcTransport(f"unix://{tmp_path}/nobody.sock", unavailable_retry=0.5)
    started = time.monotonic()
    with pytest.raises(CoordinatorUnavailable, match="gave up after") as caught:
        transport.propose(proposal("t-none"))
    assert time.monotonic() - started < 5
    status = rpc_status(caught.value)
    assert status is not None and status.code is grpc.StatusCode.UNAVAILABLE
    assert transport.rpc_count > 1
    transport.close()


def test_client_deadline(sidecar: Sidecar) -> None:
    # Two local ranks, only one proposes: the sidecar would wait 20 s; the
    # client's 0.5 s deadline fires first.
    transport = GrpcTransport(sidecar.target, propose_timeout=0.5)
    started = time.monotonic()
    with pytest.raises(SidecarNotAnswering) as caught:
        transport.propose(proposal("t-deadline", ep_size=2, local_ranks=2))
    assert time.monotonic() - started < 5
    assert not isinstance(caught.value, RoundTimedOut)
    assert caught.value.message.startswith(
        f"the sidecar at {sidecar.target} did not answer Propose for 0.5 s"
    ), caught.value.message


def test_sidecar_round_timeout_names_the_missing_rank(tmp_path: Path) -> None:
    with running_sidecar(tmp_path / "short", round_timeout=1.0) as short:
        transport = GrpcTransport(short.target, propose_timeout=10.0)
        with pytest.raises(RoundTimedOut) as caught:
            transport.propose(proposal("t-missing", ep_size=2, local_ranks=2))
    assert "1 of 2 local ranks missing" in caught.value.message
    status = rpc_status(caught.value)
    assert status is not None and status.code is grpc.StatusCode.DEADLINE_EXCEEDED


def test_pickled_transport_opens_its_own_channel(sidecar: Sidecar) -> None:
    transport = GrpcTransport(sidecar.target)
    transport.propose(proposal("t-pickle"))
    clone = pickle.loads(pickle.dumps(transport))
    assert clone.propose(proposal("t-pickle")).round == 1
    clone.close()
    transport.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_channel_is_recreated_after_fork(sidecar: Sidecar) -> None:
    transport = GrpcTransport(sidecar.target)
    # Created before the fork and never used: the child opens its channel.
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        code = 1
        try:
            decision = transport.propose(proposal("t-fork", lifetime="child-lifetime-token"))
            code = 0 if decision.action is Action.BUILD else 2
        finally:
            os.write(write_end, bytes([code]))
            os._exit(0)
    os.close(write_end)
    status = os.read(read_end, 1)
    os.waitpid(pid, 0)
    assert status == b"\x00"
    # The parent, which never opened a channel before the fork, opens its own.
    assert transport.propose(proposal("t-fork", lifetime="child-lifetime-token")).round == 1


def test_transport_for_picks_by_target(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOE_SIDECAR_TARGET", raising=False)
    assert isinstance(transport_for(None), EmbeddedTransport)
    monkeypatch.setenv("MOE_SIDECAR_TARGET", "unix:///run/x.sock")
    chosen = transport_for(None)
    assert isinstance(chosen, GrpcTransport) and chosen.target == "unix:///run/x.sock"
    assert isinstance(transport_for("embedded"), EmbeddedTransport)
    monkeypatch.setenv("MOE_SIDECAR_PROPOSE_TIMEOUT", "90")
    grpc_transport = transport_for("127.0.0.1:1")
    assert isinstance(grpc_transport, GrpcTransport) and grpc_transport.propose_timeout == 90.0


@pytest.mark.parametrize("bad", ["localhost", "tcp://1.2.3.4:5", "unix://relative.sock"])
def test_a_bad_target_in_the_environment_is_invalid_argument_naming_it(
    monkeypatch: pytest.MonkeyPatch, bad: str
) -> None:
    monkeypatch.setenv("MOE_SIDECAR_TARGET", bad)
    with pytest.raises(InvalidArgument) as caught:
        transport_for(None)
    assert str(caught.value).startswith(f"MOE_SIDECAR_TARGET={bad!r}: ")
    assert caught.value.field == "MOE_SIDECAR_TARGET"
    assert caught.value.__cause__ is None  # one line: no ConfigError chained
    with pytest.raises(InvalidArgument, match=rf"^target={bad!r}: "):
        transport_for(bad)


def test_embedded_transport_decides_like_the_core() -> None:
    transport = EmbeddedTransport()
    first = transport.propose(proposal("e"))
    assert first.action is Action.BUILD
    bigger = Proposal(
        **{
            **proposal("e", round=2).__dict__,
            "requirement": Requirement(Capacities(16, 256, 128, 2, 8), "layer.1"),
        }
    )
    assert transport.propose(bigger).action is Action.REBUILD
    transport.commit(
        "e", CommitRecord(0, "life-1-lifetime-token", 2, transport.propose(bigger).plan, 0.0)
    )
    state = transport.group_state("e")
    assert state is not None and state.plan is not None and state.plan.generation == 2
    assert transport.rpc_count == 0


def test_embedded_transport_leaves_nothing_unanswered() -> None:
    # Embedded mode checks covered rounds in the agreement: answers read
    # later are the sidecar's, and asking the embedded core for them is a bug.
    transport = EmbeddedTransport()
    transport.propose(proposal("e"))
    assert transport.unanswered == 0
    with pytest.raises(InternalError, match="embedded mode decides"):
        transport.propose_later(proposal("e", round=2))
    with pytest.raises(InternalError, match="embedded mode decides"):
        transport.next_answer()
    assert transport.unanswered == 0


def _rank_proposal(group: str, rank: int, rnd: int, layer: str = "layer.0") -> Proposal:
    return Proposal(
        group=group,
        ep_size=2,
        ep_rank=rank,
        local_ranks=2,
        lifetime=f"life-{rank}-lifetime-token",
        round=rnd,
        requirement=Requirement(Capacities(16, 64, 128, 2, 8), layer),
    )


@pytest.mark.parametrize("session", [True, False], ids=["session", "unary"])
def test_proposals_left_in_flight_are_answered_in_order(sidecar: Sidecar, session: bool) -> None:
    group = f"t-flight-{session}"
    mine, peer = GrpcTransport(sidecar.target, session=session), GrpcTransport(sidecar.target)
    try:
        if session:
            # Round 1 waits for rank 1: left in flight, it returns at once.
            started = time.monotonic()
            mine.propose_later(_rank_proposal(group, 0, 1))
            assert time.monotonic() - started < 1.0 and mine.unanswered == 1
            mine.propose_later(_rank_proposal(group, 0, 2))
            peer_decisions = [peer.propose(_rank_proposal(group, 1, n)) for n in (1, 2)]
        else:
            # Unary calls cannot stay in flight: the peer must be there first.
            answers: list[object] = []
            thread = threading.Thread(
                target=lambda: answers.extend(
                    peer.propose(_rank_proposal(group, 1, n)) for n in (1, 2)
                )
            )
            thread.start()
            mine.propose_later(_rank_proposal(group, 0, 1))
            mine.propose_later(_rank_proposal(group, 0, 2))
            thread.join(timeout=30)
            peer_decisions = list(answers)  # type: ignore[arg-type]
        assert mine.unanswered == 2
        assert [mine.next_answer(), mine.next_answer()] == peer_decisions
        assert [d.action for d in peer_decisions] == [Action.BUILD, Action.REUSE]
        assert mine.unanswered == 0
    finally:
        mine.close()
        peer.close()


def test_a_refused_proposal_in_flight_raises_its_typed_error(sidecar: Sidecar) -> None:
    mine, peer = GrpcTransport(sidecar.target), GrpcTransport(sidecar.target)
    try:
        mine.propose_later(_rank_proposal("t-flight-refused", 0, 1, layer="model.layers.0.mlp"))
        with pytest.raises(PreconditionFailed, match="disagree"):
            peer.propose(_rank_proposal("t-flight-refused", 1, 1, layer="model.layers.9.mlp"))
        with pytest.raises(PreconditionFailed) as caught:
            mine.next_answer()
        assert "'model.layers.0.mlp'" in caught.value.message
        assert "'model.layers.9.mlp'" in caught.value.message
        assert mine.unanswered == 0
        with pytest.raises(InternalError, match="nothing unanswered"):
            mine.next_answer()
    finally:
        mine.close()
        peer.close()


def test_proposals_in_flight_are_sent_again_after_the_sidecar_restarts(tmp_path: Path) -> None:
    group = "t-flight-restart"
    restarting = Sidecar(tmp_path / "restarting", round_timeout=20.0).start()
    mine = GrpcTransport(restarting.target, unavailable_retry=30.0)
    peer = GrpcTransport(restarting.target, unavailable_retry=30.0)
    try:
        mine.propose_later(_rank_proposal(group, 0, 1))
        # The round is open (rank 1 has not proposed) when the sidecar stops.
        restarting.wait_for_group(
            group, lambda g: g.waiting_ranks == 1, timeout=10, what="rank 0 waiting"
        )
        restarting.stop()
        restarting.start()
        answers: list[object] = []
        thread = threading.Thread(
            target=lambda: answers.append(peer.propose(_rank_proposal(group, 1, 1)))
        )
        thread.start()
        decision = mine.next_answer()  # the stream broke: sent again, then answered
        thread.join(timeout=30)
        assert answers == [decision] and decision.action is Action.BUILD
        assert mine.unanswered == 0 and mine.rpc_count > 1
    finally:
        mine.close()
        peer.close()
        restarting.stop()
