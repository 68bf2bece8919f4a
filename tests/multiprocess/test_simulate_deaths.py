"""``moe-sidecar simulate`` and a rank's death, run as a user runs it: the
console script in a subprocess, its rank processes spawned for real, a real
sidecar process (or two and an etcd), SIGKILL for real.

* a rank killed before the ranks are up ends the run at once, named;
* ``--kill-rank R --at-round N`` under ``exit``, ``raise`` and ``mask``: what
  each survivor did, how long after the kill, and under ``mask`` the view
  committed and exact steps after it;
* a rank killed from outside mid-run is the cause in the verdict, not the
  survivor its policy ended with status 75;
* ``--nodes 2``: ``exit`` across nodes reported as far as the library hears
  it, bounded; ``mask`` refused by the library, shown plainly.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.etcd_server import EtcdServer
from tests.multiprocess.harness import REPO, Sidecar

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

MODEL = ("--model", "qwen3-30b-a3b", "--max-tokens", "8")
"""48 identical layers, one build: the cheapest preset."""
LOSS_WAIT = "8"
"""--loss-wait: long enough for a loaded machine, short enough to keep a miss cheap."""
ACT_WITHIN_S = 2.0
"""The library's promise: every survivor acts within 2 s of the death."""


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("MOE_SIDECAR_")}


def _command(*args: str) -> list[str]:
    script = shutil.which("moe-sidecar", path=str(Path(sys.executable).parent))
    assert script is not None, "the moe-sidecar console script is not installed in this venv"
    return [script, "simulate", *args]


def simulate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(_command(*args), env=_env(), capture_output=True, text=True, timeout=150)


class _Lines:
    """A running ``simulate`` whose stdout is read line by line, with deadlines."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.process = process
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def until(self, pattern: str, timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while True:
            line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            assert line is not None, "simulate ended before " + pattern + ":\n" + "".join(self.seen)
            self.seen.append(line)
            match = re.search(pattern, line)
            if match is not None:
                return match

    def rest(self, timeout: float) -> str:
        self.process.wait(timeout=timeout)
        while (line := self.lines.get(timeout=timeout)) is not None:
            self.seen.append(line)
        return "".join(self.seen)


@contextmanager
def running(*args: str) -> Iterator[_Lines]:
    process = subprocess.Popen(
        _command(*args), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        yield _Lines(process)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)


def _gone(pid: int) -> bool:
    """No such process any more (not even a zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _json(run: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(run.stdout)
    return document


def _see_a_death() -> tuple[str, list[str]]:
    """The user guide's "See a death": its one command and the lines it shows."""
    guide = (REPO / "docs" / "user-guide.md").read_text()
    section = guide[guide.index("\n## See a death\n") :]
    command = re.search(r"```bash\n(moe-sidecar simulate [^\n]+)\n```", section)
    shown = re.search(r"```text\n(.*?)```", section, re.S)
    assert command is not None and shown is not None
    return command.group(1), shown.group(1).splitlines()


def _pattern(line: str) -> str:
    """A shown line as a pattern: its times and ports are this machine's, and
    gloo's words for the broken connection vary (closed, or reset, by peer)."""
    words = line.find("RuntimeError: ") if "its combine raised" in line else -1
    kept = line if words < 0 else line[: words + len("RuntimeError: ")]
    pattern = re.sub(r"[0-9]+\\\.[0-9]+|(?<=\\\]:)[0-9]+", "[0-9.]+", re.escape(kept))
    return pattern if words < 0 else pattern + ".*by peer.*"


def test_the_documented_death_is_what_the_command_prints() -> None:
    command, shown = _see_a_death()
    readme = (REPO / "README.md").read_text()
    assert f"```bash\n{command}\n```" in readme  # the tour's command is the guide's
    run = subprocess.run(
        shlex.split(command), env=_env(), capture_output=True, text=True, timeout=150
    )
    assert run.returncode == 0, run.stdout + run.stderr
    for line in shown:
        if line.strip() not in ("...", ""):
            assert re.search("^" + _pattern(line) + "$", run.stdout, re.M), (line, run.stdout)


def test_a_rank_killed_before_the_ranks_are_up_ends_the_run_at_once(sidecar: Sidecar) -> None:
    with running("--ranks", "2", *MODEL, "--target", sidecar.target) as run:
        pids = [int(p) for p in run.until(r"rank processes: pid (\d+), pid (\d+)", 60).groups()]
        os.kill(pids[1], signal.SIGKILL)  # the ranks are importing torch: long before "up"
        killed_at = time.monotonic()
        text = run.rest(timeout=60)
        ended_after = time.monotonic() - killed_at
    assert run.process.returncode == 1, text
    assert "FAILED: rank 1 exited (killed by signal 9) before it reached the sidecar\n" in text
    # 2 s is the promise; the margin is for a loaded 2-core machine.
    assert ended_after < 2.0 + 2.0, (ended_after, text)
    # Nothing ran, so nothing is summed up; the survivor was stopped and reaped.
    assert "ranks up" not in text and "rounds:" not in text and "wall time" not in text, text
    assert text.rstrip().endswith("FAILED")
    assert all(_gone(pid) for pid in pids)


def test_kill_under_exit_every_survivor_exits_75_with_the_librarys_line(
    sidecar: Sidecar,
) -> None:
    run = simulate(
        "--ranks", "3", *MODEL, "--target", sidecar.target, "--json",
        "--kill-rank", "1", "--at-round", "2", "--on-peer-loss", "exit", "--loss-wait", LOSS_WAIT,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    result = _json(run)
    death = result["death"]
    assert (death["ep_rank"], death["how"], death["signal"]) == (1, "killed by signal 9", "SIGKILL")
    assert (death["requested"], death["round"], death["policy"]) == (True, 2, "exit")
    assert death["where"] == "between its dispatch and its combine"
    assert [s["ep_rank"] for s in death["survivors"]] == [0, 2]
    for survivor in death["survivors"]:
        rank = survivor["ep_rank"]
        assert survivor["acted"] and survivor["action"] == "exited with status 75", survivor
        assert 0.0 <= survivor["after"] < ACT_WITHIN_S, survivor
        assert survivor["line"].startswith("moe-sidecar: EP group 'simulate:qwen3-30b-a3b/ep3/pp0'")
        assert ": rank 1 died (" in survivor["line"]
        assert survivor["line"].endswith(f"rank {rank} exits with status 75"), survivor
    # Rounds 1 and 2 were decided; nothing blamed on the survivors.
    assert [r["round"] for r in result["rounds"]] == [1, 2]
    assert result["ok"] and result["failures"] == [] and result["error"] == ""
    assert "rank 1 killed (SIGKILL) in round 2, between its dispatch and its combine" in run.stderr


def test_kill_under_raise_names_the_dead_rank_in_rank_lost(sidecar: Sidecar) -> None:
    run = simulate(
        "--ranks", "2", *MODEL, "--target", sidecar.target,
        "--kill-rank", "0", "--at-round", "1", "--on-peer-loss", "raise", "--loss-wait", LOSS_WAIT,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    text = run.stdout
    assert (
        "death: rank 0 killed by signal 9 (SIGKILL) in round 1, between its dispatch and its "
        "combine; MOE_SIDECAR_ON_PEER_LOSS=raise in the survivors" in text
    ), text
    survivor = re.search(
        r"  rank 1: raised RankLost at its next call into the manager, ([0-9.]+) s after the "
        r"death\n    RankLost: EP group '[^']+': rank 0 died \(.*\); rank 1 stops using the "
        r"all-to-all: restart every rank\n    the library printed: moe-sidecar: EP group .*: "
        r"rank 0 died \(.*\); rank 1 raises RankLost at its next call\n",
        text,
    )
    assert survivor is not None, text
    assert float(survivor.group(1)) < ACT_WITHIN_S
    assert "every survivor did what MOE_SIDECAR_ON_PEER_LOSS=raise says" in text
    assert "rounds: 1 of 48   builds: 1   rebuilds: 0   reuses: 0" in text
    assert "exited with code" not in text and text.rstrip().endswith("OK")


def test_kill_under_mask_the_survivors_adopt_the_view_and_step_exactly(sidecar: Sidecar) -> None:
    run = simulate(
        "--ranks", "3", *MODEL, "--target", sidecar.target, "--json",
        "--kill-rank", "2", "--at-round", "3", "--on-peer-loss", "mask", "--loss-wait", LOSS_WAIT,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    result = _json(run)
    death = result["death"]
    assert (death["ep_rank"], death["round"], death["where"]) == (2, 3, "between two steps")
    for survivor in death["survivors"]:
        assert survivor["acted"] and survivor["action"] == "heard of it (peer_fault())", survivor
        assert survivor["after"] < ACT_WITHIN_S, survivor
        assert "goes on under a mask once it adopts a view" in survivor["line"], survivor
        assert (survivor["view_number"], survivor["view_members"]) == (2, [0, 1]), survivor
        assert survivor["view_mask"] == 0b011
        steps = survivor["steps"]
        assert [s["step"] for s in steps] == [1, 2, 3]
        assert all(s["max_error"] == 0.0 for s in steps), steps
        # The routing does send copies to rank 2's experts: the mask dropped them.
        assert sum(s["dropped"] for s in steps) > 0 and all(s["copies"] == 64 for s in steps)
    assert "rank 2 killed (SIGKILL) in round 3, between two steps" in run.stderr


def test_a_rank_killed_mid_run_is_the_cause_not_the_survivor(sidecar: Sidecar) -> None:
    # DeepSeek's 59 rounds and growth give the kill time to land mid-run.
    with running(
        "--ranks", "2", "--max-tokens", "16", "--target", sidecar.target,
        "--on-peer-loss", "exit", "--loss-wait", LOSS_WAIT,
    ) as run:  # fmt: skip
        pids = [int(p) for p in run.until(r"rank processes: pid (\d+), pid (\d+)", 60).groups()]
        run.until(r"round  2/59", 120)
        os.kill(pids[1], signal.SIGKILL)
        text = run.rest(timeout=60)
    assert run.process.returncode == 1, text
    failed = [line for line in text.splitlines() if line.startswith("FAILED")]
    assert failed[0].startswith(
        "FAILED: rank 1 exited (killed by signal 9) during the run, not asked for (rank 0 had "
        "finished "
    ), text
    assert "without a report" not in text
    assert re.search(r"  rank 0: exited with status 75, [0-9.]+ s after the death\n", text), text
    rounds = int(re.search(r"rounds: (\d+) of 59", text).group(1))  # type: ignore[union-attr]
    assert rounds >= 2, text


def test_kill_in_embedded_mode_says_no_watcher_heard_it() -> None:
    started = time.monotonic()
    run = simulate(
        "--ranks", "2", *MODEL, "--kill-rank", "1", "--at-round", "1", "--loss-wait", "60",
    )  # fmt: skip
    assert run.returncode == 1, run.stdout + run.stderr
    assert "rank 0: no watcher runs in embedded mode" in run.stdout, run.stdout
    assert "its combine raised" in run.stdout
    assert time.monotonic() - started < 60  # no wait for a watcher that does not exist


def test_failures_before_any_rank_started_print_no_summary(tmp_path: Path) -> None:
    run = simulate("--ranks", "2", *MODEL, "--target", f"unix://{tmp_path}/absent.sock")
    assert run.returncode == 1
    assert run.stdout.startswith(f"\nFAILED: cannot reach the sidecar at unix://{tmp_path}/")
    assert "rounds:" not in run.stdout and "ranks up" not in run.stdout, run.stdout
    assert run.stdout.rstrip().endswith("FAILED")


def test_death_flags() -> None:
    # The ranges themselves: tests/unit/test_simulate_death.py. Here, as the CLI says them.
    bad = simulate("--ranks", "2", *MODEL, "--kill-rank", "2")
    assert bad.returncode == 2 and "--kill-rank 2: must be in [0, 1]" in bad.stderr, bad.stderr
    policy = simulate("--ranks", "2", *MODEL, "--on-peer-loss", "ignore")
    assert policy.returncode == 2 and "invalid choice: 'ignore'" in policy.stderr


@pytest.mark.etcd
def test_two_nodes_exit_is_reported_as_far_as_each_node_heard_it(etcd_server: EtcdServer) -> None:
    nodes = ("--nodes", "2", "--store", f"etcd://{etcd_server.endpoint}/sim-death")
    started = time.monotonic()
    run = simulate(
        "--ranks", "4", *MODEL, *nodes, "--json",
        "--kill-rank", "1", "--at-round", "2", "--on-peer-loss", "exit", "--loss-wait", "4",
    )  # fmt: skip
    # Bounded: the start of two sidecars and four ranks, the wait, and no more.
    assert time.monotonic() - started < 120, run.stdout + run.stderr
    death = _json(run)["death"]
    assert (death["ep_rank"], death["node"], death["how"]) == (1, "node-a", "killed by signal 9")
    by_rank = {s["ep_rank"]: s for s in death["survivors"]}
    assert by_rank[0]["node"] == "node-a" and by_rank[0]["acted"], by_rank[0]
    assert by_rank[0]["line"].endswith("rank 0 exits with status 75")
    for rank in (2, 3):
        survivor = by_rank[rank]
        assert survivor["node"] == "node-b"
        # Whatever node-b heard, the report says it: an exit with the library's
        # line, or that no word came within the wait.
        if survivor["acted"]:
            assert survivor["line"].endswith(f"rank {rank} exits with status 75"), survivor
        else:
            assert survivor["action"] == "did not hear of the death within 4 s (--loss-wait)"
            assert survivor["line"] == ""
    assert run.returncode == (0 if all(s["acted"] for s in by_rank.values()) else 1)


@pytest.mark.etcd
def test_two_nodes_mask_shows_the_librarys_refusal(etcd_server: EtcdServer) -> None:
    nodes = ("--nodes", "2", "--store", f"etcd://{etcd_server.endpoint}/sim-mask")
    run = simulate(
        "--ranks", "4", *MODEL, *nodes,
        "--kill-rank", "1", "--at-round", "2", "--on-peer-loss", "mask",
    )  # fmt: skip
    assert run.returncode == 1, run.stdout + run.stderr
    assert (
        "FAILED: rank 0: PreconditionFailed: MOE_SIDECAR_ON_PEER_LOSS=mask: refused for group "
        "'simulate:qwen3-30b-a3b/ep4/pp0', whose 4 ranks span more than one sidecar"
    ) in run.stdout, run.stdout
    assert "rank 1 was not killed: the run ended before the step of round 2" in run.stdout
    assert "death:" not in run.stdout
