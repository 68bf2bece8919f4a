"""All-to-all backends, one module each; :func:`backend_for` picks one by name.

``flashinfer`` drives FlashInfer's ``MoeAlltoAll`` (GPU; imported lazily),
``reference`` is a CPU copy of its contract over gloo.
"""

from __future__ import annotations

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
]

BACKENDS = ("flashinfer", "reference")


def backend_for(name: str, group: dist.ProcessGroup) -> AlltoAllBackend:
    """The backend called ``name`` for the EP group ``group``.

    Raises:
        ValueError: an unknown name.
    """
    if name == "flashinfer":
        from moe_sidecar.client.backends.flashinfer import FlashInferBackend

        return FlashInferBackend(group)
    if name == "reference":
        from moe_sidecar.client.backends.reference import ReferenceBackend

        return ReferenceBackend(group)
    raise ValueError(f"backend={name!r}: must be one of {BACKENDS}")
