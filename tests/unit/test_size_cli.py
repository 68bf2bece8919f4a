"""``moe-sidecar size``: answers per FlashInfer release, with no torch and no FlashInfer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from moe_sidecar.client.size.answer import SizeError, plan_sizes
from moe_sidecar.flashinfer import v0_7_4
from moe_sidecar.flashinfer.v0_7_2_post1 import workspace_size_per_rank

pytestmark = pytest.mark.timeout(60)

MOE_SIDECAR = "import sys; from moe_sidecar.cli import main; sys.exit(main(sys.argv[1:]))"
"""What the ``moe-sidecar`` script runs."""
DEEPSEEK = ("--ep", "2", "--tokens", "128", "--hidden", "7168", "--top-k", "8", "--experts", "256")


def _size(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", MOE_SIDECAR, "size", *argv],
        capture_output=True,
        text=True,
        timeout=50,
        env=env,
        check=False,
    )


def test_0_7_2_post1_deepseek_matches_the_measured_workspaces() -> None:
    # Measured on 2 x H200 with 0.7.2.post1 (DESIGN section 9): NVFP4 alone
    # 4,741,504 B; with the bf16 MTP layer 7,379,328 B.
    answer = plan_sizes("0.7.2.post1", 2, 128, 7168, 8, 256, ("nvfp4", "bf16"))
    assert [layer.workspace_bytes_per_rank for layer in answer.layers] == [4741504, 7379328]
    assert answer.workspace_bytes_per_rank == 7379328
    assert answer.kept_superseded_bytes_per_rank == 4741504 + 7379328
    assert answer.refusals == ()


def test_0_7_4_union_is_the_bf16_layout() -> None:
    answer = plan_sizes("0.7.4", 8, 8192, 7168, 8, 256, ("nvfp4", "bf16"))
    assert answer.workspace_bytes_per_rank == (
        v0_7_4.layer_layout(8, 8192, 8, 7168, "BF16").workspace_size
    )
    assert answer.layers[0].workspace_bytes_per_rank == (
        v0_7_4.layer_layout(8, 8192, 8, 7168, "NVFP4").workspace_size
    )
    assert answer.gpu_total_bytes == 8 * answer.workspace_bytes_per_rank


def test_integer_dispatch_extra_bytes_and_eplb() -> None:
    answer = plan_sizes("0.7.4", 4, 64, 4096, 4, 64, ("5000",), eplb_experts=64, extra_bytes=16)
    assert answer.capacities.dispatch_bytes_per_token == 5000 + 32 + 16
    d = answer.described_as
    assert d is not None and d.dispatch_bytes_per_token == 5000 + 32 + 16
    layout = v0_7_4.workspace_layout(
        4, 64, 4, 4 * 64 * (5000 + 32 + 16) + 1024, 4 * 64 * 4096 * 2, 64
    )
    assert answer.workspace_bytes_per_rank == layout.workspace_size
    old = plan_sizes("0.7.2.post1", 4, 64, 4096, 4, 64, ("5000",), eplb_experts=64, extra_bytes=16)
    assert old.workspace_bytes_per_rank == workspace_size_per_rank(4, 64, 5048, 8192, 64)


def test_beyond_the_sidecar_limits_it_answers_and_says_who_refuses() -> None:
    answer = plan_sizes("0.7.4", 256, 16384, 7168, 5, 384, ("bf16",))
    assert answer.workspace_bytes_per_rank > 0
    text = "\n".join(answer.refusals)
    # The sidecar's limit is its own (the oldest release's, and what its bounds
    # are measured for), not 0.7.4's: the refusal says which.
    assert "sidecar: ep_size=256: the sidecar holds EP groups of at most 64 ranks" in text
    assert "the oldest FlashInfer release's limit" in text
    assert "top_k=5" in text and "not divisible" in text


@pytest.mark.parametrize(
    ("release", "args", "needle"),
    [
        ("0.7.2.post1", (65, 128, 7168, 8, 260, ("bf16",)), "--ep=65"),
        ("0.7.4", (257, 128, 7168, 8, 257, ("bf16",)), "--ep=257"),
        ("0.7.4", (2, 128, 7168, 23, 256, ("bf16",)), "--top-k=23"),
        ("0.7.4", (2, 0, 7168, 8, 256, ("bf16",)), "--tokens=0"),
        ("0.7.4", (2, 128, 7168, 8, 256, ("int8",)), "--dispatch='int8'"),
        ("0.6", (2, 128, 7168, 8, 256, ("bf16",)), "--flashinfer='0.6'"),
    ],
)
def test_refused_flags_are_named(release: str, args: tuple[Any, ...], needle: str) -> None:
    with pytest.raises(SizeError, match=needle.replace("(", r"\(")):
        plan_sizes(release, *args)


def test_subprocess_json_without_torch_or_flashinfer(tmp_path: Path) -> None:
    # Torch and FlashInfer made unimportable: a module of that name that raises.
    for name in ("torch", "flashinfer"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('no {name} here')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    done = _size(
        "--flashinfer",
        "0.7.4",
        *DEEPSEEK,
        "--dispatch",
        "nvfp4",
        "--dispatch",
        "bf16",
        "--json",
        env=env,
    )
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["flashinfer"] == "0.7.4"
    assert answer["workspace_bytes_per_rank"] == (
        v0_7_4.layer_layout(2, 128, 8, 7168, "BF16").workspace_size
    )
    assert [layer["dispatch"] for layer in answer["layers"]] == ["nvfp4", "bf16"]
    assert answer["described_as"]["dispatch_format"] == "BF16"
    assert answer["refusals"] == []

    old = _size("--flashinfer", "0.7.2.post1", *DEEPSEEK, "--dispatch", "nvfp4", "--json", env=env)
    assert old.returncode == 0, old.stderr
    assert json.loads(old.stdout)["workspace_bytes_per_rank"] == 4741504


def test_subprocess_text_and_bad_flag() -> None:
    done = _size("--flashinfer", "0.7.4", *DEEPSEEK, "--dispatch", "deepseek-fp8")
    assert done.returncode == 0, done.stderr
    assert "FlashInfer 0.7.4, EP 2" in done.stdout and "dispatch_format=DeepSeekFp8" in done.stdout
    bad = _size("--flashinfer", "0.7.4", *DEEPSEEK, "--dispatch", "fp7", "--json")
    assert bad.returncode == 2
    assert "--dispatch='fp7'" in bad.stderr and json.loads(bad.stdout)["ok"] is False


@pytest.mark.parametrize(
    ("given", "kind"),
    [
        ("NVFP4", "nvfp4"),
        ("nvfp4", "nvfp4"),
        ("NvFp4", "nvfp4"),
        ("FP8PerTensor", "fp8"),
        ("QuantFormat.MXFP8", "mxfp8"),
        ("DeepSeekFp8", "deepseek-fp8"),
        ("BF16", "bf16"),
        ("5000", "5000"),
    ],
)
def test_dispatch_takes_the_librarys_quant_format_names_in_any_case(given: str, kind: str) -> None:
    done = _size("--flashinfer", "0.7.4", *DEEPSEEK, "--dispatch", given, "--json")
    assert done.returncode == 0, done.stderr
    assert [layer["dispatch"] for layer in json.loads(done.stdout)["layers"]] == [kind]


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--hidden", "1000000000000000000"),
        ("--eplb-experts", "2147483648"),
        ("--extra-bytes", "100000000000000000000"),
        ("--dispatch", "100000000000000000000000"),
        ("--tokens", "-9999999999"),
    ],
)
def test_a_value_beyond_an_int32_is_one_line_naming_the_flag(flag: str, value: str) -> None:
    argv = dict(zip(DEEPSEEK[::2], DEEPSEEK[1::2], strict=True))
    argv[flag] = value
    args = [item for pair in argv.items() for item in pair]
    dispatch = () if flag == "--dispatch" else ("--dispatch", "nvfp4")
    result = _size(*args, *dispatch)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"moe-sidecar size: {flag}={int(value)}: must be at most 2147483647 in magnitude "
        "(FlashInfer takes it as an int32)"
    ], result.stderr


# --- a configuration someone refuses: sized, named, exit 2 ----------------------

REFUSALS = [
    pytest.param(
        ("--flashinfer", "0.7.4", "--ep", "8", "--experts", "250", "--dispatch", "nvfp4"),
        "FlashInfer 0.7.4: num_experts=250 is not divisible by the EP size 8",
        id="0.7.4-experts-not-divisible",
    ),
    pytest.param(
        ("--flashinfer", "0.7.2.post1", "--ep", "8", "--experts", "250", "--dispatch", "nvfp4"),
        "FlashInfer 0.7.2.post1: num_experts=250 is not divisible by the EP size 8",
        id="0.7.2.post1-experts-not-divisible",
    ),
    pytest.param(
        ("--flashinfer", "0.7.4", "--top-k", "5", "--dispatch", "bf16"),
        "FlashInfer 0.7.4: top_k=5: NVLinkOneSidedAlltoAll supports top_k in",
        id="0.7.4-top-k-unsupported",
    ),
    pytest.param(
        ("--flashinfer", "0.7.4", "--eplb-experts", "300", "--dispatch", "bf16"),
        "FlashInfer 0.7.4: eplb_stats_num_experts=300 must be in [0, num_experts=256]",
        id="0.7.4-eplb-beyond-experts",
    ),
    pytest.param(
        ("--flashinfer", "0.7.4", "--ep", "128", "--dispatch", "bf16"),
        "sidecar: ep_size=128: the sidecar holds EP groups of at most 64 ranks",
        id="sidecar-ep-size",
    ),
    pytest.param(
        ("--flashinfer", "0.7.2.post1", "--eplb-experts", "100000", "--dispatch", "bf16"),
        "sidecar: plan.eplb_experts=100000: must be an integer in [0, 65536]",
        id="sidecar-capacity-range",
    ),
    pytest.param(
        ("--flashinfer", "0.7.4", "--ep", "64", "--tokens", "1000000", "--hidden", "100000"),
        "sidecar: plan: max_tokens=1000000, dispatch_bytes_per_token=200064",
        id="sidecar-payload-beyond-1-tib",
    ),
    pytest.param(
        ("--flashinfer", "0.7.4", "--dispatch", "100"),
        "client: --dispatch=100: 100 bytes per token is below hidden // 2 = 3584",
        id="client-dispatch-below-half-hidden",
    ),
]
"""One configuration per kind of refusal (who refuses, and why), each refused alone."""


def _argv(overrides: tuple[str, ...]) -> list[str]:
    """DeepSeek's flags (bf16 dispatch) with ``overrides`` replacing or adding flags."""
    argv = dict(zip(DEEPSEEK[::2], DEEPSEEK[1::2], strict=True)) | {"--dispatch": "bf16"}
    argv |= dict(zip(overrides[::2], overrides[1::2], strict=True))
    return ["size", *(item for pair in argv.items() for item in pair)]


@pytest.mark.parametrize(("overrides", "refusal"), REFUSALS)
def test_a_refused_configuration_is_sized_named_and_exits_2_in_table_form(
    overrides: tuple[str, ...], refusal: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from moe_sidecar.cli import main

    assert main(_argv(overrides)) == 2
    out, err = capsys.readouterr()
    assert "workspace per rank:" in out
    (named,) = [line for line in out.splitlines() if "refused by" in line]
    assert named.startswith(f"  refused by {refusal}"), out
    assert err.splitlines() == [named.replace("  refused by", "moe-sidecar size: refused by")]


@pytest.mark.parametrize(("overrides", "refusal"), REFUSALS)
def test_a_refused_configuration_is_sized_named_and_exits_2_in_json_form(
    overrides: tuple[str, ...], refusal: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from moe_sidecar.cli import main

    assert main([*_argv(overrides), "--json"]) == 2
    out, _ = capsys.readouterr()
    answer = json.loads(out)
    assert answer["ok"] is False and answer["workspace_bytes_per_rank"] > 0
    (named,) = answer["refusals"]
    assert named.startswith(refusal), named


def test_an_accepted_configuration_exits_0_with_ok(capsys: pytest.CaptureFixture[str]) -> None:
    from moe_sidecar.cli import main

    assert main([*_argv(()), "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["ok"] is True and json.loads(out)["refusals"] == [] and err == ""


def test_the_process_exits_2_on_the_configuration_flashinfer_refuses() -> None:
    # As a capacity script runs it: the process's own exit status.
    done = _size("--flashinfer", "0.7.4", *_argv(("--ep", "8", "--experts", "250"))[1:], "--json")
    assert done.returncode == 2, done.stdout + done.stderr
    assert json.loads(done.stdout)["ok"] is False
    assert "num_experts=250 is not divisible by the EP size 8" in done.stderr
