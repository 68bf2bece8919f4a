"""The reference backend's expert-to-rank partition: FlashInfer's examples."""

from __future__ import annotations

import pytest
import torch

from moe_sidecar.client.backends.reference import expert_owner

pytestmark = pytest.mark.timeout(20)


def test_uniform_partition() -> None:
    # 32 experts on 4 ranks: 8 consecutive experts each.
    owners = expert_owner(torch.arange(32), 32, 4)
    assert owners.tolist() == [e // 8 for e in range(32)]


def test_non_divisible_partition() -> None:
    # 384 experts on 5 ranks: ranks 0-3 own 77 experts, rank 4 owns 76.
    owners = expert_owner(torch.arange(384), 384, 5)
    assert torch.bincount(owners).tolist() == [77, 77, 77, 77, 76]
    assert owners[76].item() == 0 and owners[77].item() == 1
    assert owners[307].item() == 3 and owners[308].item() == 4
    assert bool((owners[1:] >= owners[:-1]).all())


def test_five_experts_on_two_ranks() -> None:
    assert expert_owner(torch.arange(5), 5, 2).tolist() == [0, 0, 0, 1, 1]
