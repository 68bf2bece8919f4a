"""FlashInfer's MoE all-to-all workspace arithmetic, in pure Python.

Byte for byte what flashinfer-python 0.7.2.post1 computes in
``moe_a2a_get_workspace_size_per_rank`` and ``calculateOffsets``
(``csrc/trtllm_moe_alltoall.cu``), without loading FlashInfer: calling any
FlashInfer function loads its CUDA module, which a CPU process (and the
sidecar) must never do. Parity with the real function is checked on the GPU
machine (``tests/gpu/test_sizing_parity.py``).

Layout of one rank's workspace (every region start aligned to 128 bytes
where FlashInfer aligns it)::

    flag (4) | local token counter (4) | send counters (4*ep) | recv counters (4*ep)
    | dispatch completion flags (4*ep) | combine completion flags (4*ep)
    | top-k target ranks (4*22*max_tokens) | top-k send indices (4*22*max_tokens)
    | eplb gathered stats (4*ep*eplb_experts)
    | dispatch payloads (ep*runtime_tokens*bytes, one region per payload)
    | combine payload (ep*runtime_tokens*bytes)

It also holds the one per-layer rule every engine follows
(:func:`dispatch_bytes_per_token`, :func:`combine_bytes_per_token`); the
capacities of a layer are built from it in :mod:`moe_sidecar.core.layer`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "ALIGNMENT",
    "BF16_BYTES",
    "FLOAT32_BYTES",
    "INT32_BYTES",
    "KMAX_TOP_K",
    "AuxOffsets",
    "align",
    "aux_data_size",
    "aux_offsets",
    "bf16_row_bytes",
    "combine_bytes_per_token",
    "dispatch_bytes_per_token",
    "routing_bytes_per_token",
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
        raise ValueError(f"{name}={value!r}: must be an int >= {low}")


def aux_offsets(ep_size: int, max_num_tokens: int, eplb_stats_num_experts: int = 0) -> AuxOffsets:
    """FlashInfer's ``calculateOffsets`` for one rank.

    Raises:
        ValueError: a negative or non-integer argument.
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
        ValueError: a negative or non-integer argument.
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
        ValueError: a negative or non-integer argument.
    """
    _check("dispatch_bytes_per_token", dispatch_bytes_per_token, 0)
    _check("combine_bytes_per_token", combine_bytes_per_token, 0)
    return (
        align(aux_data_size(ep_size, max_num_tokens, eplb_stats_num_experts))
        + align(ep_size * max_num_tokens * dispatch_bytes_per_token)
        + align(ep_size * max_num_tokens * combine_bytes_per_token)
    )


INT32_BYTES = _INT32
"""An expert id of the top-k routing (int32)."""
FLOAT32_BYTES = 4
"""A routing weight of the top-k routing (float32)."""
BF16_BYTES = 2
"""One element of a bf16 row (the combine payload, and an engine's default dispatch rows)."""


def bf16_row_bytes(hidden_size: int) -> int:
    """Bytes of one token's bf16 hidden states."""
    return BF16_BYTES * hidden_size


def routing_bytes_per_token(top_k: int) -> int:
    """Bytes per token of the routing payloads: an int32 expert id and a
    float32 weight for each of the ``top_k`` experts."""
    return (INT32_BYTES + FLOAT32_BYTES) * top_k


def dispatch_bytes_per_token(
    top_k: int,
    x_bytes_per_token: int,
    x_sf_bytes_per_token: int = 0,
    extra_payload_bytes_per_token: int = 0,
) -> int:
    """The per-layer rule for the dispatch payload per token: the hidden
    states, their scale factors, any extra payload, and the top-k routing
    (:func:`routing_bytes_per_token`). Every engine sizes a layer so."""
    return (
        x_bytes_per_token
        + x_sf_bytes_per_token
        + extra_payload_bytes_per_token
        + routing_bytes_per_token(top_k)
    )


def combine_bytes_per_token(hidden_size: int) -> int:
    """The per-layer rule for the combine payload per token: bf16 hidden states."""
    return bf16_row_bytes(hidden_size)
