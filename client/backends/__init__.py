"""All-to-all backends, one module each; :func:`backend_for` picks one by name.

* ``flashinfer``: the FlashInfer backend for the installed release: its
  row's backend in :data:`moe_sidecar.flashinfer.RELEASES`
  (:func:`flashinfer_backend_name`);
* ``flashinfer-moe-alltoall``: ``MoeAlltoAll`` of the release that has it
  (module ``flashinfer``), named explicitly;
* ``flashinfer-moe-ep``: ``flashinfer.moe_ep.NVLinkOneSidedAlltoAll`` of the
  release without ``MoeAlltoAll`` (module ``flashinfer_moe_ep``), named explicitly;
* ``reference``: a CPU copy of the contract over gloo.

An explicit name is the override (``backend=`` or ``MOE_SIDECAR_BACKEND``).
FlashInfer itself is imported only when a backend builds.
"""

from __future__ import annotations

import importlib.metadata

import torch.distributed as dist

from moe_sidecar.client.backends.base import (
    AlltoAll,
    AlltoAllBackend,
    BuildSpec,
    CommunicationSpec,
)
from moe_sidecar.client.backends.rank_mask import RankMaskError
from moe_sidecar.flashinfer import DEFAULT_RELEASE, RELEASES, release_serving

__all__ = [
    "BACKENDS",
    "AlltoAll",
    "AlltoAllBackend",
    "BuildSpec",
    "CommunicationSpec",
    "RankMaskError",
    "backend_for",
    "flashinfer_backend_name",
]

BACKENDS = (
    "flashinfer",
    *(release.backend for release in RELEASES),
    "reference",
)


def flashinfer_backend_name(version: str | None = None) -> str:
    """The FlashInfer backend for ``version`` (default: the installed
    flashinfer-python; none installed: the default release's, vLLM 0.33's
    pin and the ``[flashinfer]`` extra, whose build then says what to
    install): the backend of the release whose API that version has
    (:func:`moe_sidecar.flashinfer.release_serving`).

    Raises:
        ValueError: a version string that does not start with a release number.
    """
    if version is None:
        try:
            version = importlib.metadata.version("flashinfer-python")
        except importlib.metadata.PackageNotFoundError:
            return DEFAULT_RELEASE.backend
    return release_serving(version).backend


def backend_for(name: str, group: dist.ProcessGroup) -> AlltoAllBackend:
    """The backend called ``name`` for the EP group ``group``.

    Raises:
        ValueError: an unknown name.
    """
    if name == "flashinfer":
        name = flashinfer_backend_name()
    if name == "flashinfer-moe-alltoall":
        from moe_sidecar.client.backends.flashinfer import FlashInferBackend

        return FlashInferBackend(group)
    if name == "flashinfer-moe-ep":
        from moe_sidecar.client.backends.flashinfer_moe_ep import FlashInferMoeEpBackend

        return FlashInferMoeEpBackend(group)
    if name == "reference":
        from moe_sidecar.client.backends.reference import ReferenceBackend

        return ReferenceBackend(group)
    raise ValueError(f"backend={name!r}: must be one of {BACKENDS}")
