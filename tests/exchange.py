"""One MoE step through a ``flashinfer.moe_ep``-style communication object, checked exactly.

Used by the CPU tests (reference backend) and the GPU tests (FlashInfer's
``NVLinkOneSidedAlltoAll``) alike: the same calls vLLM 0.33's prepare/finalize
makes (``dispatch(x, topk_ids, topk_weights, hidden_states_scale=,
max_tokens_per_rank=)`` then ``combine(expert_output, output=)``), with
payloads the CPU can predict:

* hidden states are small integers (exact in bf16), derived from a global
  token id; quantized layers dispatch NVFP4-shaped bytes (``[T, hidden/2]``
  uint8 plus ``[T, hidden/16]`` uint8 scales) carrying the token id in their
  first 4 bytes; bf16 layers may carry scale bytes too (vLLM 0.33's
  ``extra_payload_bytes_per_token``); every received scale row is checked;
* the "experts" of a rank multiply a received row by ``sum(weight * (1 + id %
  3))`` over the picks this rank owns (FlashInfer's contiguous partition;
  rows without a token carry only invalid ids, -1, and contribute nothing);
* so the combined row of a token is its hidden state times the same sum over
  all its picks, computed here from the sender's own inputs.

Imports torch only; the device is the caller's.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["round_trip", "token_values"]


def token_values(global_ids: torch.Tensor, hidden: int) -> torch.Tensor:
    """Hidden states of the given global token ids: small integers, exact in bf16."""
    j = torch.arange(hidden, dtype=torch.int64, device=global_ids.device)
    return ((global_ids.to(torch.int64)[:, None] * 7 + j[None, :]) % 9 - 4).to(torch.bfloat16)


def _routing(
    rank: int, tokens: int, top_k: int, num_experts: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    ids = torch.rand(tokens, num_experts, generator=g).argsort(dim=1)[:, :top_k].to(torch.int32)
    weights = torch.randint(1, 3, (tokens, top_k), generator=g).to(torch.float32) / 2
    return ids, weights


def _packed(global_ids: torch.Tensor, hidden: int) -> torch.Tensor:
    tokens = global_ids.numel()
    j = torch.arange(hidden // 2, dtype=torch.int64)
    x = ((global_ids[:, None] * 13 + j[None, :]) % 256).to(torch.uint8)
    x[:, :4] = global_ids.to(torch.int32).view(torch.uint8).view(tokens, 4)
    return x


def _scales(global_ids: torch.Tensor, width: int) -> torch.Tensor:
    sf = ((global_ids[:, None] + torch.arange(width)[None, :]) % 256).to(torch.uint8)
    if width >= 4:
        sf[:, :4] = global_ids.to(torch.int32).view(torch.uint8).view(-1, 4)
    return sf


def _ids_of(rows: torch.Tensor) -> torch.Tensor:
    return rows[:, :4].contiguous().view(torch.int32).flatten().to(torch.int64)


def _factor(ids: torch.Tensor, weights: torch.Tensor, owned: torch.Tensor) -> torch.Tensor:
    scale = (ids.to(torch.int64) % 3 + 1).to(torch.float32)
    return (weights * scale * owned.to(torch.float32)).sum(dim=-1, keepdim=True)


def round_trip(
    communication: Any,
    *,
    rank: int,
    ep_size: int,
    hidden: int,
    top_k: int,
    num_experts: int,
    tokens: int,
    quantized: bool,
    device: torch.device,
    seed: int = 0,
    max_tokens_per_rank: int | None = None,
    scale_bytes: int | None = None,
) -> dict[str, Any]:
    """Dispatches ``tokens`` tokens of this rank, runs the experts, combines
    into a caller-made ``output`` and compares everything with the CPU's
    prediction. Collective over the EP group.

    ``scale_bytes``: bytes of ``hidden_states_scale`` per token (default:
    ``hidden // 16`` when ``quantized``, none otherwise).

    Returns ``{"max_error", "received_tokens", "rows", "bad_rows", "shapes",
    "output_is_output"}``: ``max_error`` 0.0 and ``bad_rows`` 0 when exact.
    """
    runtime = tokens if max_tokens_per_rank is None else max_tokens_per_rank
    width = (hidden // 16 if quantized else 0) if scale_bytes is None else scale_bytes
    global_ids = torch.arange(tokens, dtype=torch.int64) + rank * 1_000_000
    ids, weights = _routing(rank, tokens, top_k, num_experts, seed)
    if quantized:
        x = _packed(global_ids, hidden).to(device)
    else:
        x = token_values(global_ids, hidden).to(device)
    scale = _scales(global_ids, width).to(device) if width else None
    received = communication.dispatch(
        x,
        ids.to(device),
        weights.to(device),
        hidden_states_scale=scale,
        max_tokens_per_rank=runtime,
    )
    shapes = {
        "hidden_states": list(received.hidden_states.shape),
        "topk_ids": list(received.topk_ids.shape),
        "topk_weights": list(received.topk_weights.shape),
        "hidden_states_scale": None
        if received.hidden_states_scale is None
        else list(received.hidden_states_scale.shape),
    }
    recv_ids = received.topk_ids.cpu()
    recv_weights = received.topk_weights.cpu()
    per_rank = num_experts // ep_size
    owned = (recv_ids >= rank * per_rank) & (recv_ids < (rank + 1) * per_rank)
    factor = _factor(recv_ids, recv_weights, owned)
    carries_token = (recv_ids >= 0).any(dim=1)
    values = received.hidden_states.cpu()
    got_sf = None if received.hidden_states_scale is None else received.hidden_states_scale.cpu()
    # Which token each received row holds: its first 4 bytes (quantized
    # rows), or its scales' (bf16 rows with scales); else only the combine
    # result checks the rows.
    row_ids: torch.Tensor | None = None
    if quantized:
        row_ids = torch.where(carries_token, _ids_of(values), 0)
    elif got_sf is not None and width >= 4:
        row_ids = torch.where(carries_token, _ids_of(got_sf), 0)
    good = torch.ones(values.shape[0], dtype=torch.bool)
    if quantized:
        assert row_ids is not None
        good &= (values == _packed(row_ids, hidden)).all(dim=1)
        values = token_values(row_ids, hidden)
    elif row_ids is not None:
        good &= (values == token_values(row_ids, hidden)).all(dim=1)
    if got_sf is not None and row_ids is not None:
        good &= (got_sf == _scales(row_ids, width)).all(dim=1)
    values = values.to(torch.float32)
    bad_rows = int((carries_token & ~good).sum())
    expert_output = (values * factor).to(torch.bfloat16).to(device)
    output = torch.empty(tokens, hidden, dtype=torch.bfloat16, device=device)
    combined = communication.combine(expert_output, output=output)
    expected = token_values(global_ids, hidden).to(torch.float32) * _factor(
        ids, weights, torch.ones_like(ids, dtype=torch.bool)
    )
    error = (combined.cpu().to(torch.float32) - expected).abs().max()
    return {
        "max_error": float(error),
        "received_tokens": int(carries_token.sum()),
        "rows": int(recv_ids.shape[0]),
        "bad_rows": bad_rows,
        "shapes": shapes,
        "output_is_output": combined.data_ptr() == output.data_ptr(),
    }
