"""``moe-sidecar size --engine sglang``, run as an operator runs it (no GPU, no SGLang)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)

DEEPSEEK_V3 = [
    "--flashinfer", "0.7.2.post1", "--ep", "8", "--tokens", "4096", "--hidden", "7168",
    "--top-k", "8", "--experts", "256", "--dispatch", "nvfp4", "--engine", "sglang",
]  # fmt: skip


def _size(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-c",
            "from moe_sidecar.cli import main; raise SystemExit(main())",
            "size",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )


def test_deepseek_v3_with_its_mtp_draft() -> None:
    done = _size(*DEEPSEEK_V3, "--draft-dispatch", "bf16", "--json")
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["engine"] == "sglang"
    assert answer["engine_bytes_per_rank"] == 942_342_528 + 942_342_656
    assert answer["exact_bytes_per_rank"] == 604_701_056 + 942_342_656
    assert [n["namespace"] for n in answer["engine_namespaces"]] == ["decode", "speculative"]
    text = _size(*DEEPSEEK_V3, "--draft-dispatch", "bf16").stdout
    assert "sglang alone 942,342,528 B (898.7 MiB), exact 604,701,056 B (576.7 MiB)" in text
    assert "saved: 337,641,472 B (322.0 MiB) per rank" in text


def test_without_a_draft_sglang_still_sizes_bf16_rows() -> None:
    answer = json.loads(_size(*DEEPSEEK_V3, "--json").stdout)
    (decode,) = answer["engine_namespaces"]
    assert decode["exact_bytes_per_rank"] == 604_701_056 < decode["engine_bytes_per_rank"]


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--draft-dispatch", "fp8"], "--draft-dispatch='fp8'"),
        (["--flashinfer", "0.7.4"], "not 0.7.4"),
    ],
)
def test_refused_with_the_flag_named(extra: list[str], named: str) -> None:
    done = _size(*DEEPSEEK_V3, *extra)
    assert done.returncode == 2
    assert named in done.stderr, done.stderr
