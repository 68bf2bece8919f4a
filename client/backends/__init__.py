"""All-to-all backends, one module each; :func:`backend_for` picks one by name.

* ``flashinfer``: the FlashInfer backend for the installed release:
  ``flashinfer-moe-alltoall`` up to 0.7.2.post1, ``flashinfer-moe-ep`` from
  0.7.4 on (:func:`flashinfer_backend_name`);
* ``flashinfer-moe-alltoall``: FlashInfer 0.7.2.post1's ``MoeAlltoAll``
  (module ``flashinfer``), named explicitly;
* ``flashinfer-moe-ep``: FlashInfer 0.7.4's ``flashinfer.moe_ep``
  ``NVLinkOneSidedAlltoAll`` (module ``flashinfer_moe_ep``), named explicitly;
* ``reference``: a CPU copy of the contract over gloo.

An explicit name is the override (``backend=`` or ``MOE_SIDECAR_BACKEND``).
FlashInfer itself is imported only when a backend builds.
"""

from __future__ import annotations

import importlib.metadata
import re

import torch.distributed as dist

from moe_sidecar.client.backends.base import (
    AlltoAll,
    AlltoAllBackend,
    BuildSpec,
    CommunicationSpec,
)

__all__ = [
    "BACKENDS",
    "AlltoAll",
    "AlltoAllBackend",
    "BuildSpec",
    "CommunicationSpec",
    "backend_for",
    "flashinfer_backend_name",
]

BACKENDS = ("flashinfer", "flashinfer-moe-alltoall", "flashinfer-moe-ep", "reference")

_MOE_EP_FROM = (0, 7, 4)
"""The first FlashInfer release without ``MoeAlltoAll``."""


def flashinfer_backend_name(version: str | None = None) -> str:
    """The FlashInfer backend for ``version`` (default: the installed
    flashinfer-python; none installed: 0.7.2.post1's, vLLM 0.33's pin and
    the ``[flashinfer]`` extra, whose build then says what to install).

    Raises:
        ValueError: a version string that does not start with a release number.
    """
    if version is None:
        try:
            version = importlib.metadata.version("flashinfer-python")
        except importlib.metadata.PackageNotFoundError:
            return "flashinfer-moe-alltoall"
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"flashinfer-python version {version!r}: not a release number")
    release = tuple(int(part) for part in match.groups())
    return "flashinfer-moe-ep" if release >= _MOE_EP_FROM else "flashinfer-moe-alltoall"


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
