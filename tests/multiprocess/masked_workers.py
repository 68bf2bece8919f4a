"""What the spawned ranks of ``test_masked_steps.py`` run: the reference
all-to-all under a membership mask. Imported in the rank processes only.

Every step's inputs follow from ``(seed, rank)`` alone, so each rank computes
locally what every peer sent and what its combine must return; the worker
returns plain data (the differences, the refusals' messages).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

HIDDEN = 8
TOP_K = 3
NUM_EXPERTS = 8
TOKENS = 6
INVALID_EXPERT = -1


def owner(expert: int, ep_size: int) -> int:
    """The rank owning ``expert``: the contiguous partition, written out plainly."""
    per_rank = NUM_EXPERTS // ep_size
    return expert // per_rank


def step_inputs(rank: int, seed: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s tokens at step ``seed``: small integers, exact in bf16."""
    g = torch.Generator().manual_seed(seed * 100 + rank)
    values = torch.randint(-4, 5, (TOKENS, HIDDEN), generator=g).to(torch.float32)
    ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=g)[:TOP_K] for _ in range(TOKENS)])
    weights = torch.randint(1, 3, (TOKENS, TOP_K), generator=g).to(torch.float32) / 2
    return {"values": values, "ids": ids.to(torch.int32), "weights": weights}


def expert_scale(ids: torch.Tensor) -> torch.Tensor:
    """What expert ``e`` multiplies a row by: ``e % 3 + 1``."""
    return (ids % 3 + 1).to(torch.float32)


def expected_combine(rank: int, seed: int, ep_size: int, masked: set[int]) -> torch.Tensor:
    """Rank ``rank``'s combined rows: each token's experts summed, those of the
    ``masked`` ranks' left out (their copies were dropped, not re-routed)."""
    inputs = step_inputs(rank, seed)
    ids = inputs["ids"]
    kept = torch.tensor(
        [[owner(int(e), ep_size) not in masked for e in row] for row in ids.tolist()]
    ).to(torch.float32)
    factor = (inputs["weights"] * expert_scale(ids) * kept).sum(dim=-1, keepdim=True)
    return inputs["values"] * factor


def expected_rows(source: int, me: int, seed: int, ep_size: int) -> torch.Tensor:
    """The hidden rows ``source`` sends ``me`` at step ``seed``, in its token order."""
    inputs = step_inputs(source, seed)
    rows = [
        inputs["values"][t]
        for t, row in enumerate(inputs["ids"].tolist())
        if me in {owner(e, ep_size) for e in row}
    ]
    return torch.stack(rows) if rows else torch.empty(0, HIDDEN)


def run_step(
    a2a: Any,
    rank: int,
    world: int,
    seed: int,
    mask: int | None,
    masked: set[int],
    wrong_combine_mask: int | None = None,
) -> dict[str, Any]:
    """One dispatch + expert compute + combine under ``mask``; what differs from
    the expected values (all 0 when exact). With ``wrong_combine_mask``, a
    combine under it is tried first (and must be refused, changing nothing)."""
    inputs = step_inputs(rank, seed)
    ids = inputs["ids"]
    payloads = [inputs["values"].to(torch.bfloat16), ids, inputs["weights"]]
    x, recv_ids, recv_weights = a2a.dispatch(
        ids, payloads, TOKENS, INVALID_EXPERT, 1, active_rank_mask=mask
    )
    row_errors: dict[int, float] = {}
    counts: dict[int, tuple[int, int]] = {}
    for source in range(world):
        want = expected_rows(source, rank, seed, world) if source not in masked else None
        count = 0 if want is None else want.size(0)
        # Rows carrying a token have real expert ids; the sanitize marks the rest.
        counts[source] = (count, int((recv_ids[source] != INVALID_EXPERT).all(dim=-1).sum()))
        if want is not None and count:
            row_errors[source] = float((x[source, :count].to(torch.float32) - want).abs().max())
    safe_ids = recv_ids.clamp(min=0).long()
    owners = torch.tensor([owner(e, world) for e in range(NUM_EXPERTS)])
    mine = ((recv_ids >= 0) & (owners[safe_ids] == rank)).to(torch.float32)
    factor = (recv_weights * expert_scale(safe_ids) * mine).sum(dim=-1, keepdim=True)
    expert_out = (x.to(torch.float32) * factor).to(torch.bfloat16)
    output = torch.empty(TOKENS, HIDDEN, dtype=torch.bfloat16)
    wrong = ""
    if wrong_combine_mask is not None:
        wrong = refusal(
            lambda: a2a.combine(
                expert_out, TOKENS, output=output, active_rank_mask=wrong_combine_mask
            )
        )
    combined = a2a.combine(expert_out, TOKENS, output=output, active_rank_mask=mask)
    want = expected_combine(rank, seed, world, masked)
    return {
        "seed": seed,
        "wrong_combine_mask": wrong,
        "row_errors": row_errors,
        "counts": counts,
        "combine_error": float((combined.to(torch.float32) - want).abs().max()),
        "dropped_share": float((expected_combine(rank, seed, world, set()) - want).abs().sum()),
    }


def moe_ep_step(
    communication: Any, rank: int, world: int, seed: int, mask: torch.Tensor, masked: set[int]
) -> float:
    """One step through the moe_ep object over the same all-to-all, the mask in
    FlashInfer's words; the largest difference of the combined rows."""
    inputs = step_inputs(rank, seed)
    result = communication.dispatch(
        inputs["values"].to(torch.bfloat16),
        inputs["ids"],
        inputs["weights"],
        max_tokens_per_rank=TOKENS,
        active_rank_mask=mask,
    )
    ids = result.topk_ids
    owners = torch.tensor([owner(e, world) for e in range(NUM_EXPERTS)])
    mine = ((ids >= 0) & (owners[ids.clamp(min=0).long()] == rank)).to(torch.float32)
    factor = (result.topk_weights * expert_scale(ids.clamp(min=0)) * mine).sum(-1, keepdim=True)
    expert_out = (result.hidden_states.to(torch.float32) * factor).to(torch.bfloat16)
    combined = communication.combine(expert_out, active_rank_mask=mask)
    want = expected_combine(rank, seed, world, masked)
    return float((combined.to(torch.float32) - want).abs().max())


def refusal(call: Callable[[], object]) -> str:
    """The message of the ``RankMaskError`` ``call`` raises ('' if it returns)."""
    from moe_sidecar.client.backends import RankMaskError

    try:
        call()
    except RankMaskError as error:
        return str(error)
    return ""


def masked_steps_worker(rank: int, world: int, masked_rank: int, seeds: list[int]) -> Any:
    """All ranks build twice (without and with ``enable_rank_mask``) and step
    once unmasked; then ``masked_rank`` leaves and the others step under the
    mask without it, checking the refusals on the way."""
    from moe_sidecar.client.backends import BuildSpec, CommunicationSpec
    from moe_sidecar.client.backends.rank_mask import rank_mask_tensor
    from moe_sidecar.client.backends.reference import ReferenceBackend
    from moe_sidecar.client.sizing import layer_capacities

    group = dist.new_group(backend="gloo")
    backend = ReferenceBackend(group)
    capacities = layer_capacities(world, TOKENS, TOP_K, NUM_EXPERTS, HIDDEN, 2 * HIDDEN, 0)
    spec = BuildSpec(world, rank, capacities, backend.workspace_bytes(capacities, world))
    full = (1 << world) - 1
    plain = backend.build(spec)
    result: dict[str, Any] = {"refused": {}}
    ids = step_inputs(rank, 0)["ids"]
    payloads = [step_inputs(rank, 0)["values"].to(torch.bfloat16), ids]
    result["refused"]["unmasked_build"] = refusal(
        lambda: plain.dispatch(ids, payloads, TOKENS, active_rank_mask=full)
    )
    result["plain"] = run_step(plain, rank, world, 0, None, set())
    backend.release(plain)
    a2a = backend.build(
        BuildSpec(world, rank, capacities, spec.workspace_size_per_rank, enable_rank_mask=True)
    )
    result["all_members"] = run_step(a2a, rank, world, 1, None, set())
    if rank == masked_rank:
        return result  # from here on it takes no part at all
    mask = full & ~(1 << masked_rank)
    result["refused"]["own_bit"] = refusal(
        lambda: a2a.dispatch(ids, payloads, TOKENS, active_rank_mask=mask & ~(1 << rank))
    )
    result["refused"]["beyond_ep_size"] = refusal(
        lambda: a2a.dispatch(ids, payloads, TOKENS, active_rank_mask=mask | (1 << world))
    )
    communication = backend.communication(
        a2a,
        CommunicationSpec(world, rank, NUM_EXPERTS, TOP_K, TOKENS, HIDDEN, None, None, 0, False),
    )
    words = rank_mask_tensor(mask, ReferenceBackend.flashinfer_release.rank_mask_words)
    result["moe_ep_error"] = moe_ep_step(communication, rank, world, 21, words, {masked_rank})
    result["steps"] = [
        run_step(a2a, rank, world, seed, mask, {masked_rank}, full if i == 0 else None)
        for i, seed in enumerate(seeds)
    ]
    backend.release(a2a)
    return result
