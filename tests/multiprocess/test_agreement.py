"""Cross-rank agreement, FlashInfer's communicator and the reference backend,
on real gloo ranks: 3 processes, an EP group of ranks 0 and 1, rank 2 outside
it (so a collective on the world instead of the EP group would hang)."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_sidecar.core.plan import Capacities
from tests.multiprocess import workers
from tests.multiprocess.harness import run_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


def test_agreement_communicator_and_reference_backend(tmp_path: Path) -> None:
    results = run_ranks(workers.agreement_worker, 3, timeout=60, tmp_path=tmp_path)
    assert results[2] == {}
    for rank, out in enumerate(results[:2]):
        # The decision core's join: neither plan dominates, so the joined
        # capacities get a generation above both; a higher epoch wins whole.
        assert out["agreed"] == (Capacities(32, 400, 300, 2, 8), 0, 6)
        assert out["agreed_epoch"] == (Capacities(32, 100, 300, 2, 8), 1, 5)
        # A failed rank: everyone raises its error class, naming it and its layer.
        kind, message, is_cause = out["failed"]
        assert kind == "PreconditionFailed"
        assert "rank 1 (layer 'mtp'): boom on rank 1" in message
        assert "1 of 2 ranks failed" in message
        assert is_cause == (rank == 1)
        kind, message = out["disagree"]
        assert kind == "AgreementError"
        assert "layer 'L7'" in message and "top_k=4" in message and "top_k=2" in message
        # The communicator: one EP group, renumbered by Split keys, one color only.
        assert out["comm"] == (rank, 2, ("r0", "r1"), "from1")
        same_rank, reversed_rank, gathered, root_value = out["split"]
        assert same_rank == rank and reversed_rank == 1 - rank
        assert gathered == (1, 0) and root_value == 1
        assert "Split into 2 colors" in out["multi_color"]
        # The reference backend: a non-divisible expert partition, release
        # returning the memory, and FlashInfer's dispatch check.
        assert out["five_experts_error"] == 0.0
        assert out["live_before_release"] == 1 << 20
        assert out["live_after_release"] == 0
        assert "released" in out["after_release"]
        assert "workspace size per rank insufficient, need" in out["dispatch_overflow"]
        assert "bytes but has" in out["dispatch_overflow"]
