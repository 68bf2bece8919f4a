"""The README's demo, ``scripts/demo.sh``, run as the README's first command runs it.

It starts its own sidecar (a socket in a fresh temporary directory, no TCP
port), runs DeepSeek-V3 on two CPU ranks against it twice and prints
``moe-sidecar groups``. The lines the README shows from its output must be
what it prints, and it must leave no sidecar behind. The user guide's
walk-through runs the same two ``simulate`` commands against a sidecar on
TCP: every figure it quotes from them (sizes, generations, RPCs,
collectives, checks, history) must be what the demo prints too, and its prose on
the collectives (the proof plus one barrier per build) must add up to them.
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


def _user_guide_collectives_prose() -> list[tuple[int, int]]:
    """(the proof's, the builds') collectives the walk-through's prose gives,
    for the first run and the restart: "1 + 2 in the first run, 1 + 1 in the second"."""
    guide = " ".join((ROOT / "docs" / "user-guide.md").read_text().split())
    found = re.search(
        r"The collectives are the group's proof, .*?: (\d+) \+ (\d+) in the first run, "
        r"(\d+) \+ (\d+) in the second",
        guide,
    )
    assert found, "the user guide no longer explains the collectives counts"
    figures = [int(n) for n in found.groups()]
    return [(figures[0], figures[1]), (figures[2], figures[3])]


def _printed_runs(stdout: str) -> list[tuple[int, set[int]]]:
    """Per simulate run of the demo: its builds (builds + rebuilds) and the
    collectives counts its ranks printed."""
    runs = re.split(r"^== \d\. ", stdout, flags=re.M)[1:3]
    printed = []
    for run in runs:
        counts = re.search(r"^rounds: \d+ +builds: (\d+) +rebuilds: (\d+)", run, re.M)
        assert counts, run
        collectives = {int(n) for n in re.findall(r"RPCs, (\d+) collectives$", run, re.M)}
        printed.append((int(counts[1]) + int(counts[2]), collectives))
    return printed


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
    # The prose's sums are the figures printed: one proof, one barrier per build.
    for (proof, barriers), (builds, collectives) in zip(
        _user_guide_collectives_prose(), _printed_runs(done.stdout), strict=True
    ):
        assert (proof, barriers) == (1, builds), "docs/user-guide.md explains the collectives"
        assert collectives == {proof + barriers}, "docs/user-guide.md explains the collectives"
    assert "on node demo-node" in done.stdout  # the growth history names the node given
    assert "WARNING" not in done.stderr  # a normal run's end is no warning
    assert list(tmp_path.iterdir()) == []  # the sidecar's directory is gone with it
