"""One checked step of a simulated rank: dispatch, expert compute and combine through the manager.

Each token carries one small integer ``v`` in its hidden states; an expert
multiplies it by the token's routing weight, so the combined result must be
exactly ``v`` times the sum of the weights of the token's experts whose rank
took part: every rank's, or under a membership view its members' only (a
masked rank's copies are dropped, not re-routed). The step is split in two,
:func:`dispatch` and :func:`combine`, so that a rank can be killed between
them, as a rank dies between its dispatch and its combine on a GPU.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch

from moe_sidecar.client import WorkspaceManager
from moe_sidecar.client.backends.reference import expert_owner
from moe_sidecar.client.simulate.presets import MoeLayer

__all__ = ["Dispatched", "combine", "dispatch", "dropped_copies", "exchange"]


@dataclass(frozen=True)
class Dispatched:
    """A step between its dispatch and its combine: this rank's tokens and what it received."""

    layer: MoeLayer
    tokens: int
    values: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    received: list[torch.Tensor]


def dispatch(manager: WorkspaceManager, layer: MoeLayer, tokens: int, seed: int) -> Dispatched:
    """This rank's ``tokens`` tokens of ``layer``'s shape (from ``seed``), dispatched."""
    a2a = manager.moe_alltoall
    assert a2a is not None
    g = torch.Generator().manual_seed(seed * 1009 + manager.ep_rank)
    # Values and weights small enough that every product is exact in bf16.
    values = torch.randint(1, 16, (tokens,), generator=g)
    ids = (
        torch.rand(tokens, layer.num_experts, generator=g)
        .topk(layer.top_k, dim=1)
        .indices.to(torch.int32)
    )
    weights = torch.randint(1, 3, (tokens, layer.top_k), generator=g).to(torch.float32)
    if layer.quant == "nvfp4":
        x = values.to(torch.uint8)[:, None].expand(tokens, layer.x_bytes_per_token).contiguous()
        x_sf = torch.randint(
            0, 256, (tokens, layer.x_sf_bytes_per_token), generator=g, dtype=torch.uint8
        )
        payloads = [x, x_sf, ids, weights]
    else:
        x = values.to(torch.bfloat16)[:, None].expand(tokens, layer.hidden_size).contiguous()
        payloads = [x, ids, weights]
    received = a2a.dispatch(ids, payloads, tokens)
    return Dispatched(layer, tokens, values, ids, weights, list(received))


def _alive(
    manager: WorkspaceManager, d: Dispatched, members: Collection[int] | None
) -> torch.Tensor:
    """Per token pick: 1.0 where the expert's rank takes part, else 0.0."""
    if members is None:
        return torch.ones_like(d.weights)
    owners = expert_owner(d.ids, d.layer.num_experts, manager.ep_size)
    return torch.isin(owners, torch.tensor(sorted(members), dtype=owners.dtype)).to(torch.float32)


def combine(manager: WorkspaceManager, d: Dispatched, members: Collection[int] | None) -> float:
    """The experts' compute on what ``d`` received, and the combine; the largest
    difference from the expected result (0.0 when exact), the experts of ranks
    outside ``members`` left out (None: every rank)."""
    layer, tokens = d.layer, d.tokens
    token_values = d.received[0][..., 0].to(torch.float32)
    mine = expert_owner(d.received[-2], layer.num_experts, manager.ep_size) == manager.ep_rank
    factor = (d.received[-1] * mine).sum(dim=-1)
    expert_out = (
        (token_values * factor)[..., None]
        .expand(manager.ep_size, tokens, layer.hidden_size)
        .to(torch.bfloat16)
        .contiguous()
    )
    output = torch.empty(tokens, layer.hidden_size, dtype=torch.bfloat16)
    manager.combine_into(expert_out, tokens, output)
    kept = (d.weights * _alive(manager, d, members)).sum(dim=-1)
    expected = (d.values.to(torch.float32) * kept)[:, None]
    return float((output.to(torch.float32) - expected).abs().max())


def dropped_copies(manager: WorkspaceManager, d: Dispatched, members: Collection[int]) -> int:
    """Token picks of ``d`` whose expert's rank is outside ``members``."""
    return int((_alive(manager, d, members) == 0).sum())


def exchange(manager: WorkspaceManager, layer: MoeLayer, tokens: int, seed: int) -> float:
    """A whole step with every rank taking part; its largest difference (0.0: exact)."""
    return combine(manager, dispatch(manager, layer, tokens, seed), None)
