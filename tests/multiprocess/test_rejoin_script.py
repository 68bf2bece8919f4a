"""``bench/rejoin_gpu.py``'s whole flow on the CPU reference backend, both ways
it steps (``MoeAlltoAll``'s calls, as 0.7.2.post1's backend is stepped, and
the ``moe_ep`` object's, as 0.7.4's): a real sidecar, four real rank
processes under ``MOE_SIDECAR_ON_PEER_LOSS=mask``, the last SIGKILLed, masked
steps, a replacement joining, every rank rebuilt once and exact again. The
GPU run is the same script with the installed FlashInfer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "rejoin_gpu.py"


@pytest.mark.parametrize("backend", ["reference", "reference-moe-ep"])
def test_the_script_rejoins_a_replacement_and_steps_exactly(backend: str, tmp_path: Path) -> None:
    command = [sys.executable, str(SCRIPT), "--backend", backend, "--steps", "3"]
    command += ["--hidden", "64", "--tokens", "16", "--watchdog", "150", "--out", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=230)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"rejoin on {backend}: passed" in done.stdout, done.stdout
    assert "masked steps (view 2, rank 3 SIGKILLed): 3 of 3 exact on ranks [0, 1, 2]" in done.stdout
    assert "steps after the join: 3 of 3 exact on ranks [0, 1, 2, 3]" in done.stdout
    record = json.loads((tmp_path / "rejoin.json").read_text())
    assert record["sidecar_view"]["members"] == [0, 1, 2, 3]
    assert "rank 3 rejoined" in record["sidecar_view"]["cause"]
    for rank in range(3):
        assert record["joined"][str(rank)]["counters"] == {
            "builds": 1,
            "rebuilds": 1,
            "releases": 1,
        }
        for step in record["masked"][str(rank)]["steps"]:
            assert step["mask"] == 0b0111 and step["combine_error"] == 0.0, step
            assert step["dropped_share"] > 0, step
    replacement = record["joined"]["3"]
    assert replacement["counters"] == {"builds": 0, "rebuilds": 1, "releases": 0}
    assert replacement["generation"] == record["ready"]["0"]["generation"] + 1
    assert (tmp_path / "sidecar.log").read_text()
