"""Tests that need a package the default environment lacks (vLLM, FlashInfer 0.7.4).

Such tests carry a marker and skip, with the reason, where their package is
not what they read; under a ``CI_REQUIRE_...=1`` variable (set by .ci/run for
the environment that installs it) a missing or different package is an error
instead: in CI they must run.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

__all__ = ["skip_or_require"]


def skip_or_require(
    items: list[pytest.Item], marker: str, why_not: Callable[[], str | None], require: str
) -> None:
    """Skips the items marked ``marker`` when ``why_not()`` gives a reason.

    The marker itself is read: ``item.keywords`` also holds directory names
    (a checkout in a directory of the marker's name would match every test).

    Raises:
        pytest.UsageError: ``$require`` is ``1`` and there is a reason.
    """
    marked = [item for item in items if item.get_closest_marker(marker) is not None]
    reason = why_not() if marked else None
    if reason is None:
        return
    if os.environ.get(require) == "1":
        raise pytest.UsageError(f"{require}=1 but {reason}")
    for item in marked:
        item.add_marker(pytest.mark.skip(reason=reason))
