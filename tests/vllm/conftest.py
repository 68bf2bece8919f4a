"""The vLLM tests run vLLM's own code (vllm==0.33.0, installed by .ci/run).

Where vLLM is not importable they skip, except under ``CI_REQUIRE_VLLM=1``
(set by .ci/run), where a missing or different vLLM is an error: in CI they
must run.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

import pytest

from tests.required_install import skip_or_require

VLLM_VERSION = "0.33.0"
REQUIRE = "CI_REQUIRE_VLLM"


def _why_not() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not importable (.ci/run installs vllm==0.33.0 with --no-deps)"
    found = importlib.metadata.version("vllm")
    if found != VLLM_VERSION:
        return f"these tests read vLLM {VLLM_VERSION}'s code; found vllm {found}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_or_require(items, "vllm", _why_not, REQUIRE)
