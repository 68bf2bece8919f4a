"""What ``moe-sidecar size`` answers for: the releases and the layer kinds (its flags' choices)."""

from __future__ import annotations

from typing import Final

__all__ = ["DISPATCH_KINDS", "RELEASES"]

RELEASES: Final = ("0.7.2.post1", "0.7.4")
"""The FlashInfer releases the client has a backend for."""

DISPATCH_KINDS: Final = {
    "bf16": "BF16",
    "fp8": "FP8PerTensor",
    "mxfp8": "MXFP8",
    "nvfp4": "NVFP4",
    "deepseek-fp8": "DeepSeekFp8",
}
"""``--dispatch`` names and the FlashInfer ``QuantFormat`` whose row they send."""
