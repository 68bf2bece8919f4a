"""``moe-sidecar size``: what one rank maps for a model at an EP size, per FlashInfer release.

Pure (no torch, no FlashInfer, no GPU). The answer (:mod:`.answer`) loads on
first use of a name below, so that building ``moe-sidecar``'s parser loads
only the flags (:mod:`.command`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from moe_sidecar.client.lazy_names import lazy_names

if TYPE_CHECKING:
    from moe_sidecar.client.size.answer import (
        LayerSize,
        SizeAnswer,
        SizeError,
        activation_bytes,
        plan_sizes,
    )
    from moe_sidecar.client.size.releases import DISPATCH_KINDS, RELEASES

__all__ = [
    "DISPATCH_KINDS",
    "RELEASES",
    "LayerSize",
    "SizeAnswer",
    "SizeError",
    "activation_bytes",
    "plan_sizes",
]

__getattr__ = lazy_names(
    __name__,
    {
        "answer": ("LayerSize", "SizeAnswer", "SizeError", "activation_bytes", "plan_sizes"),
        "releases": ("DISPATCH_KINDS", "RELEASES"),
    },
)
