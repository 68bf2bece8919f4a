"""Every vLLM generation's ``initialize()`` arguments, sized as that generation sizes them.

The expected workspaces are each vLLM version's own arithmetic, written out
here from its source (``vllm/distributed/device_communicators/all2all.py``),
on FlashInfer's size function; the DeepSeek-shape figures (hidden 7168,
top_k 8, 128 tokens, EP 2) are the ones measured on 2 x H200
(``bench/results/gpu/``).
"""

from __future__ import annotations

import enum
import itertools
from typing import Any

import pytest

from moe_sidecar.client.engines.vllm.sizing import (
    DISPATCH_FORMAT_BYTES,
    UNSET,
    Generation,
    classify_call,
    describe_activation,
    dispatch_format_name,
)
from moe_sidecar.core.errors import InvalidArgument
from moe_sidecar.flashinfer.v0_7_2_post1 import capacities_workspace_bytes, workspace_size_per_rank

pytestmark = pytest.mark.timeout(30)


class QuantFormat(enum.Enum):
    """FlashInfer 0.7.2.post1's ``flashinfer.fused_moe.api.QuantFormat`` (names and
    values copied; FlashInfer reads only ``.name``). FlashInfer is not
    installed where these tests run."""

    BF16 = 0
    FP16 = 1
    FP8PerTensor = 2
    DeepSeekFp8 = 3
    MXFP8 = 4
    NVFP4 = 5
    MXFP4 = 6
    MXINT4 = 7
    INT4 = 8


EP, T, K, E, H = 2, 128, 8, 256, 7168
NVFP4_B, BF16_B, FP8_SCALED_B = 4_741_504, 7_379_328, 5_601_664
"""Workspace bytes per rank at these shapes, as measured on 2 x H200."""


def workspace(positional: tuple[object, ...] = (), hidden: int = H, **keywords: object) -> int:
    call = classify_call(EP, T, K, E, hidden, positional, keywords)
    return capacities_workspace_bytes(call.capacities, EP)


def pr42976(hidden: int, code: int, scale: int) -> int:
    """PR #42976's initialize(), transcribed."""
    hidden_bytes = hidden // 2 if code == 0 else hidden * code
    dispatch = hidden_bytes + scale + K * 4 + K * 4
    return workspace_size_per_rank(EP, T, dispatch, hidden * 2)


def v0_30(hidden: int, x: int, x_sf: int) -> int:
    """vLLM 0.30's initialize(), transcribed."""
    return workspace_size_per_rank(EP, T, x + x_sf + K * 4 + K * 4, hidden * 2)


def v0_33(hidden: int, fmt: QuantFormat | None, extra: int = 0) -> int:
    """vLLM 0.33's initialize() + FlashInfer's NVLinkOneSidedAlltoAll.__init__, transcribed."""
    row = 2 * hidden if fmt is None else DISPATCH_FORMAT_BYTES[fmt.name](hidden)
    return workspace_size_per_rank(EP, T, row + K * 4 + K * 4 + extra, hidden * max(2, 2))


# vLLM's call sites for one layer (0.30 all2all_utils.py:43-84, 0.33 :50-104,
# PR #42976's copy quoted in the notes section 5): (quantization, PR pair,
# 0.30 pair, 0.33 pair), at hidden H; MXFP8 with mx_alignment 0 (padded_k = H).
CALL_SITES: list[tuple[str, tuple[int, int], tuple[int, int], tuple[QuantFormat, int]]] = [
    ("nvfp4", (0, H // 16), (H // 2, H // 16), (QuantFormat.NVFP4, 0)),
    ("bf16", (2, 0), (H * 2, 0), (QuantFormat.BF16, 0)),
    ("mxfp8", (1, H // 32), (H, H // 32), (QuantFormat.MXFP8, H // 32 - (H + 31) // 32)),
    ("deepseek-fp8", (1, (H // 128) * 4), (H, (H // 128) * 4), (QuantFormat.DeepSeekFp8, 0)),
]


@pytest.mark.parametrize(
    ("quant", "pr", "old", "new"), CALL_SITES, ids=[row[0] for row in CALL_SITES]
)
def test_each_generation_sizes_its_call_sites_byte_equal(
    quant: str, pr: tuple[int, int], old: tuple[int, int], new: tuple[QuantFormat, int]
) -> None:
    expected = {"nvfp4": NVFP4_B, "bf16": BF16_B}.get(quant, FP8_SCALED_B)
    d, s = pr
    x, x_sf = old
    fmt, extra = new
    assert pr42976(H, d, s) == v0_30(H, x, x_sf) == v0_33(H, fmt, extra) == expected
    by_keyword = [
        workspace(dispatch_dtype_bytes_per_elem=d, dispatch_scale_bytes_per_token=s),
        workspace(x_bytes_per_token=x, x_sf_bytes_per_token=x_sf),
        workspace(dispatch_format=fmt, extra_payload_bytes_per_token=extra),
    ]
    by_position = [workspace((d, s)), workspace((x, x_sf)), workspace((fmt, extra))]
    assert by_keyword == by_position == [expected] * 3


def test_mxfp8_padding_of_a_hidden_size_not_a_multiple_of_the_alignment() -> None:
    # gpt-oss: hidden 2880, mx_alignment 128 -> padded_k 2944: 92 scale bytes,
    # of which FlashInfer's MXFP8 row already counts ceil(2880/32) = 90.
    hidden, padded_k = 2880, 2944
    extra = padded_k // 32 - (hidden + 31) // 32
    want = v0_30(hidden, hidden, padded_k // 32)
    assert pr42976(hidden, 1, padded_k // 32) == want == v0_33(hidden, QuantFormat.MXFP8, extra)
    assert (
        workspace(hidden=hidden, dispatch_dtype_bytes_per_elem=1, dispatch_scale_bytes_per_token=92)
        == workspace(hidden=hidden, x_bytes_per_token=hidden, x_sf_bytes_per_token=92)
        == workspace(
            hidden=hidden, dispatch_format=QuantFormat.MXFP8, extra_payload_bytes_per_token=extra
        )
        == want
    )


@pytest.mark.parametrize(
    ("call", "generation", "expected"),
    [
        # The positional call: sized as 0.30 it built 3,824,000 B.
        (((0, H // 16), {}), Generation.PR42976, NVFP4_B),
        (((2, 0), {}), Generation.PR42976, BF16_B),
        (((2,), {}), Generation.PR42976, BF16_B),  # PR's default scale 0
        (((H // 2, H // 16), {}), Generation.V0_30, NVFP4_B),
        (((QuantFormat.NVFP4,), {}), Generation.V0_33, NVFP4_B),
        (((None, 0), {}), Generation.V0_33, BF16_B),
        (((), {}), Generation.V0_33, BF16_B),  # no payload arguments: bf16 rows
        (((), {"dispatch_format": "NVFP4"}), Generation.V0_33, NVFP4_B),
        (((), {"dispatch_format": QuantFormat.FP16}), Generation.V0_33, BF16_B),
        (((), {"extra_payload_bytes_per_token": 0}), Generation.V0_33, BF16_B),
        (((), {"dispatch_scale_bytes_per_token": H // 16}), Generation.PR42976, NVFP4_B),
        (((0,), {"dispatch_scale_bytes_per_token": H // 16}), Generation.PR42976, NVFP4_B),
        (((H // 2,), {"x_sf_bytes_per_token": H // 16}), Generation.V0_30, NVFP4_B),
        (((QuantFormat.NVFP4,), {"extra_payload_bytes_per_token": 0}), Generation.V0_33, NVFP4_B),
    ],
)
def test_call_styles(
    call: tuple[tuple[object, ...], dict[str, object]], generation: Generation, expected: int
) -> None:
    positional, keywords = call
    understood = classify_call(EP, T, K, E, H, positional, keywords)
    assert understood.generation is generation
    assert capacities_workspace_bytes(understood.capacities, EP) == expected


@pytest.mark.parametrize(
    ("positional", "keywords", "needles"),
    [
        ((100, 448), {}, ["5th argument=100", "x_bytes_per_token >= hidden_size // 2 = 3584"]),
        ((3, 0), {}, ["5th argument=3", "dispatch_dtype_bytes_per_elem"]),
        ((-1, 0), {}, ["5th argument=-1"]),
        ((True, 0), {}, ["5th argument=True"]),
        ((2.0, 0), {}, ["5th argument=2.0"]),
        ((H // 2,), {}, ["x_sf_bytes_per_token", "missing"]),
        ((0, H // 16, 1), {}, ["at most 6"]),
        (
            (0, 0),
            {},
            ["dispatch_scale_bytes_per_token=0", "pass dispatch_scale_bytes_per_token=448"],
        ),
        (
            (),
            {"dispatch_dtype_bytes_per_elem": H // 2, "dispatch_scale_bytes_per_token": 448},
            ["dispatch_dtype_bytes_per_elem=3584", "x_bytes_per_token"],
        ),
        (
            (),
            {"dispatch_dtype_bytes_per_elem": QuantFormat.NVFP4},
            ["dispatch_dtype_bytes_per_elem", "dispatch_format"],
        ),
        (
            (),
            {"x_bytes_per_token": 2, "x_sf_bytes_per_token": 0},
            ["x_bytes_per_token=2", "dispatch_dtype_bytes_per_elem=2"],
        ),
        ((), {"x_bytes_per_token": H}, ["x_sf_bytes_per_token", "missing"]),
        ((), {"x_sf_bytes_per_token": 0}, ["x_bytes_per_token", "missing"]),
        (
            (),
            {"x_bytes_per_token": H, "x_sf_bytes_per_token": 224, "dispatch_format": None},
            ["mixes keywords", "x_bytes_per_token (vLLM 0.30)", "dispatch_format (vLLM 0.33)"],
        ),
        (
            (),
            {"dispatch_dtype_bytes_per_elem": 0, "extra_payload_bytes_per_token": 0},
            ["mixes keywords", "PR #42976"],
        ),
        ((), {"dispatch_format": 0}, ["dispatch_format=0", "dispatch_dtype_bytes_per_elem"]),
        ((), {"dispatch_format": QuantFormat.MXINT4}, ["dispatch_format", "MXINT4"]),
        ((), {"dispatch_format": "nvfp4"}, ["dispatch_format='nvfp4'"]),
        ((), {"extra_payload_bytes_per_token": -1}, ["extra_payload_bytes_per_token=-1"]),
        ((None,), {"dispatch_format": None}, ["dispatch_format", "given twice"]),
        ((2,), {"dispatch_dtype_bytes_per_elem": 2}, ["given twice"]),
    ],
)
def test_refusals_name_the_argument_and_the_keyword_meant(
    positional: tuple[object, ...], keywords: dict[str, object], needles: list[str]
) -> None:
    with pytest.raises(InvalidArgument) as caught:
        classify_call(EP, T, K, E, H, positional, keywords)
    for needle in needles:
        assert needle in str(caught.value), (needle, str(caught.value))


def test_an_ambiguous_positional_value_is_refused() -> None:
    # At hidden_size 4, 2 is both a bytes-per-element code and hidden // 2 bytes.
    with pytest.raises(InvalidArgument, match="ambiguous at hidden_size=4"):
        classify_call(EP, T, K, E, 4, (2, 0), {})
    understood = classify_call(
        EP, T, K, E, 4, (), {"x_bytes_per_token": 2, "x_sf_bytes_per_token": 0}
    )
    assert understood.generation is Generation.V0_30


def test_unset_keywords_are_absent() -> None:
    a = classify_call(EP, T, K, E, H, (0, 448), {"x_bytes_per_token": UNSET})
    assert a.generation is Generation.PR42976


def test_no_accepted_positional_call_is_smaller_than_its_generation_sizes_it() -> None:
    # Every positional (5th, 6th) accepted is sized exactly as the generation it
    # was taken for sizes the same values by keyword, and never below a 4-bit row.
    hidden = 64
    accepted = refused = 0
    for fifth, sixth in itertools.product(range(-1, 3 * hidden), (0, 1, 4, 8)):
        try:
            call = classify_call(EP, T, K, E, hidden, (fifth, sixth), {})
        except InvalidArgument:
            refused += 1
            continue
        accepted += 1
        first, second = {
            Generation.PR42976: ("dispatch_dtype_bytes_per_elem", "dispatch_scale_bytes_per_token"),
            Generation.V0_30: ("x_bytes_per_token", "x_sf_bytes_per_token"),
        }[call.generation]
        keyword = classify_call(EP, T, K, E, hidden, (), {first: fifth, second: sixth})
        assert keyword.capacities == call.capacities
        assert call.capacities.dispatch_bytes_per_token - 8 * K >= hidden // 2
    assert accepted and refused


@pytest.mark.parametrize(
    ("hidden", "activation", "expected"),
    [
        (7168, 14336, (None, 0)),
        (7168, 14336 + 256, (None, 256)),
        (7168, 4032, ("NVFP4", 0)),
        (7168, 7392, ("DeepSeekFp8", 0)),  # MXFP8 has the same bytes; the first wins
        (7168, 7400, ("DeepSeekFp8", 8)),
        (7168, 7168, ("FP8PerTensor", 0)),
        (7168, 3584, ("NVFP4", 0)),  # below every format: described, not sized
    ],
)
def test_describe_activation(hidden: int, activation: int, expected: tuple[Any, int]) -> None:
    assert describe_activation(hidden, activation) == expected


def test_format_names() -> None:
    assert dispatch_format_name(None) is None
    assert dispatch_format_name(QuantFormat.MXFP4) == "MXFP4"
    assert dispatch_format_name("BF16") == "BF16"
    with pytest.raises(InvalidArgument, match=r"dispatch_format=<QuantFormat\.INT4: 8>"):
        dispatch_format_name(QuantFormat.INT4)
