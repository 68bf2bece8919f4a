"""``bench/peer_loss_gpu.py``'s whole flow on the CPU reference backend,
both ways it is stepped (``MoeAlltoAll``'s calls, as 0.7.2.post1's backend
is, and the ``moe_ep`` object's, as 0.7.4's): a real sidecar, four real
rank processes, the last one SIGKILLed between its dispatch and its combine;
with the watcher every survivor exits 75 naming it. The GPU run is the same
script on the installed FlashInfer (``bench/gpu_runs/peer-loss*.sh``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "peer_loss_gpu.py"
STEPPED = {"reference": "ReferenceAlltoAll", "reference-moe-ep": "ReferenceCommunication"}


@pytest.mark.parametrize("backend", sorted(STEPPED))
def test_the_watcher_ends_every_survivor_naming_the_victim(backend: str, tmp_path: Path) -> None:
    command = [sys.executable, str(SCRIPT), "--backend", backend, "--hang-cap", "20"]
    command += ["--startup", "150", "--out", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=230)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"summary ({backend}): with the watcher 3 of 3 survivors exited" in done.stdout
    results = json.loads((tmp_path / "peer-loss.json").read_text())
    for name in ("watcher", "no-watcher"):
        assert sorted(results[name]) == ["0", "1", "2"], results[name]
        for outcome in results[name].values():
            assert outcome["backend"] == backend and outcome["stepped"] == STEPPED[backend]
            assert outcome["vote_stood_in_for"] is False
    for outcome in results["watcher"].values():
        assert outcome["status"] == 75 and outcome["seconds"] < 2.0, outcome
        assert "rank 3 died" in outcome["last_line"], outcome
