"""Every vLLM generation's calls through one manager, on 2 CPU ranks.

vLLM 0.33's capacity contract (its grow test's assertions, tests/contracts.py)
through ``get_communication()`` of the reference backend, exact round trips
at the full token count of every layer it initialized, checkpoint and
``destroy()``; PR #42976's and 0.30's call styles, positional and keyword,
with refused calls in between. Sidecar mode (a real sidecar) and embedded.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_sidecar.flashinfer.v0_7_2_post1 import workspace_size_per_rank
from tests.multiprocess import workers
from tests.multiprocess.harness import Sidecar, run_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

EP = 2


@pytest.mark.parametrize("mode", ["sidecar", "embedded"])
def test_every_generation_through_one_manager(mode: str, sidecar: Sidecar, tmp_path: Path) -> None:
    target = sidecar.target if mode == "sidecar" else "embedded"
    results = run_ranks(
        workers.generations_worker,
        EP,
        timeout=180,
        tmp_path=tmp_path,
        args=(target, f"generations:{mode}/ep2"),
    )
    # vLLM 0.33's union: 2048 tokens, hidden 8192 (combine), 6144 * 2 dispatch bytes.
    union = workspace_size_per_rank(EP, 2048, 6144 * 2 + 8 * 4, 8192 * 2)
    hidden, t, k = workers.HIDDEN, workers.MAX_TOKENS, workers.TOP_K
    nvfp4 = workspace_size_per_rank(EP, t, hidden // 2 + hidden // 16 + 8 * k, 2 * hidden)
    bf16 = workspace_size_per_rank(EP, t, 2 * hidden + 8 * k, 2 * hidden)
    for rank, out in enumerate(results):
        where = f"rank {rank}"
        assert "before initialize" in out["before_initialize"], where
        # Every superseded moe_ep object was destroyed, the current one not.
        assert out["destroyed"] == [True, True, True, True, True, False], where
        assert out["workspace_size"] == union and out["live"] == union, where
        assert out["params"] == (8192, 2048) and out["max_num_tokens"] == 2048, where
        for name, trip in out["trips"].items():
            assert trip["max_error"] == 0.0 and trip["bad_rows"] == 0, (where, name, trip)
            assert trip["rows"] == EP * 2048 and trip["output_is_output"], (where, name, trip)
            assert trip["received_tokens"] > 0, (where, name)
        assert out["trips"]["4096/bf16/256"]["shapes"]["hidden_states_scale"] == [EP * 2048, 256]
        assert out["trips"]["8192/nvfp4/None"]["shapes"]["hidden_states"] == [EP * 2048, 4096]
        assert out["live_unmapped"] == 0 and out["live_restored"] == union, where
        assert "unmapped" in out["unmapped_dispatch"], where
        assert out["after_restore"]["max_error"] == 0.0 and out["same_after_restore"], where
        assert out["live_after_destroy"] == 0 and out["shared_destroyed"], where
        # PR #42976 NVFP4 positional, 0.30 NVFP4 keywords (reuse), PR bf16
        # (grows), 0.30 bf16 positional (reuse): each generation's own sizes.
        assert out["older_sizes"] == [nvfp4, nvfp4, bf16, bf16], where
        assert out["older_generation"] == 2, where
        assert len(out["older_refusals"]) == 4, where
        assert all("5th argument=100" in text for text in out["older_refusals"]), where
        assert out["older_exchange"] == 0.0, where
    if mode == "sidecar":
        group = sidecar.get_group("generations:sidecar/ep2/v033")
        assert group.plan.workspace_bytes == union
        older = sidecar.get_group("generations:sidecar/ep2/older")
        assert [g.layer for g in older.history] == ["", ""]
