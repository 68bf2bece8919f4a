"""``scripts/build-image.sh`` and ``.ci/run`` agree on the image the DaemonSet names.

These need neither podman nor root: they read the scripts and run only the
script's argument handling, which comes before any check of the machine.
"""

from __future__ import annotations

import importlib.metadata
import re
import subprocess

import pytest

from tests.dockerfile import REPO
from tests.unit.test_k8s_manifests import _sidecar

pytestmark = pytest.mark.timeout(60)

SCRIPT = REPO / "scripts" / "build-image.sh"
CI = REPO / ".ci" / "run"
TAG = f"moe-sidecar:{importlib.metadata.version('moe-sidecar')}"


def test_the_default_tag_is_the_project_version_the_daemonset_runs() -> None:
    defaults = re.findall(r"^tag=(\S+)$", SCRIPT.read_text(), re.MULTILINE)
    assert defaults == [TAG]
    assert _sidecar()["image"].rsplit("/", 1)[-1] == TAG


def test_ci_builds_the_image_and_names_it_before_the_readme_command() -> None:
    lines = [line.strip() for line in CI.read_text().splitlines()]
    build = lines.index(f"scripts/build-image.sh {TAG}")
    export = lines.index(f"export SIDECAR_TEST_IMAGE={TAG}")
    readme = lines.index(
        "python -m pip install -q torch==2.13.0 -e '.[client,dev]' && python -m pytest"
    )
    assert build < export < readme == len(lines) - 1


def test_the_script_explains_itself_and_refuses_unknown_options() -> None:
    usage = subprocess.run(
        [str(SCRIPT), "--help"], capture_output=True, text=True, timeout=30, check=False
    )
    assert usage.returncode == 0, usage.stderr
    assert "apt-get install mmdebstrap podman buildah runc" in usage.stdout
    assert "set -euo" not in usage.stdout
    wrong = subprocess.run(
        [str(SCRIPT), "--fast"], capture_output=True, text=True, timeout=30, check=False
    )
    assert wrong.returncode == 2
    assert "unknown option --fast" in wrong.stderr
