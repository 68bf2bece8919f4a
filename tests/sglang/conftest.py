"""The SGLang tests run SGLang 0.5.23's own code (.ci/sglang-env.sh builds its environment).

Where SGLang is not importable they skip, except under ``CI_REQUIRE_SGLANG=1``
(set by .ci/run for that environment), where a missing or different SGLang
is an error: in CI they must run.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

import pytest

from moe_sidecar.client.engines.sglang.sizing import SGLANG_VERSION
from tests.required_install import skip_or_require

REQUIRE = "CI_REQUIRE_SGLANG"


def _why_not() -> str | None:
    if importlib.util.find_spec("sglang") is None:
        return "sglang is not importable (.ci/sglang-env.sh builds .venv-sglang with it)"
    found = importlib.metadata.version("sglang")
    if found != SGLANG_VERSION:
        return f"these tests read SGLang {SGLANG_VERSION}'s code; found sglang {found}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_or_require(items, "sglang", _why_not, REQUIRE)
