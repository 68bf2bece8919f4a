"""A rank's session stream is its liveness: its peers know within a second.

Real processes throughout: a ``python -m moe_sidecar`` process, rank
processes that talk to it over their ``Session`` streams (GrpcTransport),
and ``kill -9``. Times are measured from the kill to the moment each
survivor caught its error, on CLOCK_MONOTONIC, which every process of the
machine shares. Before a kill the test polls the sidecar until the ranks
really wait in their round (generously: the machine may be loaded), so the
time measured is the sidecar's reaction alone.

* Killed in an open round: the ranks waiting in it get RoundAborted naming
  the rank, its last layer and why (its session stream closed) in under 1 s
  (the round timeout is 20 s).
* Killed between rounds: the next round fails at once for the others.
* Killed inside the post-build barrier: peers get RankLost naming the rank
  (sidecar mode) or saying that nobody can tell which (embedded mode),
  instead of gloo's untyped RuntimeError.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.multiprocess import workers
from tests.multiprocess.harness import RankProcesses, Sidecar, run_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

RANKS = 3
KILLED = 2
SURVIVORS = (0, 1)
TARGET_S = 1.0
"""Peers of a killed rank get the named error within this long."""
STARTUP_S = 90.0
"""Spawned ranks import torch and gRPC: generous on a loaded 2-core machine."""


def _first_round(ranks: RankProcesses) -> None:
    ranks.expect(range(RANKS), "started", STARTUP_S)
    for rank in range(RANKS):
        ranks.send(rank, "propose", 1)
    decided = ranks.expect(range(RANKS), "decided", 30)
    assert {d["action"] for d in decided.values()} == {"build"}


def _assert_names_the_killed_rank(failure: dict[str, Any], rnd: int) -> None:
    assert failure["type"] == "RoundAborted", failure
    assert failure["grpc_code"] == "ABORTED", failure
    assert failure["round"] == rnd
    message = failure["message"]
    assert f"rank {KILLED} " in message, message
    assert "layer 'layer.1'" in message, message  # its last layer
    assert "session stream closed" in message, message
    assert "rank 0 " not in message and "rank 1 " not in message, message


def test_peers_of_a_rank_killed_in_an_open_round_know_within_a_second(
    sidecar: Sidecar, tmp_path: Path
) -> None:
    group = "liveness-open:fp4/tp1-ep3/pp0"
    with RankProcesses(workers.session_rank, RANKS, (sidecar.target, group)) as ranks:
        _first_round(ranks)
        for rank in SURVIVORS:
            ranks.send(rank, "propose", 2)
        sidecar.wait_for_group(
            group,
            lambda g: g.open_round == 2 and g.waiting_ranks == 2,
            timeout=30,
            what="ranks 0 and 1 waiting in round 2",
        )
        killed_at = ranks.kill(KILLED)
        failed = ranks.expect(SURVIVORS, "failed", 30)
        # The survivors are still running: only the killed rank is gone.
        state = sidecar.get_group(group)

    for rank, failure in failed.items():
        _assert_names_the_killed_rank(failure, 2)
        assert "abandoned" in failure["message"], failure
        seconds = failure["at"] - killed_at
        print(f"rank {rank}: RoundAborted {seconds * 1e3:.1f} ms after the kill")
        assert 0 < seconds < TARGET_S, f"rank {rank} knew {seconds:.3f}s after the kill"
    assert state.open_round == 0
    gone = {r.ep_rank: r.left for r in state.ranks if r.current and r.left}
    assert list(gone) == [KILLED] and "session stream closed" in gone[KILLED]


def test_a_rank_killed_between_rounds_fails_the_next_round_at_once(
    sidecar: Sidecar, tmp_path: Path
) -> None:
    group = "liveness-between:fp4/tp1-ep3/pp0"
    with RankProcesses(workers.session_rank, RANKS, (sidecar.target, group)) as ranks:
        _first_round(ranks)
        ranks.kill(KILLED)
        # No wait for the sidecar to notice: whichever comes first, the
        # departure or the proposals, the round fails at once.
        for rank in SURVIVORS:
            ranks.send(rank, "propose", 2)
        failed = ranks.expect(SURVIVORS, "failed", 30)

    for rank, failure in failed.items():
        _assert_names_the_killed_rank(failure, 2)
        seconds = failure["at"] - failure["started"]
        print(f"rank {rank}: RoundAborted {seconds * 1e3:.1f} ms after proposing")
        assert seconds < TARGET_S, f"rank {rank} waited {seconds:.3f}s for a doomed round"


@pytest.mark.parametrize("mode", ["sidecar", "embedded"])
def test_a_rank_dying_in_the_post_build_barrier_is_rank_lost(
    mode: str, sidecar: Sidecar, tmp_path: Path
) -> None:
    target = sidecar.target if mode == "sidecar" else "embedded"
    results = run_ranks(
        workers.barrier_death_worker,
        RANKS,
        timeout=60,
        tmp_path=tmp_path / "ranks",
        args=(target, f"barrier-death-{mode}:fp4/tp1-ep3/pp0", KILLED),
        # The survivors report what the barrier raised: their watchers must
        # not end them first (the default, exit, would: status 75).
        envs=[{"MOE_SIDECAR_ON_PEER_LOSS": "raise"}] * RANKS,
        dies={KILLED: workers.DEATH_STATUS},
    )
    for rank in SURVIVORS:
        failure = results[rank]
        assert failure["type"] == "RankLost", failure
        assert "RoundAborted" in failure["mro"]
        assert failure["cause"] == "RuntimeError"  # gloo's, kept as the cause
        message = failure["message"]
        assert "the post-build barrier failed" in message, message
        assert f"on rank {rank}" in message, message
        assert not failure["initialized"], failure
        # gloo notices the closed connection; nobody waits for a timeout.
        assert failure["seconds"] < 20, failure
        print(f"rank {rank} ({mode}): RankLost after {failure['seconds']:.3f}s: {message}")
        if mode == "sidecar":
            assert failure["ranks"] == [KILLED], failure
            assert f"rank {KILLED} (last layer 'model.layers.0.mlp') is gone" in message, message
            assert "session stream closed" in message, message
        else:
            assert failure["embedded"]
            assert failure["ranks"] == [], failure
            assert "in embedded mode no sidecar sees which" in message, message
