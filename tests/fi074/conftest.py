"""Tests marked ``fi074`` read FlashInfer 0.7.4's own Python (flashinfer-python==0.7.4,
installed ``--no-deps`` in a second environment by .ci/run: it cannot share one
with 0.7.2.post1).

They only import FlashInfer and inspect it, or run the project's pure code
against it: calling a FlashInfer function loads its CUDA module. Where
FlashInfer 0.7.4 is not importable they skip, except under
``CI_REQUIRE_FI074=1`` (set by .ci/run for that environment), where it is an error.
"""

from __future__ import annotations

import importlib.metadata

import pytest

from tests.required_install import skip_or_require

FLASHINFER_VERSION = "0.7.4"
REQUIRE = "CI_REQUIRE_FI074"


def _why_not() -> str | None:
    try:
        found = importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        return "flashinfer-python is not installed (.ci/run installs 0.7.4 in .venv-fi074)"
    if found != FLASHINFER_VERSION:
        return f"these tests read FlashInfer {FLASHINFER_VERSION}'s code; found {found}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_or_require(items, "fi074", _why_not, REQUIRE)
