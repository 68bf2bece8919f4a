"""Membership masks against FlashInfer 0.7.4's own ``moe_ep``, read on CPU.

Where the mask enters (``NVLinkOneSidedConfig.enable_rank_mask``, the
``active_rank_mask`` keyword of ``dispatch`` and ``combine``), how many
words it has (``kRankMaskWords`` of the kernels' header), and that the
client's subclass refuses a bad mask, naming it, before FlashInfer's code
runs. A valid mask's words are built by FlashInfer's
``NVLinkOneSidedAlltoAll.active_rank_mask``, which reads the JIT module's
constants: that part runs on the GPU machine only.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

from moe_sidecar.flashinfer import v0_7_4

pytestmark = [pytest.mark.fi074, pytest.mark.timeout(120)]


def _package() -> Path:
    spec = importlib.util.find_spec("flashinfer")
    assert spec is not None and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations)))


def test_the_words_and_the_limit_are_the_kernels() -> None:
    header = (
        _package()
        / "data/csrc/nv_internal/tensorrt_llm/kernels/moe/communication/moeAlltoAllKernels.h"
    ).read_text()
    words = re.search(r"constexpr int kRankMaskWords = (\d+);", header)
    ranks = re.search(r"constexpr int kMaxRanks = (\d+);", header)
    assert words is not None and ranks is not None
    assert int(words.group(1)) == v0_7_4.RANK_MASK_WORDS == v0_7_4.RELEASE.rank_mask_words
    assert int(ranks.group(1)) == v0_7_4.MAX_RANKS


def test_where_the_mask_enters() -> None:
    moe_ep = importlib.import_module("flashinfer.moe_ep")
    config = {f.name: f.default for f in dataclasses.fields(moe_ep.NVLinkOneSidedConfig)}
    assert config["enable_rank_mask"] is False
    cls = moe_ep.NVLinkOneSidedAlltoAll
    for method in (cls.dispatch, cls.combine):
        parameter = inspect.signature(method).parameters["active_rank_mask"]
        assert parameter.kind is inspect.Parameter.KEYWORD_ONLY and parameter.default is None
    assert list(inspect.signature(cls.active_rank_mask).parameters) == ["self", "active_ranks"]
    from moe_sidecar.client.backends.flashinfer_moe_ep import vllm_compatible_class

    ours = vllm_compatible_class()
    assert [(n, p.kind) for n, p in inspect.signature(cls.combine).parameters.items()] == [
        (n, p.kind) for n, p in inspect.signature(ours.combine).parameters.items()
    ]


def _unbuilt(enable_rank_mask: bool) -> Any:
    """The client's object with what its checks read; no workspace."""
    import torch

    from moe_sidecar.client.backends.flashinfer_moe_ep import vllm_compatible_class

    moe_ep = importlib.import_module("flashinfer.moe_ep")
    obj = object.__new__(vllm_compatible_class())
    obj.params = moe_ep.MoEEpCommParams(
        num_experts=8, top_k=2, max_tokens_per_rank=4, hidden_size=256, dtype=torch.bfloat16
    )
    obj.config = moe_ep.NVLinkOneSidedConfig(
        cft=False, lamport=False, enable_rank_mask=enable_rank_mask
    )
    obj.ep_rank, obj.ep_size = 1, 4
    obj._state = {"round_owner": None}
    obj._round = None
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
    import torch

    from moe_sidecar.client.backends import RankMaskError

    obj = _unbuilt(enable_rank_mask)
    x = torch.ones(1, 256, dtype=torch.bfloat16)
    ids = torch.zeros(1, 2, dtype=torch.int32)
    for call in (
        lambda: obj.dispatch(x, ids, active_rank_mask=mask),
        lambda: obj.combine(x, active_rank_mask=mask),
    ):
        with pytest.raises(RankMaskError) as caught:
            call()
        for word in words:
            assert word in str(caught.value)
    assert obj._round is None  # nothing started
