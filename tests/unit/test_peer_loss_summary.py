"""``bench/peer_loss_gpu.py``'s summary line, for outcomes the CPU run never
has: survivors still hung at the cap without the watcher (FlashInfer 0.7.4,
whose waits trap only after ``timeout_sec``) must read as capped, not as a
trap, with the ratio a lower bound."""

from __future__ import annotations

from typing import Any

import pytest

from bench.peer_loss_gpu import summarize

pytestmark = pytest.mark.timeout(30)

VICTIM_LINE = "moe-sidecar: EP group 'g': rank 3 died (...); rank 0 exits with status 75"


def _watched(seconds: float) -> dict[str, Any]:
    return {"status": 75, "seconds": seconds, "last_line": VICTIM_LINE, "wait_timeout_s": 300}


def _unwatched(status: int | None, seconds: float | None) -> dict[str, Any]:
    return {"status": status, "seconds": seconds, "last_line": "", "wait_timeout_s": 300}


def test_survivors_hung_at_the_cap_are_capped_not_a_trap() -> None:
    results = {
        "watcher": {r: _watched(0.1 + r / 10) for r in range(3)},
        "no-watcher": {r: _unwatched(None, None) for r in range(3)},
    }
    line, passed = summarize("flashinfer-moe-ep", 3, 60.0, results)
    assert passed
    assert line.startswith("summary (flashinfer-moe-ep): with the watcher 3 of 3 survivors")
    assert "the last within 0.300 s" in line
    assert "0 of 3 survivors ended, 3 still hung at the 60 s cap (capped, not a trap" in line
    assert "timeout_sec=300 s" in line and line.endswith("at least 200x")


def test_survivors_that_ended_give_an_exact_ratio() -> None:
    results = {
        "watcher": {r: _watched(0.25) for r in range(3)},
        "no-watcher": {0: _unwatched(1, 303.6), 1: _unwatched(1, 303.7), 2: _unwatched(1, 310.0)},
    }
    line, passed = summarize("flashinfer-moe-alltoall", 3, 400.0, results)
    assert passed and "still hung" not in line
    assert "3 of 3 survivors ended (the first after 303.6 s, the last after 310.0 s)" in line
    assert line.endswith(": 1214x")


def test_a_survivor_the_watcher_did_not_end_fails_the_run() -> None:
    results = {
        "watcher": {0: _watched(0.2), 1: _unwatched(1, 0.1), 2: _watched(0.2)},
        "no-watcher": {r: _unwatched(None, None) for r in range(3)},
    }
    line, passed = summarize("reference", 3, 20.0, results)
    assert not passed and "with the watcher 2 of 3 survivors exited with status 75" in line
    assert "the last within" not in line and line.endswith(": no ratio")


def test_some_hung_some_ended_the_first_that_ended_gives_the_ratio() -> None:
    results = {
        "watcher": {r: _watched(0.25) for r in range(3)},
        "no-watcher": {0: _unwatched(None, None), 1: _unwatched(1, 303.6), 2: _unwatched(1, 303.7)},
    }
    line, passed = summarize("flashinfer-moe-alltoall", 3, 400.0, results)
    assert passed and "2 of 3 survivors ended (the first after 303.6 s" in line
    assert "1 still hung at the 400 s cap (capped, not a trap" in line
    assert line.endswith(": 1214x")
