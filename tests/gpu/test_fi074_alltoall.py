"""FlashInfer 0.7.4's ``NVLinkOneSidedAlltoAll`` through the client and a real sidecar.

DeepSeek-V3 shapes (hidden 7168, top_k 8, 256 experts), EP 2 and EP 8: an
NVFP4 layer (build), a bf16 MTP layer (growth: one rebuild at the union),
the NVFP4 layer again (reuse). After each, vLLM 0.33's own call form
(``dispatch(x, topk_ids, topk_weights, hidden_states_scale=...,
max_tokens_per_rank=...)``, ``combine(expert_output, output=...)``) on what
``get_communication()`` returns, checked exactly against what the CPU
predicts. The superseded workspace is measured freed (device memory, all
ranks together) and FlashInfer's own workspace size equals the pure one.
Cleanup frees the rest. A separate case shows why the union is needed: the
NVFP4 layer's workspace refuses the bf16 layer's dispatch.

EP ranks may share a GPU (rank r on ``cuda:r % device_count``), so EP 8 runs
on one H200. FlashInfer 0.7.4's ``NVLinkOneSidedAlltoAll`` refuses a GPU
without NVLink peers in its platform vote (``nvlink_platform_supported``,
read under two module names); these tests stand in for that vote ONLY when
every rank of the group is on the same GPU (one device visible), and say so
in their result. With as many GPUs as ranks the vote is FlashInfer's own.
Functional only: no bandwidth or latency figure comes from ranks sharing a GPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.multiprocess.harness import run_ranks, running_sidecar

pytestmark = [pytest.mark.gpu(gpus=1, flashinfer="0.7.4"), pytest.mark.timeout(600)]

HIDDEN, TOP_K, EXPERTS, TOKENS = 7168, 8, 256, 64


def _setup(rank: int, world_size: int) -> dict[str, Any]:
    """This rank's device; the platform vote stood in for only when every rank
    shares one GPU."""
    import importlib

    import torch

    count = torch.cuda.device_count()
    torch.cuda.set_device(rank % count)
    shared_gpu = count == 1
    if shared_gpu:
        for name in (
            "flashinfer.moe_ep.backends.split.comm.nvlink_common",
            "flashinfer.moe_ep.backends.split.comm.nvlink_one_sided.communication",
        ):
            setattr(importlib.import_module(name), "nvlink_platform_supported", lambda: True)  # noqa: B010
    torch.ones(1, device="cuda").sum().item()
    return {"device": rank % count, "vote_stood_in_for": shared_gpu}


def _routing(rank: int, tokens: int) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(1000 + rank)
    ids = torch.rand(tokens, EXPERTS, generator=g).argsort(dim=1)[:, :TOP_K].to(torch.int32)
    weights = (torch.arange(TOP_K, dtype=torch.float32) + 1)[None, :].repeat(tokens, 1) / 8
    return ids, weights


def _gids(rank: int, tokens: int) -> Any:
    import torch

    return torch.arange(tokens, dtype=torch.int64) + rank * tokens


def _payload(fmt: str, gids: Any) -> tuple[Any, Any]:
    """(hidden states, scales) of the tokens ``gids``, each row naming its token:
    bf16 small integers (exact) with ``gid // 16`` and ``gid % 16`` first, or
    NVFP4's packed bytes (the global id in the first 4) with scale bytes."""
    import torch

    from tests.exchange import token_values

    if fmt == "BF16":
        x = token_values(gids, HIDDEN)
        x[:, 0] = (gids // 16).to(torch.bfloat16)
        x[:, 1] = (gids % 16).to(torch.bfloat16)
        return x, None
    j = torch.arange(HIDDEN // 2, dtype=torch.int64)
    x = ((gids[:, None] * 13 + j[None, :]) % 251).to(torch.uint8)
    x[:, :4] = gids.to(torch.int32)[:, None].view(torch.uint8).reshape(-1, 4)
    s = torch.arange(HIDDEN // 16, dtype=torch.int64)
    sf = ((gids[:, None] * 5 + s[None, :]) % 127).to(torch.uint8)
    return x, sf


def _row_gids(fmt: str, rows: Any) -> Any:
    """The global token id each received row names (see :func:`_payload`)."""
    import torch

    if fmt == "BF16":
        return (rows[:, 0].float() * 16 + rows[:, 1].float()).to(torch.int64)
    return rows[:, :4].contiguous().view(torch.int32).reshape(-1).to(torch.int64)


def _round_trip(communication: Any, fmt: str, rank: int, ep: int) -> dict[str, Any]:
    """vLLM 0.33's dispatch/combine calls; every received row and every
    combined output checked against the CPU's prediction."""
    import torch

    from tests.exchange import token_values

    # The CPU only for a dry run of this check against the reference backend.
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    gids = _gids(rank, TOKENS)
    ids, weights = _routing(rank, TOKENS)
    x, sf = _payload(fmt, gids)
    received = communication.dispatch(
        x.to(device),
        ids.to(device),
        weights.to(device),
        hidden_states_scale=None if sf is None else sf.to(device),
        max_tokens_per_rank=TOKENS,
    )
    recv_ids = received.topk_ids.cpu()
    recv_x = received.hidden_states.cpu()
    per_rank = EXPERTS // ep
    valid = (recv_ids >= 0).any(dim=1)
    rows = recv_x[valid]
    row_gid = _row_gids(fmt, rows)
    # Which tokens must arrive here: every token of every rank with an expert on this rank.
    want = set()
    for src in range(ep):
        src_ids, _ = _routing(src, TOKENS)
        owned = ((src_ids >= rank * per_rank) & (src_ids < (rank + 1) * per_rank)).any(dim=1)
        want |= {int(g) for g in _gids(src, TOKENS)[owned]}
    got = [int(g) for g in row_gid]
    exact = sorted(got) == sorted(want) and len(set(got)) == len(got)
    for row, gid in zip(rows, row_gid, strict=True):
        src, local = divmod(int(gid), TOKENS)
        sx, ssf = _payload(fmt, torch.tensor([gid]))
        src_ids, src_w = _routing(src, TOKENS)
        exact &= bool((row == sx[0]).all())
        i = int(torch.nonzero(valid)[got.index(int(gid))])
        exact &= bool((recv_ids[i] == src_ids[local]).all())
        exact &= bool((received.topk_weights.cpu()[i] == src_w[local]).all())
        if ssf is not None:
            exact &= bool((received.hidden_states_scale.cpu()[i] == ssf[0]).all())
    # Each rank's "expert" multiplies a token's values by (1 + rank).
    out_rows = torch.zeros(recv_ids.shape[0], HIDDEN, dtype=torch.bfloat16)
    out_rows[valid] = (token_values(row_gid, HIDDEN).float() * (1 + rank)).to(torch.bfloat16)
    output = torch.empty(TOKENS, HIDDEN, dtype=torch.bfloat16, device=device)
    communication.combine(out_rows.to(device), output=output)
    owners = ids.to(torch.int64) // per_rank
    factor = torch.tensor(
        [sum(1 + r for r in set(row.tolist())) for row in owners], dtype=torch.float32
    )
    expected = (token_values(gids, HIDDEN).float() * factor[:, None]).to(torch.bfloat16)
    combine_error = float((output.cpu().float() - expected.float()).abs().max())
    return {"dispatch_exact": bool(exact), "rows": len(got), "combine_error": combine_error}


def _growth_rank(rank: int, world_size: int, target: str, group: str) -> dict[str, Any]:
    import torch.distributed as dist

    from moe_sidecar.client import WorkspaceManager
    from moe_sidecar.flashinfer import v0_7_4 as s
    from tests.gpu import workers
    from tests.gpu.workers import aligned, granularity, world

    out = _setup(rank, world_size)
    manager = WorkspaceManager(world(), group=group, target=target, backend="flashinfer-moe-ep")
    unit = granularity()

    def layer(fmt: str, label: str) -> dict[str, Any]:
        dist.barrier()
        before = workers.memory_mark()  # with ranks sharing the GPU, all of them at once
        manager.initialize(
            TOKENS,
            TOP_K,
            EXPERTS,
            HIDDEN,
            dispatch_format=fmt,
            extra_payload_bytes_per_token=0,
            layer=label,
        )
        communication = manager.get_communication()
        handle = manager.moe_alltoall
        flashinfer_size = int(communication.metainfo[communication._index.WORKSPACE_SIZE_INDEX])
        result = _round_trip(communication, fmt, rank, world_size)
        result |= {
            "workspace_size": manager.workspace_size,
            "flashinfer_size": flashinfer_size,
            "is_handle": communication is handle,
            "generation": manager.generation,
            "held_change": workers.held_bytes_change(before),
        }
        return result

    out["nvfp4"] = layer("NVFP4", "model.layers.3.mlp (nvfp4)")
    out["bf16"] = layer("BF16", "mtp.0.mlp (bf16)")
    out["nvfp4_again"] = layer("NVFP4", "model.layers.4.mlp (nvfp4)")
    counters = manager.counters
    out["counters"] = (counters.builds, counters.rebuilds, counters.reuses, counters.releases)
    out["unreleased"] = manager.backend.unreleased  # type: ignore[attr-defined]
    out["shared_releases"] = manager.backend.shared_releases  # type: ignore[attr-defined]
    dist.barrier()
    before = workers.memory_mark()
    manager.cleanup()
    out["cleanup_change"] = workers.held_bytes_change(before)
    out["expected"] = {
        "nvfp4": s.layer_layout(world_size, TOKENS, TOP_K, HIDDEN, "NVFP4").workspace_size,
        "bf16": s.layer_layout(world_size, TOKENS, TOP_K, HIDDEN, "BF16").workspace_size,
        "unit": unit,
        "ranks_per_gpu": workers.ranks_per_gpu(),
    }
    out["aligned"] = {k: aligned(out["expected"][k], unit) for k in ("nvfp4", "bf16")}
    dist.barrier()
    return out


@pytest.mark.parametrize("ep", [2, 8])
def test_deepseek_v3_growth_on_flashinfer_0_7_4(ep: int, tmp_path: Path) -> None:
    group = f"gpu-fi074:deepseek-v3/ep{ep}/pp0"
    with running_sidecar(tmp_path / "sidecar", round_timeout=120.0) as sidecar:
        results = run_ranks(
            _growth_rank,
            ep,
            timeout=540,
            tmp_path=tmp_path / "ranks",
            args=(sidecar.target, group),
            # Eager module loading: no kernel loaded lazily between two memory marks.
            envs=[{"MOE_SIDECAR_LOCAL_RANKS": str(ep), "CUDA_MODULE_LOADING": "EAGER"}] * ep,
        )
        stored = sidecar.get_group(group)
    for rank, r in enumerate(results):
        per_gpu = r["expected"]["ranks_per_gpu"]
        print(f"EP {ep} rank {rank}: {r}")
        for name, size in (("nvfp4", "nvfp4"), ("bf16", "bf16"), ("nvfp4_again", "bf16")):
            step = r[name]
            assert step["dispatch_exact"] and step["combine_error"] == 0.0, (rank, name, step)
            assert step["workspace_size"] == step["flashinfer_size"] == r["expected"][size]
            assert step["is_handle"]
        assert [r[n]["generation"] for n in ("nvfp4", "bf16", "nvfp4_again")] == [1, 2, 2]
        assert r["counters"] == (1, 1, 1, 1)
        # Growth: the superseded NVFP4 workspace is gone, the union is held.
        assert r["nvfp4"]["held_change"] >= per_gpu * r["aligned"]["nvfp4"]
        assert r["bf16"]["held_change"] == per_gpu * (r["aligned"]["bf16"] - r["aligned"]["nvfp4"])
        assert r["nvfp4_again"]["held_change"] == 0
        assert r["unreleased"] == 0 and r["shared_releases"] == 0
        assert r["cleanup_change"] == -per_gpu * r["aligned"]["bf16"]
    assert stored.plan.generation == 2


def _overflow_rank(rank: int, world_size: int) -> dict[str, Any]:
    """The NVFP4 layer's workspace, asked to carry the bf16 layer's dispatch."""
    import torch
    import torch.distributed as dist

    from moe_sidecar.client.backends import BuildSpec
    from moe_sidecar.client.backends.flashinfer_moe_ep import FlashInferMoeEpBackend
    from moe_sidecar.core.plan import Capacities
    from tests.gpu.workers import world

    out = _setup(rank, world_size)
    nvfp4 = Capacities(
        max_tokens=TOKENS,
        dispatch_bytes_per_token=HIDDEN // 2 + HIDDEN // 16 + 8 * TOP_K,
        combine_bytes_per_token=2 * HIDDEN,
        top_k=TOP_K,
        num_experts=EXPERTS,
    )
    backend = FlashInferMoeEpBackend(world())
    size = backend.workspace_bytes(nvfp4, world_size)
    handle = backend.build(BuildSpec(world_size, rank, nvfp4, size))
    device = torch.device("cuda", torch.cuda.current_device())
    ids, weights = _routing(rank, TOKENS)
    x, _ = _payload("BF16", _gids(rank, TOKENS))
    communication: Any = handle
    try:
        communication.dispatch(
            x.to(device), ids.to(device), weights.to(device), max_tokens_per_rank=TOKENS
        )
    except Exception as error:  # FlashInfer's check: whatever type its FFI raises
        out["error"] = f"{type(error).__name__}: {error}"
    else:
        out["error"] = ""
    torch.cuda.synchronize()
    dist.barrier()
    backend.release(handle)
    return out


def test_the_nvfp4_workspace_refuses_the_bf16_dispatch(tmp_path: Path) -> None:
    results = run_ranks(_overflow_rank, 2, timeout=300, tmp_path=tmp_path)
    for rank, r in enumerate(results):
        print(f"rank {rank}: {r}")
        assert "exceeds" in r["error"], (rank, r)
