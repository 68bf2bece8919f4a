"""FlashInfer's workspace arithmetic, checked against values worked by hand.

Parity with FlashInfer itself over a grid runs on the GPU machine
(tests/gpu/test_sizing_parity.py).
"""

from __future__ import annotations

import pytest

from moe_sidecar.client import sizing
from moe_sidecar.client import sizing as client_sizing
from moe_sidecar.client.engines.vllm import sizing as vllm_sizing
from moe_sidecar.core import sizing as core_sizing
from moe_sidecar.core.errors import InvalidArgument
from moe_sidecar.core.layer import layer_capacities
from moe_sidecar.flashinfer.v0_7_2_post1 import capacities_workspace_bytes

pytestmark = pytest.mark.timeout(10)


def test_aux_offsets_ep2_256_tokens() -> None:
    o = sizing.aux_offsets(2, 256)
    assert (o.flag_val, o.local_token_counter, o.send_counters, o.recv_counters) == (0, 4, 8, 16)
    assert o.dispatch_completion_flags == 128
    assert o.combine_completion_flags == 256
    assert o.topk_target_ranks == 384
    # 384 + 256 * 22 * 4 = 22912, already aligned.
    assert o.topk_send_indices == 22912
    assert o.eplb_gathered_stats == 45440
    assert o.payload_data == 45440


def test_eplb_region() -> None:
    # 45440 + 2 * 100 * 4 = 46240 -> aligned up to 46336.
    assert sizing.aux_data_size(2, 256, 100) == 46336


def test_workspace_nvfp4_layer_hidden_4096() -> None:
    c = sizing.layer_capacities(2, 256, 2, 16, 4096, 4096 // 2, 4096 // 16)
    assert c.dispatch_bytes_per_token == 2048 + 256 + 16
    assert c.combine_bytes_per_token == 8192
    assert capacities_workspace_bytes(c, 2) == 45440 + 2 * 256 * 2320 + 2 * 256 * 8192


def test_bf16_layer_needs_more_than_nvfp4() -> None:
    nvfp4 = sizing.layer_capacities(2, 256, 2, 16, 4096, 2048, 256)
    bf16 = sizing.layer_capacities(2, 256, 2, 16, 4096, 8192, 0)
    assert capacities_workspace_bytes(bf16, 2) > capacities_workspace_bytes(nvfp4, 2)
    # The bf16 dispatch fits the NVFP4 workspace; its combine does not: the
    # combine payload starts after the (bigger) dispatch payloads.
    payload = sizing.aux_data_size(2, 256)
    dispatch_end = payload + 2 * 256 * bf16.dispatch_bytes_per_token
    assert dispatch_end <= capacities_workspace_bytes(nvfp4, 2)
    combine_offset = sizing.align(dispatch_end)
    assert combine_offset + 2 * 256 * bf16.combine_bytes_per_token > capacities_workspace_bytes(
        nvfp4, 2
    )


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ((2, 0, 2, 16, 4096, 2048, 256), "layer.max_tokens=0"),
        ((2, 16, 0, 16, 4096, 2048, 256), "layer.top_k=0"),
        ((2, 16, 2, 1, 4096, 2048, 256), "layer.num_experts=1"),
        ((2, 16, 2, 16, 0, 2048, 256), "hidden_size=0"),
        ((2, 16, 2, 16, 4096, -1, 256), "x_bytes_per_token=-1"),
        ((2, 16, 2, 16, 4096, 2048, -1), "x_sf_bytes_per_token=-1"),
    ],
)
def test_layer_arguments_out_of_range_name_the_argument(args: tuple[int, ...], needle: str) -> None:
    with pytest.raises(InvalidArgument, match=needle):
        sizing.layer_capacities(*args)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((1, 1, 0, 0), 640),  # 16 -> 128, +4 -> 256, +4 -> 384, +88 -> 512, +88 -> 640
        ((8, 0, 100, 100), 384),
        ((64, 1, 1, 1), 1408 + 128 + 128),  # 520 -> 640, 896, 1152, 1280, 1408
    ],
)
def test_small_cases(args: tuple[int, int, int, int], expected: int) -> None:
    ep, tokens, dispatch, combine = args
    aux = sizing.aux_data_size(ep, tokens)
    total = sizing.workspace_size_per_rank(ep, tokens, dispatch, combine)
    assert total == sizing.align(aux) + sizing.align(ep * tokens * dispatch) + sizing.align(
        ep * tokens * combine
    )
    assert total == expected


@pytest.mark.parametrize(
    "bad",
    [
        {"ep_size": 0},
        {"max_num_tokens": -1},
        {"dispatch_bytes_per_token": -1},
        {"eplb_stats_num_experts": -2},
        {"ep_size": 2.0},
    ],
)
def test_bad_arguments_name_the_field(bad: dict[str, object]) -> None:
    args: dict[str, object] = {
        "ep_size": 2,
        "max_num_tokens": 16,
        "dispatch_bytes_per_token": 10,
        "combine_bytes_per_token": 10,
    }
    args.update(bad)
    (name,) = bad
    with pytest.raises(ValueError, match=name):
        sizing.workspace_size_per_rank(**args)  # type: ignore[arg-type]


def test_one_per_layer_rule_serves_the_client_the_core_and_every_vllm_generation() -> None:
    # The client re-exports the core's rule instead of spelling it again.
    assert client_sizing.dispatch_bytes_per_token is core_sizing.dispatch_bytes_per_token
    assert client_sizing.combine_bytes_per_token is core_sizing.combine_bytes_per_token
    assert vllm_sizing.routing_bytes_per_token is core_sizing.routing_bytes_per_token
    hidden, top_k = 7168, 8
    assert core_sizing.dispatch_bytes_per_token(top_k, hidden // 2, hidden // 16) == (
        hidden // 2 + hidden // 16 + 8 * top_k
    )
    assert core_sizing.dispatch_bytes_per_token(top_k, 2 * hidden, 0, 64) == 2 * hidden + 64 + 64
    assert core_sizing.combine_bytes_per_token(hidden) == 2 * hidden
    nvfp4 = hidden // 2 + hidden // 16
    expected = layer_capacities(256, top_k, 256, hidden, nvfp4)
    assert expected.dispatch_bytes_per_token == nvfp4 + 8 * top_k
    for positional, keywords in (
        ((nvfp4, 0), {}),
        ((), {"dispatch_dtype_bytes_per_elem": 0, "dispatch_scale_bytes_per_token": hidden // 16}),
        ((), {"dispatch_format": "NVFP4"}),
    ):
        call = vllm_sizing.classify_call(8, 256, top_k, 256, hidden, positional, keywords)
        assert call.capacities == expected
    assert client_sizing.layer_capacities(8, 256, top_k, 256, hidden, nvfp4, 0) == expected
