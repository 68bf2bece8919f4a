"""moe_sidecar.client.sizing equals FlashInfer's moe_a2a_get_workspace_size_per_rank.

Over a grid of EP sizes (1..64), token counts (1..8192), payload sizes and
EPLB sizes, byte for byte. Runs on the GPU machine: FlashInfer's function
loads its CUDA module.
"""

from __future__ import annotations

import itertools

import pytest

from moe_sidecar.client import sizing
from moe_sidecar.flashinfer.v0_7_2_post1 import capacities_workspace_bytes

pytestmark = [pytest.mark.gpu(flashinfer="0.7.2.post1"), pytest.mark.timeout(600)]

EP_SIZES = [1, 2, 3, 4, 5, 7, 8, 16, 31, 32, 48, 63, 64]
TOKENS = [1, 2, 3, 7, 64, 127, 128, 129, 255, 256, 1000, 1024, 4095, 4096, 8191, 8192]
# (dispatch, combine) bytes per token: empty, odd, NVFP4-like, bf16-like, big.
PAYLOADS = [(0, 0), (1, 1), (3, 5), (2320, 8192), (8208, 8192), (3664 + 64, 14336), (28688, 14336)]
EPLB = [0, 1, 37, 256]


def test_workspace_size_matches_flashinfer() -> None:
    from flashinfer.comm.trtllm_moe_alltoall import moe_a2a_get_workspace_size_per_rank

    checked = 0
    mismatches = []
    for ep, tokens, (dispatch, combine), eplb in itertools.product(
        EP_SIZES, TOKENS, PAYLOADS, EPLB
    ):
        theirs = int(moe_a2a_get_workspace_size_per_rank(ep, tokens, dispatch, combine, eplb))
        ours = sizing.workspace_size_per_rank(ep, tokens, dispatch, combine, eplb)
        checked += 1
        if ours != theirs:
            mismatches.append((ep, tokens, dispatch, combine, eplb, ours, theirs))
    print(f"sizing parity: {checked} cases checked, {len(mismatches)} mismatches")
    assert not mismatches[:20]


def test_aux_data_size_matches_flashinfer() -> None:
    from flashinfer.comm.trtllm_moe_alltoall import get_moe_alltoall_module

    module = get_moe_alltoall_module()
    checked = 0
    for ep, tokens, eplb in itertools.product(EP_SIZES, TOKENS, EPLB):
        assert int(module.moe_a2a_get_aux_data_size(ep, tokens, eplb)) == sizing.aux_data_size(
            ep, tokens, eplb
        ), (ep, tokens, eplb)
        checked += 1
    print(f"aux size parity: {checked} cases checked")


def test_layer_rule_matches_flashinfer() -> None:
    from flashinfer.comm.trtllm_moe_alltoall import moe_a2a_get_workspace_size_per_rank

    # DeepSeek-V3-like (hidden 7168, top_k 8) NVFP4 and bf16 layers, and the
    # issue's 4096/top_k 2 pair, at several EP sizes and token counts.
    for hidden, top_k in ((4096, 2), (7168, 8)):
        for x_bytes, x_sf in ((hidden // 2, hidden // 16), (hidden * 2, 0)):
            for ep, tokens in itertools.product((2, 8, 64), (256, 8192)):
                ours = sizing.layer_capacities(ep, tokens, top_k, 256, hidden, x_bytes, x_sf)
                theirs = moe_a2a_get_workspace_size_per_rank(
                    ep, tokens, x_bytes + x_sf + 8 * top_k, 2 * hidden
                )
                assert capacities_workspace_bytes(ours, ep) == int(theirs)
