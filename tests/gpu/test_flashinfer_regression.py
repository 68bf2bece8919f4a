"""The regression, for real: FlashInfer's MoeAlltoAll on 2 ranks through the sidecar.

* Sized by the first (NVFP4) layer alone, a bf16 MTP layer's combine raises
  FlashInfer's ``workspace insufficient for combine payload region``.
* Through ``WorkspaceManager(backend="flashinfer")`` and a real sidecar on a
  Unix socket: NVFP4, bf16, NVFP4 again; after each, dispatch + combine give
  exactly what the CPU predicts; the workspace grows once and never shrinks;
  the superseded workspace's device memory comes back, so what the
  all-to-all holds is the union workspace only.
* Warm restart: new rank processes against the same sidecar build once, at
  the union size, and the bf16 layer runs without a rebuild.

Two GPUs, one rank each; or one GPU that both ranks share (``MoeAlltoAll``
runs so), where device memory is read for both ranks together.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.gpu import workers
from tests.gpu.workers import world
from tests.multiprocess.harness import run_ranks, running_sidecar

pytestmark = [pytest.mark.gpu(gpus=1, flashinfer="0.7.2.post1"), pytest.mark.timeout(300)]

GROUP = "gpu-regression:nvfp4+bf16-mtp/ep2/pp0"


def _overflow_rank(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist

    from moe_sidecar.client import sizing
    from moe_sidecar.client.backends import BuildSpec
    from moe_sidecar.client.backends.flashinfer import FlashInferBackend

    workers.warm_up_cuda(rank)
    first = sizing.layer_capacities(
        world_size,
        workers.TOKENS,
        workers.TOP_K,
        workers.NUM_EXPERTS,
        workers.HIDDEN,
        workers.NVFP4.x_bytes_per_token,
        workers.NVFP4.x_sf_bytes_per_token,
    )
    backend = FlashInferBackend(world())
    workspace = backend.workspace_bytes(first, world_size)
    a2a = backend.build(
        BuildSpec(
            ep_size=world_size,
            ep_rank=rank,
            capacities=first,
            workspace_size_per_rank=workspace,
        )
    )
    workers.round_trip(a2a, workers.NVFP4, rank, world_size)
    try:
        workers.round_trip(a2a, workers.BF16_MTP, rank, world_size, check=False)
    except RuntimeError as error:
        message = str(error)
    else:
        message = ""
    dist.barrier()
    return {"error": message, "workspace": workspace}


def test_first_layer_sizing_overflows_on_the_bf16_combine(tmp_path: Path) -> None:
    results = run_ranks(_overflow_rank, 2, timeout=180, tmp_path=tmp_path)
    for rank, result in enumerate(results):
        assert "workspace insufficient for combine payload region" in result["error"], (
            rank,
            result,
        )


def _sequence_rank(rank: int, world_size: int, target: str) -> dict[str, Any]:
    import torch.distributed as dist

    from moe_sidecar.client import WorkspaceManager

    workers.warm_up_cuda(rank)
    manager = WorkspaceManager(world(), group=GROUP, target=target, backend="flashinfer")
    steps = []
    unit = 0
    for layer in workers.SEQUENCE:
        before = workers.memory_mark()
        previous = manager.moe_alltoall
        manager.initialize(
            workers.TOKENS,
            workers.TOP_K,
            workers.NUM_EXPERTS,
            workers.HIDDEN,
            layer.x_bytes_per_token,
            layer.x_sf_bytes_per_token,
            layer=layer.label,
        )
        held = workers.held_bytes_change(before)
        unit = unit or workers.granularity()
        workers.round_trip(manager.moe_alltoall, layer, rank, world_size)
        steps.append(
            {
                "layer": layer.label,
                "workspace": manager.workspace_size,
                "generation": manager.generation,
                "new_object": manager.moe_alltoall is not previous,
                "held_change": held,
            }
        )
    counters = manager.counters
    dist.barrier()
    return {
        "steps": steps,
        "granularity": unit,
        "ranks_per_gpu": workers.ranks_per_gpu(),
        "builds": counters.builds,
        "rebuilds": counters.rebuilds,
        "reuses": counters.reuses,
        "rpcs": counters.rpcs,
        "unreleased": manager.backend.unreleased,  # type: ignore[attr-defined]
    }


def test_regression_then_warm_restart_through_the_sidecar(tmp_path: Path) -> None:
    with running_sidecar(tmp_path / "sidecar", round_timeout=60) as sidecar:
        first = run_ranks(
            _sequence_rank, 2, timeout=240, tmp_path=tmp_path / "first", args=(sidecar.target,)
        )
        second = run_ranks(
            _sequence_rank, 2, timeout=240, tmp_path=tmp_path / "second", args=(sidecar.target,)
        )
        group = sidecar.get_group(GROUP)

    for result in first:
        print("first lifetime", result)
        nvfp4, bf16, again = result["steps"]
        unit = result["granularity"]
        assert bf16["workspace"] > nvfp4["workspace"]
        assert again["workspace"] == bf16["workspace"]  # never shrinks
        assert [s["new_object"] for s in result["steps"]] == [True, True, False]
        assert (result["builds"], result["rebuilds"], result["reuses"]) == (1, 1, 1)
        assert result["unreleased"] == 0
        # Device memory: the first build takes the NVFP4 workspace, the
        # rebuild takes the union and gives the NVFP4 one back, the reuse
        # takes nothing: what stays held is the union workspace only.
        # (Times the ranks sharing the GPU, when they do.)
        per_gpu = result["ranks_per_gpu"]
        assert nvfp4["held_change"] == per_gpu * workers.aligned(nvfp4["workspace"], unit)
        assert bf16["held_change"] == per_gpu * (
            workers.aligned(bf16["workspace"], unit) - workers.aligned(nvfp4["workspace"], unit)
        )
        assert again["held_change"] == 0
    for result in second:
        print("second lifetime", result)
        steps = result["steps"]
        union = first[0]["steps"][1]["workspace"]
        assert [s["workspace"] for s in steps] == [union, union, union]
        assert [s["new_object"] for s in steps] == [True, False, False]
        assert (result["builds"], result["rebuilds"], result["reuses"]) == (1, 0, 2)
        assert steps[0]["held_change"] == result["ranks_per_gpu"] * workers.aligned(
            union, result["granularity"]
        )
    assert group.plan.workspace_bytes == first[0]["steps"][1]["workspace"]
    assert group.lifetimes == 2
