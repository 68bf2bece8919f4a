"""A renderer of the kustomize features ``docker/k8s`` and ``docker/k8s-etcd`` use.

``kubectl kustomize`` is the reference; a machine without kubectl (and no
network to fetch it) still renders the manifests here, for the checks of
what a container runs (its image). The subset, as kustomize v5 does it:

- ``resources``: YAML files, and directories holding a ``kustomization.yaml``
  (rendered first, with their own transformers);
- ``components``: directories whose ``kustomization.yaml`` is a
  ``Component``; their ``resources`` are added, their ``patches`` are
  strategic-merge patches of env and fields that are no image (refused
  otherwise, so ignoring them cannot change an image);
- ``images``: for every container and init container whose image's name
  (without tag or digest) is an entry's ``name``, the name becomes
  ``newName`` and the tag ``newTag`` (each when given).

Any other key of a kustomization is refused, naming it: the renderer never
silently renders something kustomize would render otherwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

__all__ = ["KNOWN_KEYS", "UnsupportedKustomization", "container_images", "render"]

KNOWN_KEYS = frozenset({"apiVersion", "kind", "resources", "components", "patches", "images"})
"""The keys of a kustomization this renderer knows."""


class UnsupportedKustomization(ValueError):
    """A kustomization uses a feature this renderer does not render."""


def _kustomization(directory: Path) -> dict[str, Any]:
    path = directory / "kustomization.yaml"
    data = yaml.safe_load(path.read_text())
    unknown = sorted(set(data) - KNOWN_KEYS)
    if unknown:
        raise UnsupportedKustomization(f"{path}: keys {unknown} are not rendered here")
    return dict(data)


def _documents(path: Path) -> list[dict[str, Any]]:
    if path.is_dir():
        return render(path)
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _holds_image(node: object) -> bool:
    if isinstance(node, dict):
        return "image" in node or any(_holds_image(v) for v in node.values())
    if isinstance(node, list):
        return any(_holds_image(v) for v in node)
    return False


def _component(directory: Path) -> list[dict[str, Any]]:
    data = _kustomization(directory)
    if data.get("kind") != "Component":
        raise UnsupportedKustomization(f"{directory}: a component must be kind Component")
    if "images" in data:
        raise UnsupportedKustomization(f"{directory}: images in a component are not rendered")
    for patch in data.get("patches", []):
        if set(patch) != {"path"}:
            raise UnsupportedKustomization(f"{directory}: patch {patch} is not a file patch")
        for document in yaml.safe_load_all((directory / patch["path"]).read_text()):
            if _holds_image(document):
                raise UnsupportedKustomization(f"{directory}: patch {patch['path']} sets an image")
    return [d for r in data.get("resources", []) for d in _documents(directory / r)]


def _pod_specs(document: dict[str, Any]) -> list[dict[str, Any]]:
    spec = document.get("spec", {})
    template = spec.get("template", {}).get("spec")
    return [template] if isinstance(template, dict) else []


def _new_image(image: str, entry: dict[str, str]) -> str:
    name, _, tag = image.partition(":")
    if "@" in name:
        raise UnsupportedKustomization(f"image {image!r}: digests are not rendered here")
    if name != entry["name"]:
        return image
    name = entry.get("newName", name)
    tag = str(entry.get("newTag", tag))
    return f"{name}:{tag}" if tag else name


def _set_images(documents: list[dict[str, Any]], entries: list[dict[str, str]]) -> None:
    for document in documents:
        for spec in _pod_specs(document):
            for container in spec.get("initContainers", []) + spec.get("containers", []):
                for entry in entries:
                    container["image"] = _new_image(container["image"], entry)


def render(directory: Path) -> list[dict[str, Any]]:
    """The documents ``kubectl kustomize directory`` prints, for the subset above.

    Raises:
        UnsupportedKustomization: a feature outside the subset (naming it).
    """
    data = _kustomization(directory)
    if data.get("kind", "Kustomization") != "Kustomization":
        raise UnsupportedKustomization(f"{directory}: not a Kustomization")
    if data.get("patches"):
        raise UnsupportedKustomization(f"{directory}: patches outside components")
    documents = [d for r in data.get("resources", []) for d in _documents(directory / r)]
    for component in data.get("components", []):
        documents += _component(directory / component)
    _set_images(documents, data.get("images", []))
    return documents


def container_images(documents: list[dict[str, Any]]) -> dict[str, str]:
    """``"Kind/name/container" -> image`` for every container and init container."""
    found = {}
    for document in documents:
        where = f"{document['kind']}/{document['metadata']['name']}"
        for spec in _pod_specs(document):
            for container in spec.get("initContainers", []) + spec.get("containers", []):
                found[f"{where}/{container['name']}"] = container["image"]
    return found
