"""The Kubernetes quick start runs the images it builds.

The README and docs/kubernetes.md build and push two images; the manifests
name them without a registry and ``docker/k8s/kustomization.yaml``'s
``images:`` block, the one place to change, says where they come from. The
manifests are rendered (``tests.kustomize``, checked against ``kubectl
kustomize`` where the machine has kubectl) and every container must run an
image the quick start built.
"""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.dockerfile import REPO
from tests.kustomize import UnsupportedKustomization, container_images, render

pytestmark = pytest.mark.timeout(60)

OVERLAYS = [REPO / "docker" / "k8s", REPO / "docker" / "k8s-etcd"]
SIDECAR_CONTAINERS = {"moe-sidecar", "sidecar-state-owner"}
"""The DaemonSet's containers that run the sidecar image; the others of it run the inference image."""
ETCD_IMAGE = "gcr.io/etcd-development/etcd:v3.5.17"
"""The example etcd's public image (docker/k8s/components/etcd-server)."""


def _built_images(doc: Path) -> dict[str, str]:
    """``Dockerfile -> image`` of the ``docker build -f ... -t ...`` lines of ``doc``."""
    built = re.findall(r"docker build -f (docker/Dockerfile\S*) -t (\S+) \.", doc.read_text())
    assert built, f"{doc} builds no image"
    return dict(built)


@pytest.mark.parametrize("doc", ["README.md", "docs/kubernetes.md"])
def test_every_container_runs_an_image_the_quick_start_builds(doc: str) -> None:
    built = _built_images(REPO / doc)
    sidecar, inference = built["docker/Dockerfile"], built["docker/Dockerfile.inference"]
    version = importlib.metadata.version("moe-sidecar")
    assert sidecar.endswith(f"/moe-sidecar:{version}"), sidecar
    pushed = re.findall(r"docker push (\S+)", (REPO / doc).read_text())
    assert sorted(pushed) == sorted([sidecar, inference])
    for overlay in OVERLAYS:
        images = container_images(render(overlay))
        for where, image in images.items():
            kind, _, container = where.split("/")
            if kind == "StatefulSet":
                assert image == ETCD_IMAGE, where
            else:
                expected = sidecar if container in SIDECAR_CONTAINERS else inference
                assert image == expected, f"{overlay.name}: {where} runs {image}"
        assert any(w.endswith("/moe-sidecar") for w in images)


def test_the_images_are_set_in_one_place() -> None:
    # The manifests name each image once, without a registry; the kustomization maps it.
    kustomization = yaml.safe_load((REPO / "docker" / "k8s" / "kustomization.yaml").read_text())
    entries = {entry["name"]: entry for entry in kustomization["images"]}
    assert set(entries) == {"moe-sidecar", "vllm-moe-sidecar"}
    raw = (REPO / "docker" / "k8s" / "inference-daemonset.yaml").read_text()
    named = set(re.findall(r"^\s+image: (\S+)$", raw, re.MULTILINE))
    assert {image.partition(":")[0] for image in named} == set(entries)
    for name, entry in entries.items():
        assert entry["newName"].rsplit("/", 1)[-1] == name
        assert f"{name}:{entry['newTag']}" in named  # the tag the manifest names, not another


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_the_renderer_renders_what_kubectl_kustomize_does(overlay: Path) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not on PATH: tests.kustomize alone renders the manifests")
    done = subprocess.run(
        [kubectl, "kustomize", str(overlay)], capture_output=True, text=True, timeout=50
    )
    assert done.returncode == 0, done.stderr
    theirs = [d for d in yaml.safe_load_all(done.stdout) if d is not None]
    assert container_images(render(overlay)) == container_images(theirs)
    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    assert sorted(map(key, render(overlay))) == sorted(map(key, theirs))


def test_the_renderer_refuses_what_it_does_not_render(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: []\nnamePrefix: x-\n")
    with pytest.raises(UnsupportedKustomization, match="namePrefix"):
        render(tmp_path)


def test_the_pod_picture_names_what_the_daemonset_runs() -> None:
    text = (REPO / "docs" / "kubernetes.md").read_text()
    picture = re.search(r"## The pod\n.*?```mermaid\n(.*?)```", text, re.S)
    assert picture, "docs/kubernetes.md has no picture of the pod"
    drawn = picture.group(1)
    (daemonset,) = [d for d in render(REPO / "docker" / "k8s") if d["kind"] == "DaemonSet"]
    spec = daemonset["spec"]["template"]["spec"]
    assert f"pod {daemonset['metadata']['name']}" in drawn
    by_name = {c["name"]: c for c in spec["initContainers"] + spec["containers"]}
    sidecar, inference = by_name["moe-sidecar"], by_name["inference"]
    assert "container inference" in drawn and "init container moe-sidecar" in drawn
    assert sidecar["restartPolicy"] == "Always"
    for port in sidecar["ports"]:
        assert f":{port['containerPort']}" in drawn, port
    env = {e["name"]: e.get("value", "") for e in sidecar["env"]}
    for listen in env["MOE_SIDECAR_LISTEN"].split(","):
        assert listen.removeprefix("unix://") in drawn, listen
    assert env["MOE_SIDECAR_STATE_DIR"] in drawn
    volumes = {v["name"]: v for v in spec["volumes"]}
    for name in ("sidecar-state", "flashinfer-jit-cache"):
        assert volumes[name]["hostPath"]["path"] in drawn, name
    assert "emptyDir" in volumes["sidecar-socket"] and "emptyDir sidecar-socket" in drawn
    ranks = {e["name"]: e.get("value") for e in inference["env"]}["MOE_SIDECAR_LOCAL_RANKS"]
    assert f"{ranks} EP ranks" in drawn and f"rank {int(ranks) - 1}" in drawn
