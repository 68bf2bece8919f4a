"""The parent of a simulation: it starts the rank processes, follows them, and gathers the result.

It prints one line per round as rank 0 finishes it; a rank's failure, a
rank's death (asked for with ``--kill-rank`` or not), an unreachable sidecar
or a run past its timeout ends up in the result, which the caller formats
(:mod:`moe_sidecar.client.simulate.summary`). Each rank has a pipe of its
own and the parent waits on the pipes and the processes' sentinels at once,
so a rank's end is seen when it happens: one that ends before every rank is
up ends the run at once, and every wait after a death is bounded by
``--loss-wait``.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import tempfile
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import TextIO

import grpc

from moe_sidecar.client.errors import InvalidArgument
from moe_sidecar.client.peer_loss import PEER_LOSS_EXIT_STATUS, policy_from_environment
from moe_sidecar.client.simulate.death import (
    AtKillPoint,
    RankExit,
    StepFailed,
    SurvivorReport,
    describe_exit,
    read_death,
)
from moe_sidecar.client.simulate.rank import rank_main
from moe_sidecar.client.simulate.records import (
    RankReport,
    RankStarted,
    RoundRecord,
    SimulatedRankFailure,
    SimulationConfig,
    SimulationResult,
)
from moe_sidecar.client.simulate.sidecars import (
    check_reachable,
    fetch_history,
    fetch_node_views,
    node_sidecars,
)
from moe_sidecar.wire.display import format_bytes

__all__ = ["run_simulation"]

_FAILURE_GRACE_S = 3.0
"""After one rank's failure the others usually fail too (and say why): how long they get."""
_REPORT_GRACE_S = 3.0
"""Past ``--loss-wait``, how long the survivors of a death get to send their reports."""


def _progress_line(record: RoundRecord, total: int) -> str:
    width = len(str(total))
    return (
        f"  round {record.round:>{width}}/{total}  {record.layer:<22} {record.quant:<5}  "
        f"{record.action.upper():<7}  workspace {format_bytes(record.workspace_bytes):>10}  "
        f"generation {record.generation}  {record.seconds * 1000:7.1f} ms"
    )


def _policy(config: SimulationConfig) -> str:
    """The ranks' ``MOE_SIDECAR_ON_PEER_LOSS``, as the library reads it."""
    if config.on_peer_loss is not None:
        return config.on_peer_loss
    try:
        return policy_from_environment(os.environ).value
    except InvalidArgument:
        return "malformed"  # the ranks' managers refuse it, naming it


class _Follower:
    """Follows the rank processes: their messages, their exits, a requested kill."""

    def __init__(
        self,
        config: SimulationConfig,
        result: SimulationResult,
        processes: Sequence[multiprocessing.process.BaseProcess],
        readers: Sequence[Connection],
        say: Callable[[str], None],
        wall_start: float,
    ) -> None:
        self.config = config
        self.result = result
        self.processes = processes
        self.say = say
        self.wall_start = wall_start
        self.open_readers = {reader: rank for rank, reader in enumerate(readers)}
        self.started: set[int] = set()
        self.exits: dict[int, RankExit] = {}
        self.step_failures: dict[int, StepFailed] = {}
        self.survivor_reports: dict[int, SurvivorReport] = {}
        self.kill: tuple[int, float] | None = None
        """The rank killed on request, and when."""
        self.kill_where = ""
        self.failed_at: float | None = None
        self.death_at: float | None = None

    def follow(self) -> None:
        """Reads messages and exits until every rank ended, or the run must end."""
        deadline = self.wall_start + self.config.timeout
        while self.open_readers or len(self.exits) < len(self.processes):
            sentinels = {
                p.sentinel: rank for rank, p in enumerate(self.processes) if rank not in self.exits
            }
            ready = wait([*self.open_readers, *sentinels], timeout=0.1)
            for item in ready:
                if isinstance(item, Connection) and item in self.open_readers:
                    self._read(item)
            for item in ready:
                if isinstance(item, int) and item in sentinels:
                    self._exited(sentinels[item])
            if self._must_end(deadline):
                return

    def _read(self, reader: Connection) -> None:
        try:
            message = reader.recv()
        except (EOFError, OSError):
            # The rank ended (after a partial message, if it was killed mid-write).
            del self.open_readers[reader]
            reader.close()
            return
        self._receive(message)

    def _receive(self, message: object) -> None:
        result = self.result
        if isinstance(message, RankStarted):
            self.started.add(message.ep_rank)
            if len(self.started) == self.config.ranks:
                result.startup_seconds = time.monotonic() - self.wall_start
                self.say(f"  {self.config.ranks} ranks up in {result.startup_seconds:.1f} s")
        elif isinstance(message, RoundRecord):
            result.rounds.append(message)
            self.say(_progress_line(message, len(self.config.model.layers)))
        elif isinstance(message, RankReport):
            result.reports.append(message)
        elif isinstance(message, SimulatedRankFailure):
            result.failures.append(message)
            self.failed_at = self.failed_at or time.monotonic()
        elif isinstance(message, AtKillPoint):
            self._kill(message)
        elif isinstance(message, StepFailed):
            self.step_failures[message.ep_rank] = message
        elif isinstance(message, SurvivorReport):
            self.survivor_reports[message.ep_rank] = message

    def _kill(self, point: AtKillPoint) -> None:
        """The rank asked for is at its kill point: SIGKILL, timed from here."""
        pid = self.processes[point.ep_rank].pid
        assert pid is not None  # started
        at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        self.kill, self.kill_where, self.death_at = (point.ep_rank, at), point.where, at
        self.say(f"  rank {point.ep_rank} killed (SIGKILL) in round {point.round}, {point.where}")

    def _reported(self, rank: int) -> bool:
        return any(f.ep_rank == rank for f in self.result.failures) or any(
            r.ep_rank == rank for r in self.result.reports
        )

    def _exited(self, rank: int) -> None:
        process = self.processes[rank]
        process.join(timeout=1)  # reaps it: no zombie
        exit_ = RankExit(rank, process.exitcode, time.monotonic())
        self.exits[rank] = exit_
        self._drain(rank)
        how = describe_exit(exit_.exitcode)
        if self.kill is not None:
            if rank != self.kill[0]:
                after = exit_.at - self.kill[1]
                self.say(f"  rank {rank} exited ({how}) {after:.3f} s after the kill")
        elif not self._reported(rank) and exit_.exitcode != 0:
            if self.death_at is None and exit_.exitcode != PEER_LOSS_EXIT_STATUS:
                self.death_at = exit_.at
            self.say(f"  rank {rank} exited ({how})")

    def _drain(self, rank: int) -> None:
        """Reads what an ended rank sent before it ended (its pipe reads EOF after it)."""
        for reader, owner in list(self.open_readers.items()):
            if owner == rank:
                while reader in self.open_readers:
                    self._read(reader)

    def _must_end(self, deadline: float) -> bool:
        """Whether to stop the ranks still running now (the run's end is decided)."""
        now = time.monotonic()
        if len(self.started) < self.config.ranks and self._died_before_up():
            return True
        if self.failed_at is not None and now - self.failed_at > _FAILURE_GRACE_S:
            return True
        if (
            self.death_at is not None
            and now - self.death_at > self.config.loss_wait + _REPORT_GRACE_S
        ):
            return True
        if now > deadline:
            self.result.error = (
                f"timed out after {self.config.timeout:g} s (--timeout); rank 0 finished "
                f"{len(self.result.rounds)} of {len(self.config.model.layers)} rounds"
            )
            return True
        return False

    def _died_before_up(self) -> bool:
        """A rank ended without a word before every rank was up: names it in the result."""
        for rank, exit_ in sorted(self.exits.items(), key=lambda item: item[1].at):
            if self._reported(rank):
                continue  # its own failure says why
            where = "joined its group" if self.config.embedded else "reached the sidecar"
            self.result.error = (
                f"rank {rank} exited ({describe_exit(exit_.exitcode)}) before it {where}"
            )
            return True
        return False

    def stop(self) -> None:
        """Stops every rank still running (SIGTERM, then SIGKILL) and reads what they sent."""
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        for rank, process in enumerate(self.processes):
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
            if rank not in self.exits:
                self.exits[rank] = RankExit(rank, process.exitcode, time.monotonic(), stopped=True)
            self._drain(rank)


def run_simulation(config: SimulationConfig, progress: TextIO | None = None) -> SimulationResult:
    """Runs the demo and returns what happened.

    A rank's failure or death, an unreachable sidecar or a run past
    ``config.timeout`` is reported in the result (``ok`` is False; with a
    death asked for, ``ok`` says whether every survivor did what its policy
    says), not raised. Progress (one line per round) goes to ``progress``
    when given.

    Raises:
        OSError: the rank processes could not be started.
    """
    result = SimulationResult(
        model=config.model.name,
        ranks=config.ranks,
        target=config.target,
        group=config.group,
        total_rounds=len(config.model.layers),
        kill_rank=config.kill_rank,
        kill_round=config.kill_round,
    )
    wall_start = time.monotonic()

    def say(line: str) -> None:
        """One progress line, when there is somewhere to write it."""
        if progress is not None:
            print(line, file=progress, flush=True)

    if config.target is not None:
        result.error = check_reachable(config.target, timeout=5.0)
        if result.error:
            return result
    if config.nodes > 1:
        where = f"{config.nodes} sidecars (nodes) sharing plans through {config.store}"
    elif config.start_sidecar:
        where = "a sidecar started for this run"
    elif config.target:
        where = f"the sidecar at {config.target}"
    else:
        where = "embedded mode (no sidecar)"
    say(
        f"simulate {config.model.name}: {len(config.model.layers)} MoE layers on "
        f"{config.ranks} CPU ranks, max_num_tokens {config.max_tokens}, group "
        f"{config.group!r}, decided by {where}"
    )
    if config.kill_rank is not None:
        say(
            f"  rank {config.kill_rank} is to be killed (SIGKILL) in round {config.kill_round}; "
            f"MOE_SIDECAR_ON_PEER_LOSS={_policy(config)} in the ranks"
        )
    with contextlib.ExitStack() as stack:
        if config.starts_sidecars:
            try:
                targets = stack.enter_context(node_sidecars(config, say))
            except RuntimeError as error:
                result.error = str(error)
                return result
        else:
            targets = [config.target] if config.target is not None else []
        _run_ranks(config, result, targets, say, wall_start)
        if targets and not result.error:
            # The history is a nicety; the run's own results stand without it.
            with contextlib.suppress(grpc.RpcError):
                fetch_history(result, targets[0])
            if config.nodes > 1:
                with contextlib.suppress(grpc.RpcError):
                    fetch_node_views(result, targets)
    result.wall_seconds = time.monotonic() - wall_start
    return result


def _run_ranks(
    config: SimulationConfig,
    result: SimulationResult,
    targets: Sequence[str],
    say: Callable[[str], None],
    wall_start: float,
) -> None:
    """Starts one process per rank, follows them into ``result``, and stops them.

    Raises:
        OSError: the rank processes could not be started.
    """
    context = multiprocessing.get_context("spawn")
    # The ranks meet through a file in a private directory rather than on a
    # TCP port picked in advance: a port found free here could be taken by
    # another process before rank 0 binds it. Gloo's own connections listen
    # on ports the kernel assigns, so nothing is picked ahead of time.
    with tempfile.TemporaryDirectory(prefix="moe-sidecar-simulate-") as run_dir:
        init_method = "file://" + os.path.join(run_dir, "rendezvous")
        stderr_paths = [Path(run_dir) / f"rank{rank}.stderr" for rank in range(config.ranks)]
        pipes = [context.Pipe(duplex=False) for _ in range(config.ranks)]
        processes = [
            context.Process(
                target=rank_main,
                args=(
                    rank,
                    config,
                    init_method,
                    pipes[rank][1],
                    targets[config.node_of(rank)] if targets else None,
                    str(stderr_paths[rank]),
                ),
                name=f"simulate-rank{rank}",
                daemon=True,
            )
            for rank in range(config.ranks)
        ]
        for process in processes:
            process.start()
        for _, writer in pipes:
            writer.close()  # the rank's end only now: its pipe reads EOF once it ends
        say("  rank processes: " + ", ".join(f"pid {p.pid}" for p in processes))
        follower = _Follower(config, result, processes, [r for r, _ in pipes], say, wall_start)
        try:
            follower.follow()
        finally:
            follower.stop()
        stderr = {
            rank: path.read_text(errors="replace") if path.exists() else ""
            for rank, path in enumerate(stderr_paths)
        }
    _settle(config, result, follower, stderr)


def _settle(
    config: SimulationConfig,
    result: SimulationResult,
    follower: _Follower,
    stderr: dict[int, str],
) -> None:
    """The death (if one) read from what the ranks said and how they ended;
    each rank's stderr less the lines the death report quotes; ordered lists."""
    result.death = read_death(
        ranks=config.ranks,
        nodes=[config.node_name(rank) for rank in range(config.ranks)],
        policy=_policy(config),
        loss_wait=config.loss_wait,
        kill=follower.kill,
        kill_round=config.kill_round,
        where=follower.kill_where,
        rounds_done=len(result.rounds),
        exits=follower.exits,
        step_failures=follower.step_failures,
        reports=follower.survivor_reports,
        raised={f.ep_rank: (f"{f.error_type}: {f.message}", f.at) for f in result.failures},
        finished=frozenset(r.ep_rank for r in result.reports),
        stderr=stderr,
        exit_status=PEER_LOSS_EXIT_STATUS,
    )
    death = result.death
    if death is not None and not result.error:
        # A survivor's RankLost is its policy's doing: shown with the death, not as a cause.
        result.failures = [
            f
            for f in result.failures
            if not (f.error_type == "RankLost" and f.ep_rank != death.ep_rank)
        ]
        if not death.requested:
            result.error = (
                f"rank {death.ep_rank} exited ({death.how}) during the run, not asked for "
                f"(rank 0 had finished {len(result.rounds)} of {len(config.model.layers)} "
                "rounds)"
            )
    quoted = {s.line for s in death.survivors} if death is not None else set()
    for rank, text in stderr.items():
        kept = [line for line in text.splitlines() if line.strip() and line.strip() not in quoted]
        if kept:
            result.stderr[rank] = "\n".join(kept) + "\n"
    result.reports.sort(key=lambda r: r.ep_rank)
    result.failures.sort(key=lambda f: f.ep_rank)
