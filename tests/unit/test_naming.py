"""The group-name rule (moe_sidecar.client.naming), case by case."""

from __future__ import annotations

import pytest

from moe_sidecar.client.engines.vllm.naming import VllmLayout, group_name, vllm_group_name
from moe_sidecar.client.naming import ranks_group_name
from moe_sidecar.core.errors import InvalidArgument
from moe_sidecar.core.limits import MAX_NAME_LENGTH
from moe_sidecar.core.policy import validate_group_name

pytestmark = pytest.mark.timeout(10)

DEEPSEEK = VllmLayout("deepseek-ai/DeepSeek-V3", "fp8", 1, 1, 8, 8, 0)


@pytest.mark.parametrize(
    ("explicit", "environ", "layout", "embedded", "expected"),
    [
        ("mine", {"MOE_SIDECAR_GROUP": "env"}, DEEPSEEK, False, "mine"),
        (None, {"MOE_SIDECAR_GROUP": "env"}, DEEPSEEK, False, "env"),
        (
            None,
            {"MOE_SIDECAR_GROUP": "  "},
            DEEPSEEK,
            False,
            "deepseek-ai/DeepSeek-V3:fp8/tp1-pp1-dp8-ep8/pp0",
        ),
        ("", {}, DEEPSEEK, True, "deepseek-ai/DeepSeek-V3:fp8/tp1-pp1-dp8-ep8/pp0"),
        (None, {}, None, True, "embedded/ep4/ranks4-7"),
    ],
)
def test_first_match_wins(
    explicit: str | None,
    environ: dict[str, str],
    layout: VllmLayout | None,
    embedded: bool,
    expected: str,
) -> None:
    assert group_name(explicit, environ, layout, [4, 5, 6, 7], embedded=embedded) == expected


def test_sidecar_mode_without_a_name_is_refused_naming_the_variable() -> None:
    with pytest.raises(InvalidArgument, match="MOE_SIDECAR_GROUP") as caught:
        group_name(None, {}, None, [0, 1], embedded=False)
    assert caught.value.field == "MOE_SIDECAR_GROUP"


@pytest.mark.parametrize(
    ("layout", "expected"),
    [
        (DEEPSEEK, "deepseek-ai/DeepSeek-V3:fp8/tp1-pp1-dp8-ep8/pp0"),
        (
            VllmLayout("/models/qwen3-moe", None, 2, 2, 2, 4, 1),
            "/models/qwen3-moe:unquantized/tp2-pp2-dp2-ep4/pp1",
        ),
        (
            VllmLayout("m", "modelopt_fp4", 1, 1, 4, 8, 0, prefill_context_parallel_size=2),
            "m:modelopt_fp4/tp1-pp1-dp4-ep8-pcp2/pp0",
        ),
        (VllmLayout(None, None, 1, 1, 2, 2, 0), "unknown-model:unquantized/tp1-pp1-dp2-ep2/pp0"),
        (VllmLayout("a\tb", None, 1, 1, 2, 2, 0), "a?b:unquantized/tp1-pp1-dp2-ep2/pp0"),
    ],
)
def test_vllm_names(layout: VllmLayout, expected: str) -> None:
    assert vllm_group_name(layout) == expected
    validate_group_name(expected)


def test_a_long_model_path_keeps_its_end_and_a_hash() -> None:
    base = "/mnt/models/" + "x" * 400
    one = vllm_group_name(VllmLayout(base + "/deepseek-v3", "fp8", 1, 1, 8, 8, 0))
    two = vllm_group_name(VllmLayout(base + "-b/deepseek-v3", "fp8", 1, 1, 8, 8, 0))
    for name in (one, two):
        assert len(name) <= MAX_NAME_LENGTH
        assert name.startswith("...") and "/deepseek-v3#" in name
        assert name.endswith(":fp8/tp1-pp1-dp8-ep8/pp0")
        validate_group_name(name)
    assert one != two


def test_ranks_name() -> None:
    assert ranks_group_name([2, 3]) == "embedded/ep2/ranks2-3"
