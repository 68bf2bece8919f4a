"""The README's first commands: what a newcomer runs, and what CI runs.

The README opens with two commands: the first installs the project into a
fresh virtual environment and runs the demo, the second runs every test.
``.ci/run`` must end with exactly the second, and the demo the first runs must
exist; every grpcurl line the README shows is one that docs/operations.md's
tested section runs too.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(10)

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _first_block() -> list[str]:
    match = re.search(r"```bash\n(.*?)```", README, re.S)
    assert match, "the README starts with no bash block"
    return match.group(1).splitlines()


def test_the_readme_opens_with_the_two_commands() -> None:
    assert README.index("```bash") < README.index("\n## ")
    install, tests = _first_block()
    assert install.startswith("python3 -m venv .venv && . .venv/bin/activate && ")
    assert "--index-url https://download.pytorch.org/whl/cpu" in install
    assert "python -m pip install '.[client]'" in install
    assert install.endswith("scripts/demo.sh")
    assert tests == "python -m pip install -q torch==2.13.0 -e '.[client,dev]' && python -m pytest"


def test_ci_ends_with_the_readme_test_command() -> None:
    lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.strip()]
    assert lines[-1] == _first_block()[1]


def test_the_demo_is_there_and_runnable() -> None:
    demo = ROOT / "scripts" / "demo.sh"
    assert os.access(demo, os.X_OK)
    assert "moe-sidecar simulate" in demo.read_text()


def test_the_readme_stays_short() -> None:
    assert len(README.splitlines()) <= 300


def test_the_readme_grpcurl_lines_are_the_tested_ones() -> None:
    operations = (ROOT / "docs" / "operations.md").read_text()
    section = operations[operations.index("## Inspecting it with grpcurl") :]
    shown = [
        line.split("#")[0].rstrip() for line in README.splitlines() if line.startswith("grpcurl -")
    ]
    assert shown
    for line in shown:
        assert line in section, line


def test_every_relative_link_of_the_docs_resolves() -> None:
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.name}: {target}"


def test_the_readme_size_example_is_what_the_command_prints() -> None:
    [command] = [line for line in README.splitlines() if line.startswith("moe-sidecar size ")]
    # The installed console script, run as the README runs it.
    script = str(Path(sys.executable).with_name("moe-sidecar"))
    run = subprocess.run(
        [script, *command.split()[1:]], check=True, capture_output=True, text=True, timeout=30
    )
    printed = run.stdout.splitlines()
    shown = README[README.index(command) :]
    shown = shown[shown.index("```text\n") + len("```text\n") :]
    shown = shown[: shown.index("```")]
    for line in shown.splitlines():
        if line.strip() == "...":
            continue
        # A line the README shortens ends in ", ...)": the rest must be the command's.
        head = line.removesuffix(", ...)")
        assert any(p.startswith(head) for p in printed), line
