"""``moe-sidecar size``: what one rank maps for a model at an EP size, per FlashInfer release.

Pure (no torch, no FlashInfer, no GPU). The answer (:mod:`.answer`) loads on
first use of a name below, so that building ``moe-sidecar``'s parser loads
only the flags (:mod:`.command`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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

_HOME = {"DISPATCH_KINDS": "releases", "RELEASES": "releases"}


def __getattr__(name: str) -> Any:
    if name in __all__:
        module = _HOME.get(name, "answer")
        return getattr(importlib.import_module(f"{__name__}.{module}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
