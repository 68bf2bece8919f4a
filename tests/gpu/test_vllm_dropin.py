"""The vLLM drop-in, for real: FlashInfer 0.7.2.post1 at EP 2, every call style vLLM makes.

vLLM itself cannot travel to the GPU machine (its wheel is 336 MB); the CPU
tests (tests/vllm) run vLLM's own code against the manager. Here the same
calls run against FlashInfer's real all-to-all:

* vLLM PR #42976's regression test body (``test_one_sided_manager_workspace_grow``
  in vLLM's ``tests/distributed/test_mnnvl_alltoall.py``), copied below with two lines changed and
  marked: the class is the manager (what vLLM's plugin puts in place of
  vLLM's), and the CPU group is the 2-rank world (vLLM's ``get_dp_group()``
  with ``dp_size=2, tp=1`` is those same ranks). Its 0.30 version too. Every
  workspace is FlashInfer's own ``moe_a2a_get_workspace_size_per_rank`` of
  what that vLLM computes; after ``cleanup()`` nothing stays allocated.
* vLLM 0.33's call style: its grow-test assertions (tests/contracts.py) with
  FlashInfer's own ``QuantFormat``, ``get_communication()`` being FlashInfer's
  ``NVLinkOneSidedAlltoAll``; then ``dispatch(x, topk_ids, topk_weights,
  hidden_states_scale=, max_tokens_per_rank=)`` and ``combine(out, output=)``
  for every layer it initialized, at the full 2048 tokens, checked exactly;
  the device memory held is the union workspace only, and ``destroy()``
  gives it back.

Both in sidecar mode (a real sidecar on a Unix socket) and in embedded mode.
Two GPUs, one rank each; or one GPU that both ranks share, where device
memory is read for both ranks together.
Run: ``python3 -m pytest tests/gpu/test_vllm_dropin.py -v -s`` (docs/development.md, "GPU tests").
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.build_log import recording_builds
from tests.contracts import v033_capacity_contract
from tests.exchange import round_trip
from tests.gpu import workers
from tests.gpu.workers import world
from tests.multiprocess.harness import run_ranks, running_sidecar

pytestmark = [pytest.mark.gpu(gpus=1, flashinfer="0.7.2.post1"), pytest.mark.timeout(600)]


# --- vLLM PR #42976's regression test body; two lines changed (marked) ------------


# fmt: off
def _one_sided_workspace_grow_worker(rank, world_size):
    from moe_sidecar.client import (  # was: from vllm.distributed.device_communicators.all2all import (
        WorkspaceManager as FlashInferNVLinkOneSidedManager,  # FlashInferNVLinkOneSidedManager,
    )

    cpu_group = world()  # was: cpu_group = get_dp_group().cpu_group
    manager = FlashInferNVLinkOneSidedManager(cpu_group)

    base_kwargs = dict(
        max_num_tokens=1024,
        top_k=2,
        num_experts=world_size * 8,
        hidden_size=4096,
    )
    nvfp4_kwargs = dict(
        dispatch_dtype_bytes_per_elem=0,
        dispatch_scale_bytes_per_token=base_kwargs["hidden_size"] // 16,
    )
    bf16_kwargs = dict(
        dispatch_dtype_bytes_per_elem=2,
        dispatch_scale_bytes_per_token=0,
    )

    # First init: NVFP4-like (hidden_bytes = hidden // 2 + hidden // 16).
    manager.initialize(**base_kwargs, **nvfp4_kwargs)
    assert manager.initialized
    nvfp4_workspace_size = manager.workspace_size
    nvfp4_moe_alltoall = manager.moe_alltoall

    torch.distributed.barrier()

    # Second init: bf16-like (hidden_bytes = hidden * 2). Models the case of
    # a quantized base MoE followed by an unquantized MoE layer (e.g. an MTP
    # head). Per-token dispatch payload is ~4x larger, so the union workspace
    # must grow and MoeAlltoAll must be rebuilt.
    manager.initialize(**base_kwargs, **bf16_kwargs)
    assert manager.initialized
    assert manager.workspace_size > nvfp4_workspace_size
    assert manager.moe_alltoall is not nvfp4_moe_alltoall
    bf16_workspace_size = manager.workspace_size
    bf16_moe_alltoall = manager.moe_alltoall

    torch.distributed.barrier()

    # Third init: back to NVFP4-like shape. Existing workspace already covers
    # it, so initialize() must no-op — no shrink, no rebuild.
    manager.initialize(**base_kwargs, **nvfp4_kwargs)
    assert manager.initialized
    assert manager.workspace_size == bf16_workspace_size
    assert manager.moe_alltoall is bf16_moe_alltoall

    torch.distributed.barrier()
    manager.cleanup()
# fmt: on


# The same body at vLLM 0.30 (commit 030ea52): only the keyword dicts differ.
# fmt: off
def _one_sided_workspace_grow_worker_v030(rank, world_size):
    from moe_sidecar.client import (  # was: from vllm.distributed.device_communicators.all2all import (
        WorkspaceManager as FlashInferNVLinkOneSidedManager,  # FlashInferNVLinkOneSidedManager,
    )

    cpu_group = world()  # was: cpu_group = get_dp_group().cpu_group
    manager = FlashInferNVLinkOneSidedManager(cpu_group)

    base_kwargs = dict(
        max_num_tokens=1024,
        top_k=2,
        num_experts=world_size * 8,
        hidden_size=4096,
    )
    hidden = base_kwargs["hidden_size"]
    nvfp4_kwargs = dict(x_bytes_per_token=hidden // 2, x_sf_bytes_per_token=hidden // 16)
    bf16_kwargs = dict(x_bytes_per_token=hidden * 2, x_sf_bytes_per_token=0)

    # First init: NVFP4-like (hidden_bytes = hidden // 2 + hidden // 16).
    manager.initialize(**base_kwargs, **nvfp4_kwargs)
    assert manager.initialized
    nvfp4_workspace_size = manager.workspace_size
    nvfp4_moe_alltoall = manager.moe_alltoall

    torch.distributed.barrier()

    # Second init: bf16-like (hidden_bytes = hidden * 2). Models the case of
    # a quantized base MoE followed by an unquantized MoE layer (e.g. an MTP
    # head). Per-token dispatch payload is ~4x larger, so the union workspace
    # must grow and MoeAlltoAll must be rebuilt.
    manager.initialize(**base_kwargs, **bf16_kwargs)
    assert manager.initialized
    assert manager.workspace_size > nvfp4_workspace_size
    assert manager.moe_alltoall is not nvfp4_moe_alltoall
    bf16_workspace_size = manager.workspace_size
    bf16_moe_alltoall = manager.moe_alltoall

    torch.distributed.barrier()

    # Third init: back to NVFP4-like shape. Existing workspace already covers
    # it, so initialize() must no-op — no shrink, no rebuild.
    manager.initialize(**base_kwargs, **nvfp4_kwargs)
    assert manager.initialized
    assert manager.workspace_size == bf16_workspace_size
    assert manager.moe_alltoall is bf16_moe_alltoall

    torch.distributed.barrier()
    manager.cleanup()
# fmt: on


def _cache_entries() -> int:
    from flashinfer.comm.trtllm_moe_alltoall import MoeAlltoAll

    return len(MoeAlltoAll._WORKSPACE_CACHE)


def _regression_rank(rank: int, world_size: int, group_prefix: str) -> dict[str, Any]:
    import torch.distributed as dist

    workers.warm_up_cuda(rank)
    out: dict[str, Any] = {"granularity": workers.granularity()}
    for name, body in (
        ("pr42976", _one_sided_workspace_grow_worker),
        ("v030", _one_sided_workspace_grow_worker_v030),
    ):
        # A fresh sidecar group per body: these bodies expect a fresh manager,
        # and a second run against one group starts from its plan (warm restart).
        os.environ["MOE_SIDECAR_GROUP"] = f"{group_prefix}/{name}"
        before = workers.memory_mark()
        with recording_builds() as log:
            body(rank, world_size)
        out[name] = {
            "builds": log.builds,
            "held_after_cleanup": workers.held_bytes_change(before),
            "cache_entries": _cache_entries(),
        }
    dist.barrier()
    return out


def _env(mode: str, target: str) -> list[dict[str, str]]:
    env = {
        "MOE_SIDECAR_TARGET": target if mode == "sidecar" else "",
        "MOE_SIDECAR_BACKEND": "flashinfer",
        "NCCL_NVLS_ENABLE": "0",
    }
    return [env, env]


@pytest.mark.parametrize("mode", ["sidecar", "embedded"])
def test_vllm_regression_test_body_on_flashinfer(mode: str, tmp_path: Path) -> None:
    from flashinfer.comm.trtllm_moe_alltoall import moe_a2a_get_workspace_size_per_rank

    with running_sidecar(tmp_path / "sidecar", round_timeout=60) as sidecar:
        results = run_ranks(
            _regression_rank,
            2,
            timeout=420,
            tmp_path=tmp_path / "ranks",
            args=(f"gpu-vllm-regression:{mode}",),
            envs=_env(mode, sidecar.target),
        )
    hidden, top_k, tokens = 4096, 2, 1024
    # What PR #42976 (and 0.30) compute, sized by FlashInfer itself.
    nvfp4 = int(
        moe_a2a_get_workspace_size_per_rank(
            2, tokens, hidden // 2 + hidden // 16 + top_k * 4 + top_k * 4, hidden * 2
        )
    )
    bf16 = int(
        moe_a2a_get_workspace_size_per_rank(
            2, tokens, hidden * 2 + top_k * 4 + top_k * 4, hidden * 2
        )
    )
    for rank, result in enumerate(results):
        print(f"rank {rank}: {result}")
        for body in ("pr42976", "v030"):
            assert result[body]["builds"] == [("build", nvfp4, tokens), ("rebuild", bf16, tokens)]
            # cleanup() freed the last workspace, the rebuild the first one.
            assert result[body]["held_after_cleanup"] == 0, (rank, body)
            assert result[body]["cache_entries"] == 0, (rank, body)


# --- vLLM 0.33's call style --------------------------------------------------------

# (hidden, quantized, scale bytes) of every layer the 0.33 contract initializes.
V033_LAYERS = [
    (4096, True, None),
    (4096, False, None),
    (4096, False, 256),
    (2048, False, None),
    (8192, True, None),
    (6144, False, None),
]


def _destroyed(communication: Any) -> bool:
    try:
        communication.alltoall  # noqa: B018 - raises once destroyed
    except RuntimeError:
        return True
    return False


def _v033_rank(rank: int, world_size: int, group: str) -> dict[str, Any]:
    import torch.distributed as dist
    from flashinfer.fused_moe import QuantFormat
    from flashinfer.moe_ep import NVLinkOneSidedAlltoAll

    from moe_sidecar.client import WorkspaceManager

    workers.warm_up_cuda(rank)
    device = torch.device("cuda", torch.cuda.current_device())
    os.environ["MOE_SIDECAR_GROUP"] = group
    before = workers.memory_mark()
    manager = WorkspaceManager(world())
    with recording_builds() as log:
        contract = v033_capacity_contract(manager, world_size, QuantFormat)
    shared = contract["shared"]
    out: dict[str, Any] = {
        "granularity": workers.granularity(),
        "ranks_per_gpu": workers.ranks_per_gpu(),
        "builds": log.builds,
        "is_flashinfers": isinstance(shared, NVLinkOneSidedAlltoAll),
        "destroyed": [_destroyed(o) for o in contract["objects"]],
        "workspace_size": manager.workspace_size,
        "alltoall_size": shared.alltoall.workspace_size_per_rank,
        "params": (shared.params.hidden_size, shared.params.max_tokens_per_rank),
        "held": workers.held_bytes_change(before),
        "cache_entries": _cache_entries(),
    }
    trips = {}
    for i, (hidden, quantized, scales) in enumerate(V033_LAYERS):
        trips[f"{hidden}/{'nvfp4' if quantized else 'bf16'}/{scales}"] = round_trip(
            manager.get_communication(),
            rank=rank,
            ep_size=world_size,
            hidden=hidden,
            top_k=4,
            num_experts=world_size * 8,
            tokens=2048,
            quantized=quantized,
            device=device,
            seed=i,
            scale_bytes=scales,
        )
    torch.cuda.synchronize()
    out["trips"] = trips
    out["unreleased"] = manager.backend.unreleased  # type: ignore[attr-defined]
    manager.destroy()
    out["held_after_destroy"] = workers.held_bytes_change(before)
    out["cache_after_destroy"] = _cache_entries()
    dist.barrier()
    return out


@pytest.mark.parametrize("mode", ["sidecar", "embedded"])
def test_vllm_033_call_style_through_get_communication(mode: str, tmp_path: Path) -> None:
    from flashinfer.comm.trtllm_moe_alltoall import moe_a2a_get_workspace_size_per_rank

    with running_sidecar(tmp_path / "sidecar", round_timeout=60) as sidecar:
        results = run_ranks(
            _v033_rank,
            2,
            timeout=420,
            tmp_path=tmp_path / "ranks",
            args=(f"gpu-vllm-033:{mode}",),
            envs=_env(mode, sidecar.target),
        )

    def flashinfer_size(tokens: int, hidden: int, row: int) -> int:
        # What FlashInfer's NVLinkOneSidedAlltoAll.__init__ computes for vLLM 0.33's params.
        return int(moe_a2a_get_workspace_size_per_rank(2, tokens, row + 4 * 4 + 4 * 4, hidden * 2))

    expected_builds = [
        flashinfer_size(1024, 4096, 4096 // 2 + 4096 // 16),
        flashinfer_size(1024, 4096, 8192),
        flashinfer_size(2048, 4096, 8192),
        flashinfer_size(2048, 4096, 8192 + 256),
        flashinfer_size(2048, 8192, 8192 + 256),
        flashinfer_size(2048, 8192, 6144 * 2),
    ]
    union = expected_builds[-1]
    for rank, out in enumerate(results):
        print(f"rank {rank}: {out}")
        assert [b[1] for b in out["builds"]] == expected_builds, rank
        assert out["is_flashinfers"], rank
        assert out["destroyed"] == [True, True, True, True, True, False], rank
        assert out["workspace_size"] == out["alltoall_size"] == union, rank
        assert out["params"] == (8192, 2048), rank
        # Growth freed every superseded workspace: one allocation held, the union.
        assert out["cache_entries"] == 1 and out["unreleased"] == 0, rank
        assert out["held"] == out["ranks_per_gpu"] * workers.aligned(union, out["granularity"]), (
            rank
        )
        for name, trip in out["trips"].items():
            assert trip["max_error"] == 0.0 and trip["bad_rows"] == 0, (rank, name, trip)
            assert trip["rows"] == 2 * 2048 and trip["output_is_output"], (rank, name, trip)
        assert out["held_after_destroy"] == 0 and out["cache_after_destroy"] == 0, rank
