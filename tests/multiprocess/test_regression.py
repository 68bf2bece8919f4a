"""The seed's regression on 2 CPU ranks: NVFP4 layer, bf16 MTP layer, NVFP4 again.

With the coordinator the workspace grows to the union on the second call
(``moe_alltoall`` is a new object, the old workspace is freed) and the third
call neither shrinks nor rebuilds; dispatch + combine through the reference
backend match a result computed locally after every call. Without the
coordinator (a workspace sized by the first layer) the bf16 combine fails
with FlashInfer's overflow error. Both in sidecar mode (a real sidecar on a
Unix socket) and in embedded mode, with the same plans.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from moe_sidecar.core.plan import Capacities, join_capacities
from moe_sidecar.flashinfer.v0_7_2_post1 import capacities_workspace_bytes
from tests.multiprocess import workers
from tests.multiprocess.harness import Sidecar, run_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

EP = 2


def expected_workspaces() -> list[int]:
    """The union after each call of the regression sequence."""
    union: Capacities | None = None
    sizes = []
    for layer in workers.REGRESSION:
        need = workers.layer_capacities(EP, layer)
        union = need if union is None else join_capacities(union, need)
        sizes.append(capacities_workspace_bytes(union, EP))
    return sizes


def check_regression(results: list[dict[str, Any]]) -> None:
    nvfp4, bf16, nvfp4_again = expected_workspaces()
    assert nvfp4 < bf16 == nvfp4_again, "the bf16 layer must need more than the NVFP4 one"
    for rank, result in enumerate(results):
        first, second, third = result["records"]
        where = f"rank {rank}"
        assert [r["workspace_size"] for r in result["records"]] == [nvfp4, bf16, bf16], where
        assert [r["generation"] for r in result["records"]] == [1, 2, 2], where
        assert all(r["max_num_tokens"] == workers.MAX_TOKENS for r in result["records"]), where
        assert first["delta"]["builds"] == 1 and first["new_object"], where
        # Second call: grew, a new object, the superseded workspace freed.
        assert second["delta"]["rebuilds"] == 1 and second["new_object"], where
        assert second["old_released"] and second["delta"]["releases"] == 1, where
        assert second["live_bytes"] == bf16, f"{where}: only the union workspace is held"
        # Third call: neither shrinks nor rebuilds.
        assert third["delta"]["reuses"] == 1 and not third["new_object"], where
        assert third["delta"]["builds"] == third["delta"]["rebuilds"] == 0, where
        assert all(r["max_error"] == 0.0 for r in result["records"]), where
        # Without the coordinator: the first layer's workspace serves the
        # first layer and overflows on the bf16 combine, as FlashInfer does.
        assert result["naive_first_error"] == 0.0, where
        assert "workspace insufficient for combine payload region" in result["naive_overflow"]
    # Every rank holds the same plans after every call.
    plans = {
        tuple((r["workspace_size"], r["max_num_tokens"], r["generation"]) for r in res["records"])
        for res in results
    }
    assert len(plans) == 1, plans


def test_regression_sequence_through_a_sidecar(sidecar: Sidecar, tmp_path: Path) -> None:
    group = "regression:fp4/tp1-ep2/pp0"
    # target=None: the ranks find the sidecar through MOE_SIDECAR_TARGET.
    results = run_ranks(
        workers.regression_worker,
        EP,
        timeout=60,
        tmp_path=tmp_path,
        args=(None, group),
        envs=[{"MOE_SIDECAR_TARGET": sidecar.target}] * EP,
    )
    check_regression(results)
    assert not results[0]["embedded"] and not results[0]["agrees"]
    for result in results:
        first, second, third = result["records"]
        # Node-local group: a build round is Propose + Commit and one barrier
        # (plus the backend's allocation check), the lifetime's first also its
        # Arrive; a REUSE round one RPC only.
        assert (first["delta"]["rpcs"], second["delta"]["rpcs"]) == (3, 2)
        assert second["dist_calls"] == ["all_gather", "barrier"]
        assert third["delta"]["rpcs"] == 1 and third["dist_calls"] == []
    stored = sidecar.get_group(group)
    assert stored.plan.workspace_bytes == expected_workspaces()[-1]
    assert stored.plan.generation == 2
    assert [r.committed_generation for r in stored.ranks] == [2, 2]
    assert [g.layer for g in stored.history] == ["model.layers.0.mlp", "mtp.mlp"]


def test_regression_sequence_embedded(tmp_path: Path) -> None:
    results = run_ranks(
        workers.regression_worker, EP, timeout=60, tmp_path=tmp_path, args=(None, "")
    )
    check_regression(results)
    assert results[0]["embedded"] and results[0]["agrees"]
    for result in results:
        # Embedded mode agrees across ranks every round: one all-gather, and
        # nothing else on a REUSE round (a rebuild adds the backend's own
        # size exchange and the barrier).
        assert all(r["delta"]["rpcs"] == 0 for r in result["records"])
        assert result["records"][2]["dist_calls"] == ["all_gather"]
        assert result["records"][1]["dist_calls"] == ["all_gather", "all_gather", "barrier"]


def test_reuse_round_is_one_rpc_and_no_collective(sidecar: Sidecar, tmp_path: Path) -> None:
    results = run_ranks(
        workers.reuse_worker,
        EP,
        timeout=60,
        tmp_path=tmp_path,
        args=(sidecar.target, "reuse:fp4/tp1-ep2/pp0"),
    )
    for result in results:
        assert not result["agrees"]
        build, *reuses = result["records"]
        assert build["delta"]["builds"] == 1
        assert len(reuses) == 5
        for record in reuses:
            assert record["delta"]["reuses"] == 1
            assert record["delta"]["rpcs"] == 1, record
            assert record["delta"]["collectives"] == 0, record
            assert record["dist_calls"] == [], record
            assert not record["new_object"]


@pytest.mark.parametrize("mode", ["sidecar", "embedded"])
def test_layer_with_fewer_tokens_than_the_plan(mode: str, sidecar: Sidecar, tmp_path: Path) -> None:
    # FlashInfer's auxiliary data grows with the token count a workspace is
    # built for: a bf16 layer sized at 16 tokens, on a plan built for 20,
    # needs more than its own size. The union of capacities serves it.
    layers = [
        workers.nvfp4_layer("model.layers.0.mlp", max_num_tokens=workers.MAX_TOKENS + 4),
        workers.bf16_layer("mtp.mlp"),
    ]
    own = [capacities_workspace_bytes(workers.layer_capacities(EP, layer), EP) for layer in layers]
    target = sidecar.target if mode == "sidecar" else "embedded"
    results = run_ranks(
        workers.layers_worker,
        EP,
        timeout=60,
        tmp_path=tmp_path,
        args=(target, f"fewer-tokens:{mode}/tp1-ep2/pp0", layers),
    )
    for records in results:
        assert [r["max_error"] for r in records] == [0.0, 0.0]
        assert records[1]["max_num_tokens"] == workers.MAX_TOKENS + 4
        assert records[1]["workspace_size"] > max(own)
        assert records[1]["generation"] > records[0]["generation"]
    assert results[0] == [
        {**r, "seconds": mine["seconds"]} for r, mine in zip(results[1], results[0], strict=True)
    ]
