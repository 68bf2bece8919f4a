"""Covered rounds across sidecar restarts: 8 real rank processes, a real
sidecar killed (``kill -9``) or stopped (SIGTERM) 60 times while the ranks
pass a model's 61 covered layers again and again.

A covered round sends its proposal and goes on; after a restart the client
sends what is unanswered again on a new stream, and the sidecar answers it
with the answer it had (every REUSE round is recorded before it is answered,
and a sidecar retains as many closed rounds as a client may leave
unanswered). So a restart costs the ranks nothing but time: no rank error,
no round timed out, and every round one answer (REUSE, for every rank).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from moe_workspace.v1 import coordinator_pb2 as pb
from tests.multiprocess import covered_workers
from tests.multiprocess.harness import Sidecar, run_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

RESTARTS = 60
LAYERS = 61
RANKS = 8


def _storm(sidecar: Sidecar, group: str, stop_file: Path, done: list[int]) -> None:
    """Restarts ``sidecar`` ``RESTARTS`` times, each once the ranks closed
    more rounds since the last, kill -9 and SIGTERM in turn; then asks the
    ranks to stop."""
    try:
        last = 0
        for restart in range(RESTARTS):

            def moved_on(g: pb.Group, after: int = last) -> bool:
                return g.last_closed_round > after

            group_now = sidecar.wait_for_group(
                group, moved_on, timeout=90, what=f"rounds closed after restart {restart}"
            )
            last = group_now.last_closed_round
            sidecar.stop(kill=restart % 2 == 0)
            sidecar.start()
            done.append(last)
    finally:
        stop_file.touch()


def test_covered_ranks_pass_60_sidecar_restarts_with_one_answer_per_round(
    tmp_path: Path,
) -> None:
    sidecar = Sidecar(tmp_path / "sidecar", round_timeout=20.0).start()
    group = "covered/restart-storm"
    stop_file = tmp_path / "stop"
    restarted_at: list[int] = []
    storm = threading.Thread(target=_storm, args=(sidecar, group, stop_file, restarted_at))
    storm.start()
    try:
        results = run_ranks(
            covered_workers.restart_storm_worker,
            RANKS,
            timeout=540,
            tmp_path=tmp_path,
            args=(sidecar.target, group, LAYERS, str(stop_file)),
        )
    finally:
        stop_file.touch()
        storm.join(timeout=120)
    try:
        final = sidecar.get_group(group)
    finally:
        sidecar.stop()
    assert len(restarted_at) == RESTARTS, restarted_at
    passes = results[0]["passes"]
    for rank, result in enumerate(results):
        where = f"rank {rank}: {result}"
        assert result["passes"] == passes, where
        # Every covered round's answer was REUSE, for every rank: one answer each.
        assert result["covered"] == result["reuses"] == passes * LAYERS, where
        assert (result["builds"], result["rebuilds"]) == (1, 0), where
        assert result["after"] == 0 and result["max_error"] == 0.0, where
    assert final.last_closed_round == 1 + passes * LAYERS
    log = sidecar.log.read_text()
    assert "round timed out" not in log and "closed long ago" not in log
    print(
        f"{RESTARTS} restarts at rounds {restarted_at[0]}..{restarted_at[-1]}; "
        f"{passes} passes of {LAYERS} covered layers on {RANKS} ranks; "
        f"rpcs per rank {[r['rpc_count'] for r in results]}"
    )
