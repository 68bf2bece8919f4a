"""The vLLM tests run vLLM's own code: vllm 0.33.0 or 0.34.0, each in its own
environment of .ci/run (0.34 beside FlashInfer 0.7.4).

Where vLLM is not importable, or is another release, they skip, except under
``CI_REQUIRE_VLLM=1`` (set by .ci/run), where that is an error: in CI they
must run. A test of one release's code only asks :func:`vllm_release`.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

import pytest

from tests.required_install import skip_or_require

SUPPORTED_VLLM = frozenset({"0.33.0", "0.34.0"})
"""The vLLM releases whose code these tests read."""
REQUIRE = "CI_REQUIRE_VLLM"


def vllm_release() -> str:
    """The installed vLLM's version (the tests run only where it is supported)."""
    return importlib.metadata.version("vllm")


def _why_not() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not importable (.ci/run installs vllm 0.33.0 and 0.34.0 with --no-deps)"
    found = vllm_release()
    if found not in SUPPORTED_VLLM:
        return f"these tests read vLLM {' or '.join(sorted(SUPPORTED_VLLM))}'s code; found vllm {found}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_or_require(items, "vllm", _why_not, REQUIRE)
