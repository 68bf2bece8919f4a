"""Rank-side code of the GPU tests and the GPU benchmark (spawned processes).

Payloads are chosen so the CPU can predict every result exactly: hidden
states are small integers (exact in bf16), each "expert" multiplies what it
received by ``1 + its rank``, so a token's combined output is its hidden
state times the sum of ``1 + r`` over the distinct ranks owning its top-k
experts (FlashInfer sends a token once per distinct target rank).
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

HIDDEN = 4096
TOP_K = 2
NUM_EXPERTS = 16
TOKENS = 256


@dataclass(frozen=True)
class Layer:
    """One MoE layer as the manager sees it."""

    label: str
    x_bytes_per_token: int
    x_sf_bytes_per_token: int

    @property
    def quantized(self) -> bool:
        return self.x_sf_bytes_per_token > 0


NVFP4 = Layer("model.layers.0.mlp (nvfp4)", HIDDEN // 2, HIDDEN // 16)
BF16_MTP = Layer("mtp.0.mlp (bf16)", HIDDEN * 2, 0)
NVFP4_AGAIN = Layer("model.layers.1.mlp (nvfp4)", HIDDEN // 2, HIDDEN // 16)
SEQUENCE = (NVFP4, BF16_MTP, NVFP4_AGAIN)


def selected_experts(src: int, tokens: int = TOKENS) -> torch.Tensor:
    """Rank ``src``'s top-k expert choices: distinct per token, reproducible."""
    g = torch.Generator().manual_seed(1000 + src)
    return torch.rand(tokens, NUM_EXPERTS, generator=g).argsort(dim=1)[:, :TOP_K].to(torch.int32)


def token_values(global_ids: torch.Tensor, hidden: int = HIDDEN) -> torch.Tensor:
    """Hidden states of the given global token ids: small integers, exact in bf16."""
    j = torch.arange(hidden, dtype=torch.int64)
    return ((global_ids.to(torch.int64)[:, None] * 7 + j[None, :]) % 9 - 4).to(torch.bfloat16)


def owner(experts: torch.Tensor, ep_size: int) -> torch.Tensor:
    """The rank owning each expert (uniform partition, as FlashInfer's)."""
    return experts.to(torch.int64) // (NUM_EXPERTS // ep_size)


def expected_output(src: int, ep_size: int) -> torch.Tensor:
    """What combine must return on rank ``src``, computed on the CPU."""
    ranks = owner(selected_experts(src), ep_size)
    factor = torch.zeros(TOKENS, dtype=torch.float32)
    for r in range(ep_size):
        factor += (ranks == r).any(dim=1).float() * (1 + r)
    values = token_values(torch.arange(TOKENS) + src * TOKENS).float()
    return (values * factor[:, None]).to(torch.bfloat16)


def expected_rows(src: int, dst: int, ep_size: int) -> torch.Tensor:
    """Global ids of the tokens rank ``src`` sends to rank ``dst``, sorted."""
    ranks = owner(selected_experts(src), ep_size)
    return torch.nonzero((ranks == dst).any(dim=1)).flatten() + src * TOKENS


def _quantized_payload(global_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4-shaped bytes whose first 4 bytes carry the token's global id."""
    tokens = global_ids.numel()
    j = torch.arange(HIDDEN // 2, dtype=torch.int64)
    x = ((global_ids[:, None] * 13 + j[None, :]) % 256).to(torch.uint8)
    x[:, :4] = global_ids.to(torch.int32).view(torch.uint8).view(tokens, 4)
    sf = ((global_ids[:, None] + torch.arange(HIDDEN // 16)[None, :]) % 256).to(torch.uint8)
    return x, sf


def _ids_of_rows(rows: torch.Tensor) -> torch.Tensor:
    return rows[:, :4].contiguous().view(torch.int32).flatten().to(torch.int64)


def round_trip(a2a: Any, layer: Layer, rank: int, ep_size: int, *, check: bool = True) -> None:
    """Dispatches this rank's tokens with ``layer``'s payloads, runs the
    experts, combines, and (with ``check``) compares everything received and
    returned with the CPU's prediction, exactly.

    Raises:
        AssertionError: a received row or a combined value differs.
    """
    device = torch.device("cuda", torch.cuda.current_device())
    global_ids = torch.arange(TOKENS, dtype=torch.int64) + rank * TOKENS
    experts = selected_experts(rank).to(device)
    weights = torch.full((TOKENS, TOP_K), 0.5, dtype=torch.float32, device=device)
    if layer.quantized:
        x, sf = _quantized_payload(global_ids)
        payloads = [x.to(device), sf.to(device), experts, weights]
    else:
        payloads = [token_values(global_ids).to(device), experts, weights]
    recv = a2a.dispatch(experts, payloads, TOKENS)
    hidden_rows = recv[0]
    assert tuple(hidden_rows.shape[:2]) == (ep_size, TOKENS), hidden_rows.shape
    # The experts: rebuild each received token's hidden state, scale it.
    if layer.quantized:
        ids = _ids_of_rows(hidden_rows.reshape(ep_size * TOKENS, -1).cpu())
        values = token_values(ids % (ep_size * TOKENS)).view(ep_size, TOKENS, HIDDEN)
        expert_out = (values.float() * (1 + rank)).to(torch.bfloat16).to(device)
    else:
        expert_out = (hidden_rows.float() * (1 + rank)).to(torch.bfloat16)
    if check:
        for src in range(ep_size):
            want = expected_rows(src, rank, ep_size)
            rows = hidden_rows[src, : want.numel()].cpu()
            if layer.quantized:
                got = torch.sort(_ids_of_rows(rows)).values
                assert torch.equal(got, want), f"rank {rank}: rows from {src} differ"
            else:
                assert torch.equal(
                    torch.sort(rows.float().sum(dim=1)).values,
                    torch.sort(token_values(want).float().sum(dim=1)).values,
                ), f"rank {rank}: rows from {src} differ"
    out = a2a.combine(expert_out.contiguous(), TOKENS)
    torch.cuda.synchronize()
    if check:
        want_out = expected_output(rank, ep_size)
        assert torch.equal(out.cpu(), want_out), (
            f"rank {rank} layer {layer.label}: combine differs from the CPU reference "
            f"in {(out.cpu() != want_out).sum().item()} values"
        )


def gpu_shared() -> bool:
    """Whether this rank's GPU serves other ranks of the process group too
    (fewer GPUs than ranks: rank r on GPU r % count)."""
    import torch.distributed as dist

    return dist.is_initialized() and torch.cuda.device_count() < dist.get_world_size()


def ranks_per_gpu() -> int:
    """How many ranks of the process group share this rank's GPU (1 on a GPU of its own)."""
    import torch.distributed as dist

    if not gpu_shared():
        return 1
    count, mine = torch.cuda.device_count(), torch.cuda.current_device()
    return sum(1 for r in range(dist.get_world_size()) if r % count == mine)


def held_bytes_change(before: tuple[int, int]) -> int:
    """Device bytes taken since ``before`` outside PyTorch's caching allocators.

    On a GPU that ranks share, the bytes every one of them took (their
    PyTorch growth gathered and removed): then a collective, called by every
    rank at the same point, as :func:`memory_mark`.
    """
    import torch.distributed as dist

    free, reserved = memory_mark()
    mine = reserved - before[1]
    if not gpu_shared():
        return (before[0] - free) - mine
    changes: list[int] = [0] * dist.get_world_size()
    dist.all_gather_object(changes, mine)
    count, gpu = torch.cuda.device_count(), torch.cuda.current_device()
    return (before[0] - free) - sum(c for r, c in enumerate(changes) if r % count == gpu)


def memory_mark() -> tuple[int, int]:
    """(free device bytes, bytes reserved by PyTorch), after pending work.

    On a GPU that ranks share, once every rank has got here (a barrier), so
    that a mark sees every rank at the same step.
    """
    import torch.distributed as dist

    if gpu_shared():
        dist.barrier()
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()


def granularity() -> int:
    """FlashInfer's allocation granularity for MNNVL memory on this device."""
    from flashinfer.comm.mnnvl import MnnvlMemory

    return int(MnnvlMemory.get_allocation_granularity(torch.cuda.current_device()))


def aligned(n: int, unit: int) -> int:
    return (n + unit - 1) // unit * unit


def warm_up_cuda(rank: int) -> None:
    """Selects this rank's GPU and loads what PyTorch loads on first use, so
    later memory marks see only what the all-to-all takes. Rank r is on GPU
    r % count: with fewer GPUs than ranks, ranks share them."""
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    a = torch.randn(TOKENS, HIDDEN, device=device).to(torch.bfloat16)
    (a.float() * 2).to(torch.bfloat16).sum().item()
    torch.arange(4, device=device).to(torch.uint8).view(torch.int32)
    torch.cuda.synchronize()


NO_AOT_DIR = Path("/nonexistent/flashinfer-aot")


def use_jit_cache_only() -> None:
    """Makes FlashInfer in this process ignore ahead-of-time modules.

    The GPU machine's install line copies a compiled ``mnnvl_moe_alltoall.so``
    into ``flashinfer/data/aot/``, which FlashInfer loads before looking at its
    JIT cache (``jit_env.get_aot_artifacts``: the ``FLASHINFER_AOT_DIR``
    fallback wins outright). Tests and benchmarks of the cache must not load
    it: this points FlashInfer's AOT directory somewhere empty, through the
    module attributes FlashInfer reads at call time (``flashinfer/jit/env.py``:
    "do ``from .jit import env as jit_env`` ... this helps AOT script to
    override envs"). Call it before the all-to-all module is first loaded.
    Imports FlashInfer.
    """
    import flashinfer.jit.env as jit_env

    jit_env.FLASHINFER_AOT_DIR = NO_AOT_DIR
    jit_env.FLASHINFER_AOT_PROVIDERS = ()
    jit_env.FLASHINFER_AOT_DIRS = (NO_AOT_DIR,)
    assert not jit_env.get_aot_artifacts("mnnvl_moe_alltoall"), "an AOT module is still found"


def world() -> Any:
    """The default process group (every test rank is in one EP group)."""
    import torch.distributed as dist

    group = dist.group.WORLD
    assert group is not None, "torch.distributed is not initialized"
    return group


def timed(fn: Any) -> tuple[Any, float]:
    torch.cuda.synchronize()
    started = time.perf_counter()
    value = fn()
    torch.cuda.synchronize()
    return value, time.perf_counter() - started
