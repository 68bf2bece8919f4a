"""The README's demo, ``scripts/demo.sh``, run as the README's first command runs it.

It starts its own sidecar (a socket in a fresh temporary directory, no TCP
port), runs DeepSeek-V3 on two CPU ranks against it twice and prints
``moe-sidecar groups``. The lines the README shows from its output must be
what it prints, and it must leave no sidecar behind. The user guide's
walk-through runs the same two ``simulate`` commands against a sidecar on
TCP: every figure it quotes from them (sizes, generations, RPCs,
collectives, checks, history) must be what the demo prints too.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]


def _readme_demo_lines() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"The demo prints.*?```text\n(.*?)```", readme, re.S)
    assert block, "the README shows no demo output"
    return [line for line in block.group(1).splitlines() if line.strip() and "..." not in line]


def _user_guide_simulate_lines() -> list[str]:
    guide = (ROOT / "docs" / "user-guide.md").read_text()
    blocks = re.findall(
        r"moe-sidecar simulate --ranks 2 --model deepseek-v3 --target \S+\n```\n\n"
        r"```text\n(.*?)```",
        guide,
        re.S,
    )
    assert len(blocks) == 2, "the user guide shows the first run and the restart"
    lines = [line for block in blocks for line in block.splitlines()]
    # What differs per run or per target: times, the address, the lines elided.
    varying = ("...", "ranks up in", "wall time:", "decided by the sidecar at")
    return [line for line in lines if line.strip() and not any(v in line for v in varying)]


def _timing_free(line: str) -> str:
    # Round times and the socket's temporary directory differ per run.
    return re.sub(r"\s+[0-9.]+ ms$", "", re.sub(r"moe-sidecar-demo\.\S+/", "", line))


def test_the_demo_prints_what_the_readme_shows(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOE_SIDECAR_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["TMPDIR"] = str(tmp_path)
    done = subprocess.run(
        [str(ROOT / "scripts" / "demo.sh")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    printed = {_timing_free(line) for line in done.stdout.splitlines()}
    for line in _readme_demo_lines():
        assert _timing_free(line) in printed, line
    for line in _user_guide_simulate_lines():
        assert _timing_free(line) in printed, f"docs/user-guide.md shows {line!r}"
    assert "on node demo-node" in done.stdout  # the growth history names the node given
    assert "WARNING" not in done.stderr  # a normal run's end is no warning
    assert list(tmp_path.iterdir()) == []  # the sidecar's directory is gone with it
