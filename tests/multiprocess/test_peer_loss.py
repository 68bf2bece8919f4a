"""A dead rank costs its peers a second, not five minutes: the peer-loss watcher.

Real processes throughout: a ``python -m moe_sidecar`` process, four rank
processes (``tests.multiprocess.peer_loss_rank``: a gloo group, a
WorkspaceManager on the reference backend talking to the sidecar), and
``kill -9``. While the survivors' main threads are blocked (one in a long
sleep, two in a gloo barrier waiting for it: stand-ins for a CUDA wait and a
combine waiting for its peers), their watchers hear of the death from the
sidecar and act by ``MOE_SIDECAR_ON_PEER_LOSS``:

* ``exit`` (the default): every survivor is gone within 2 s of the kill,
  with status 75 and one line naming the group, the dead rank and the cause;
* ``raise``: the next call into the manager raises RankLost naming it, once;
* ``wait``: nothing happens (today's behaviour);
* a rank that cleans up and exits is not a death: nobody is ended, and the
  watchers still end the survivors when a rank is killed afterwards.

Times are CLOCK_MONOTONIC, which every process of the machine shares: the
kill's, and when the test saw each survivor's exit (a thread blocked in
its wait() per rank).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import pytest

from moe_sidecar.client.peer_loss import PEER_LOSS_EXIT_STATUS
from tests.multiprocess.harness import REPO, Sidecar

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

WORLD = 4
KILLED = 3
SURVIVORS = (0, 1, 2)
TARGET_S = 2.0
"""Every survivor is gone within this long of the kill (``exit``)."""
STARTUP_S = 180.0
"""Four ranks import torch and gRPC and build: generous on a loaded 2-core machine."""


_RANK_COMMAND = (sys.executable, "-m", "tests.multiprocess.peer_loss_rank")


class Ranks:
    """The four rank processes: commands on stdin, JSON answers on stdout,
    stderr in a file per rank. A context manager; every rank still alive at
    the end is killed."""

    command: tuple[str, ...] = _RANK_COMMAND
    """The rank program (a subclass runs another with the same arguments)."""

    def __init__(self, tmp_path: Path, target: str, group: str, policy: str | None) -> None:
        tmp_path.mkdir(parents=True, exist_ok=True)
        init_method = f"file://{tmp_path / 'rendezvous'}"
        env = {**os.environ, "MOE_SIDECAR_TARGET": target, "MOE_SIDECAR_LOCAL_RANKS": ""}
        env.pop("MOE_SIDECAR_ON_PEER_LOSS", None)
        if policy is not None:
            env["MOE_SIDECAR_ON_PEER_LOSS"] = policy
        self.env = env
        """The ranks' environment (a replacement's too)."""
        self.stderr_paths = [tmp_path / f"rank{r}.stderr" for r in range(WORLD)]
        self.answers: list[queue.Queue[dict[str, Any]]] = [queue.Queue() for _ in range(WORLD)]
        self.processes: list[subprocess.Popen[str]] = []
        self.ended: list[threading.Event] = []
        self.ended_at: list[float] = []
        """When each rank's exit was seen, by a thread blocked in its wait()."""
        for rank in range(WORLD):
            self.start(rank, [init_method, group])

    def start(self, rank: int, args: Sequence[str]) -> None:
        """Starts rank ``rank``'s process (``command``, the rank, the world
        size, then ``args``), or a new one in the place of a rank that ended
        (its stderr file goes on, its answers come on the same queue)."""
        replacing = rank < len(self.processes)
        if replacing:
            assert self.ended[rank].is_set(), f"rank {rank} is still running"
        with open(self.stderr_paths[rank], "a" if replacing else "w") as stderr:
            process = subprocess.Popen(
                [*self.command, str(rank), str(WORLD), *args],
                cwd=REPO,
                env=self.env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
            )
        if replacing:
            self.processes[rank], self.ended[rank] = process, threading.Event()
        else:
            self.processes.append(process)
            self.ended.append(threading.Event())
            self.ended_at.append(0.0)
        threading.Thread(target=self._wait, args=(rank,), daemon=True).start()
        assert process.stdout is not None
        threading.Thread(
            target=self._read, args=(process.stdout, self.answers[rank]), daemon=True
        ).start()

    def _wait(self, rank: int) -> None:
        self.processes[rank].wait()
        self.ended_at[rank] = time.monotonic()
        self.ended[rank].set()

    @staticmethod
    def _read(stdout: IO[str], answers: queue.Queue[dict[str, Any]]) -> None:
        for line in stdout:
            if line.startswith("{"):
                answers.put(json.loads(line))

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc: object) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=10)

    def send(self, ranks: Sequence[int], command: str) -> None:
        for rank in ranks:
            stdin = self.processes[rank].stdin
            assert stdin is not None
            stdin.write(command + "\n")
            stdin.flush()

    def expect(self, ranks: Sequence[int], event: str, timeout: float) -> dict[int, Any]:
        """The next answer of each of ``ranks``, which must be ``event``."""
        deadline = time.monotonic() + timeout
        got: dict[int, Any] = {}
        for rank in ranks:
            try:
                answer = self.answers[rank].get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise AssertionError(
                    f"rank {rank}: no {event!r} within {timeout}s (exit code "
                    f"{self.processes[rank].poll()}):\n{self.stderr(rank)}"
                ) from None
            assert answer["event"] == event, (rank, answer, self.stderr(rank))
            got[rank] = answer
        return got

    def kill(self, rank: int) -> float:
        """SIGKILLs ``rank``; the CLOCK_MONOTONIC time of the kill."""
        killed_at = time.monotonic()
        os.kill(self.processes[rank].pid, signal.SIGKILL)
        assert self.ended[rank].wait(10), f"rank {rank} still running 10s after SIGKILL"
        return killed_at

    def exits(self, ranks: Sequence[int], timeout: float) -> dict[int, tuple[int, float]]:
        """Each of ``ranks``' exit status and when it was seen, waiting at most ``timeout``."""
        deadline = time.monotonic() + timeout
        for rank in ranks:
            self.ended[rank].wait(max(deadline - time.monotonic(), 0.0))
        missing = [r for r in ranks if not self.ended[r].is_set()]
        assert not missing, f"ranks {missing} still running {timeout}s later"
        return {r: (self.processes[r].returncode, self.ended_at[r]) for r in ranks}

    def stderr(self, rank: int) -> str:
        return self.stderr_paths[rank].read_text()

    def wait_stderr(self, rank: int, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.stderr(rank):
            assert time.monotonic() < deadline, f"rank {rank}: no {text!r}:\n{self.stderr(rank)}"
            time.sleep(0.02)  # the poll interval of a wait with a deadline


def _started(ranks: Ranks) -> None:
    ready = ranks.expect(range(WORLD), "ready", STARTUP_S)
    assert {r["generation"] for r in ready.values()} == {1}


def _block_survivors(ranks: Ranks) -> None:
    """Rank 0 sleeps; ranks 1 and 2 wait in a gloo barrier for it; rank 3 sleeps."""
    ranks.send(range(WORLD), "group 0 1 2")
    ranks.expect(range(WORLD), "grouped", 60)
    ranks.send((0, KILLED), "block")
    ranks.send((1, 2), "barrier")
    ranks.expect(range(WORLD), "blocking", 30)


def _death_lines(text: str, group: str) -> list[str]:
    return [line for line in text.splitlines() if f"EP group '{group}': rank " in line]


def _assert_exited_naming(
    ranks: Ranks, group: str, dead: int, exits: dict[int, tuple[int, float]], killed_at: float
) -> None:
    for rank, (code, seen) in exits.items():
        seconds = seen - killed_at
        print(f"rank {rank}: exited {code} {seconds * 1e3:.0f} ms after rank {dead}'s kill")
        assert code == PEER_LOSS_EXIT_STATUS, (rank, code, ranks.stderr(rank))
        assert seconds < TARGET_S, f"rank {rank} ended {seconds:.3f}s after the kill"
        [line] = _death_lines(ranks.stderr(rank), group)
        assert f"rank {dead} died" in line, line
        assert "session stream closed" in line, line  # the cause, in the sidecar's words
        assert f"rank {rank} exits with status {PEER_LOSS_EXIT_STATUS}" in line, line


def test_exit_ends_every_blocked_survivor_within_two_seconds(
    sidecar: Sidecar, tmp_path: Path
) -> None:
    group = "peer-loss-exit:fp4/tp1-ep4/pp0"
    with Ranks(tmp_path / "ranks", sidecar.target, group, policy=None) as ranks:
        _started(ranks)
        _block_survivors(ranks)
        killed_at = ranks.kill(KILLED)
        exits = ranks.exits(SURVIVORS, timeout=30)
        _assert_exited_naming(ranks, group, KILLED, exits, killed_at)
    state = sidecar.get_group(group)
    assert [r.ep_rank for r in state.ranks if r.current and r.left] == list(range(WORLD))


def test_raise_raises_rank_lost_at_the_next_call(sidecar: Sidecar, tmp_path: Path) -> None:
    group = "peer-loss-raise:fp4/tp1-ep4/pp0"
    with Ranks(tmp_path / "ranks", sidecar.target, group, policy="raise") as ranks:
        _started(ranks)
        ranks.kill(KILLED)
        for rank in SURVIVORS:
            ranks.wait_stderr(rank, "raises RankLost at its next call", timeout=30)
        ranks.send(SURVIVORS, "call")
        raised = ranks.expect(SURVIVORS, "raised", 30)
        ranks.send(SURVIVORS, "call")
        again = ranks.expect(SURVIVORS, "called", 30)  # raised once
        ranks.send(SURVIVORS, "cleanup")
        ranks.expect(SURVIVORS, "cleaned", 30)
        assert {r: c for r, (c, _) in ranks.exits(SURVIVORS, 30).items()} == dict.fromkeys(
            SURVIVORS, 0
        )
    assert len(again) == len(SURVIVORS)
    for failure in raised.values():
        assert failure["type"] == "RankLost", failure
        assert failure["ranks"] == [KILLED], failure
        assert f"EP group '{group}': rank {KILLED} died" in failure["message"], failure
        assert "session stream closed" in failure["message"], failure


def test_wait_leaves_the_survivors_alone(sidecar: Sidecar, tmp_path: Path) -> None:
    group = "peer-loss-wait:fp4/tp1-ep4/pp0"
    with Ranks(tmp_path / "ranks", sidecar.target, group, policy="wait") as ranks:
        _started(ranks)
        ranks.kill(KILLED)
        sidecar.wait_for_group(
            group,
            lambda g: any(r.ep_rank == KILLED and r.left for r in g.ranks),
            timeout=30,
            what=f"rank {KILLED} gone",
        )
        # The sidecar decided the next membership view: the survivors, proposed.
        view = sidecar.get_group(group).view
        assert (view.number, list(view.members), view.state) == (2, [0, 1, 2], 1), view
        assert f"rank {KILLED} " in view.cause, view
        ranks.send(SURVIVORS, "call")
        ranks.expect(SURVIVORS, "called", 30)
        ranks.send(SURVIVORS, "cleanup")
        ranks.expect(SURVIVORS, "cleaned", 30)
        for rank in SURVIVORS:
            assert not _death_lines(ranks.stderr(rank), group), ranks.stderr(rank)


def test_a_rank_that_cleans_up_is_not_a_death(sidecar: Sidecar, tmp_path: Path) -> None:
    group = "peer-loss-clean:fp4/tp1-ep4/pp0"
    with Ranks(tmp_path / "ranks", sidecar.target, group, policy="exit") as ranks:
        _started(ranks)
        ranks.send((KILLED,), "cleanup")
        ranks.expect((KILLED,), "cleaned", 30)
        assert ranks.exits((KILLED,), 30)[KILLED][0] == 0
        left = sidecar.wait_for_group(
            group,
            lambda g: any(r.ep_rank == KILLED and r.left for r in g.ranks),
            timeout=30,
            what=f"rank {KILLED} gone",
        )
        [gone] = [r.left for r in left.ranks if r.ep_rank == KILLED]
        assert "closed its session cleanly" in gone, gone
        ranks.send(SURVIVORS, "call")
        ranks.expect(SURVIVORS, "called", 30)  # alive: the clean close ended nobody
        # The watchers are live: a kill afterwards ends the others at once.
        killed_at = ranks.kill(2)
        exits = ranks.exits((0, 1), timeout=30)
        _assert_exited_naming(ranks, group, 2, exits, killed_at)
