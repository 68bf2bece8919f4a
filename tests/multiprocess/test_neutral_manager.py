"""The engine-neutral manager alone: the seed's regression stated as capacities.

Two CPU ranks run :class:`moe_sidecar.client.manager.AlltoAllManager` on the
reference backend with no engine (no vLLM argument form anywhere): each
layer's need is a ``LayerNeed`` of capacities and a dispatch row. Through a
real sidecar and in embedded mode the workspace grows to the union once,
never shrinks, and dispatch + combine stay exact; the manager has none of
vLLM's surface.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from tests.multiprocess import workers
from tests.multiprocess.harness import Sidecar, run_ranks
from tests.multiprocess.test_regression import EP, expected_workspaces

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

VLLM_SURFACE = ("initialize", "combine_into", "get_handle", "initialized", "workspace_size")


def neutral_worker(rank: int, world: int, target: str | None, group: str) -> dict[str, Any]:
    """The regression's layers through ``AlltoAllManager.initialize_layer``."""
    import torch.distributed as dist

    from moe_sidecar.client.layer_need import LayerNeed, Layout
    from moe_sidecar.client.manager import AlltoAllManager

    cpu_group = dist.new_group(backend="gloo")
    manager = AlltoAllManager(cpu_group, group=group, target=target, backend="reference")
    records = []
    for seed, layer in enumerate(workers.REGRESSION):
        # The row as FlashInfer's moe_ep object names it: NVFP4 or bf16 rows.
        name = "NVFP4" if layer.x_sf_bytes else None
        layout = Layout(workers.HIDDEN, name, name, layer.x_bytes + layer.x_sf_bytes, 0)
        need = LayerNeed(workers.layer_capacities(world, layer), layout, layer.name)
        before = manager.moe_alltoall
        manager.initialize_layer(need)
        handle = manager.moe_alltoall
        records.append(
            {
                "workspace": manager.workspace_bytes,
                "generation": manager.generation,
                "new_object": handle is not before,
                "max_error": workers.exchange(handle, layer, rank, world, seed=seed),
            }
        )
    communication = manager.get_communication()
    out: dict[str, Any] = {
        "records": records,
        "counters": asdict(manager.counters),
        "row": (communication.params.hidden_size, communication.params.max_tokens_per_rank),
        "vllm_surface": [n for n in VLLM_SURFACE if hasattr(manager, n)],
    }
    manager.cleanup()
    out["after_cleanup"] = (manager.plan, manager.workspace_bytes)
    return out


def _check(results: list[dict[str, Any]]) -> None:
    nvfp4, bf16, _ = expected_workspaces()
    for rank, out in enumerate(results):
        where = f"rank {rank}"
        assert [r["workspace"] for r in out["records"]] == [nvfp4, bf16, bf16], where
        assert [r["generation"] for r in out["records"]] == [1, 2, 2], where
        assert [r["new_object"] for r in out["records"]] == [True, True, False], where
        assert all(r["max_error"] == 0.0 for r in out["records"]), where
        counters = out["counters"]
        assert (counters["builds"], counters["rebuilds"], counters["reuses"]) == (1, 1, 1), where
        assert counters["releases"] == 1, f"{where}: the NVFP4 workspace is given back"
        assert out["row"] == (workers.HIDDEN, workers.MAX_TOKENS), where
        assert out["vllm_surface"] == [], where
        assert out["after_cleanup"] == (None, 0), where


def test_the_neutral_manager_through_a_sidecar(sidecar: Sidecar, tmp_path: Path) -> None:
    group = "neutral:fp4/tp1-ep2/pp0"
    results = run_ranks(
        neutral_worker, EP, timeout=60, tmp_path=tmp_path, args=(sidecar.target, group)
    )
    _check(results)
    stored = sidecar.get_group(group)
    assert (stored.plan.workspace_bytes, stored.plan.generation) == (expected_workspaces()[1], 2)


def test_the_neutral_manager_embedded(tmp_path: Path) -> None:
    results = run_ranks(
        neutral_worker, EP, timeout=60, tmp_path=tmp_path, args=("embedded", "neutral/embedded")
    )
    _check(results)
