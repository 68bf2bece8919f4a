"""The README's picture: its computed sizes are the ones the GPU run measured and
checked against FlashInfer's, and its measured points are that run's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.scripts import load_script

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parents[2]


def _script() -> ModuleType:
    return load_script("draw_workspace_memory")


def test_computed_sizes_equal_what_the_gpu_run_checked_against_flashinfer() -> None:
    script = _script()
    document = json.loads(script.MEASURED.read_text())
    for run in document["runs"]:
        row = script.computed(2, run["tokens"])
        assert [row.nvfp4, row.union] == run["expected"], run["tokens"]


def test_measured_points_are_the_runs_and_cover_the_computed_workspaces() -> None:
    script = _script()
    document = json.loads(script.MEASURED.read_text())
    for point in script.measured():
        row = script.computed(2, point.tokens)
        [run] = [r for r in document["runs"] if r["tokens"] == point.tokens]
        unit = run["runs"]["vllm-0.33"][0]["granularity"]
        # Held memory is each workspace rounded up to the allocation granularity.
        assert 0 <= point.moe_sidecar - row.union < unit
        assert 0 <= point.vllm - row.vllm < 2 * unit


def test_the_ep8_figure_the_docs_quote_is_the_computed_one() -> None:
    row = _script().computed(8)
    assert (
        row.nvfp4
        == json.loads((ROOT / "bench/results/gpu/vllm-memory.json").read_text())[
            "ep8_8192_tokens_superseded_bytes"
        ]
    )
    gib = 2**30
    assert (f"{row.vllm / gib:.2f}", f"{row.union / gib:.2f}", f"{row.nvfp4 / gib:.2f}") == (
        "2.88",
        "1.76",
        "1.13",
    )


def test_the_picture_is_committed() -> None:
    picture = _script().PICTURE
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_picture_computes_what_the_size_command_prints() -> None:
    script = _script()
    # The installed console script, as a user runs it.
    command = [str(Path(sys.executable).with_name("moe-sidecar")), "size"]
    command += ["--flashinfer", script.RELEASE]
    command += ["--ep", "8", "--tokens", str(script.TOKENS), "--hidden", str(script.HIDDEN)]
    command += ["--top-k", str(script.TOP_K), "--experts", str(script.NUM_EXPERTS), "--json"]
    for kind in script.LAYER_KINDS:
        command += ["--dispatch", kind]
    printed = json.loads(
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=20).stdout
    )
    row = script.computed(8)
    assert (row.nvfp4, row.union, row.vllm) == (
        printed["layers"][0]["workspace_bytes_per_rank"],
        printed["workspace_bytes_per_rank"],
        printed["kept_superseded_bytes_per_rank"],
    )
