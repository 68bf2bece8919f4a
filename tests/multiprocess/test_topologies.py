"""Layouts beyond one EP group on one node: pipeline stages, two nodes.

* Pipeline parallelism: 4 ranks as 2 stages x EP 2, where stage 1 grows once
  more than stage 0. Every barrier and agreement is scoped to the stage's EP
  group, so everything finishes (a world-wide barrier would leave stage 1
  waiting for stage 0 in its extra rebuild).
* Two simulated nodes: 8 ranks in one EP group, 4 per node, each node with
  its own sidecar. Each sidecar decides for its 4 ranks; the cross-node
  all-reduce makes all 8 hold the same plan and generation, and the commits
  teach both sidecars the agreed plan.
* ``mask`` over two sidecars: refused by name at every rank's first
  ``initialize()``, before anything is shared or proposed, since each node
  would commit a view of its own; on one sidecar the same ranks build.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.multiprocess import workers
from tests.multiprocess.harness import Sidecar, run_ranks, running_sidecar

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(150)]


def test_pipeline_stages_rebuild_independently(sidecar: Sidecar, tmp_path: Path) -> None:
    results = run_ranks(
        workers.pipeline_worker, 4, timeout=90, tmp_path=tmp_path, args=(sidecar.target,)
    )
    for mode in ("sidecar", "embedded"):
        by_stage: dict[int, list[list[tuple[int, int]]]] = {}
        for rank, result in enumerate(results):
            records = result["results"][mode]
            assert all(r["max_error"] == 0.0 for r in records), (mode, rank)
            rebuilds = sum(r["delta"]["rebuilds"] for r in records)
            assert rebuilds == result["stage"], (mode, rank, rebuilds)
            plans = [(r["workspace_size"], r["generation"]) for r in records]
            by_stage.setdefault(result["stage"], []).append(plans)
        # The two ranks of a stage agree; the stages differ.
        for stage, stage_plans in by_stage.items():
            assert stage_plans[0] == stage_plans[1], (mode, stage)
        assert by_stage[0][0][-1][1] == 1 and by_stage[1][0][-1][1] == 2, mode
    for stage in (0, 1):
        stored = sidecar.get_group(f"pp-test:sidecar/tp1-ep2/pp{stage}")
        assert stored.plan.generation == stage + 1


def test_two_nodes_agree_on_one_plan(tmp_path: Path) -> None:
    group = "two-nodes:fp4/tp1-ep8/pp0"
    with (
        running_sidecar(tmp_path / "node0") as node0,
        running_sidecar(tmp_path / "node1") as node1,
    ):
        results = run_ranks(
            workers.two_nodes_worker,
            8,
            timeout=120,
            tmp_path=tmp_path,
            args=([node0.target, node1.target],),
        )
        stored = [node0.get_group(group), node1.get_group(group)]
    assert all(result["agrees"] for result in results)
    histories = {
        tuple((r["workspace_size"], r["max_num_tokens"], r["generation"]) for r in res["records"])
        for res in results
    }
    assert len(histories) == 1, histories
    (history,) = histories
    # Node 1's larger first layer reached node 0 through the agreement.
    assert history[0][1] == workers.MAX_TOKENS + 4
    # The generation moves exactly when the plan grows (each node's sidecar
    # counts its own generations; ranks agree on the largest).
    (g0, g1, g2) = [generation for _, _, generation in history]
    assert g0 < g1 == g2
    assert history[0][0] < history[1][0] == history[2][0]
    for result in results:
        assert all(r["max_error"] == 0.0 for r in result["records"])
        # Every round: one RPC (two with the commit, three with the first
        # round's Arrive) and one all-gather.
        assert [r["delta"]["rpcs"] for r in result["records"]] == [3, 2, 1]
        assert result["records"][2]["dist_calls"] == ["all_gather"]
    final_bytes, final_tokens, final_generation = history[-1]
    for sidecar_view in stored:
        assert sidecar_view.local_ranks == 4
        assert sidecar_view.plan.workspace_bytes == final_bytes
        assert sidecar_view.plan.capacities.max_tokens == final_tokens
        assert sorted(r.committed_generation for r in sidecar_view.ranks) == [final_generation] * 4


def _mask_first_rounds(tmp_path: Path, nodes: int, group: str) -> tuple[list[Any], list[list[str]]]:
    """4 ranks under ``mask`` over ``nodes`` real sidecars; each rank's first
    round, and what each sidecar then holds of the group."""
    sidecars = [Sidecar(tmp_path / f"node{n}").start() for n in range(nodes)]
    try:
        results = run_ranks(
            workers.mask_across_sidecars_worker,
            4,
            timeout=60,
            tmp_path=tmp_path,
            args=([s.target for s in sidecars], group),
            envs=[{"MOE_SIDECAR_ON_PEER_LOSS": "mask"}] * 4,
        )
        groups = [s.group_names() for s in sidecars]
    finally:
        for sidecar in sidecars:
            sidecar.stop()
    return results, groups


def test_mask_is_refused_when_the_group_spans_sidecars(tmp_path: Path) -> None:
    group = "mask-two-nodes:fp4/tp1-ep4/pp0"
    results, groups = _mask_first_rounds(tmp_path, 2, group)
    for rank, result in enumerate(results):
        for call in (result["first"], result["again"]):
            assert call["type"] == "PreconditionFailed", (rank, call)
            # Raised by the rank itself, not answered by a sidecar.
            assert call["grpc_code"] is None, (rank, call)
            message = call["message"]
            assert message.startswith("MOE_SIDECAR_ON_PEER_LOSS=mask: refused"), message
            assert group in message and "span more than one sidecar" in message, message
            assert "4 ranks" in message and "2 on this rank's node" in message, message
            # Refused at once: nothing waited for a peer.
            assert call["seconds"] < 5, (rank, call)
        assert result["generation"] == 0, rank
    # Nothing was shared or proposed: neither sidecar heard of the group.
    assert groups == [[], []]


def test_mask_on_one_sidecar_builds(tmp_path: Path) -> None:
    group = "mask-one-node:fp4/tp1-ep4/pp0"
    results, groups = _mask_first_rounds(tmp_path, 1, group)
    for rank, result in enumerate(results):
        assert result["first"]["type"] is None, (rank, result["first"])
        assert result["generation"] == 1, rank
    assert groups == [[group]]
