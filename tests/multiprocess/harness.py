"""Real rank processes and a real sidecar for the multi-process tests.

``run_ranks`` spawns one process per rank (the ``spawn`` start method, as an
inference server starts its workers), joins them into a gloo group on
127.0.0.1, runs a worker function in each and returns what each returned.
Every rank has a watchdog: past its timeout it dumps every thread's stack to
a file and exits, and the parent puts those stacks, and every traceback a
rank sent back, into the test failure.

``Sidecar`` starts ``python -m moe_sidecar`` on a Unix socket in a temporary
directory and stops it.
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing
import os
import queue
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc

from moe_workspace.v1 import coordinator_pb2 as pb
from moe_workspace.v1 import coordinator_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    init_method: str,
    timeout: float,
    results: Any,
    env: dict[str, str],
    args: tuple[Any, ...],
    stack_file: str,
) -> None:
    for key, value in env.items():
        if value:
            os.environ[key] = value
        else:
            os.environ.pop(key, None)
    with open(stack_file, "w") as stacks:
        # The watchdog: a hung rank prints where it hangs and exits.
        faulthandler.dump_traceback_later(timeout, exit=True, file=stacks)
        try:
            import torch.distributed as dist

            dist.init_process_group(
                "gloo",
                init_method=init_method,
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=timeout),
            )
            try:
                value = fn(rank, world_size, *args)
            finally:
                dist.destroy_process_group()
            results.put((rank, True, value))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
        finally:
            faulthandler.cancel_dump_traceback_later()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    timeout: float,
    tmp_path: Path,
    args: tuple[Any, ...] = (),
    envs: Sequence[dict[str, str]] | None = None,
    dies: dict[int, int] | None = None,
) -> list[Any]:
    """Runs ``fn(rank, world_size, *args)`` in ``world_size`` spawned ranks.

    ``envs[rank]`` is set in that rank's environment (an empty value unsets
    the variable). Returns the values in rank order; raises AssertionError
    with every rank's traceback (or watchdog stack dump) if any rank failed
    or the ranks did not finish within ``timeout`` seconds.

    ``dies`` maps ranks that are meant to die (``os._exit``) to the exit
    status they must end with; their value is None.
    """
    dies = dies or {}
    tmp_path.mkdir(parents=True, exist_ok=True)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    # A fresh rendezvous file per world: no TCP port to pick and lose to
    # another process between picking and binding (gloo's own sockets take
    # ports the kernel assigns).
    init_method = f"file://{tmp_path / f'rendezvous-{time.monotonic_ns()}'}"
    base_env = {"MOE_SIDECAR_TARGET": "", "MOE_SIDECAR_LOCAL_RANKS": ""}
    stack_files = [str(tmp_path / f"rank{rank}.stacks") for rank in range(world_size)]
    processes = []
    for rank in range(world_size):
        env = dict(base_env)
        if envs is not None:
            env.update(envs[rank])
        process = context.Process(
            target=_rank_main,
            args=(
                fn,
                rank,
                world_size,
                init_method,
                timeout,
                results,
                env,
                args,
                stack_files[rank],
            ),
            name=f"rank{rank}",
            daemon=True,
        )
        process.start()
        processes.append(process)

    collected: dict[int, tuple[bool, Any]] = {}
    # The parent waits a little longer than the watchdogs, so a hung rank has
    # time to write its stacks.
    deadline = time.monotonic() + timeout + 15
    while len(collected) < world_size - len(dies) and time.monotonic() < deadline:
        try:
            rank, ok, value = results.get(timeout=0.2)
        except queue.Empty:
            if all(not p.is_alive() for p in processes) and results.empty():
                break
            continue
        collected[rank] = (ok, value)
    for process in processes:
        process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join(timeout=5)

    problems = []
    for rank in range(world_size):
        if rank in dies:
            if rank in collected or processes[rank].exitcode != dies[rank]:
                problems.append(
                    f"--- rank {rank} was to die with status {dies[rank]}: exit code "
                    f"{processes[rank].exitcode}, result {collected.get(rank)}"
                )
            collected[rank] = (True, None)
        elif rank not in collected:
            stacks = Path(stack_files[rank]).read_text() if Path(stack_files[rank]).exists() else ""
            problems.append(
                f"--- rank {rank}: no result (exit code {processes[rank].exitcode}); "
                f"watchdog stacks:\n{stacks or '(none)'}"
            )
        elif not collected[rank][0]:
            problems.append(f"--- rank {rank} raised:\n{collected[rank][1]}")
    if problems:
        raise AssertionError("rank processes failed:\n" + "\n".join(problems))
    return [collected[rank][1] for rank in range(world_size)]


class RankProcesses:
    """Spawned rank processes driven by commands, for tests that kill some of them.

    Rank ``r`` runs ``fn(r, count, commands, results, *args)``: it reads
    commands from its own queue and puts ``(rank, kind, payload)`` on its own
    results queue. Nothing is shared between ranks: a rank killed while its
    queue's feeder thread holds the queue's write lock would otherwise block
    every other rank's results forever. No process group: these ranks only
    talk to the sidecar. A context manager; every process still alive at the
    end is killed.
    """

    def __init__(self, fn: Callable[..., Any], count: int, args: tuple[Any, ...] = ()) -> None:
        context = multiprocessing.get_context("spawn")
        self.results: list[Any] = [context.Queue() for _ in range(count)]
        self.commands: list[Any] = [context.Queue() for _ in range(count)]
        self.processes = [
            context.Process(
                target=fn,
                args=(rank, count, self.commands[rank], self.results[rank], *args),
                name=f"rank{rank}",
                daemon=True,
            )
            for rank in range(count)
        ]

    def __enter__(self) -> RankProcesses:
        for process in self.processes:
            process.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for process in self.processes:
            if process.is_alive():
                process.kill()
            process.join(timeout=10)

    def send(self, rank: int, *command: Any) -> None:
        self.commands[rank].put(command)

    def expect(self, ranks: Sequence[int], kind: str, timeout: float) -> dict[int, Any]:
        """The payloads of the next result of each of ``ranks``, which must be
        of ``kind`` (an AssertionError naming what came instead, or who did not
        answer in time)."""
        got: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(got) < len(ranks):
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"no {kind!r} from ranks {sorted(set(ranks) - set(got))} in {timeout}s; "
                    f"exit codes {[p.exitcode for p in self.processes]}"
                )
            for rank in ranks:
                if rank in got:
                    continue
                try:
                    sender, what, payload = self.results[rank].get(timeout=0.05)
                except queue.Empty:
                    continue
                assert sender == rank, (sender, rank)
                assert what == kind, f"rank {rank}: expected {kind!r}, got {what!r}: {payload}"
                got[rank] = payload
        return got

    def kill(self, rank: int) -> float:
        """SIGKILLs ``rank``; returns the CLOCK_MONOTONIC time of the kill
        (the clock every process of the machine shares)."""
        pid = self.processes[rank].pid
        assert pid is not None
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        self.processes[rank].join(timeout=10)
        return killed_at


class Sidecar:
    """A real ``python -m moe_sidecar`` on a Unix socket, for one test."""

    def __init__(
        self,
        directory: Path,
        *,
        round_timeout: float = 20.0,
        args: Sequence[str] = (),
        metrics_port: int = 0,
    ) -> None:
        """``args`` are more ``serve`` flags (e.g. ``--store``); ``metrics_port``
        0 leaves the Prometheus endpoint off."""
        directory.mkdir(parents=True, exist_ok=True)
        self.args = tuple(args)
        self.metrics_port = metrics_port
        self.directory = directory
        self.socket = directory / "s.sock"
        self.state_dir = directory / "state"
        self.round_timeout = round_timeout
        self.target = f"unix://{self.socket}"
        self.log = directory / "sidecar.log"
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> Sidecar:
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()
        command = [
            sys.executable,
            "-m",
            "moe_sidecar",
            "--listen",
            self.target,
            "--state-dir",
            str(self.state_dir),
            "--health-port",
            "0",
            "--metrics-port",
            str(self.metrics_port),
            "--round-timeout",
            str(self.round_timeout),
            "--log-format",
            "text",
            *self.args,
        ]
        with open(self.log, "ab") as log:
            self._process = subprocess.Popen(
                command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT
            )
        self._wait_ready(timeout=30.0)
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self._process is not None
            if self._process.poll() is not None:
                raise AssertionError(f"sidecar exited at start:\n{self.log.read_text()}")
            if self.socket.exists():
                with grpc.insecure_channel(self.target) as channel:
                    try:
                        grpc.channel_ready_future(channel).result(timeout=1.0)
                        return
                    except grpc.FutureTimeoutError:
                        pass
            time.sleep(0.05)  # the poll interval of a wait with a deadline
        raise AssertionError(f"sidecar not ready after {timeout}s:\n{self.log.read_text()}")

    def get_group(self, name: str) -> pb.Group:
        with grpc.insecure_channel(self.target) as channel:
            stub = pb_grpc.WorkspaceCoordinatorStub(channel)
            return stub.GetGroup(pb.GetGroupRequest(group=name), timeout=5.0)

    def group_names(self) -> list[str]:
        """The names of the groups the sidecar holds (its first page)."""
        with grpc.insecure_channel(self.target) as channel:
            stub = pb_grpc.WorkspaceCoordinatorStub(channel)
            return [g.name for g in stub.ListGroups(pb.ListGroupsRequest(), timeout=5.0).groups]

    def wait_for_group(
        self, name: str, condition: Callable[[pb.Group], bool], *, timeout: float, what: str
    ) -> pb.Group:
        """Polls ``GetGroup`` until ``condition`` holds and returns that group.

        A proposal sent without waiting may not have reached the sidecar yet,
        so NOT_FOUND means "not yet", not a failure.

        Raises:
            AssertionError: ``condition`` did not hold within ``timeout``
                seconds (``what`` says what was awaited).
            grpc.RpcError: ``GetGroup`` failed with a status other than NOT_FOUND.
        """
        deadline = time.monotonic() + timeout
        while True:
            try:
                group = self.get_group(name)
                if condition(group):
                    return group
            except grpc.RpcError as error:
                if not isinstance(error, grpc.Call) or error.code() != grpc.StatusCode.NOT_FOUND:
                    raise
            if time.monotonic() > deadline:
                raise AssertionError(f"group {name!r}: {what}: not within {timeout}s")
            time.sleep(0.02)  # the poll interval of a wait with a deadline

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def stop(self, *, kill: bool = False) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)


@contextlib.contextmanager
def running_sidecar(directory: Path, *, round_timeout: float = 20.0) -> Iterator[Sidecar]:
    sidecar = Sidecar(directory, round_timeout=round_timeout).start()
    try:
        yield sidecar
    finally:
        sidecar.stop()
