"""A replacement rejoins on the installed FlashInfer release, through the
manager and a real sidecar: ``bench/rejoin_gpu.py`` on the GPU (4 ranks
sharing GPU 0 at DeepSeek-V3's shape; its flow is tested on CPU in
``tests/multiprocess/test_rejoin_script.py``). Every masked step and every
step after the join exact, every rank rebuilt once for the join, and the
sidecar's view of the join COMMITTED, on either release."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(480)]

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "rejoin_gpu.py"


def test_a_replacement_rejoins_and_every_rank_steps_exactly(tmp_path: Path) -> None:
    command = [sys.executable, str(SCRIPT), "--steps", "5", "--watchdog", "400"]
    done = subprocess.run(
        [*command, "--out", str(tmp_path)], capture_output=True, text=True, timeout=470
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "masked steps (view 2, rank 3 SIGKILLed): 5 of 5 exact on ranks [0, 1, 2]" in done.stdout
    assert "every rank rebuilt once: True" in done.stdout
    assert "steps after the join: 5 of 5 exact on ranks [0, 1, 2, 3]" in done.stdout
