"""The sidecar's own faults end no healthy rank, and no death goes unheard after them.

Real processes throughout: a ``python -m moe_sidecar`` process, four rank
processes (``tests.multiprocess.sidecar_fault_rank``, or
``masked_view_rank`` under ``mask``: gloo, the reference backend), SIGSTOP /
SIGCONT of the sidecar, its ``kill -9`` or SIGTERM and a start on the same
state directory, and ``kill -9`` of a rank:

* stalled while the ranks commit a build (5 s): the commits wait and finish;
  with ``MOE_SIDECAR_STALL_BUDGET=2`` each raises ``SidecarNotAnswering``
  naming the socket and the 2 s, and still nobody ends or is counted gone;
* stalled while idle: nobody ends, and a death afterwards is heard;
* restarted while the ranks are idle: every rank's session and watcher come
  back by themselves, and a rank killed afterwards ends every survivor
  within 2 s, naming it;
* ``mask``: the view proposed before a restart is adopted after it
  (view [0, 1, 2]), and the steps after are exact;
* a rank killed while the sidecar is down is named as not back
  (``GetGroup``, ``moe-sidecar groups``) and declared lost when
  ``--reconnect-window`` closes: every survivor acts within 2 s of it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.multiprocess.harness import Sidecar, free_port
from tests.multiprocess.test_masked_view import MaskedRanks, _check_steps, _groups_cli
from tests.multiprocess.test_peer_loss import (
    KILLED,
    STARTUP_S,
    SURVIVORS,
    WORLD,
    Ranks,
    _assert_exited_naming,
    _death_lines,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

STALL_S = 5.0
"""How long the sidecar stays stopped: the fault's length, not a wait."""


class FaultRanks(Ranks):
    """:class:`Ranks` running ``sidecar_fault_rank`` instead."""

    command = (sys.executable, "-m", "tests.multiprocess.sidecar_fault_rank")


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[Sidecar]:
    """A real sidecar with its metrics endpoint on (the tests read its gauges)."""
    running = Sidecar(tmp_path / "sidecar", round_timeout=20.0, metrics_port=free_port()).start()
    try:
        yield running
    finally:
        if running.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                _signal(running, signal.SIGCONT)  # a failed test leaves none stopped
        running.stop()


def _signal(sidecar: Sidecar, number: signal.Signals) -> None:
    assert sidecar.pid is not None
    os.kill(sidecar.pid, number)


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP): its state in /proc."""
    text = Path(f"/proc/{pid}/stat").read_text()
    return text.rsplit(")", 1)[1].split()[0] in ("T", "t")


def _resume_after_stall(sidecar: Sidecar) -> threading.Thread:
    """A thread that waits until the sidecar is stopped (by a rank's build),
    lets it stay stopped :data:`STALL_S`, and resumes it."""
    pid = sidecar.pid
    assert pid is not None

    def run() -> None:
        deadline = time.monotonic() + 120
        while not _stopped(pid):
            assert time.monotonic() < deadline, "the sidecar was never stopped"
            time.sleep(0.01)  # the poll interval of a wait with a deadline
        time.sleep(STALL_S)  # the stall itself
        _signal(sidecar, signal.SIGCONT)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _gauge(sidecar: Sidecar, name: str) -> float:
    url = f"http://127.0.0.1:{sidecar.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as page:
        for line in page.read().decode().splitlines():
            if line.startswith(f"{name} "):
                return float(line.split()[1])
    return 0.0


def _wait_connected(sidecar: Sidecar, ranks: int, timeout: float = 30.0) -> float:
    """Waits until ``ranks`` sessions and watchers are open on the sidecar;
    the seconds it took."""
    started = time.monotonic()
    while True:
        sessions = _gauge(sidecar, "moe_sidecar_sessions")
        watchers = _gauge(sidecar, "moe_sidecar_watchers")
        if sessions == ranks and watchers == ranks:
            return time.monotonic() - started
        assert time.monotonic() - started < timeout, (
            f"{sessions:g} sessions and {watchers:g} watchers of {ranks} ranks after {timeout}s"
        )
        time.sleep(0.02)  # the poll interval of a wait with a deadline


def _nobody_gone(sidecar: Sidecar, group: str) -> None:
    shown = sidecar.get_group(group)
    assert not [r.ep_rank for r in shown.ranks if r.current and r.left], shown


def test_a_stall_during_commits_is_a_wait(sidecar: Sidecar, tmp_path: Path) -> None:
    group = "faults-stall-commit:fp4/tp1-ep4/pp0"
    with FaultRanks(tmp_path / "ranks", sidecar.target, group, policy=None) as ranks:
        ranks.expect(range(WORLD), "ready", STARTUP_S)
        resumer = _resume_after_stall(sidecar)
        started = time.monotonic()
        ranks.send(range(WORLD), f"grow {sidecar.pid}")
        grown = ranks.expect(range(WORLD), "grown", 120)
        resumer.join(30)
        assert time.monotonic() - started >= STALL_S  # the commits did wait for the stall
        assert {g["generation"] for g in grown.values()} == {2}, grown
        ranks.send(range(WORLD), "call")
        ranks.expect(range(WORLD), "called", 30)
        _nobody_gone(sidecar, group)
        for rank in range(WORLD):
            assert not _death_lines(ranks.stderr(rank), group), ranks.stderr(rank)
        ranks.send(range(WORLD), "cleanup")
        ranks.expect(range(WORLD), "cleaned", 30)
        assert {r: c for r, (c, _) in ranks.exits(range(WORLD), 30).items()} == dict.fromkeys(
            range(WORLD), 0
        )


def test_a_stall_past_the_budget_raises_the_named_error_and_ends_no_one(
    sidecar: Sidecar, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MOE_SIDECAR_STALL_BUDGET", "2")
    group = "faults-stall-budget:fp4/tp1-ep4/pp0"
    with FaultRanks(tmp_path / "ranks", sidecar.target, group, policy=None) as ranks:
        ranks.expect(range(WORLD), "ready", STARTUP_S)
        resumer = _resume_after_stall(sidecar)
        ranks.send(range(WORLD), f"grow {sidecar.pid}")
        raised = ranks.expect(range(WORLD), "raised", 60)
        for rank, failure in raised.items():
            assert failure["type"] == "SidecarNotAnswering", (rank, failure)
            assert "CoordinatorUnavailable" in failure["mro"], (rank, failure)
            assert "RoundTimedOut" not in failure["mro"], (rank, failure)
            assert failure["message"].startswith(
                f"the sidecar at {sidecar.target} did not answer Commit for 2 s"
            ), (rank, failure)
        resumer.join(30)
        # Awake, the sidecar answers the commits nobody waits for any more:
        # they land, and no session was read as a death.
        sidecar.wait_for_group(
            group,
            lambda g: [r.committed_generation for r in g.ranks if r.current] == [2] * WORLD,
            timeout=30,
            what="every late commit recorded",
        )
        _nobody_gone(sidecar, group)
        ranks.send(range(WORLD), "cleanup")
        ranks.expect(range(WORLD), "cleaned", 30)
        exits = ranks.exits(range(WORLD), 30)
        assert {r: c for r, (c, _) in exits.items()} == dict.fromkeys(range(WORLD), 0)
        for rank in range(WORLD):
            assert not _death_lines(ranks.stderr(rank), group), ranks.stderr(rank)


def test_a_stall_while_idle_ends_no_one_and_a_death_after_it_is_heard(
    sidecar: Sidecar, tmp_path: Path
) -> None:
    group = "faults-stall-idle:fp4/tp1-ep4/pp0"
    with FaultRanks(tmp_path / "ranks", sidecar.target, group, policy=None) as ranks:
        ranks.expect(range(WORLD), "ready", STARTUP_S)
        _signal(sidecar, signal.SIGSTOP)
        time.sleep(STALL_S)  # the stall itself
        _signal(sidecar, signal.SIGCONT)
        ranks.send(range(WORLD), "call")
        ranks.expect(range(WORLD), "called", 30)
        _nobody_gone(sidecar, group)
        ranks.send(SURVIVORS, "block")
        ranks.expect(SURVIVORS, "blocking", 30)
        killed_at = ranks.kill(KILLED)
        exits = ranks.exits(SURVIVORS, timeout=30)
        _assert_exited_naming(ranks, group, KILLED, exits, killed_at)


@pytest.mark.parametrize("stop", ["kill -9", "SIGTERM"])
def test_after_a_restart_a_death_ends_every_survivor_within_two_seconds(
    sidecar: Sidecar, tmp_path: Path, stop: str
) -> None:
    group = f"faults-restart-{stop.replace(' ', '')}:fp4/tp1-ep4/pp0"
    with FaultRanks(tmp_path / "ranks", sidecar.target, group, policy=None) as ranks:
        ranks.expect(range(WORLD), "ready", STARTUP_S)
        ranks.send(SURVIVORS, "block")  # idle, as an engine between batches
        ranks.expect(SURVIVORS, "blocking", 30)
        _wait_connected(sidecar, WORLD)
        sidecar.stop(kill=stop == "kill -9")
        sidecar.start()
        # Nobody calls: the sessions and watchers come back by themselves.
        back = _wait_connected(sidecar, WORLD)
        print(f"{stop}: every session and watcher back {back * 1e3:.0f} ms after the start")
        _nobody_gone(sidecar, group)
        killed_at = ranks.kill(KILLED)
        exits = ranks.exits(SURVIVORS, timeout=30)
        _assert_exited_naming(ranks, group, KILLED, exits, killed_at)


def test_a_view_proposed_before_a_restart_is_adopted_after_it(
    sidecar: Sidecar, tmp_path: Path
) -> None:
    group = "faults-masked-restart:fp4/tp1-ep4/pp0"
    everyone = (1 << WORLD) - 1
    survivors_mask = everyone & ~(1 << KILLED)
    with MaskedRanks(tmp_path / "ranks", sidecar.target, group, policy="mask") as ranks:
        ranks.expect(range(WORLD), "ready", STARTUP_S)
        ranks.send(range(WORLD), "steps 0 2")
        _check_steps(ranks.expect(range(WORLD), "stepped", 60), 0, 2, set(), everyone)
        ranks.kill(KILLED)
        ranks.send(SURVIVORS, "fault")
        assert all(f["fault"] for f in ranks.expect(SURVIVORS, "fault", 60).values())
        sidecar.stop(kill=True)
        sidecar.start()
        _wait_connected(sidecar, len(SURVIVORS))
        ranks.send(SURVIVORS, "adopt")
        adopted = ranks.expect(SURVIVORS, "adopted", 90)
        for rank, view in adopted.items():
            assert (view["number"], view["members"]) == (2, list(SURVIVORS)), (rank, view)
            assert view["mask"] == view["active_mask"] == survivors_mask, (rank, view)
        shown = sidecar.get_group(group).view
        assert (shown.number, list(shown.members), shown.state) == (2, [0, 1, 2], 2), shown
        ranks.send(SURVIVORS, "steps 2 5")
        _check_steps(ranks.expect(SURVIVORS, "stepped", 120), 2, 5, {KILLED}, survivors_mask)
        ranks.send(SURVIVORS, "cleanup")
        ranks.expect(SURVIVORS, "cleaned", 30)


def test_a_rank_that_dies_while_the_sidecar_is_down_is_declared_lost_when_the_window_closes(
    sidecar: Sidecar, tmp_path: Path
) -> None:
    group = "faults-died-while-down:fp4/tp1-ep4/pp0"
    window = 3.0
    with FaultRanks(tmp_path / "ranks", sidecar.target, group, policy=None) as ranks:
        ranks.expect(range(WORLD), "ready", STARTUP_S)
        ranks.send(SURVIVORS, "block")
        ranks.expect(SURVIVORS, "blocking", 30)
        _wait_connected(sidecar, WORLD)
        sidecar.stop(kill=True)
        ranks.kill(KILLED)  # nobody can hear it: the sidecar is down
        sidecar.args = (*sidecar.args, "--reconnect-window", f"{window:g}")
        launched = time.monotonic()
        sidecar.start()
        listening = time.monotonic()
        _wait_connected(sidecar, len(SURVIVORS))
        shown = sidecar.get_group(group)
        assert list(shown.awaited_ranks) == [KILLED], shown  # the survivors are back
        listed = _groups_cli(sidecar.target)
        assert f"not back since the sidecar's start: ranks [{KILLED}]" in listed, listed
        exits = ranks.exits(SURVIVORS, timeout=30)
        for rank, (code, seen) in exits.items():
            assert code == 75, (rank, code, ranks.stderr(rank))
            # Declared lost when the window (from the sidecar's start) closed,
            # and acted on within 2 s of it.
            assert seen - launched >= window, (rank, seen - launched)
            assert seen - listening < window + 2.0, (rank, seen - listening)
            [line] = _death_lines(ranks.stderr(rank), group)
            assert f"rank {KILLED} died" in line, line
            assert "did not reconnect within --reconnect-window 3 s" in line, line
    gone = sidecar.get_group(group)
    assert not gone.awaited_ranks, gone
