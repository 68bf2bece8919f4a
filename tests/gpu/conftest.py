"""GPU tests: run on a machine with CUDA GPUs and flashinfer-python 0.7.2.post1.

Everything here is marked ``gpu`` and skips cleanly elsewhere (CI has no GPU).
README's "GPU tests" section says how to run them on a two-GPU box.
"""

from __future__ import annotations

import importlib.util

import pytest


def _cuda_devices() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _why_skip(min_gpus: int) -> str | None:
    if importlib.util.find_spec("flashinfer") is None:
        return "flashinfer-python is not installed (GPU machine only)"
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
        reason = _why_skip(needed)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
