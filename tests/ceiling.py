"""The sidecar's default workspace ceiling, measured in each group's FlashInfer release.

What the state holder passes the decision core (``Coordinator``): the
default ``--max-workspace-bytes`` and the size function of
:mod:`moe_sidecar.flashinfer`. The core's table-driven tests pass it too.
"""

from __future__ import annotations

from typing import Final

from moe_sidecar import flashinfer
from moe_sidecar.core import limits

__all__ = ["CEILING", "ceiling_of"]


def ceiling_of(max_bytes: int) -> limits.WorkspaceCeiling:
    """A ceiling of ``max_bytes`` per rank, in the releases' own arithmetic."""
    return limits.WorkspaceCeiling(max_bytes, flashinfer.workspace_size)


CEILING: Final = ceiling_of(limits.DEFAULT_MAX_WORKSPACE_BYTES)
