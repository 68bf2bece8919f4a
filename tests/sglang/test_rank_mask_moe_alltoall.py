"""Membership masks against FlashInfer 0.7.2's ``MoeAlltoAll``, read on CPU.

The SGLang environment holds flashinfer-python 0.7.2, whose all-to-all
files are byte-identical to 0.7.2.post1's (the row of
:mod:`moe_sidecar.flashinfer.v0_7_2_post1`): where the mask enters
(``MoeAlltoAll(enable_rank_mask=)``, the ``active_rank_mask`` keyword of
``dispatch`` and ``combine``), its words (``MOE_A2A_RANK_MASK_WORDS``), and
the client's words equal to FlashInfer's own ``moe_a2a_active_rank_mask``.
The client's subclass refuses a bad mask, naming it, before FlashInfer's code
runs. Nothing here loads a CUDA module.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any

import pytest
import torch

from moe_sidecar.client.backends import RankMaskError
from moe_sidecar.client.backends.flashinfer import masked_class
from moe_sidecar.client.backends.rank_mask import kernel_mask, rank_mask_tensor
from moe_sidecar.flashinfer import v0_7_2_post1

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(120)]

WORDS = v0_7_2_post1.RELEASE.rank_mask_words


def _alltoall() -> Any:
    return importlib.import_module("flashinfer.comm.trtllm_moe_alltoall")


def test_where_the_mask_enters_and_its_words() -> None:
    module = _alltoall()
    assert module.MOE_A2A_RANK_MASK_WORDS == WORDS == v0_7_2_post1.RANK_MASK_WORDS
    cls = module.MoeAlltoAll
    assert inspect.signature(cls.__init__).parameters["enable_rank_mask"].default is False
    for method in (cls.dispatch, cls.combine):
        assert inspect.signature(method).parameters["active_rank_mask"].default is None


@pytest.mark.parametrize("mask", [0b1, 0b1011, 0b1111, (1 << 64) - 1, 1 | (1 << 63)])
def test_the_words_are_flashinfers(mask: int) -> None:
    ep_size = 64 if mask >> 4 else 4
    ranks = [rank for rank in range(ep_size) if (mask >> rank) & 1]
    theirs = _alltoall().moe_a2a_active_rank_mask(ranks, ep_size)
    assert torch.equal(rank_mask_tensor(mask, WORDS), theirs)
    build = functools.partial(_alltoall().moe_a2a_active_rank_mask, ep_size=ep_size)
    ours = kernel_mask(
        mask, ep_size=ep_size, ep_rank=0, enable_rank_mask=True, words=WORDS, build=build
    )
    assert ours is not None and torch.equal(ours, theirs)


def _unbuilt(enable_rank_mask: bool) -> Any:
    """The client's ``MoeAlltoAll`` with what its mask checks read; no workspace."""
    module = _alltoall()
    obj = object.__new__(masked_class(module.MoeAlltoAll, module.moe_a2a_active_rank_mask))
    obj.ep_size, obj.ep_rank, obj.enable_rank_mask = 4, 1, enable_rank_mask
    return obj


@pytest.mark.parametrize(
    ("enable_rank_mask", "mask", "words"),
    [
        (False, 0b1011, ("active_rank_mask=0xb", "enable_rank_mask")),
        (True, 0b1101, ("active_rank_mask=0xd", "ep_rank=1")),
        (True, 0b11011, ("active_rank_mask=0x1b", "ep_size=4")),
    ],
)
def test_a_bad_mask_is_refused_by_name_before_flashinfer(
    enable_rank_mask: bool, mask: int, words: tuple[str, ...]
) -> None:
    obj = _unbuilt(enable_rank_mask)
    ids = torch.zeros(1, 2, dtype=torch.int32)
    payload = torch.ones(4, 1, 8, dtype=torch.bfloat16)
    for call in (
        lambda: obj.dispatch(ids, [payload[0]], 1, active_rank_mask=mask),
        lambda: obj.combine(payload, 1, active_rank_mask=mask),
    ):
        with pytest.raises(RankMaskError) as caught:
            call()
        for word in words:
            assert word in str(caught.value)
