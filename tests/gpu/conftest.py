"""GPU tests: run on a machine with CUDA GPUs and flashinfer-python.

Everything here is marked ``gpu`` and skips cleanly elsewhere (CI has no GPU).
A test written for one FlashInfer release says so in its marker,
``gpu(flashinfer="0.7.2.post1")``, and skips with the reason under another,
so that one GPU run per release environment runs each test where it applies.
docs/development.md ("GPU tests") says how to run them, on one GPU or two.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

import pytest


def _cuda_devices() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _installed_flashinfer() -> str | None:
    try:
        return importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        return None


def _why_skip(min_gpus: int, release: str | None) -> str | None:
    if importlib.util.find_spec("flashinfer") is None:
        return "flashinfer-python is not installed (GPU machine only)"
    installed = _installed_flashinfer()
    if release is not None and installed != release:
        # Read from the metadata: importing FlashInfer here would load CUDA
        # in the collecting process.
        return (
            f"written for flashinfer-python {release}, found {installed}: "
            f"run it in the {release} environment"
        )
    found = _cuda_devices()
    if found < min_gpus:
        return f"needs {min_gpus} CUDA GPU(s), found {found}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "gpu" not in item.keywords:
            continue
        marker = item.get_closest_marker("gpu")
        needed = int(marker.kwargs.get("gpus", 1)) if marker is not None else 1
        release = marker.kwargs.get("flashinfer") if marker is not None else None
        reason = _why_skip(needed, release)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
