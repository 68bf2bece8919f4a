"""A failed bind's gRPC C-core log line becomes the cause in our one line; a
successful bind's lines are written back to stderr unchanged."""

from __future__ import annotations

import os

import pytest

from moe_sidecar.listeners import _core_cause, _core_log_captured

pytestmark = pytest.mark.timeout(10)

LINE = "E1202 14:50:26.696742   27374 add_port.cc:83] Failed to add port: Cannot assign\n"


def test_a_failed_blocks_core_lines_are_held_not_printed(capfd: pytest.CaptureFixture[str]) -> None:
    def fail(blocks: list[list[str]]) -> None:
        with _core_log_captured() as captured:
            blocks.append(captured)  # filled when the block ends
            os.write(2, LINE.encode())
            raise RuntimeError("Failed to bind")

    blocks: list[list[str]] = []
    with pytest.raises(RuntimeError):
        fail(blocks)
    assert capfd.readouterr().err == ""
    assert _core_cause(blocks[0][0]) == "Failed to add port: Cannot assign"


def test_a_successful_blocks_core_lines_go_to_stderr(capfd: pytest.CaptureFixture[str]) -> None:
    with _core_log_captured() as held:
        os.write(2, LINE.encode())
    assert held == [LINE]
    assert capfd.readouterr().err == LINE
