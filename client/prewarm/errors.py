"""What stops ``moe-sidecar prewarm``: one exception type per cause, each with its exit status."""

from __future__ import annotations

__all__ = [
    "ArchError",
    "BuildFailed",
    "FlashInferMissing",
    "FlashInferVersionMismatch",
    "PrewarmError",
    "ToolMissing",
]


class PrewarmError(Exception):
    """``prewarm`` cannot run here; :attr:`exit_status` is what the CLI returns."""

    exit_status = 2


class ArchError(PrewarmError, ValueError):
    """A CUDA architecture that FlashInfer would not accept or cannot be normalised."""


class FlashInferMissing(PrewarmError):
    """flashinfer-python is not installed (or not as a distribution)."""


class FlashInferVersionMismatch(PrewarmError):
    """Another flashinfer-python release than the one the backend drives."""


class ToolMissing(PrewarmError):
    """nvcc, ninja or the C++ compiler FlashInfer calls is not there."""


class BuildFailed(PrewarmError):
    """FlashInfer's build of a target failed or timed out."""

    exit_status = 1
