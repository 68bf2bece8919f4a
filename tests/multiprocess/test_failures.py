"""Divergence and restarts: clear errors instead of hangs, and warm starts.

* Divergence: one rank proposes another layer shape (top_k). Every rank gets
  a clear error naming the rank and the layer, well within the round
  timeout: the sidecar refuses the round for all its ranks; in embedded mode
  the cross-rank all-reduce finds it.
* Warm restart: a model's layer sequence, then the rank processes restarted
  against the same sidecar: round 1 already gets the historical union, so
  the second start builds exactly once and never rebuilds.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multiprocess import workers
from tests.multiprocess.harness import Sidecar, run_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(150)]


def test_divergent_rank_fails_every_rank_naming_it(sidecar: Sidecar, tmp_path: Path) -> None:
    results = run_ranks(
        workers.divergence_worker,
        2,
        timeout=60,
        tmp_path=tmp_path,
        args=(sidecar.target, "diverge:fp4/tp1-ep2/pp0"),
    )
    for result in results:
        assert result["type"] == "PreconditionFailed", result
        assert result["grpc_code"] == "FAILED_PRECONDITION"
        assert "rank 1" in result["message"] and "'mtp.mlp'" in result["message"]
        assert "top_k=4" in result["message"]
        assert result["seconds"] < sidecar.round_timeout / 2, result


def test_divergence_in_embedded_mode(tmp_path: Path) -> None:
    results = run_ranks(workers.embedded_divergence_worker, 2, timeout=60, tmp_path=tmp_path)
    for result in results:
        first = result["round_one"]
        # Round 1: each rank's own core accepts its shape; the all-reduce
        # sees top_k differ and names the odd rank and its layer.
        assert first["type"] == "AgreementError", first
        assert "PreconditionFailed" in first["mro"]
        assert "rank 1 layer 'L0' has top_k=4" in first["message"]
        # Round 2: rank 1's core refuses the heterogeneous layer; rank 0 was
        # fine but raises the same error, naming rank 1 and its layer.
        second = result["round_two"]
        assert second["type"] == "PreconditionFailed", second
        assert "rank 1 (layer 'mtp')" in second["message"]
        assert "top_k=4" in second["message"]
        assert first["seconds"] < 10 and second["seconds"] < 10
        assert first["grpc_code"] is None


def test_warm_restart_builds_once(sidecar: Sidecar, tmp_path: Path) -> None:
    group = "warm:fp4/tp1-ep2/pp0"
    starts = []
    for start in range(2):
        starts.append(
            run_ranks(
                workers.warm_restart_worker,
                2,
                timeout=60,
                tmp_path=tmp_path / f"start{start}",
                args=(sidecar.target, group),
            )
        )
    cold, warm = starts
    union = cold[0]["records"][-1]["workspace_size"]
    for result in cold:
        assert result["counters"]["builds"] == 1 and result["counters"]["rebuilds"] == 1
    for result in warm:
        assert result["counters"]["builds"] == 1, result["counters"]
        assert result["counters"]["rebuilds"] == 0, result["counters"]
        # Built at the union from round 1, before the bf16 layer is reached.
        assert result["records"][0]["workspace_size"] == union
        assert result["records"][0]["generation"] == cold[0]["records"][-1]["generation"]
        assert result["max_error"] == 0.0
        assert result["lifetime"] not in {r["lifetime"] for r in cold}
    stored = sidecar.get_group(group)
    assert stored.lifetimes == 2
    assert stored.plan.workspace_bytes == union
