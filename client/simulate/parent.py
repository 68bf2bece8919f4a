"""The parent of a simulation: it starts the rank processes, follows them, and gathers the result.

It prints one line per round as rank 0 finishes it; a rank's failure, an
unreachable sidecar or a run past its timeout ends up in the result, which
the caller formats (:mod:`moe_sidecar.client.simulate.summary`).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import queue
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

import grpc

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


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _progress_line(record: RoundRecord, total: int) -> str:
    width = len(str(total))
    return (
        f"  round {record.round:>{width}}/{total}  {record.layer:<22} {record.quant:<5}  "
        f"{record.action.upper():<7}  workspace {format_bytes(record.workspace_bytes):>10}  "
        f"generation {record.generation}  {record.seconds * 1000:7.1f} ms"
    )


def _stop(processes: Sequence[multiprocessing.process.BaseProcess]) -> None:
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join(timeout=5)


def _collect(
    config: SimulationConfig,
    result: SimulationResult,
    processes: Sequence[multiprocessing.process.BaseProcess],
    events: Any,
    say: Callable[[str], None],
    wall_start: float,
) -> None:
    """Reads the ranks' events into ``result`` until they finish, fail or time out."""
    deadline = wall_start + config.timeout
    started: set[int] = set()
    failed_at: float | None = None
    while True:
        try:
            event = events.get(timeout=0.1)
        except queue.Empty:
            event = None
        if isinstance(event, RankStarted):
            started.add(event.ep_rank)
            if len(started) == config.ranks:
                result.startup_seconds = time.monotonic() - wall_start
                say(f"  {config.ranks} ranks up in {result.startup_seconds:.1f} s")
        elif isinstance(event, RoundRecord):
            result.rounds.append(event)
            say(_progress_line(event, len(config.model.layers)))
        elif isinstance(event, RankReport):
            result.reports.append(event)
        elif isinstance(event, SimulatedRankFailure):
            result.failures.append(event)
            failed_at = failed_at or time.monotonic()
        if event is not None:
            continue
        if all(not p.is_alive() for p in processes):
            return
        now = time.monotonic()
        # After one failure the others usually fail too (and say why); give
        # them a moment, then stop the ones still waiting.
        if failed_at is not None and now - failed_at > 3.0:
            return
        if now > deadline:
            result.error = (
                f"timed out after {config.timeout:g} s (--timeout); rank 0 finished "
                f"{len(result.rounds)} of {len(config.model.layers)} rounds"
            )
            return


def _settle(
    result: SimulationResult, processes: Sequence[multiprocessing.process.BaseProcess]
) -> None:
    """Names a rank that exited without a report; orders reports and failures."""
    for rank, process in enumerate(processes):
        reported = any(f.ep_rank == rank for f in result.failures) or any(
            r.ep_rank == rank for r in result.reports
        )
        if not reported and not result.error and not result.failures:
            result.error = f"rank {rank} exited with code {process.exitcode} without a report"
    result.reports.sort(key=lambda r: r.ep_rank)
    result.failures.sort(key=lambda f: f.ep_rank)


def run_simulation(config: SimulationConfig, progress: TextIO | None = None) -> SimulationResult:
    """Runs the demo and returns what happened.

    A rank's failure, an unreachable sidecar or a run past ``config.timeout``
    is reported in the result (``ok`` is False), not raised. Progress (one
    line per round) goes to ``progress`` when given.

    Raises:
        OSError: the rank processes could not be started.
    """
    result = SimulationResult(
        model=config.model.name, ranks=config.ranks, target=config.target, group=config.group
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
    elif config.target:
        where = f"the sidecar at {config.target}"
    else:
        where = "embedded mode (no sidecar)"
    say(
        f"simulate {config.model.name}: {len(config.model.layers)} MoE layers on "
        f"{config.ranks} CPU ranks, max_num_tokens {config.max_tokens}, group "
        f"{config.group!r}, decided by {where}"
    )
    with contextlib.ExitStack() as stack:
        if config.nodes > 1:
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
    events = context.Queue()
    port = _free_port()
    processes = [
        context.Process(
            target=rank_main,
            args=(rank, config, port, events, targets[config.node_of(rank)] if targets else None),
            name=f"simulate-rank{rank}",
            daemon=True,
        )
        for rank in range(config.ranks)
    ]
    for process in processes:
        process.start()
    try:
        _collect(config, result, processes, events, say, wall_start)
    finally:
        _stop(processes)
    _settle(result, processes)
