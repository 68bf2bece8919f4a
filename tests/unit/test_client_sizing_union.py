"""The payload/auxiliary split of the workspace size, and why the union needs it."""

from __future__ import annotations

import pytest
from moe_sidecar.client import sizing

pytestmark = pytest.mark.timeout(10)


def test_workspace_is_aux_plus_payload() -> None:
    for ep, tokens, dispatch, combine in [(2, 16, 160, 512), (8, 8192, 7200, 14336), (3, 7, 1, 3)]:
        payload = sizing.payload_bytes(ep, tokens, dispatch, combine)
        assert sizing.workspace_for_payload(ep, tokens, payload) == (
            sizing.workspace_size_per_rank(ep, tokens, dispatch, combine)
        )


def test_payload_by_hand() -> None:
    # 2 * 16 * 160 = 5120 and 2 * 16 * 512 = 16384, both already aligned.
    assert sizing.payload_bytes(2, 16, 160, 512) == 5120 + 16384
    # 3 * 7 * 1 = 21 -> 128; 3 * 7 * 3 = 63 -> 128.
    assert sizing.payload_bytes(3, 7, 1, 3) == 256
    assert sizing.layer_sizes(2, 16, 2, 256, 128, 16).payload_bytes == 5120 + 16384


def test_max_of_sizes_and_tokens_separately_is_not_enough() -> None:
    # An NVFP4 layer at 20 tokens and a bf16 layer at 16: the larger size is
    # the bf16 layer's, but a workspace built for 20 tokens has a larger
    # auxiliary region, so the bf16 payload no longer fits in it.
    nvfp4 = sizing.layer_sizes(2, 20, 2, 256, 128, 16)
    bf16 = sizing.layer_sizes(2, 16, 2, 256, 512, 0)
    naive = max(nvfp4.workspace_bytes, bf16.workspace_bytes)
    needed = sizing.workspace_for_payload(2, 20, max(nvfp4.payload_bytes, bf16.payload_bytes))
    assert needed > naive
    assert needed - naive == sizing.aux_data_size(2, 20) - sizing.aux_data_size(2, 16)


def test_rejects_negative_payload() -> None:
    with pytest.raises(ValueError, match="payload"):
        sizing.workspace_for_payload(2, 16, -1)
