"""A rank late to its lifetime's first ``initialize()`` is waited for in the sidecar's view.

Before the first proposal the EP group's ranks share their group's proof
over gloo. Each rank first tells its sidecar it has arrived, so that wait
is visible (``GetGroup``'s ``arrived_ranks``, ``moe-sidecar groups``,
``moe_sidecar_waiting_ranks``) and bounded by the sidecar's
``--round-timeout``: the ranks that came get ``RoundTimedOut`` naming the
rank that did not, instead of waiting for gloo. A rank that dies there is
named to its peers. Real sidecar, real rank processes, the reference backend.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.multiprocess import first_round_workers
from tests.multiprocess.harness import Sidecar, free_port, run_ranks, running_sidecar

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

ROUND_TIMEOUT = 3.0
STARTUP_S = 90.0
"""Spawned ranks import torch and gRPC: generous on a loaded 2-core machine."""


def _run_in_background(**kw: Any) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["results"] = run_ranks(**kw)
        except BaseException as error:  # handed to the test's thread
            out["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def _wait_until_forgotten(sidecar: Sidecar, group: str, *, timeout: float) -> None:
    """Polls until the sidecar knows nothing of ``group`` (NOT_FOUND)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            sidecar.get_group(group)
        except grpc.RpcError as error:
            if isinstance(error, grpc.Call) and error.code() == grpc.StatusCode.NOT_FOUND:
                return
            raise
        assert time.monotonic() < deadline, f"group {group!r} still known after {timeout}s"
        time.sleep(0.02)  # the poll interval of a wait with a deadline


def _waiting_gauge(port: int, group: str) -> float | None:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as page:
        text = page.read().decode()
    for line in text.splitlines():
        if line.startswith("moe_sidecar_waiting_ranks{") and f'group="{group}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def test_a_late_rank_is_waited_for_in_view_and_named_at_the_round_timeout(
    tmp_path: Path,
) -> None:
    port = free_port()
    sidecar = Sidecar(tmp_path / "sidecar", round_timeout=ROUND_TIMEOUT, metrics_port=port)
    sidecar.start()
    group = "first-round/late"
    release = tmp_path / "release-rank-1"
    try:
        thread, out = _run_in_background(
            fn=first_round_workers.late_rank_worker,
            world_size=2,
            timeout=180,
            tmp_path=tmp_path / "ranks",
            args=(sidecar.target, group, 1, str(release)),
        )
        # Rank 0 waits at its first round: the sidecar shows it, and counts it waiting.
        shown = sidecar.wait_for_group(
            group, lambda g: list(g.arrived_ranks) == [0], timeout=STARTUP_S, what="rank 0 arrived"
        )
        # Nobody stated local_ranks: the ranks count them in the exchange, after arriving.
        assert shown.ep_size == 2 and shown.local_ranks == 0
        assert _waiting_gauge(port, group) == 1.0
        listed = subprocess.run(
            [
                str(Path(sys.executable).parent / "moe-sidecar"),
                "groups",
                "--target",
                sidecar.target,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert "arrived at the first round, sharing the group's proof: ranks [0]" in (
            listed.stdout
        ), listed.stdout + listed.stderr
        # Its round timeout ends the wait (the sidecar then forgets the arrival) ...
        _wait_until_forgotten(sidecar, group, timeout=60)
        release.touch()  # ... and only then does rank 1 come.
        thread.join(timeout=200)
        assert not thread.is_alive(), "the ranks did not finish"
        assert "error" not in out, out.get("error")
        early, late = out["results"]
    finally:
        sidecar.stop()
    assert early["type"] == "RoundTimedOut", early
    assert early["grpc_code"] == "DEADLINE_EXCEEDED", early
    assert "rank 1 (never arrived)" in early["message"], early["message"]
    assert "ranks arrived: [0]" in early["message"], early["message"]
    waited = early["at"] - early["started"]
    assert ROUND_TIMEOUT - 0.5 <= waited < ROUND_TIMEOUT + 20, waited
    # Rank 1 got the proof rank 0 had sent and proposed; rank 0 never did.
    assert late["type"] == "RoundTimedOut", late
    assert "rank 0" in late["message"], late["message"]


def test_a_rank_that_dies_at_its_first_round_is_named_to_its_peers(tmp_path: Path) -> None:
    sidecar = Sidecar(tmp_path / "sidecar", round_timeout=ROUND_TIMEOUT)
    sidecar.start()
    group = "first-round/dies"
    arrived, release = tmp_path / "rank-1-arrived", tmp_path / "release-rank-0"
    try:
        thread, out = _run_in_background(
            fn=first_round_workers.dying_arrival_worker,
            world_size=2,
            timeout=180,
            tmp_path=tmp_path / "ranks",
            args=(sidecar.target, group, 1, str(arrived), str(release)),
            dies={1: first_round_workers.DEATH_STATUS},
        )
        sidecar.wait_for_group(
            group, lambda g: list(g.arrived_ranks) == [1], timeout=STARTUP_S, what="rank 1 arrived"
        )
        arrived.touch()
        gone = sidecar.wait_for_group(
            group,
            lambda g: any(r.left for r in g.ranks),
            timeout=60,
            what="rank 1 shown gone",
        )
        assert [r.ep_rank for r in gone.ranks if r.left] == [1]
        release.touch()
        thread.join(timeout=200)
        assert not thread.is_alive(), "the ranks did not finish"
        assert "error" not in out, out.get("error")
        survivor = out["results"][0]
    finally:
        sidecar.stop()
    assert survivor["type"] in ("RankLost", "RoundTimedOut"), survivor
    assert "rank 1 " in survivor["message"], survivor["message"]
    assert "arrival" in survivor["message"], survivor["message"]


ABSENT_TIMEOUT = 2.0
"""The round timeout of the absent-peer tests: short, so the suite stays fast."""
LATE_S = 3 * ABSENT_TIMEOUT
"""How late the late peer comes (at most: it comes at once after rank 0 ended)."""
BOUND_S = ABSENT_TIMEOUT + 2.0
"""Rank 0's first call ends within the round timeout plus this much slack
(its construction, the arrival's call, a loaded machine)."""


def _absent_peer(tmp_path: Path, how: str, round_timeout: float, late_s: float) -> list[Any]:
    """Runs :func:`first_round_workers.peer_absent_worker` (rank 1 absent as
    ``how`` says) against a sidecar of ``round_timeout``; both ranks' reports."""
    with running_sidecar(tmp_path / "sidecar", round_timeout=round_timeout) as sidecar:
        return run_ranks(
            first_round_workers.peer_absent_worker,
            2,
            timeout=60 + 2 * late_s,
            tmp_path=tmp_path / "ranks",
            args=(sidecar.target, f"first-round/{how}", how, late_s, str(tmp_path / "done")),
            dies={1: first_round_workers.DEATH_STATUS} if how == "killed" else None,
        )


@pytest.mark.parametrize("how", ["late", "never"])
def test_a_peer_absent_from_its_first_call_is_named_at_the_round_timeout(
    tmp_path: Path, how: str
) -> None:
    early, late = _absent_peer(tmp_path, how, ABSENT_TIMEOUT, LATE_S)
    assert early.get("type") == "RoundTimedOut", early
    assert "rank 1 (never arrived)" in early["message"], early["message"]
    assert early["waited"] < BOUND_S, early
    if how == "late":
        assert "ok" not in late, late  # rank 0 ended: its first round cannot close


def test_a_peer_killed_before_its_first_call_is_named(tmp_path: Path) -> None:
    early, _ = _absent_peer(tmp_path, "killed", ABSENT_TIMEOUT, LATE_S)
    assert early.get("type") == "RankLost", early
    assert "rank 1 (never arrived)" in early["message"], early["message"]
    assert "exited before its first initialize()" in early["message"], early["message"]
    assert early["waited"] < BOUND_S, early


def test_a_peer_late_by_less_than_the_round_timeout_is_waited_for(tmp_path: Path) -> None:
    # A longer round timeout than above: the margin is what a loaded machine needs.
    early, late = _absent_peer(tmp_path, "on_time", round_timeout=10.0, late_s=2.0)
    assert early.get("ok") and late.get("ok"), (early, late)
    assert early["waited"] >= 2.0, early  # it did wait for its peer
