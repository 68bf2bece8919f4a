"""The tests marked ``image`` run the sidecar image itself, with podman.

``SIDECAR_TEST_IMAGE`` names the image (``.ci/run`` builds it with
``scripts/build-image.sh`` and sets it). They need root (a network namespace
per pod, volumes owned by the manifest's users), podman with runc, ``ip`` and
``nsenter``. Without any of these they skip, except under ``CI=true``, where
they fail: CI builds the image, so they must run there.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.image.pod import Pod, podman, tools_missing

ENV_IMAGE = "SIDECAR_TEST_IMAGE"


def _unavailable(reason: str) -> None:
    """Skips with ``reason``; fails instead under ``CI=true`` (CI must run these tests)."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{reason}: CI must build and run the image (.ci/run, scripts/build-image.sh)")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def sidecar_image() -> str:
    """The built sidecar image, present in podman's storage."""
    missing = tools_missing()
    if missing:
        _unavailable(f"{', '.join(missing)} not on PATH (apt-get install podman runc iproute2)")
    if os.geteuid() != 0:
        _unavailable("the image tests run pods as root (a network namespace, volume owners)")
    image = os.environ.get(ENV_IMAGE, "").strip()
    if not image:
        _unavailable(f"${ENV_IMAGE} is not set (scripts/build-image.sh builds moe-sidecar:0.1.0)")
    if podman("image", "exists", image, check=False).returncode != 0:
        _unavailable(f"${ENV_IMAGE}={image}: no such image (run scripts/build-image.sh)")
    return image


@pytest.fixture
def pod(sidecar_image: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pod]:
    """A pod of the DaemonSet; its containers and network namespace are removed after."""
    # A short root: the socket's host path must stay under Linux's 107 bytes.
    root = tmp_path_factory.mktemp("pod")
    made = Pod(root=root, image=sidecar_image)
    try:
        yield made
    finally:
        made.close()
        shutil.rmtree(root, ignore_errors=True)


def socket_path(pod: Pod, mount_path: Path, volume: str) -> Path:
    """The host path of a file the container sees at ``mount_path`` on ``volume``."""
    return pod.volume_path(volume) / mount_path.name
