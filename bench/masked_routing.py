"""The routing, the "experts" and the expected values of a masked step, at any shape.

The same arithmetic as ``tests/multiprocess/masked_workers.py`` (the CPU
test of masked steps on the reference backend), with the shape a parameter:
at that test's shape every tensor here equals the test's
(``tests/unit/test_masked_routing.py`` checks it), and
``bench/masked_steps_gpu.py`` runs it at DeepSeek-V3's.

Every step's inputs follow from ``(seed, rank)`` alone, so each rank computes
locally what its combine must return: each token's hidden state (small
integers) times ``sum(weight * (expert % 3 + 1))`` over its top-k experts,
those owned by a masked rank left out (FlashInfer drops a token's copy for
a masked rank; it is not re-routed). Weights are 0.5 or 1, so every partial
sum is a multiple of 0.5 below ``4 * 3 * top_k``: exact in bf16 for
``top_k <= 10`` (:func:`exact_in_bf16`), and the combine is compared exactly.

Imports torch only; tensors are made on the CPU, the caller moves them.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

__all__ = [
    "DEEPSEEK_V3",
    "INVALID_EXPERT",
    "Shape",
    "add_shape_arguments",
    "dropped_share",
    "exact_in_bf16",
    "expected_combine",
    "expected_rows",
    "expert_output",
    "owner",
    "shape_from",
    "step_inputs",
]

INVALID_EXPERT = -1
"""The expert id the dispatch writes into rows that carry no token."""


@dataclass(frozen=True)
class Shape:
    """One MoE layer's step: hidden size, top-k, experts, tokens per rank."""

    hidden: int
    top_k: int
    num_experts: int
    tokens: int


DEEPSEEK_V3 = Shape(hidden=7168, top_k=8, num_experts=256, tokens=128)
"""DeepSeek-V3's hidden size, top-k and experts; 128 tokens per rank."""


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """``--ranks``'s companions of a masked-steps bench: the layer's shape
    (DeepSeek-V3's by default), read back by :func:`shape_from`."""
    parser.add_argument("--hidden", type=int, default=DEEPSEEK_V3.hidden)
    parser.add_argument("--top-k", type=int, default=DEEPSEEK_V3.top_k)
    parser.add_argument("--experts", type=int, default=DEEPSEEK_V3.num_experts)
    parser.add_argument(
        "--tokens", type=int, default=DEEPSEEK_V3.tokens, help="tokens per rank per step"
    )


def shape_from(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Shape:
    """The shape ``args`` name (see :func:`add_shape_arguments`), checked
    against ``args.ranks`` and ``args.steps``; a bad one ends the bench
    through ``parser.error`` (naming the flag and its value)."""
    if args.ranks < 2 or args.experts % args.ranks:
        parser.error(
            f"--ranks={args.ranks}: needs at least 2 and to divide --experts={args.experts}"
        )
    if args.steps < 1:
        parser.error(f"--steps={args.steps}: must be at least 1")
    return Shape(args.hidden, args.top_k, args.experts, args.tokens)


def owner(expert: int, shape: Shape, ep_size: int) -> int:
    """The rank owning ``expert``: the contiguous partition, written out plainly."""
    return expert // (shape.num_experts // ep_size)


def step_inputs(shape: Shape, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s tokens at step ``seed``: small integers, exact in bf16."""
    g = torch.Generator().manual_seed(seed * 100 + rank)
    values = torch.randint(-4, 5, (shape.tokens, shape.hidden), generator=g).to(torch.float32)
    ids = torch.stack(
        [torch.randperm(shape.num_experts, generator=g)[: shape.top_k] for _ in range(shape.tokens)]
    )
    weights = torch.randint(1, 3, (shape.tokens, shape.top_k), generator=g).to(torch.float32) / 2
    return {"values": values, "ids": ids.to(torch.int32), "weights": weights}


def _expert_scale(ids: torch.Tensor) -> torch.Tensor:
    """What expert ``e`` multiplies a row by: ``e % 3 + 1``."""
    return (ids % 3 + 1).to(torch.float32)


def expected_combine(
    shape: Shape, rank: int, seed: int, ep_size: int, masked: set[int]
) -> torch.Tensor:
    """Rank ``rank``'s combined rows (float32): each token's experts summed,
    those of the ``masked`` ranks left out."""
    inputs = step_inputs(shape, rank, seed)
    ids = inputs["ids"]
    kept = torch.tensor(
        [[owner(int(e), shape, ep_size) not in masked for e in row] for row in ids.tolist()]
    ).to(torch.float32)
    factor = (inputs["weights"] * _expert_scale(ids) * kept).sum(dim=-1, keepdim=True)
    return inputs["values"] * factor


def dropped_share(shape: Shape, rank: int, seed: int, ep_size: int, masked: set[int]) -> float:
    """How much of rank ``rank``'s combine the ``masked`` ranks' experts carry
    (the sum of absolute differences; 0 when the routing sends them nothing)."""
    full = expected_combine(shape, rank, seed, ep_size, set())
    return float((full - expected_combine(shape, rank, seed, ep_size, masked)).abs().sum())


def expected_rows(shape: Shape, source: int, me: int, seed: int, ep_size: int) -> torch.Tensor:
    """The hidden rows ``source`` sends ``me`` at step ``seed``, in its token order."""
    inputs = step_inputs(shape, source, seed)
    rows = [
        inputs["values"][t]
        for t, row in enumerate(inputs["ids"].tolist())
        if me in {owner(e, shape, ep_size) for e in row}
    ]
    return torch.stack(rows) if rows else torch.empty(0, shape.hidden)


def expert_output(
    shape: Shape,
    rank: int,
    ep_size: int,
    hidden_rows: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """This rank's "experts" on the rows it received (any leading shape, any
    device): each row times ``sum(weight * (e % 3 + 1))`` over the row's
    experts this rank owns; rows without a token (ids ``INVALID_EXPERT``)
    give 0. bf16, as the combine takes it."""
    per_rank = shape.num_experts // ep_size
    safe = ids.clamp(min=0).long()
    mine = ((ids >= 0) & (safe // per_rank == rank)).to(torch.float32)
    factor = (weights.to(torch.float32) * _expert_scale(safe) * mine).sum(dim=-1, keepdim=True)
    return (hidden_rows.to(torch.float32) * factor).to(torch.bfloat16)


def exact_in_bf16(shape: Shape) -> bool:
    """Whether every partial sum of a combine is exact in bf16: a multiple of
    0.5 of magnitude at most ``4 * 3 * top_k`` (values up to 4, scales up to
    3, weights up to 1), which bf16's 8 significant bits hold below 128."""
    return 4 * 3 * shape.top_k < 128
