"""What the sidecar logs when a rank's process ends: a rank that closed its
manager (its session said goodbye) left normally, at INFO, with nothing at
WARNING or above; a rank killed mid-lifetime is a loss, at WARNING.

The sidecar and the rank are real processes; the rank talks over the
client's own transport, as the manager does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.helpers import (
    ROOT,
    log_records,
    start_sidecar_process,
    stop_process,
    wait_until_serving,
)

pytestmark = pytest.mark.timeout(60)

_MAIN = "import sys; from moe_sidecar.cli import main; sys.exit(main())"
"""``moe-sidecar`` (``python -m moe_sidecar`` alone is ``serve``)."""

_RANK = """
import os, signal, sys
from moe_sidecar.client.transport import GrpcTransport
from moe_sidecar.core.group import CommitRecord, Proposal, Requirement
from moe_sidecar.core.plan import Capacities

target, group, ending = sys.argv[1:]
lifetime = "life-1-lifetime-token"
transport = GrpcTransport(target)
decision = transport.propose(Proposal(group=group, ep_size=1, ep_rank=0, local_ranks=1,
    lifetime=lifetime, round=1,
    requirement=Requirement(Capacities(16, 64, 128, 2, 8), "model.layers.0.mlp")))
transport.commit(group, CommitRecord(0, lifetime, 1, decision.plan, 0.01))
print("built", flush=True)
if ending == "killed":
    os.kill(os.getpid(), signal.SIGKILL)
transport.close()
"""
"""One rank's lifetime over the client's transport: one round built and
committed, then its end."""


def _rank(target: str, group: str, ending: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _RANK, target, group, ending],
        cwd=ROOT, capture_output=True, text=True, timeout=30, check=False,
        env={k: v for k, v in os.environ.items() if not k.startswith("MOE_SIDECAR_")},
    )  # fmt: skip


def _gone_record(log: Path, group: str, timeout: float = 20.0) -> dict[str, Any]:
    """The sidecar's record of the rank of ``group`` being gone, once written."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for record in log_records(log):
            if record.get("group") == group and record["message"].startswith("rank "):
                return record
        time.sleep(0.05)  # the poll interval of a wait with a deadline
    raise AssertionError(f"no record of the rank of {group} gone:\n{log.read_text()}")


@pytest.fixture
def sidecar(tmp_path: Path) -> Any:
    log = tmp_path / "sidecar.log"
    target = f"unix://{tmp_path}/s.sock"
    process = start_sidecar_process(
        log, "--listen", target, "--state-dir", str(tmp_path / "state"),
        "--health-port", "0", "--metrics-port", "0", "--log-format", "json",
    )  # fmt: skip
    try:
        wait_until_serving(target, process, log)
        yield target, log
    finally:
        stop_process(process)


def test_a_rank_that_closed_its_manager_and_exited_is_logged_as_leaving_normally(
    sidecar: tuple[str, Path],
) -> None:
    target, log = sidecar
    done = _rank(target, "clean-exit/ep1", "closed")
    assert done.returncode == 0, done.stderr
    record = _gone_record(log, "clean-exit/ep1")
    assert (record["level"], record["message"]) == ("INFO", "rank left the group normally")
    assert "closed its session cleanly" in record["detail"], record
    # Nothing of the group reads like a failure: no warning, no error, and its
    # last view (no member left) ended rather than "failed: members none".
    loud = [r for r in log_records(log) if r["level"] not in ("DEBUG", "INFO")]
    assert loud == [], loud
    ended = (
        "view 2 ended at generation 1 (rank 0 (last reported round 1, layer "
        "'model.layers.0.mlp') is gone: it closed its session cleanly (cleanup); no member is left)"
    )
    views = [r["detail"] for r in log_records(log) if r["message"] == "view changed"]
    assert views == [ended], views
    groups = subprocess.run(
        [sys.executable, "-c", _MAIN, "groups", "--target", target],
        cwd=ROOT, capture_output=True, text=True, timeout=30, check=False,
        env={k: v for k, v in os.environ.items() if not k.startswith("MOE_SIDECAR_")},
    )  # fmt: skip
    assert groups.returncode == 0, groups.stderr
    assert f"  {ended}\n" in groups.stdout, groups.stdout
    assert "failed" not in groups.stdout, groups.stdout


def test_a_killed_rank_is_logged_as_lost(sidecar: tuple[str, Path]) -> None:
    target, log = sidecar
    done = _rank(target, "killed/ep1", "killed")
    assert done.returncode == -signal.SIGKILL, done.stderr
    record = _gone_record(log, "killed/ep1")
    assert (record["level"], record["message"]) == (
        "WARNING",
        "rank lost: its session broke without a goodbye",
    )
    assert "its session stream closed" in record["detail"], record
