"""What ``moe-sidecar size`` answers for: the releases and the layer kinds (its flags' choices)."""

from __future__ import annotations

from typing import Final

from moe_sidecar import flashinfer

__all__ = ["DISPATCH_KINDS", "RELEASES"]

RELEASES: Final = tuple(release.name for release in flashinfer.RELEASES)
"""The names of the FlashInfer releases the client has a backend for
(:data:`moe_sidecar.flashinfer.RELEASES`)."""

DISPATCH_KINDS: Final = {
    "bf16": "BF16",
    "fp8": "FP8PerTensor",
    "mxfp8": "MXFP8",
    "nvfp4": "NVFP4",
    "deepseek-fp8": "DeepSeekFp8",
}
"""``--dispatch`` names and the FlashInfer ``QuantFormat`` whose row they send."""
