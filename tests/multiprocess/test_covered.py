"""Covered rounds do not wait: real sidecars, real rank processes, real etcd.

A round whose layer the built plan covers sends its proposal and returns;
its answer is read later, in order: before a round that waits, in
``get_communication()`` / ``moe_alltoall`` and in ``cleanup()``.

* The rank really does not wait: rank 0 finishes its covered rounds while
  rank 1 has not proposed them yet (it is held until rank 0 is done).
* At most ``max_unanswered`` answers are ever outstanding: past it a
  covered round reads the oldest first.
* A refusal found in a covered round (rank 1 names another layer) is raised
  on every rank, naming both layers, at the next round that waits, at
  ``get_communication()`` or at ``cleanup()``.
* One rank needing growth in a round the other passed as covered: every
  rank of the round got the same REBUILD; the rank that waited builds at
  once, the other when it reads the answer, and their build collectives
  meet: both end on the same larger workspace, exchange through it, and
  nobody hangs.
* A plan merged from another node (through etcd) above what was built: the
  covered rounds' answers are REBUILD, and every rank rebuilds once, when it
  reads them.
* Embedded mode: covered rounds skip the all-gather; ``get_communication()``
  agrees once; a rank needing growth in a round its peer passed as covered
  puts them out of step, and both raise naming the rounds.
"""

from __future__ import annotations

import multiprocessing
import threading
from pathlib import Path

import pytest

from moe_sidecar.client.transport import GrpcTransport
from moe_sidecar.core.group import Proposal, Requirement
from moe_sidecar.core.plan import Action
from tests.etcd_server import EtcdServer
from tests.multiprocess import covered_workers, workers
from tests.multiprocess.harness import Sidecar, run_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(150)]


def test_covered_rounds_return_before_the_peers_propose(sidecar: Sidecar, tmp_path: Path) -> None:
    covered = 5
    results = run_ranks(
        covered_workers.no_wait_worker,
        2,
        timeout=90,
        tmp_path=tmp_path,
        args=(sidecar.target, "covered/no-wait", covered),
    )
    for rank, result in enumerate(results):
        where = f"rank {rank}: {result}"
        assert result["covered"] == covered and result["reuses"] == covered, where
        assert (result["builds"], result["rebuilds"]) == (1, 0), where
        assert result["after"] == 0 and result["max_error"] == 0.0, where
        assert result["communication"] == "ReferenceCommunication", where
        # The hostname exchange at construction, the group proof's broadcast at
        # the first initialize() and the post-build barrier only.
        assert result["collectives"] == 3, where
    # Rank 0 went through every covered round before rank 1 proposed any:
    # nothing was answered yet, so the messages piled up on its stream.
    assert results[0]["unanswered"] == list(range(1, covered + 1)), results[0]
    group = sidecar.get_group("covered/no-wait")
    assert group.last_closed_round == 1 + covered
    assert [r.last_layer for r in group.ranks] == [f"model.layers.{covered}.mlp"] * 2


def test_covered_rounds_leave_at_most_max_unanswered_outstanding(
    sidecar: Sidecar, tmp_path: Path
) -> None:
    window, covered = 2, 5
    results = run_ranks(
        covered_workers.window_worker,
        2,
        timeout=90,
        tmp_path=tmp_path,
        args=(sidecar.target, "covered/window", window, covered),
    )
    for rank, result in enumerate(results):
        where = f"rank {rank}: {result}"
        # An answer is only taken off when the rank reads it: the count grows
        # to the window, and from there each covered round reads the oldest
        # answer before it sends its own.
        assert result["unanswered"] == [1] + [window] * (covered - 1), where
        assert result["after"] == 0, where
        assert result["covered"] == covered and result["reuses"] == covered, where
        assert (result["builds"], result["rebuilds"]) == (1, 0), where
    group = sidecar.get_group("covered/window")
    assert group.last_closed_round == 1 + covered


@pytest.mark.parametrize("settle", ["communication", "growth", "cleanup"])
def test_a_refused_covered_round_raises_on_every_rank(
    sidecar: Sidecar, tmp_path: Path, settle: str
) -> None:
    results = run_ranks(
        covered_workers.refused_worker,
        2,
        timeout=90,
        tmp_path=tmp_path,
        args=(sidecar.target, f"covered/refused-{settle}", settle),
    )
    for rank, result in enumerate(results):
        where = f"rank {rank} ({settle}): {result}"
        assert result["returned"] and result["covered"] == 2, where
        raised = result["raised"]
        assert raised is not None and raised["type"] == "PreconditionFailed", where
        message = raised["message"]
        assert "round 3" in message, where
        assert "'model.layers.2.mlp'" in message and "'model.layers.7.mlp'" in message, where
        assert "rank 0" in message and "rank 1" in message, where


def test_growth_in_a_round_another_rank_passed_as_covered(sidecar: Sidecar, tmp_path: Path) -> None:
    results = run_ranks(
        covered_workers.growth_in_covered_round_worker,
        2,
        timeout=90,
        tmp_path=tmp_path,
        args=(sidecar.target, "covered/mixed"),
    )
    assert results[0]["workspace_size"] == results[1]["workspace_size"]
    for rank, result in enumerate(results):
        where = f"rank {rank}: {result}"
        assert result["generation"] == 2 and result["max_num_tokens"] == 2 * workers.MAX_TOKENS
        assert (result["builds"], result["rebuilds"]) == (1, 1), where
        assert result["max_error"] == 0.0, where
    # Rank 0 passed round 3 and the two after it as covered; rank 1 waited in
    # round 3 (it needed more) and passed rounds 4 and 5.
    assert results[0]["covered"] == 4 and results[1]["covered"] == 3, results
    group = sidecar.get_group("covered/mixed")
    assert [r.committed_generation for r in group.ranks] == [2, 2]
    assert group.plan.capacities.max_tokens == 2 * workers.MAX_TOKENS


def _raise_plan_on_other_node(
    group: str, ours: Sidecar, other: Sidecar, merged: object, failures: list[str]
) -> None:
    """Once ``ours`` holds the ranks' first build, two ranks of another node
    (a pod of the same group elsewhere) build larger on ``other``; sets
    ``merged`` when ``ours`` has merged that plan from etcd."""
    try:
        first = ours.wait_for_group(
            group,
            lambda g: [r.committed_generation for r in g.ranks] == [1, 1],
            timeout=60,
            what="both ranks committed the first build",
        ).plan.capacities
        need = workers.layer_capacities(2, workers.nvfp4_layer("x", max_num_tokens=64))
        assert need.max_tokens > first.max_tokens
        decisions: list[object] = [None, None]

        def propose(rank: int) -> None:
            transport = GrpcTransport(other.target)
            decisions[rank] = transport.propose(
                Proposal(group, 2, rank, 2, f"other-node-{rank}-token", 1, Requirement(need, "L0"))
            )
            transport.close()

        threads = [threading.Thread(target=propose, args=(rank,)) for rank in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        assert all(getattr(d, "action", None) is Action.BUILD for d in decisions), decisions
        ours.wait_for_group(
            group,
            lambda g: g.plan.capacities.max_tokens == need.max_tokens,
            timeout=60,
            what="the other node's plan merged",
        )
        merged.set()  # type: ignore[attr-defined]
    except Exception as error:
        failures.append(repr(error))


@pytest.mark.etcd
def test_a_plan_merged_from_another_node_rebuilds_every_rank_once(
    etcd_server: EtcdServer, tmp_path: Path
) -> None:
    group = "covered/merged"
    store = ("--store", f"etcd://{etcd_server.endpoint}/covered")
    ours = Sidecar(tmp_path / "node0", args=store).start()
    other = Sidecar(tmp_path / "node1", args=store).start()
    try:
        merged = multiprocessing.get_context("spawn").Event()
        failures: list[str] = []
        raiser = threading.Thread(
            target=_raise_plan_on_other_node, args=(group, ours, other, merged, failures)
        )
        raiser.start()
        try:
            results = run_ranks(
                covered_workers.merged_plan_worker,
                2,
                timeout=120,
                tmp_path=tmp_path,
                args=(ours.target, group, merged, 3),
            )
        finally:
            # When the other node's ranks failed, the ranks here fail first
            # (never merged): the cause is what the raiser saw.
            raiser.join(timeout=60)
            assert not failures, failures
        for rank, result in enumerate(results):
            where = f"rank {rank}: {result}"
            assert result["first_generation"] == 1 and result["covered"] == 3, where
            assert (result["builds"], result["rebuilds"]) == (1, 1), where
            assert result["max_num_tokens"] == 64, where
        assert results[0]["generation"] == results[1]["generation"] > 1
        state = ours.get_group(group)
        assert [r.committed_generation for r in state.ranks] == [results[0]["generation"]] * 2
    finally:
        ours.stop()
        other.stop()


def test_embedded_covered_rounds_skip_the_agreement(tmp_path: Path) -> None:
    results = run_ranks(
        covered_workers.embedded_worker,
        2,
        timeout=90,
        tmp_path=tmp_path,
        args=("covered/embedded", False),
    )
    for rank, result in enumerate(results):
        where = f"rank {rank}: {result}"
        assert result["raised"] is None and result["max_error"] == 0.0, where
        assert result["per_round"] == [0, 0, 0, 0] and result["covered"] == 4, where
        # Round 1's agreement and barrier, then one agreement before use.
        assert result["built_collectives"] == 2 and result["collectives"] == 3, where


def test_embedded_ranks_out_of_step_raise_on_every_rank(tmp_path: Path) -> None:
    results = run_ranks(
        covered_workers.embedded_worker,
        2,
        timeout=90,
        tmp_path=tmp_path,
        args=("covered/embedded-out-of-step", True),
    )
    for rank, result in enumerate(results):
        where = f"rank {rank}: {result}"
        raised = result["raised"]
        assert raised is not None and raised["type"] == "AgreementError", where
        message = raised["message"]
        assert "out of step" in message, where
        assert "rank 0 (layer 'model.layers.4.mlp') is settling after round 5" in message, where
        assert "rank 1 (layer 'model.layers.2.mlp') needs round 3 agreed" in message, where
