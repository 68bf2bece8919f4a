"""``bench/masked_steps_gpu.py``'s whole flow on the CPU reference backend,
both ways it steps (``MoeAlltoAll``'s calls, as 0.7.2.post1's backend is
stepped, and the ``moe_ep`` object's, as 0.7.4's): four real rank processes,
two unmasked steps, the last rank SIGKILLed, three masked steps exact on the
others. The GPU run is the same script with the installed FlashInfer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "masked_steps_gpu.py"


@pytest.mark.parametrize("backend", ["reference", "reference-moe-ep"])
def test_the_script_runs_masked_steps_exactly(backend: str, tmp_path: Path) -> None:
    command = [sys.executable, str(SCRIPT), "--backend", backend, "--steps", "3"]
    command += ["--hidden", "64", "--tokens", "16", "--watchdog", "120", "--out", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "masked steps: 3 of 3 exact on ranks [0, 1, 2]" in done.stdout, done.stdout
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [line["rank"] for line in lines] == [0, 1, 2, 3]
    assert lines[3]["status"] == -9 and lines[3]["masked_steps"] == 0
    record = json.loads((tmp_path / "masked-steps.json").read_text())
    for rank in range(3):
        for step in record["outcomes"][str(rank)]["masked"]:
            assert step["mask"] == 0b0111 and step["combine_error"] == 0.0
            assert step["rows_received"] == step["rows_from_members"], step
