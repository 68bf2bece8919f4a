"""The rounds a client may leave unanswered and the rounds a sidecar retains
are one limit: the client refuses a larger window, naming it."""

from __future__ import annotations

import pytest

from moe_sidecar.client import WorkspaceManager
from moe_sidecar.client.errors import InvalidArgument
from moe_sidecar.client.manager import DEFAULT_MAX_UNANSWERED
from moe_sidecar.core.policy import RETAINED_ROUNDS

pytestmark = pytest.mark.timeout(30)


def test_the_default_window_is_what_a_sidecar_retains() -> None:
    assert DEFAULT_MAX_UNANSWERED == RETAINED_ROUNDS


@pytest.mark.parametrize("window", [0, RETAINED_ROUNDS + 1, 256])
def test_a_window_a_sidecar_cannot_answer_after_a_restart_is_refused(window: int) -> None:
    with pytest.raises(InvalidArgument, match=rf"max_unanswered={window}: must be 1 to 64") as info:
        # Refused before the CPU group is looked at.
        WorkspaceManager(None, group="g", max_unanswered=window)  # type: ignore[arg-type]
    assert info.value.field == "max_unanswered"
