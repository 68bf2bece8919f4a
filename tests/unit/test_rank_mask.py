"""Membership masks as the backends check them and as FlashInfer's words carry them."""

from __future__ import annotations

import pytest
import torch

from moe_sidecar.client.backends import RankMaskError
from moe_sidecar.client.backends.rank_mask import (
    active_ranks,
    all_ranks_mask,
    check_rank_mask,
    members,
    rank_mask_from_tensor,
    rank_mask_tensor,
    rank_mask_words,
)
from moe_sidecar.flashinfer import v0_7_2_post1, v0_7_4

pytestmark = pytest.mark.timeout(10)


def test_no_mask_is_every_rank_on_a_build_that_takes_one() -> None:
    assert check_rank_mask(None, ep_size=4, ep_rank=1, enable_rank_mask=False) is None
    assert check_rank_mask(None, ep_size=4, ep_rank=1, enable_rank_mask=True) == 0b1111
    assert check_rank_mask(0b1011, ep_size=4, ep_rank=1, enable_rank_mask=True) == 0b1011


@pytest.mark.parametrize(
    ("mask", "enabled", "words"),
    [
        (0b1111, False, ("active_rank_mask=0xf", "enable_rank_mask")),
        (0b1101, True, ("active_rank_mask=0xd", "ep_rank=1")),
        (0b10011, True, ("active_rank_mask=0x13", "ep_size=4")),
        (-1, True, ("active_rank_mask=-0x1", "ep_size=4")),
        (True, True, ("active_rank_mask=True", "int bitmask")),
        ("0b1011", True, ("active_rank_mask='0b1011'", "int bitmask")),
    ],
)
def test_refusals_name_the_argument_and_value(
    mask: object, enabled: bool, words: tuple[str, ...]
) -> None:
    with pytest.raises(RankMaskError) as caught:
        check_rank_mask(mask, ep_size=4, ep_rank=1, enable_rank_mask=enabled)  # type: ignore[arg-type]
    assert isinstance(caught.value, ValueError)
    for word in words:
        assert word in str(caught.value)


def test_members_and_ranks() -> None:
    assert all_ranks_mask(4) == 0b1111
    assert active_ranks(0b1011, 4) == (0, 1, 3)
    assert members(0b1011, 4) == (0, 1, 3)
    assert members(0b1111, 4) is None
    assert members(None, 4) is None


@pytest.mark.parametrize(
    ("mask", "words", "expected"),
    [
        (0b1011, 1, (0b1011,)),
        (all_ranks_mask(64), 1, (2**64 - 1,)),
        (0b1011, 4, (0b1011, 0, 0, 0)),
        (1 | (1 << 64) | (1 << 255), 4, (1, 1, 0, 1 << 63)),
        (all_ranks_mask(256), 4, (2**64 - 1,) * 4),
    ],
)
def test_words_lowest_ranks_first(mask: int, words: int, expected: tuple[int, ...]) -> None:
    assert rank_mask_words(mask, words) == expected
    tensor = rank_mask_tensor(mask, words)
    assert tensor.dtype == torch.uint64 and tensor.device.type == "cpu"
    assert list(tensor.shape) == [words]
    assert rank_mask_from_tensor(tensor) == mask


def test_a_mask_beyond_the_words_is_refused() -> None:
    with pytest.raises(RankMaskError, match=r"active_rank_mask=0x10000000000000000.*1 64-bit"):
        rank_mask_words(1 << 64, 1)
    with pytest.raises(RankMaskError, match="active_rank_mask=-0x1"):
        rank_mask_words(-1, 4)


def test_flashinfer_form_is_checked() -> None:
    assert rank_mask_from_tensor(None) is None
    assert rank_mask_from_tensor(0b11) == 0b11
    with pytest.raises(RankMaskError, match="active_rank_mask: must be a 1-D CPU uint64"):
        rank_mask_from_tensor(torch.tensor([3], dtype=torch.int64))
    with pytest.raises(RankMaskError, match="active_rank_mask"):
        rank_mask_from_tensor(torch.zeros(1, 1, dtype=torch.uint64))


def test_each_release_names_its_words_and_limit() -> None:
    # MOE_A2A_RANK_MASK_WORDS of 0.7.2.post1; kRankMaskWords of 0.7.4.
    assert v0_7_2_post1.RELEASE.rank_mask_words == 1
    assert v0_7_4.RELEASE.rank_mask_words == 4
    for release in (v0_7_2_post1.RELEASE, v0_7_4.RELEASE):
        assert release.rank_mask_words * 64 == release.max_ranks
