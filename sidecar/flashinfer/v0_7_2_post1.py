"""FlashInfer 0.7.2.post1 (and 0.7.2): ``MoeAlltoAll``'s workspace, in pure Python.

Byte for byte what flashinfer-python 0.7.2.post1 computes in
``moe_a2a_get_workspace_size_per_rank`` and ``calculateOffsets``
(``csrc/trtllm_moe_alltoall.cu``), without loading FlashInfer: calling any
FlashInfer function loads its CUDA module, which a CPU process (and the
sidecar) must never do. Parity with the real function is checked on the GPU
machine (``tests/gpu/test_sizing_parity.py``). 0.7.2's all-to-all files are
byte-identical, so this row serves it too.

Layout of one rank's workspace (every region start aligned to 128 bytes
where FlashInfer aligns it)::

    flag (4) | local token counter (4) | send counters (4*ep) | recv counters (4*ep)
    | dispatch completion flags (4*ep) | combine completion flags (4*ep)
    | top-k target ranks (4*22*max_tokens) | top-k send indices (4*22*max_tokens)
    | eplb gathered stats (4*ep*eplb_experts)
    | dispatch payloads (ep*runtime_tokens*bytes, one region per payload)
    | combine payload (ep*runtime_tokens*bytes)

Beside it: the release's dispatch-format byte table
(:data:`DISPATCH_FORMAT_BYTES`), its limits and its JIT module, in
:data:`RELEASE`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final

from moe_sidecar.core.plan import Capacities
from moe_sidecar.flashinfer.release import JitModuleFacts, LayoutError, Release

__all__ = [
    "ALIGNMENT",
    "DISPATCH_FORMAT_BYTES",
    "KMAX_TOP_K",
    "MAX_RANKS",
    "RANK_MASK_WORDS",
    "RELEASE",
    "AuxOffsets",
    "align",
    "aux_data_size",
    "aux_offsets",
    "capacities_workspace_bytes",
    "object_refusals",
    "workspace_size_per_rank",
]

ALIGNMENT = 128
"""FlashInfer's kCachelineAlignment."""
KMAX_TOP_K = 22
"""FlashInfer's kMaxTopK: the top-k regions are sized for it, whatever top_k is."""
_INT32 = 4


def align(offset: int, alignment: int = ALIGNMENT) -> int:
    """Rounds ``offset`` up to a multiple of ``alignment``."""
    return (offset + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class AuxOffsets:
    """Start of each region of a rank's workspace (FlashInfer's metainfo)."""

    flag_val: int
    local_token_counter: int
    send_counters: int
    recv_counters: int
    dispatch_completion_flags: int
    combine_completion_flags: int
    topk_target_ranks: int
    topk_send_indices: int
    eplb_gathered_stats: int
    payload_data: int
    """First byte of the dispatch payloads: the size of the auxiliary data."""


def _check(name: str, value: int, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise LayoutError(f"{name}={value!r}: must be an int >= {low}")


def aux_offsets(ep_size: int, max_num_tokens: int, eplb_stats_num_experts: int = 0) -> AuxOffsets:
    """FlashInfer's ``calculateOffsets`` for one rank.

    Raises:
        LayoutError: a negative or non-integer argument.
    """
    _check("ep_size", ep_size, 1)
    _check("max_num_tokens", max_num_tokens, 0)
    _check("eplb_stats_num_experts", eplb_stats_num_experts, 0)
    offset = 0
    flag_val = offset
    offset += _INT32
    local_token_counter = offset
    offset += _INT32
    send_counters = offset
    offset += ep_size * _INT32
    recv_counters = offset
    offset += ep_size * _INT32
    offset = align(offset)
    dispatch_completion_flags = offset
    offset += ep_size * _INT32
    offset = align(offset)
    combine_completion_flags = offset
    offset += ep_size * _INT32
    offset = align(offset)
    topk_target_ranks = offset
    offset += max_num_tokens * KMAX_TOP_K * _INT32
    offset = align(offset)
    topk_send_indices = offset
    offset += max_num_tokens * KMAX_TOP_K * _INT32
    offset = align(offset)
    eplb_gathered_stats = offset
    offset += ep_size * eplb_stats_num_experts * _INT32
    offset = align(offset)
    return AuxOffsets(
        flag_val=flag_val,
        local_token_counter=local_token_counter,
        send_counters=send_counters,
        recv_counters=recv_counters,
        dispatch_completion_flags=dispatch_completion_flags,
        combine_completion_flags=combine_completion_flags,
        topk_target_ranks=topk_target_ranks,
        topk_send_indices=topk_send_indices,
        eplb_gathered_stats=eplb_gathered_stats,
        payload_data=offset,
    )


def aux_data_size(ep_size: int, max_num_tokens: int, eplb_stats_num_experts: int = 0) -> int:
    """FlashInfer's ``moe_a2a_get_aux_data_size``.

    Raises:
        LayoutError: a negative or non-integer argument.
    """
    return aux_offsets(ep_size, max_num_tokens, eplb_stats_num_experts).payload_data


def workspace_size_per_rank(
    ep_size: int,
    max_num_tokens: int,
    dispatch_bytes_per_token: int,
    combine_bytes_per_token: int,
    eplb_stats_num_experts: int = 0,
) -> int:
    """FlashInfer's ``moe_a2a_get_workspace_size_per_rank``, byte for byte.

    Args:
        ep_size: ranks in the EP group.
        max_num_tokens: most tokens one rank dispatches in one call.
        dispatch_bytes_per_token: sum of every dispatch payload's bytes per token.
        combine_bytes_per_token: bytes per token of the combine payload.
        eplb_stats_num_experts: experts reserved for EPLB stats (0: none).

    Raises:
        LayoutError: a negative or non-integer argument.
    """
    _check("dispatch_bytes_per_token", dispatch_bytes_per_token, 0)
    _check("combine_bytes_per_token", combine_bytes_per_token, 0)
    return (
        align(aux_data_size(ep_size, max_num_tokens, eplb_stats_num_experts))
        + align(ep_size * max_num_tokens * dispatch_bytes_per_token)
        + align(ep_size * max_num_tokens * combine_bytes_per_token)
    )


MAX_RANKS: Final = 64
"""``kMaxRanks``: the largest EP group ``MoeAlltoAll`` takes."""
RANK_MASK_WORDS: Final = 1
"""``MOE_A2A_RANK_MASK_WORDS`` (``flashinfer/comm/trtllm_moe_alltoall.py``, the
``kRankMaskWords`` of its kernels): one word covers the 64 ranks."""


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


DISPATCH_FORMAT_BYTES: Final[Mapping[str, Callable[[int], int]]] = {
    "BF16": lambda hidden: 2 * hidden,
    "FP16": lambda hidden: 2 * hidden,
    "FP8PerTensor": lambda hidden: hidden,
    "DeepSeekFp8": lambda hidden: hidden + 4 * _ceil_div(hidden, 128),
    "MXFP8": lambda hidden: hidden + _ceil_div(hidden, 32),
    "NVFP4": lambda hidden: _ceil_div(hidden, 2) + _ceil_div(hidden, 16),
    "MXFP4": lambda hidden: _ceil_div(hidden, 2) + _ceil_div(hidden, 32),
}
"""FlashInfer 0.7.2.post1's ``_DISPATCH_BYTES_PER_TOKEN``
(``flashinfer/moe_ep/core/comm/communication.py:60``): the bytes one token's
activations and their per-block scales take on the wire, by ``QuantFormat``
name. Formats missing here (``MXINT4``, ``INT4``) FlashInfer refuses as a
dispatch format."""


def capacities_workspace_bytes(capacities: Capacities, ep_size: int) -> int:
    """:func:`workspace_size_per_rank` of ``capacities`` at ``ep_size``.

    Raises:
        LayoutError: ``ep_size`` below 1 or a negative field.
    """
    return _remembered_size(
        ep_size,
        capacities.max_tokens,
        capacities.dispatch_bytes_per_token,
        capacities.combine_bytes_per_token,
        capacities.eplb_experts,
    )


@functools.lru_cache(maxsize=1024)
def _remembered_size(
    ep_size: int, max_tokens: int, dispatch: int, combine: int, eplb_experts: int
) -> int:
    # A round asks for the same plan's size many times (limits, every
    # answer, gauges, logs): remembered.
    return workspace_size_per_rank(ep_size, max_tokens, dispatch, combine, eplb_experts)


def object_refusals(
    ep_size: int, top_k: int, num_experts: int, eplb_stats_num_experts: int
) -> tuple[str, ...]:
    """Why this release's objects would refuse these beyond the layout
    (empty: they would not): the ``moe_ep`` wrapper vLLM 0.33 calls needs
    ``num_experts`` divisible by the EP size."""
    del top_k, eplb_stats_num_experts  # no rule of this release reads them
    if num_experts % ep_size:
        return (f"num_experts={num_experts} is not divisible by the EP size {ep_size}",)
    return ()


RELEASE: Final = Release(
    name="0.7.2.post1",
    versions=("0.7.2", "0.7.2.post1"),
    backend="flashinfer-moe-alltoall",
    api="MoeAlltoAll",
    max_ranks=MAX_RANKS,
    rank_mask_words=RANK_MASK_WORDS,
    max_top_k=KMAX_TOP_K,
    supported_top_k=tuple(range(1, KMAX_TOP_K + 1)),
    dispatch_format_bytes=DISPATCH_FORMAT_BYTES,
    jit_module=JitModuleFacts(
        name="mnnvl_moe_alltoall",
        sources=("data/csrc/trtllm_moe_alltoall.cu",),
        spec_factory="flashinfer.jit.comm:gen_moe_alltoall_module",
        role="the all-to-all of the client's flashinfer backend",
    ),
    workspace_size=capacities_workspace_bytes,
    object_refusals=object_refusals,
    install_extra="flashinfer",
)
"""FlashInfer 0.7.2.post1 (vLLM 0.33's pin), serving 0.7.2 too: ``MoeAlltoAll``,
JIT module ``mnnvl_moe_alltoall`` (about 190 s to compile on an H200 host)."""
