"""SGLang's own sizes and the exact ones, table-driven (pure: no SGLang needed)."""

from __future__ import annotations

import pytest

from moe_sidecar.client.engines.sglang.naming import SglangLayout, sglang_group_name
from moe_sidecar.client.engines.sglang.plugin import plugin_mode
from moe_sidecar.client.engines.sglang.sizing import (
    DispatchType,
    Namespace,
    effective_dispatch,
    engine_dispatch_bytes,
    engine_workspace_bytes,
    exact_workspace_bytes,
)
from moe_sidecar.core.errors import InvalidArgument

pytestmark = pytest.mark.timeout(30)

MIB = 1 << 20
H, K = 7168, 8  # DeepSeek-V3


def test_deepseek_v3_at_4096_tokens_ep8() -> None:
    """The figures docs/sglang.md quotes: SGLang 898.7 + 898.7 MiB, exact 576.7 + 898.7."""
    target = engine_workspace_bytes(8, 4096, H, K, DispatchType.NVFP4, Namespace.DECODE, eagle=True)
    draft = engine_workspace_bytes(
        8, 4096, H, K, DispatchType.NVFP4, Namespace.SPECULATIVE, eagle=True
    )
    exact_target = exact_workspace_bytes(8, 4096, K, [(H, DispatchType.NVFP4)], Namespace.DECODE)
    exact_draft = exact_workspace_bytes(8, 4096, K, [(H, DispatchType.BF16)], Namespace.SPECULATIVE)
    assert (target, draft) == (942_342_528, 942_342_656)
    assert (exact_target, exact_draft) == (604_701_056, 942_342_656)
    assert [round(b / MIB, 1) for b in (target, draft, exact_target, exact_draft)] == [
        898.7,
        898.7,
        576.7,
        898.7,
    ]
    assert (target - exact_target) / MIB == 322.0


@pytest.mark.parametrize(
    ("dispatch_type", "eagle", "expected"),
    [
        (DispatchType.BF16, False, 2 * H + 8 * K),
        (DispatchType.NVFP4, False, 2 * H + 8 * K),  # max(quantized, bf16)
        (DispatchType.MXFP8, False, 2 * H + 8 * K),
        (DispatchType.NVFP4, True, 2 * H + 8 * K),  # EAGLE/NEXTN: bf16 always
    ],
)
def test_sglang_sizes_bf16_rows(dispatch_type: DispatchType, eagle: bool, expected: int) -> None:
    assert engine_dispatch_bytes(H, K, dispatch_type, eagle=eagle) == expected


@pytest.mark.parametrize(
    ("dispatch_type", "scale", "mxfp8", "expected"),
    [
        (DispatchType.NVFP4, True, False, DispatchType.NVFP4),
        (DispatchType.NVFP4, False, False, DispatchType.BF16),
        (DispatchType.MXFP8, False, True, DispatchType.MXFP8),
        (DispatchType.MXFP8, False, False, DispatchType.BF16),
        (DispatchType.BF16, True, True, DispatchType.BF16),
    ],
)
def test_effective_dispatch(
    dispatch_type: DispatchType, scale: bool, mxfp8: bool, expected: DispatchType
) -> None:
    got = effective_dispatch(dispatch_type, has_input_global_scale=scale, uses_mxfp8=mxfp8)
    assert got is expected


def test_union_and_padding() -> None:
    mixed = [(H, DispatchType.NVFP4), (H, DispatchType.BF16)]
    assert exact_workspace_bytes(2, 128, K, mixed, Namespace.SP_PREFILL) == (
        exact_workspace_bytes(2, 128, K, [(H, DispatchType.BF16)], Namespace.DECODE) + 256
    )
    with pytest.raises(InvalidArgument, match="layers"):
        exact_workspace_bytes(2, 128, K, [], Namespace.DECODE)


LAYOUT = SglangLayout("deepseek-ai/DeepSeek-V3", "modelopt_fp4", 8, 1, 8, 8, 0, draft=False)


@pytest.mark.parametrize(
    ("layout", "namespace", "environ", "expected"),
    [
        (
            LAYOUT,
            Namespace.DECODE,
            {},
            "deepseek-ai/DeepSeek-V3:modelopt_fp4/tp8-pp1-dp8-ep8/pp0/decode",
        ),
        (
            LAYOUT,
            Namespace.SPECULATIVE,
            {},
            "deepseek-ai/DeepSeek-V3:modelopt_fp4/tp8-pp1-dp8-ep8/pp0/speculative",
        ),
        (
            SglangLayout("m", None, 2, 2, 2, 2, 1, draft=True),
            Namespace.SP_PREFILL,
            {},
            "m:unquantized/tp2-pp2-dp2-ep2/pp1/sp-prefill-draft",
        ),
        (LAYOUT, Namespace.DECODE, {"MOE_SIDECAR_GROUP": "prod-a"}, "prod-a/decode"),
    ],
)
def test_group_names(
    layout: SglangLayout, namespace: Namespace, environ: dict[str, str], expected: str
) -> None:
    assert sglang_group_name(layout, namespace, environ) == expected


def test_long_model_path_fits() -> None:
    layout = SglangLayout("/models/" + "x" * 400, None, 1, 1, 1, 1, 0, draft=False)
    name = sglang_group_name(layout, Namespace.DECODE, {})
    assert len(name) <= 256 and name.endswith("/pp0/decode") and "#" in name


@pytest.mark.parametrize(
    ("environ", "mode"),
    [
        ({}, None),
        ({"MOE_SIDECAR_SGLANG": "1"}, "embedded"),
        ({"MOE_SIDECAR_TARGET": "unix:///run/s.sock"}, "sidecar"),
        ({"MOE_SIDECAR_TARGET": "embedded"}, "embedded"),
        ({"MOE_SIDECAR_TARGET": "unix:///run/s.sock", "MOE_SIDECAR_SGLANG": "0"}, None),
        ({"MOE_SIDECAR_VLLM": "1"}, None),
    ],
)
def test_plugin_mode(environ: dict[str, str], mode: str | None) -> None:
    assert plugin_mode(environ) == mode


def test_plugin_mode_names_a_malformed_switch() -> None:
    with pytest.raises(InvalidArgument, match=r"MOE_SIDECAR_SGLANG.*'perhaps'"):
        plugin_mode({"MOE_SIDECAR_SGLANG": "perhaps"})
